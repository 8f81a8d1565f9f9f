"""Attaching the agent: :func:`attach` for a trainer (the reference Trainer here, the
frameworks' in :mod:`agent.integrations`), and the knob bindings they share."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from agent.core import Agent, ending_reason
from agent.knobs import (ACCUM_STEPS, CHECKPOINTING, KERNELS, MEMORY_FRACTION,
                         MEMORY_SNAPSHOT_STEPS, NUM_WORKERS, PIN_MEMORY, PRECISION,
                         PREFETCH_FACTOR, Knob, KnobSet)
from agent.runlog import log_dir
from gpuopt.memory import MemorySnapshot, set_memory_fraction
from gpuopt.loader import MAX_NUM_WORKERS, MAX_PREFETCH_FACTOR, ReconfigurableLoader
from gpuopt.precision import MixedPrecision, precision_support, precision_warning
from gpuopt.trainer import StepStats, Trainer


def refuse(reason: str | None) -> None:
    """A :attr:`agent.knobs.Knob.check` helper: raise ``ValueError(reason)`` unless
    ``reason`` is None."""
    if reason is not None:
        raise ValueError(reason)


def precision_knob(mixed_precision: MixedPrecision) -> Knob:
    """The ``precision`` knob bound to a :class:`gpuopt.MixedPrecision` policy.

    Values the device cannot run are refused when the command arrives, with the reason;
    fp16 on a CPU is accepted with a warning (it runs, slowly).
    """
    device_type = mixed_precision.device_type

    return Knob(PRECISION, get=lambda: mixed_precision.precision,
                set=lambda value: setattr(mixed_precision, "precision", value),
                check=lambda value: refuse(precision_support(value, device_type)),
                warn=lambda value: precision_warning(value, device_type))


def loader_knobs(loader: ReconfigurableLoader) -> list[Knob]:
    """The ``num_workers``, ``pin_memory`` and ``prefetch_factor`` knobs of a
    :class:`gpuopt.loader.ReconfigurableLoader`.

    Applying one rebuilds the loader's workers on the rest of the epoch (every sample
    still once); it costs the training thread about the new workers' start-up (tens of
    ms). If the new workers fail, the loader keeps its previous configuration and the
    failure is reported as an event.
    """
    def setter(name: str) -> Any:
        return lambda value: loader.reconfigure(**{name: value})

    def pin_warning(value: bool) -> str | None:
        if value and not torch.cuda.is_available():
            return "pin_memory has no effect without CUDA (no host-to-device copies)"
        return None

    def prefetch_factor() -> int:
        value = loader.config["prefetch_factor"]
        return 2 if value is None else value  # None: DataLoader's default, 2

    return [
        Knob(dataclasses.replace(NUM_WORKERS, maximum=MAX_NUM_WORKERS),
             get=lambda: loader.config["num_workers"], set=setter("num_workers")),
        Knob(PIN_MEMORY, get=lambda: loader.config["pin_memory"], set=setter("pin_memory"),
             warn=pin_warning),
        Knob(dataclasses.replace(PREFETCH_FACTOR, maximum=MAX_PREFETCH_FACTOR),
             get=prefetch_factor, set=setter("prefetch_factor"),
             warn=lambda value: (None if loader.config["num_workers"] else
                                 "prefetch_factor is kept, and takes effect once "
                                 "num_workers > 0 (it is 0 now)")),
    ]


class MemoryKnobs:
    """The ``memory_fraction`` and ``memory_snapshot_steps`` knobs of a run on a CUDA
    ``device``; on any other device :meth:`bind` marks them unsupported, with the
    reason."""

    def __init__(self, device: torch.device, run_name: str) -> None:
        self.device = device
        self.run_name = run_name
        self.fraction = 1.0
        self.snapshot = MemorySnapshot(device) if device.type == "cuda" else None
        self.snapshot_steps_left = 0

    def set_fraction(self, value: float) -> None:
        set_memory_fraction(value, self.device)
        self.fraction = value

    def start_snapshot(self, steps: int) -> None:
        self.snapshot.start(steps, log_dir() / f"{self.run_name}-memory-snapshot.pickle")
        self.snapshot_steps_left = steps

    def after_step(self, agent: Agent, step: int) -> None:
        """Training thread, after the boundary of ``step``: tick a running snapshot;
        once its file is written, an event says where."""
        if not self.snapshot_steps_left:
            return
        self.snapshot_steps_left -= 1
        path = self.snapshot.on_optimizer_step()
        if path is not None:
            agent.event("info", f"memory snapshot written to {path}", kind="memory_snapshot",
                        path=str(path), step=step)

    def bind(self, knobs: KnobSet) -> None:
        """Add both knobs to ``knobs`` on CUDA; elsewhere mark them unsupported."""
        if self.snapshot is None:
            for spec in (MEMORY_FRACTION, MEMORY_SNAPSHOT_STEPS):
                knobs.unsupported[spec.name] = (f"needs CUDA; this run is on "
                                                f"{self.device.type}")
            return
        knobs.add(Knob(MEMORY_FRACTION, get=lambda: self.fraction, set=self.set_fraction))
        knobs.add(Knob(MEMORY_SNAPSHOT_STEPS, get=lambda: self.snapshot_steps_left,
                       set=self.start_snapshot))


def publish_events(agent: Agent, step: int,
                   events: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Publish ``(kind, text, fields)`` events of ``step`` (e.g. a model backend's compile
    events): level ``warning`` for kind ``warning``, else ``info``."""
    for kind, text, fields in events:
        agent.event("warning" if kind == "warning" else "info", text, kind=kind, step=step,
                    **fields)


