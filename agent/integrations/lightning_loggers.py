"""gpuwatch's measurements and knob changes in a Lightning Trainer's own loggers.

What is logged and how: :mod:`agent.integrations.loggers`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from agent.integrations.loggers import PREFIX, Bridge, agent_of


class GpuwatchLoggers(pl.Callback):
    """Logs gpuwatch's measurements and knob changes to the Trainer's loggers.

    To ``trainer.loggers``, every ``log_every_n_steps`` optimizer steps and when ``fit``
    ends, each at the optimizer step of the latest record; add it beside the gpuwatch
    callback (``agent.attach(trainer)`` or ``GpuwatchCallback``). Knob changes also go to a
    logger that takes text (TensorBoard's ``add_text``).

    .. note:: Without a gpuwatch agent among the Trainer's callbacks it logs nothing.
    """

    def __init__(self) -> None:
        self._bridge: Bridge | None = None
        self._logged_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # set by Lightning's callback connector, not declared on the Trainer class
        agent = agent_of(trainer.callbacks)  # type: ignore[attr-defined]
        if agent is not None:
            self._bridge = Bridge(agent)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        # set by Lightning's logger connector, not declared on the Trainer class
        every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
        if (self._bridge is not None and step != self._logged_step
                and step % max(1, every) == 0):
            self._logged_step = step
            self._log(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                 stage: str) -> None:
        if self._bridge is None:
            return
        self._log(trainer)  # what came since the last log: the run's last steps
        self._bridge.close()
        self._bridge = None

    def _log(self, trainer: pl.Trainer) -> None:
        assert self._bridge is not None
        step, metrics, changes = self._bridge.collect()
        if step is None:
            return
        for logger in trainer.loggers:
            if metrics:
                logger.log_metrics(metrics, step=step)
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if callable(add_text):  # TensorBoard: each change at its own step
                for change_step, line in changes:
                    add_text(f"{PREFIX}knob_changes", line, change_step)
