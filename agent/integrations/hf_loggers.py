"""gpuwatch's measurements and knob changes in a ``transformers.Trainer``'s own loggers.

Its ``report_to`` integrations log them (what is logged and how:
:mod:`agent.integrations.loggers`)."""

from __future__ import annotations

from typing import Any

import transformers
from transformers import TrainerCallback

from agent.integrations.loggers import PREFIX, Bridge, agent_of


class GpuwatchHFLoggers(TrainerCallback):
    """Adds gpuwatch's measurements to every log of the Trainer (``on_log``).

    So its reporting integrations (TensorBoard, W&B, MLflow, ... of ``report_to``) log them
    at the Trainer's step (with their own prefix: TensorBoard's is ``train/``, so
    ``train/gpuwatch/step_time_s``); ``gpuwatch/knob_changes`` counts the changes since the
    last log (the ``gpuwatch/knob/<name>`` series show each). Add it with
    ``trainer.add_callback(GpuwatchHFLoggers(trainer))`` beside the gpuwatch callback; when
    training begins it moves itself first among the Trainer's callbacks, so that the
    reporters see what it adds.

    Args:
        trainer: the Trainer whose logs it adds to.

    .. note:: Without a gpuwatch agent among the Trainer's callbacks it adds nothing.
    """

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer = trainer
        self._bridge: Bridge | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        callbacks = self.trainer.callback_handler.callbacks
        agent = agent_of(callbacks)
        if agent is None:
            return
        self._bridge = Bridge(agent)
        if self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)  # before the reporters, which log in on_log

    def on_log(self, args: Any, state: Any, control: Any,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self._bridge is None or logs is None:
            return
        _, metrics, changes = self._bridge.collect()
        logs.update(metrics)
        if changes:
            logs[f"{PREFIX}knob_changes"] = len(changes)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._bridge is not None:
            self._bridge.close()
            self._bridge = None