class _TrainerCallback:
    """Trainer hooks -> agent; each hook is a line or two."""

    def __init__(self, agent: Agent, memory: MemoryKnobs) -> None:
        self.agent = agent
        self.memory = memory
        self._measurement_error_reported = False

    def on_fit_start(self, trainer: Trainer) -> None:
        self.agent.mark_start()

    def on_optimizer_step(self, trainer: Trainer, stats: StepStats) -> None:
        self.agent.optimizer_step(stats.step, stats.micro_batches, stats.samples,
                                  stats.data_wait_s, stats.loss, stats.skipped,
                                  stats.activation_bytes, tokens=stats.tokens, lr=stats.lr,
                                  grad_norm=stats.grad_norm)
        publish_events(self.agent, stats.step, trainer.model_backend.pop_events())
        if trainer.activation_measurement_error and not self._measurement_error_reported:
            self._measurement_error_reported = True
            self.agent.event("warning", "activation memory is not measured for this model "
                             f"({trainer.activation_measurement_error})", kind="warning",
                             step=stats.step)
        self.memory.after_step(self.agent, stats.step)

    def on_out_of_memory(self, trainer: Trainer, error: torch.OutOfMemoryError) -> bool:
        return self.agent.roll_back_last_change(
            trainer.step + 1, f"step {trainer.step + 1} ran out of memory")

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        self.agent.close(ending_reason(error))

    def on_fit_end(self, trainer: Trainer) -> None:
        self.agent.close("finished")  # (after on_exception: already closed)


def attach(trainer: Any, *, name: str = "", transport: str = "ipc", **options: Any) -> Any:
    """Attach the agent to the trainer you already have, in one line, before it trains.

    By its type: a :class:`gpuopt.Trainer` (below); a ``lightning.pytorch.Trainer``
    before ``fit`` (:mod:`agent.integrations.lightning`); a ``transformers.Trainer``
    before ``train`` (:mod:`agent.integrations.hf`); an ``accelerate.Accelerator`` of a
    hand-written loop (:mod:`agent.integrations.accelerate`, which returns the loop's
    run object). Each integration installs its framework's own callback and imports its
    framework only then. Returns the started agent (or the accelerate run).

    Raises:
        TypeError: ``trainer`` is none of these (a hand-written loop uses
            :func:`agent.session`).

    For a :class:`gpuopt.Trainer`:

    The agent measures every optimizer step of the next :meth:`Trainer.fit` and exposes
    the knobs ``precision``, ``accum_steps``, ``kernels``, ``memory_fraction`` and
    ``memory_snapshot_steps`` (the last two on CUDA; elsewhere a command for them is
    refused with the reason), ``checkpointing`` when the model
    has blocks to checkpoint, and ``num_workers``, ``pin_memory`` and ``prefetch_factor``
    when the trainer's loader is a :class:`gpuopt.loader.ReconfigurableLoader`. It
    closes (``bye``, run file removed) when that ``fit`` returns. After a change of
    precision, accumulation or kernels, an out-of-memory error in the next steps rolls
    the change back and the window is run again (``Trainer.on_out_of_memory``). Costs the
    training thread a few microseconds per optimizer step and never synchronizes the
    device.

    Args:
        trainer: the trainer to observe and steer.
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"`` (see :class:`agent.Agent`).
        options: more :class:`agent.Agent` arguments (and the integration's own).
    """
    if not isinstance(trainer, Trainer):
        from agent.integrations import integration_for

        module = integration_for(trainer)
        if module is None:
            raise TypeError(
                f"agent.attach() takes a gpuopt.Trainer, a lightning.pytorch.Trainer, a "
                f"transformers.Trainer or an accelerate.Accelerator, not "
                f"{type(trainer).__module__}.{type(trainer).__qualname__}; for a "
                "hand-written loop use agent.session(...)")
        return importlib.import_module(module).attach(trainer, name=name,
                                                      transport=transport, **options)
    knobs = KnobSet()
    knobs.add(precision_knob(trainer.mixed_precision))
    knobs.add(Knob(ACCUM_STEPS, get=lambda: trainer.accum_steps,
                   set=lambda value: setattr(trainer, "accum_steps", value)))
    if isinstance(trainer.loader, ReconfigurableLoader):
        for knob in loader_knobs(trainer.loader):
            knobs.add(knob)
    knobs.add(Knob(KERNELS, get=lambda: trainer.kernels,
                   set=lambda value: setattr(trainer, "kernels", value),
                   check=lambda value: refuse(trainer.model_backend.support(value))))
    if trainer.activation_checkpointing is not None:
        knobs.add(Knob(CHECKPOINTING, get=lambda: trainer.checkpointing,
                       set=lambda value: setattr(trainer, "checkpointing", value)))
    agent = Agent(knobs, name=name, model=trainer.model, device=trainer.device,
                  transport=transport, training={"framework": "gpuopt.Trainer",
                                                 "loss_normalization": trainer.loss_normalization},
                  **options)
    memory = MemoryKnobs(trainer.device, agent.run_id)
    memory.bind(knobs)
    agent.refresh_knobs()
    trainer.callbacks.append(_TrainerCallback(agent, memory))
    return agent.start()
