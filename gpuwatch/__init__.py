"""gpuwatch: a terminal dashboard and command line for a live PyTorch training run.

The dashboard never imports torch: it reads the run's telemetry over ZeroMQ (see
:mod:`agent.wire.protocol`) and finds runs through their run files (:mod:`agent.wire.runs`).
"""
