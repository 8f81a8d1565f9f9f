"""Attaching the agent: :func:`attach` for a trainer, and the knob bindings they share.

A trainer: the reference Trainer here, the frameworks' in :mod:`agent.integrations`."""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable, Protocol

import torch

from agent.wire.protocol import EventKind
from agent.step.core import Agent
from agent.wire.knobs import (CPU_THREADS, DROPOUT, KERNELS, LR_SCALE, MEMORY_FRACTION,
                              MEMORY_SNAPSHOT_STEPS, MICRO_BATCH_SIZE, MIXTURE, NUM_WORKERS,
                              PIN_MEMORY, PRECISION, PREFETCH_FACTOR, WEIGHT_DECAY, Knob, KnobSet,
                              weights_text)
from agent.wire.runlog import log_dir
from gpuopt.dropout import DropoutRate
from gpuopt.environment import usable_cpu_count
from gpuopt.memory import MemorySnapshot, set_memory_fraction
from gpuopt.mixture import MixtureLoader
from gpuopt.loader import MAX_NUM_WORKERS, MAX_PREFETCH_FACTOR, ReconfigurableLoader
from gpuopt.optim import OptimizerSettings
from gpuopt.precision import precision_support, precision_warning
from gpuopt.trainer import Trainer


def refuse(reason: str | None) -> None:
    """A :attr:`agent.wire.knobs.Knob.check` helper: raise ``ValueError(reason)`` unless None.

    Unless ``reason`` is None."""
    if reason is not None:
        raise ValueError(reason)


class PrecisionPolicy(Protocol):
    """What :func:`precision_knob` binds to: a :class:`gpuopt.MixedPrecision`, or a stand-in.

    An integration's stand-in with the same two members."""

    device_type: str
    precision: str


def precision_knob(mixed_precision: PrecisionPolicy,
                   refusal: Callable[[str], str | None] | None = None) -> Knob:
    """The ``precision`` knob bound to a :class:`gpuopt.MixedPrecision` policy.

    Or any :class:`PrecisionPolicy`.

    Values the device cannot run are refused when the command arrives, with the reason,
    and so are those ``refusal(value)`` gives a reason for (the model's: e.g.
    :func:`agent.integrations.sharded.precision_refusal`); fp16 on a CPU is accepted with a warning
    (it runs, slowly).
    """
    device_type = mixed_precision.device_type

    def check(value: str) -> None:
        refuse(precision_support(value, device_type)
               or (refusal(value) if refusal is not None else None))

    return Knob.attribute(PRECISION, mixed_precision, check=check,
                          warn=lambda value: precision_warning(value, device_type))


def dropout_knob(model: torch.nn.Module) -> Knob | str:
    """The binder of ``dropout``: the knob of the model's dropout modules, or why it has none.

    :class:`gpuopt.dropout.DropoutRate`; exact in any framework, as a module reads its ``p``
    at each forward. Or the reason the model has none."""
    rate = DropoutRate(model)
    if rate.refusal is not None:
        return rate.refusal
    return Knob.attribute(DROPOUT, rate, "p")


#: Why a run has no ``mixture`` knob, unless its integration says why more precisely.
NOT_A_MIXTURE = ("this run's data is not a mixture: build it with "
                 "gpuopt.mixture.MixtureLoader(datasets, weights, batch_size) and train "
                 "from that loader")


def mixture_knob(loader: MixtureLoader) -> Knob:
    """The ``mixture`` knob of a :class:`gpuopt.mixture.MixtureLoader`: its weights.

    One weight per dataset (a command with another count is refused with it), set with
    :meth:`~gpuopt.mixture.MixtureLoader.set_weights` at the boundary (the rest of the
    epoch drawn again: one pass over its indices). A value whose text is the current
    weights' changes nothing, so a resume that sets the saved value keeps the saved
    draw bit for bit."""
    count = len(loader.datasets)

    def set_weights(value: str) -> None:
        if value != weights_text(loader.weights):
            loader.set_weights([float(weight) for weight in value.split(",")])

    return Knob(dataclasses.replace(MIXTURE, minimum=count, maximum=count),
                get=lambda: weights_text(loader.weights), set=set_weights)


