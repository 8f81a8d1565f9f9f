"""The step path: what runs on the training thread at every optimizer step, and its records.

The records it leaves for the I/O thread.

It owns the agent (:class:`agent.step.core.Agent`: one deque append a step, never a
device synchronisation), the step records (:mod:`agent.step.record`), the device markers
that time a step without waiting for it (:mod:`agent.step.markers`) and the encoder that
turns queued records into ``steps`` batches (:mod:`agent.step.encoder`).
"""
