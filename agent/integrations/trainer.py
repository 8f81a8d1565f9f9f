"""The reference :class:`gpuopt.Trainer` under the agent: its run, on the run base.

The Trainer reports each optimizer step to its callbacks (:class:`gpuopt.trainer.StepStats`);
the run turns that into the typed record at the boundary. Its checkpoint is
:meth:`gpuopt.Trainer.state_dict` (model, optimizer, scheduler, GradScaler, settings, data
position, random numbers), with the knob values a person chose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent.wire.protocol import EventKind
from agent.integrations.adapters import (cpu_threads_knob, dropout_knob, loader_knobs,
                                         micro_batch_size_knob, optimizer_knobs, precision_knob,
                                         refuse)
from agent.control.checkpoints import load_checkpoint, torch_checkpoint
from agent.step.core import Agent, ending_reason
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINTING, DROPOUT, KERNELS, MAX_GRAD_NORM,
                              MICRO_BATCH_SIZE, Knob, KnobSet)
from agent.step.record import StepRecord
from agent.integrations.run import RunBase
from gpuopt.loader import ReconfigurableLoader
from gpuopt.trainer import StepStats, Trainer


class TrainerRun(RunBase):
    """One :class:`gpuopt.Trainer` under the agent; its callback hooks are one call each.

    Args:
        agent: the run's agent. trainer: the Trainer.
    """

    def __init__(self, agent: Agent, trainer: Trainer) -> None:
        super().__init__(agent, device=trainer.device)
        self.trainer = trainer
        self.step = trainer.step
        self._measurement_error_reported = False
        self.event_sources.append(trainer.model_backend.pop_events)

    def data_state(self) -> None:
        """None: the Trainer's own state holds its data position."""
        return None

    def data_reason(self, value: Any = None) -> str | None:
        """Why a resume would not train the same data: None for a ReconfigurableLoader.

        The Trainer's loader position is exact for a ReconfigurableLoader; another loader's
        is its :class:`gpuopt.position.DataPosition`'s."""
        if isinstance(self.trainer.loader, ReconfigurableLoader):
            return None
        return self.trainer.data_position.exact_reason

    def end_loop(self) -> None:
        """The Trainer's :meth:`gpuopt.Trainer.stop`: ``fit`` returns before the next step.

        Its ``on_fit_end`` hooks run."""
        self.trainer.stop()

    #: a recovery keeps these of the state as they are now (the Trainer's loader
    #: position, epoch and random numbers)
    recovery_data_keys = ("loader", "data", "epoch", "rng")

    def drop_refusal(self, snapshot: Any, micro_batches: int) -> None:
        """None: the Trainer's loader draws and drops them (:meth:`drop_micro_batches`)."""
        return None

    def drop_micro_batches(self, micro_batches: int) -> None:
        """The Trainer's loader draws the next ``micro_batches`` and drops them, untrained.

        Through :meth:`gpuopt.position.DataPosition.drop` of the Trainer's data position,
        which its loop (a ReconfigurableLoader's too) follows."""
        self.trainer.data_position.drop(micro_batches)

    def live_state(self) -> dict[str, Any]:
        """:meth:`gpuopt.Trainer.state_dict`: its live tensors, for a rollback."""
        return self.trainer.state_dict()

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """The Trainer goes back to ``snapshot`` in the middle of ``fit``, its data position too.

        The batches after it come again."""
        self.trainer.load_state_dict(snapshot)

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A checkpoint :meth:`save` wrote, read as :func:`attach`'s ``resume_from`` reads it.

        The Trainer's state (the snapshot), its step and knob values."""
        saved = load_checkpoint(path)
        return saved["trainer"], saved["step"], saved["knobs"]

    def save(self, path: Any, knobs: dict[str, Any]) -> None:
        """``torch.save`` of :meth:`gpuopt.Trainer.state_dict` and the knob values."""
        torch.save(torch_checkpoint(self.agent, knobs, self.trainer.step,
                                    {"trainer": self.trainer.state_dict()}), path)

    # ------------------------------------------------------------ the Trainer's hooks

    def on_fit_start(self, trainer: Trainer) -> None:
        self.agent.mark_start()

    def on_optimizer_step(self, trainer: Trainer, stats: StepStats) -> None:
        self.boundary(StepRecord(
            step=stats.step, micro_batches=stats.micro_batches, samples=stats.samples,
            data_wait_s=stats.data_wait_s, loss=stats.loss, skipped=stats.skipped,
            activation_bytes=stats.activation_bytes, tokens=stats.tokens,
            lr=stats.lr_groups or stats.lr, grad_norm=stats.grad_norm))
        if trainer.activation_measurement_error and not self._measurement_error_reported:
            self._measurement_error_reported = True
            self.agent.event("warning", "activation memory is not measured for this model "
                             f"({trainer.activation_measurement_error})", kind=EventKind.WARNING,
                             step=stats.step)

    def on_out_of_memory(self, trainer: Trainer, error: torch.OutOfMemoryError) -> bool:
        return self.agent.roll_back_last_change(
            trainer.step + 1, f"step {trainer.step + 1} ran out of memory")

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self.close(ending_reason(error))

    def on_fit_end(self, trainer: Trainer) -> None:
        self.close("finished")  # (after on_exception: already closed)


