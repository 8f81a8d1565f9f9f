"""Ways to attach the agent to a training loop: the reference Trainer, or a hand-written loop."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator

import torch

from agent.core import Agent
from agent.knobs import (ACCUM_STEPS, CHECKPOINTING, KERNELS, MEMORY_FRACTION,
                         MEMORY_SNAPSHOT_STEPS, NUM_WORKERS, PIN_MEMORY, PRECISION,
                         PREFETCH_FACTOR, Knob, KnobSet)
from agent.runlog import log_dir
from gpuopt.data import batch_size
from gpuopt.memory import MemorySnapshot, set_memory_fraction
from gpuopt.loader import MAX_NUM_WORKERS, MAX_PREFETCH_FACTOR, ReconfigurableLoader
from gpuopt.precision import MixedPrecision, precision_support, precision_warning
from gpuopt.trainer import StepStats, Trainer


def _refuse(reason: str | None) -> None:
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
                check=lambda value: _refuse(precision_support(value, device_type)),
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

    def on_optimizer_step(self) -> str | None:
        """Training thread: tick a running snapshot; its file's path once written."""
        if not self.snapshot_steps_left:
            return None
        self.snapshot_steps_left -= 1
        path = self.snapshot.on_optimizer_step()
        return None if path is None else str(path)

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
                                  stats.activation_bytes)
        for kind, text, fields in trainer.model_backend.pop_events():
            self.agent.event("info", text, kind=kind, step=stats.step, **fields)
        if trainer.activation_measurement_error and not self._measurement_error_reported:
            self._measurement_error_reported = True
            self.agent.event("warning", "activation memory is not measured for this model "
                             f"({trainer.activation_measurement_error})", kind="warning",
                             step=stats.step)
        snapshot = self.memory.on_optimizer_step()
        if snapshot is not None:
            self.agent.event("info", f"memory snapshot written to {snapshot}",
                             kind="memory_snapshot", path=snapshot, step=stats.step)

    def on_out_of_memory(self, trainer: Trainer, error: torch.OutOfMemoryError) -> bool:
        return self.agent.roll_back_last_change(
            trainer.step + 1, f"step {trainer.step + 1} ran out of memory")

    def on_fit_end(self, trainer: Trainer) -> None:
        self.agent.close("finished")


def attach(trainer: Trainer, *, name: str = "", transport: str = "ipc",
           **options: Any) -> Agent:
    """Attach a started agent to a :class:`gpuopt.Trainer`; returns the agent.

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
        options: more :class:`agent.Agent` arguments.
    """
    knobs = KnobSet()
    knobs.add(precision_knob(trainer.mixed_precision))
    knobs.add(Knob(ACCUM_STEPS, get=lambda: trainer.accum_steps,
                   set=lambda value: setattr(trainer, "accum_steps", value)))
    if isinstance(trainer.loader, ReconfigurableLoader):
        for knob in loader_knobs(trainer.loader):
            knobs.add(knob)
    knobs.add(Knob(KERNELS, get=lambda: trainer.kernels,
                   set=lambda value: setattr(trainer, "kernels", value),
                   check=lambda value: _refuse(trainer.model_backend.support(value))))
    if trainer.activation_checkpointing is not None:
        knobs.add(Knob(CHECKPOINTING, get=lambda: trainer.checkpointing,
                       set=lambda value: setattr(trainer, "checkpointing", value)))
    agent = Agent(knobs, name=name, model=trainer.model, device=trainer.device,
                  transport=transport, **options)
    memory = MemoryKnobs(trainer.device, agent.run_id)
    memory.bind(knobs)
    agent.refresh_knobs()
    trainer.callbacks.append(_TrainerCallback(agent, memory))
    return agent.start()


class Session:
    """The agent for a hand-written training loop (see :func:`session`)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.step = 0
        self._data_wait_s = 0.0
        self._micro_batches = 0
        self._samples = 0

    def __enter__(self) -> "Session":
        self.agent.mark_start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.agent.close("finished" if exc_info[0] is None else f"error: {exc_info[1]!r}")

    def loader(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``batches`` timing each ``next()`` (the data wait) and counting
        micro-batches and samples (dim 0 of the batch's first tensor)."""
        iterator = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._data_wait_s += time.perf_counter() - start
            self._micro_batches += 1
            self._samples += batch_size(batch)
            yield batch

    def optimizer_step(self, loss: torch.Tensor | None = None, samples: int | None = None,
                       skipped: torch.Tensor | None = None,
                       activation_bytes: int | None = None) -> None:
        """Mark an optimizer-step boundary: call it right after ``optimizer.step()`` and
        ``zero_grad()``. Pending commands (e.g. ``precision``) are applied here.

        Args:
            loss: the step's loss tensor (any device; it is never read on this thread).
            samples: samples in the step, if the loader wrapper cannot count them.
            skipped: what :meth:`gpuopt.MixedPrecision.step` returned (fp16: whether
                the GradScaler skipped the step), so skipped steps are counted.
            activation_bytes: ``saved.bytes`` of a :class:`gpuopt.memory.SavedActivations`
                opened around one micro-batch's forward, on the steps you measure.

        .. note:: Never synchronizes the device; a few microseconds.
        """
        self.step += 1
        self.agent.optimizer_step(self.step, max(self._micro_batches, 1),
                                  self._samples if samples is None else samples,
                                  self._data_wait_s, loss, skipped, activation_bytes)
        self._data_wait_s = 0.0
        self._micro_batches = 0
        self._samples = 0


def session(*, name: str = "", model: torch.nn.Module | None = None,
            device: torch.device | str | None = None,
            mixed_precision: MixedPrecision | None = None, knobs: KnobSet | None = None,
            transport: str = "ipc", **options: Any) -> Session:
    """An agent for a hand-written loop, as a context manager.

    Example::

        mp = gpuopt.MixedPrecision("cpu")
        with agent.session(model=model, mixed_precision=mp) as run:
            for x, y in run.loader(loader):
                with mp.autocast():
                    loss = loss_fn(model(x), y)
                mp.backward(loss)
                skipped = mp.step(optimizer)
                optimizer.zero_grad()
                run.optimizer_step(loss, skipped=skipped)

    Args:
        name, model, device, transport: as for :class:`agent.Agent`.
        mixed_precision: if given, the ``precision`` knob is bound to it.
        knobs: further knobs of your own (a :class:`agent.knobs.KnobSet`).
    """
    knobs = knobs or KnobSet()
    if mixed_precision is not None:
        knobs.add(precision_knob(mixed_precision))
        device = device or torch.device(mixed_precision.device_type)
    if device is None and model is not None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
    agent = Agent(knobs, name=name, model=model, device=device, transport=transport,
                  **options)
    return Session(agent.start())
