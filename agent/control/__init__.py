"""Control: the live changes of a run's knobs and the ways back.

It owns the command desk that answers, schedules and applies commands
(:mod:`agent.control.desk`), the ledger of changes applied (:mod:`agent.control.ledger`),
the guard that rolls a harmful change back (:mod:`agent.control.guard`) and checkpoints
with their knob files (:mod:`agent.control.checkpoints`). The knobs' specs and schema are
the wire's (:mod:`agent.wire.knobs`).
"""