def attach(trainer: Trainer, *, name: str = "", transport: str = "ipc",
           checkpoint_dir: str | os.PathLike | None = None,
           resume_from: str | os.PathLike | None = None,
           eval_fn: Callable[[], dict[str, Any] | None] | None = None,
           **options: Any) -> Agent:
    """Attach the agent to a :class:`gpuopt.Trainer` (see :func:`agent.attach`); return the agent.

    :func:`agent.attach` calls this. Returns the started agent. ``eval_fn()`` (returning a
    dict of metric names to numbers) is what ``evaluate=now`` runs, on the training thread
    at a boundary; without it the run has no ``evaluate`` command.

    Raises:
        ValueError: ``resume_from`` is not a checkpoint of the ``checkpoint`` command,
            or this Trainer cannot take it (:meth:`gpuopt.Trainer.load_state_dict`).
        OSError: it cannot be read.
    """
    saved = load_checkpoint(resume_from) if resume_from is not None else None
    if saved is not None:
        trainer.load_state_dict(saved["trainer"])
    knobs = KnobSet()
    knobs.add(precision_knob(trainer.mixed_precision))
    knobs.add(Knob.attribute(ACCUM_STEPS, trainer))
    if isinstance(trainer.loader, ReconfigurableLoader):
        for knob in loader_knobs(trainer.loader):
            knobs.add(knob)
    knobs.add(Knob.attribute(KERNELS, trainer,
                             check=lambda value: refuse(trainer.model_backend.support(value))))
    if trainer.activation_checkpointing is not None:
        knobs.add(Knob.attribute(CHECKPOINTING, trainer))
    optimizer_knobs(trainer.optimizer_settings, knobs)
    knobs.add(Knob(MAX_GRAD_NORM, get=lambda: trainer.max_grad_norm or 0.0,
                   set=lambda value: setattr(trainer, "max_grad_norm", value)))
    # (the knobs panel lists them in this order: the newer ones after the established)
    if isinstance(trainer.loader, ReconfigurableLoader):
        knobs.add(micro_batch_size_knob(trainer.loader, lambda: trainer.accum_steps,
                                        lambda value: setattr(trainer, "accum_steps", value)))
    else:
        knobs.bind(MICRO_BATCH_SIZE, (
            "the Trainer's loader is not a gpuopt.loader.ReconfigurableLoader, whose "
            "batches can change size mid-epoch"))
    knobs.add(cpu_threads_knob(knobs))
    knobs.bind(DROPOUT, dropout_knob(trainer.model))
    agent = Agent(knobs, name=name, model=trainer.model, device=trainer.device,
                  transport=transport, training={"framework": "gpuopt.Trainer",
                                                 "loss_normalization": trainer.loss_normalization},
                  **options)
    run = TrainerRun(agent, trainer)
    run.bind_checkpoint(run.save, step=lambda: trainer.step, directory=checkpoint_dir)
    run.bind_evaluate(eval_fn, trainer.model, declare="agent.attach(trainer, eval_fn=...)")
    if saved is not None:
        run.restore(saved["knobs"], str(resume_from), from_run=saved.get("run"))
    trainer.callbacks.append(run)
    run.start()
    return agent
