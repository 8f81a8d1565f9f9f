"""The wire: what the agent and its readers share, and nothing else of the agent; no torch.

Its readers: the dashboard, the CLI, other ranks' agents, node relays.

It owns the message envelope, the message types, event kinds and replies
(:mod:`agent.wire.protocol`), the run registry, i.e. the run files (:mod:`agent.wire.runs`),
the run log's format (:mod:`agent.wire.runlog`), a multi-node job's keys
(:mod:`agent.wire.nodes`), the knob schema (:mod:`agent.wire.knobs`) and the client side
of commands (:mod:`agent.wire.commands`). ``gpuwatch`` imports nothing else of ``agent``.
"""