def loader_knobs(loader: ReconfigurableLoader) -> list[Knob]:
    """The ``num_workers``, ``pin_memory``, ``prefetch_factor`` knobs of a loader, and ``mixture``.

    Of a :class:`gpuopt.loader.ReconfigurableLoader`, and ``mixture`` (:func:`mixture_knob`)
    for a :class:`gpuopt.mixture.MixtureLoader`.

    Applying one rebuilds the loader's workers on the rest of the epoch (every sample
    still once); it costs the training thread about the new workers' start-up (tens of
    ms). If the new workers fail, the loader keeps its previous configuration and the
    failure is reported as an event.
    """
    def setter(name: str) -> Any:
        return lambda value: loader.reconfigure(**{name: value})

    def pin_warning(value: bool) -> str | None:
        # (either way: the in-run search then skips a toggle that can only measure noise)
        if not torch.cuda.is_available():
            return "pin_memory has no effect without CUDA (no host-to-device copies)"
        return None

    def prefetch_factor() -> int:
        value = loader.config["prefetch_factor"]
        return 2 if value is None else value  # None: DataLoader's default, 2

    return [
        *([mixture_knob(loader)] if isinstance(loader, MixtureLoader) else []),
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


def cpu_threads_knob(knobs: KnobSet) -> Knob:
    """The ``cpu_threads`` knob: torch's intra-op threads in this process.

    Set with ``torch.set_num_threads``, from 1 to the CPUs it may run on.

    On a CPU-bound host it trades against ``num_workers``: DataLoader workers (one
    thread each) and the training's own threads share the same cores. Applying it costs
    microseconds; it is process-wide, so it holds for every model and loop here. While
    ``knobs``' ``kernels`` is ``compile`` a change warns (and the in-run search skips
    it): torch.compile guards on the thread count, so the next step recompiles.

    The count is the training thread's: with OpenMP each thread that has run torch code
    keeps its own (``torch.get_num_threads()`` on the agent's I/O thread still says the
    old count after the training thread set a new one), so the knob reads the count it
    last set, first the one of the thread that binds it (the training thread, at
    attach); a ``torch.set_num_threads`` of the script's own afterwards is not seen.
    """
    threads = [torch.get_num_threads()]

    def set_threads(value: int) -> None:
        torch.set_num_threads(value)
        threads[0] = value

    def warn(value: Any) -> str | None:
        kernels = knobs.knobs.get(KERNELS.name)
        if kernels is not None and kernels.get() == "compile" and value != threads[0]:
            return ("with kernels=compile, torch.compile guards on the thread count: the "
                    "next step recompiles the model (tens of seconds without a step)")
        return None

    return Knob(dataclasses.replace(CPU_THREADS, maximum=usable_cpu_count()),
                get=lambda: threads[0], set=set_threads, warn=warn)


def effective_batch_refusal(micro_batch_size: int, batch_size: int, accum_steps: int
                            ) -> str | None:
    """Why ``micro_batch_size`` cannot keep the effective batch exactly, or None when it can.

    The effective batch: ``batch_size`` samples per micro-batch x ``accum_steps``."""
    effective = batch_size * accum_steps
    now = f"the effective batch of {effective} samples ({batch_size} x accum_steps {accum_steps})"
    if micro_batch_size > effective:
        return f"more than {now}: accum_steps would be below 1"
    if effective % micro_batch_size:
        return (f"{now} is not a multiple of {micro_batch_size}: accum_steps would not be "
                "a whole number")
    return None


def micro_batch_size_knob(loader: ReconfigurableLoader, get_accum: Callable[[], int],
                          set_accum: Callable[[int], None]) -> Knob:
    """The ``micro_batch_size`` knob of a loop, keeping the effective batch with ``accum_steps``.

    Its micro-batches come from ``loader`` and its window size is ``get_accum()`` /
    ``set_accum(n)``: a new size rebuilds the loader on the rest of the epoch (every sample
    still once, in the same order) and sets ``accum_steps`` so that the effective batch
    stays the same. A size that cannot keep it exactly is refused with the reason. Costs
    what a loader rebuild costs (:meth:`gpuopt.loader.ReconfigurableLoader.reconfigure`); if
    the new workers fail, both settings stay as they were.
    """
    def check(value: int) -> None:
        refuse(effective_batch_refusal(value, loader.batch_size, get_accum()))

    def apply(value: int) -> None:
        accum_steps = get_accum()
        refuse(effective_batch_refusal(value, loader.batch_size, accum_steps))
        effective = loader.batch_size * accum_steps
        loader.reconfigure(batch_size=value)
        set_accum(effective // value)

    return Knob(MICRO_BATCH_SIZE, get=lambda: loader.batch_size, set=apply, check=check)


def optimizer_knobs(settings: OptimizerSettings, knobs: KnobSet) -> None:
    """Bind ``lr_scale`` and ``weight_decay`` of an optimizer's settings.

    Of its :class:`gpuopt.optim.OptimizerSettings`: the scale multiplies what the schedule
    sets, inside the step only; the decay goes to the param groups that decay (a warning
    says so when none did, and every group gets it). ``weight_decay`` is marked unsupported,
    with the reason, for an optimizer that has none."""
    knobs.add(Knob.attribute(LR_SCALE, settings))
    reason = settings.weight_decay_reason()
    if reason is not None:
        knobs.bind(WEIGHT_DECAY, reason)
        return

    def every_group(value: float) -> str | None:
        if value and settings.decays_every_group:
            return ("no param group had weight decay when gpuwatch attached, so nothing "
                    "tells biases and norms apart: every group decays (give them a group "
                    "of their own with weight_decay=0 to keep them out)")
        return None

    knobs.add(Knob.attribute(WEIGHT_DECAY, settings, warn=every_group))


class MemoryKnobs:
    """The ``memory_fraction`` and ``memory_snapshot_steps`` knobs of a run on a CUDA ``device``.

    On any other device :meth:`bind` marks them unsupported, with the reason."""

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
        assert self.snapshot is not None  # its knob is bound only on CUDA, where there is one
        self.snapshot.start(steps, log_dir() / f"{self.run_name}-memory-snapshot.pickle")
        self.snapshot_steps_left = steps

    def after_step(self, agent: Agent, step: int) -> None:
        """Training thread, after the boundary of ``step`` while a snapshot runs: tick it.

        Call it only while :attr:`snapshot_steps_left` (the boundary checks it, to make no
        call a step otherwise). Once its file is written, an event says where."""
        self.snapshot_steps_left -= 1
        assert self.snapshot is not None  # steps are left only of a started snapshot
        path = self.snapshot.on_optimizer_step()
        if path is not None:
            agent.event("info", f"memory snapshot written to {path}",
                        kind=EventKind.MEMORY_SNAPSHOT, path=str(path), step=step)

    def bind(self, knobs: KnobSet) -> None:
        """Add both knobs to ``knobs`` on CUDA; elsewhere mark them unsupported."""
        if self.snapshot is None:
            for spec in (MEMORY_FRACTION, MEMORY_SNAPSHOT_STEPS):
                knobs.bind(spec, f"needs CUDA; this run is on "
                                 f"{self.device.type}")
            return
        knobs.add(Knob(MEMORY_FRACTION, get=lambda: self.fraction, set=self.set_fraction))
        knobs.add(Knob(MEMORY_SNAPSHOT_STEPS, get=lambda: self.snapshot_steps_left,
                       set=self.start_snapshot))


def publish_events(agent: Agent, step: int,
                   events: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Publish ``(kind, text, fields)`` events of ``step`` (e.g. a model backend's compile events).

    Level ``warning`` for kind ``warning``, else ``info``."""
    for kind, text, fields in events:
        agent.event("warning" if kind == EventKind.WARNING else "info", text, kind=kind, step=step,
                    **fields)


def attach(trainer: Any, *, name: str = "", transport: str = "ipc",
           checkpoint_dir: str | os.PathLike | None = None,
           resume_from: str | os.PathLike | None = None, **options: Any) -> Any:
    """Attach the agent to the trainer you already have, in one line, before it trains.

    By its type: a :class:`gpuopt.Trainer` (below); a ``lightning.pytorch.Trainer``
    before ``fit`` (:mod:`agent.integrations.lightning`); a ``transformers.Trainer``
    before ``train`` (:mod:`agent.integrations.hf`); an ``accelerate.Accelerator`` of a
    hand-written loop (:mod:`agent.integrations.accelerate`, which returns the loop's
    run object); a ``lightning.fabric.Fabric`` after ``fabric.setup``
    (:mod:`agent.integrations.fabric`, which returns the loop's run object). Each
    integration installs its framework's own callback and imports its framework only
    then. Returns the started agent (or the accelerate or Fabric run).

    Raises:
        TypeError: ``trainer`` is none of these (a hand-written loop uses
            :func:`agent.session`).

    For a :class:`gpuopt.Trainer`:

    The agent measures every optimizer step of the next :meth:`Trainer.fit` and exposes
    the knobs ``precision``, ``accum_steps``, ``kernels``, ``lr_scale``, ``weight_decay``
    (when the optimizer has it), ``max_grad_norm`` (0: no clipping), ``cpu_threads``,
    ``memory_fraction`` and ``memory_snapshot_steps`` (the last two on CUDA; elsewhere a
    command for them is refused with the reason), ``checkpointing`` when the model
    has blocks to checkpoint, and ``num_workers``, ``pin_memory``, ``prefetch_factor`` and
    ``micro_batch_size`` when the trainer's loader is a
    :class:`gpuopt.loader.ReconfigurableLoader`; and the ``checkpoint`` command
    (:meth:`Trainer.state_dict` and the knob values, by ``torch.save``, see
    :mod:`agent.control.checkpoints`). It closes (``bye``, run file removed) when that ``fit``
    returns. After a guarded change (precision, accumulation, micro-batch size, kernels,
    the optimizer's knobs), an out-of-memory error in the next steps rolls the change
    back and the window is run again
    (``Trainer.on_out_of_memory``). Costs the training thread a few microseconds per
    optimizer step and never synchronizes the device.

    Args:
        trainer: the trainer to observe and steer.
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"`` (see :class:`agent.Agent`).
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        resume_from: a checkpoint the command saved: the trainer continues from it (its
            state, loader position, random numbers and every knob value; see
            :meth:`Trainer.load_state_dict`), and an event says so.
        options: more :class:`agent.Agent` arguments, such as ``recover=`` (the
            :class:`agent.control.recovery.Recovery` settings of ``recover=on``), and the
            integration's own, such as ``eval_fn=``: what ``evaluate=now`` runs, for the
            gpuopt Trainer, accelerate and Fabric (Lightning and HF run their own
            evaluation).

    Every run also takes ``pause=on|off``, ``stop=now|checkpoint``, ``recover=on|off``
    where it keeps its state and, where it has an evaluation, ``evaluate=now`` (see
    :mod:`agent.integrations.run`).

    Raises:
        ValueError: ``resume_from`` is not such a checkpoint, or this trainer cannot take
            it (see :meth:`Trainer.load_state_dict`). OSError: it cannot be read.
    """
    if isinstance(trainer, Trainer):
        from agent.integrations.trainer import attach as attach_trainer

        return attach_trainer(trainer, name=name, transport=transport,
                              checkpoint_dir=checkpoint_dir, resume_from=resume_from,
                              **options)
    from agent.integrations import integration_for

    module = integration_for(trainer)
    if module is None:
        raise TypeError(
            f"agent.attach() takes a gpuopt.Trainer, a lightning.pytorch.Trainer, a "
            f"transformers.Trainer, an accelerate.Accelerator or a lightning.fabric.Fabric, "
            f"not "
            f"{type(trainer).__module__}.{type(trainer).__qualname__}; for a "
            "hand-written loop use agent.session(...)")
    for option, value in (("checkpoint_dir", checkpoint_dir), ("resume_from", resume_from)):
        if value is not None:
            options[option] = value
    return importlib.import_module(module).attach(trainer, name=name, transport=transport,
                                                  **options)
