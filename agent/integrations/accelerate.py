"""gpuwatch for hand-written loops on a Hugging Face ``accelerate.Accelerator``.

Three changed lines in the usual loop::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    run = agent.attach(accelerator)                # 1: after prepare()
    for batch in run.loader(loader):               # 2: times each fetch (the data wait)
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
        run.micro_batch(loss)                      # 3: once per micro-batch

:meth:`AcceleratorRun.micro_batch` reads ``accelerator.sync_gradients``: on the
micro-batch that ends an accumulation window (accelerate steps the optimizer there),
:attr:`AcceleratorRun.step` counts the step at once (a loop that stops on ``run.step >=
max_steps`` takes exactly ``max_steps``), and the step is recorded and the live commands
due are applied once that iteration is over, at the next fetch from
:meth:`AcceleratorRun.loader` (or the end of its data, or a ``break`` out of it), before
the next ``accelerator.accumulate`` counts a micro-batch: so every knob changes between
two windows. (A loop that does not fetch through ``run.loader`` calls
``run.micro_batch`` after ``optimizer.zero_grad()``; the step is recorded at the call.)
The run starts at :func:`attach` (no ``with``) and ends at interpreter exit, on SIGTERM
or an uncaught exception (named in ``bye``), or at :meth:`AcceleratorRun.close`.

**Resume.** ``attach(accelerator, resume_from=PATH)`` with a ``checkpoint=now``
checkpoint, and the same loop goes on exactly (on CPU in fp32, bit for bit: the same
micro-batches in every window, the same losses and parameters): nothing to skip or
count in the loop. Each ``run.loader(loader)`` call is one epoch, the first after a
resume the rest of the checkpoint's (from the first micro-batch the saved run had not
trained, in the same shuffled order); :attr:`AcceleratorRun.step` and
:attr:`AcceleratorRun.epoch` are the checkpoint's, so either loop shape resumes as it
is::

    while run.step < max_steps:                    # a loop that counts steps
        for batch in run.loader(loader):
            ...
            if run.step >= max_steps:
                break

    for epoch in range(run.epoch, num_epochs):     # a loop that counts epochs
        for batch in run.loader(loader):
            ...

Each step record has the window's loss, micro-batches, samples, tokens (declared with
``tokens_per_sample``, or the ``input_ids`` of mapping batches), the data wait, the
learning rate the step used (every param group's, read inside its optimizer step; for a
step not taken, param group 0's at the window's first fetch, after the previous window's
``scheduler.step()``) and the gradient norm when the loop called
``accelerator.clip_grad_norm_``.

**The loss convention.** Pass the undivided loss of the micro-batch: what ``loss_fn``
returned, the tensor given to ``accelerator.backward`` (which divides its own copy by
``gradient_accumulation_steps``; the tensor passed in is unchanged). The step's loss is
the mean of the window's micro-batch losses, formed here on the device (never read on
the training thread). Gradient normalisation is accelerate's: each micro-batch's loss is
divided by ``gradient_accumulation_steps`` (the window's gradient is the mean of
micro-batch means; a short last window at the end of a prepared DataLoader is still
divided by the full size, as accelerate does in a fresh run).

**Knobs** (each applies at an optimizer-step boundary and trains as a fresh run so
configured from that step, or is refused with the reason):

- ``accum_steps``: sets ``gradient_accumulation_steps`` and restarts accelerate's
  micro-batch count (``accelerator.step = 0``), so every following window has exactly
  the new number of micro-batches and each loss is divided by it. (Changing
  ``gradient_accumulation_steps`` alone leaves the count misaligned: after 4 -> 3 at
  micro-batch 8 the first window was one micro-batch divided by 3.) Needs the loop to use
  ``accelerator.accumulate``. An LR schedule keeps counting optimizer steps; one planned
  for a total from the starting value is not re-planned (the reply warns).
- ``precision`` (fp32 / bf16 / fp16): the prepared model's ``forward`` runs under the
  current autocast with fp32 outputs (accelerate's own mixed-precision wrapping, made
  live); ``accelerator.autocast()`` and :meth:`AcceleratorRun.autocast` follow it; fp16
  uses one ``torch.amp.GradScaler``, created at the first switch to fp16 (or
  accelerate's own) and kept with its scale, set as ``accelerator.scaler`` and on every
  prepared optimizer, so ``accelerator.backward`` scales, ``clip_grad_norm_`` unscales
  and the optimizer step goes through ``GradScaler.step`` / ``update``. Refused where
  accelerate does not run the model itself (DeepSpeed, FSDP, Megatron, XLA), for a model
  already ``torch.compile``'d, and after something else replaced the model's forward.
- ``checkpointing``: :class:`gpuopt.checkpointing.ActivationCheckpointing` over the
  model's ``blocks`` (or ``checkpoint_blocks=``).
- ``kernels``: eager / ``torch.compile`` of the model's forward (one kept compiled view,
  :class:`gpuopt.backends.ModelBackend`); the loop's own ``model(...)`` call goes through
  it. ``triton`` only for models with :mod:`gpuopt.kernels` fused modules, on CUDA.
  One process only (compiling inside DDP is not verified).
- ``num_workers``, ``pin_memory``, ``prefetch_factor``: when the loop's data is a
  :class:`gpuopt.loader.ReconfigurableLoader` (given to :meth:`AcceleratorRun.loader`).
- ``lr_scale``, ``weight_decay``: :class:`gpuopt.optim.OptimizerSettings` on the loop's
  optimizer (the scale multiplies what the loop's scheduler sets, inside the step only;
  the decay goes to the groups that decay).
- ``max_grad_norm``: the threshold of the loop's own ``accelerator.clip_grad_norm_``
  call (the knob's value replaces the loop's from the change; 0: the norm is still
  computed, nothing clipped); refused once a step was taken without that call.
- ``micro_batch_size``: when the loop's data is a ReconfigurableLoader: the rest of the
  epoch in batches of the new size, and ``accum_steps`` moved to keep the effective
  batch (so, as ``accum_steps``, once the loop is in ``accelerator.accumulate``).
- ``checkpoint=now``: accelerate's ``save_state`` into ``<checkpoint_dir>/checkpoint-<N>``,
  made atomic, with the knob values, the step and the data position (the batches
  :meth:`AcceleratorRun.loader` fetched in the epoch, the random numbers at its start and
  at the boundary, accelerate's epoch count or a ReconfigurableLoader's position);
  ``attach(accelerator, resume_from=PATH)`` continues from it (see **Resume**). The
  reply warns when the data cannot be resumed exactly (batches not fetched through
  ``run.loader``, an IterableDataset, a one-shot iterator). Refused with several
  processes and with ``automatic_checkpoint_naming``.
- ``memory_fraction``, ``memory_snapshot_steps``: on CUDA.

Imported only when used: ``import agent`` does not import accelerate.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step
from accelerate.utils import DistributedType
from accelerate.utils.operations import convert_to_fp32

from agent.wire.protocol import EventKind
from agent.integrations.adapters import (cpu_threads_knob, dropout_knob, loader_knobs,
                                         micro_batch_size_knob, optimizer_knobs, refuse)
from agent.control.checkpoints import (GRAD_SCALER_FILE, load_tensors, read_knobs_file,
                                       restore_knobs, write_knobs_file)
from agent.step.core import Agent
from agent.wire.runlog import open_no_follow
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINT, CHECKPOINTING, DROPOUT, KERNELS,
                              LOADER_KNOBS, LR_SCALE, MAX_GRAD_NORM, MICRO_BATCH_SIZE, NUM_WORKERS,
                              PRECISION, WEIGHT_DECAY, Knob, KnobSet)
from agent.step.record import StepRecord
from agent.integrations.run import RunBase
from agent.integrations.sharded import MetadataUnpickler
from gpuopt.backends import ModelBackend
from gpuopt.checkpointing import ActivationCheckpointing, find_blocks
from gpuopt.kernels.backend import KernelBackendMixin
from gpuopt.loader import ReconfigurableLoader
from gpuopt.optim import OptimizerSettings
from gpuopt.precision import ReusableAutocast, precision_support, precision_warning
from gpuopt.saving import rng_state, set_rng_state

__all__ = ["AcceleratorRun", "attach"]

#: accelerate's ``mixed_precision`` names <-> the ``precision`` knob's values.
_FROM_ACCELERATE = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_TO_ACCELERATE = {value: key for key, value in _FROM_ACCELERATE.items()}
_AUTOCAST_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Setups whose model, backward and optimizer step are the plain (or DDP) ones that the
#: knobs below change; under the others accelerate hands them to DeepSpeed, FSDP, ...
_PLAIN = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
_MISPLACED = ("run.micro_batch() ran before optimizer.step() and zero_grad() in a window "
              "that ended: call it after them (zero_grad with set_to_none, the default), "
              "or iterate run.loader()")
_NO_CLIPPING = ("the loop does not call accelerator.clip_grad_norm_(model.parameters(), "
                "max_norm) (after accelerator.backward, when accelerator.sync_gradients): add "
                "it, and gpuwatch sets its threshold")
_LOADER_REASON = ("the loop's data is not a gpuopt.loader.ReconfigurableLoader (a "
                  "DataLoader fixes its workers when it is built); give one to run.loader() "
                  "for live loader knobs")
_MICRO_BATCH_REASON = ("the loop's data is not a gpuopt.loader.ReconfigurableLoader (a "
                       "DataLoader fixes its batch size when it is built); give one to "
                       "run.loader() for a live micro_batch_size")
#: In a ``checkpoint=now`` directory: the data position (:meth:`AcceleratorRun.data_state`).
DATA_FILE = "gpuwatch-data.pt"


# ---------------------------------------------------------------------- precision

class _Precision:
    """The live precision of an accelerate run: the autocast of the model's forward and
    of ``accelerator.autocast()``, and the GradScaler of backward and optimizer step.

    :meth:`set` changes, between optimizer steps, every place accelerate reads it:
    ``accelerator.state`` (``mixed_precision``, read by ``accelerator.autocast()`` and
    ``unscale_gradients``), ``accelerator.native_amp``, ``accelerator.scaler`` (read by
    ``backward``) and each prepared :class:`~accelerate.optimizer.AcceleratedOptimizer`'s
    ``scaler`` (read by its ``step``).
    """

    def __init__(self, accelerator: Accelerator, device_type: str) -> None:
        self.accelerator = accelerator
        self.device_type = device_type
        self.precision = _FROM_ACCELERATE[accelerator.mixed_precision]
        self.dtype = _AUTOCAST_DTYPE[self.precision]
        handler = accelerator.autocast_handler
        self.autocast_kwargs: dict[str, Any] = handler.to_kwargs() if handler else {}
        #: the one GradScaler of this run: accelerate's own (fp16 from the start) or the
        #: one made at the first switch to fp16; kept while in fp32/bf16
        self.scaler: torch.amp.GradScaler | None = accelerator.scaler

    def set(self, value: str) -> None:
        """Switch to ``value`` (between optimizer steps).

        Raises ``ValueError`` (the reason) before changing anything when ``value`` cannot
        run here."""
        reason = precision_support(value, self.device_type)
        if reason is not None:
            raise ValueError(reason)
        scaler = self.scaler
        if value == "fp16" and scaler is None:
            handler = self.accelerator.scaler_handler
            scaler = torch.amp.GradScaler(self.device_type,
                                          **(handler.to_kwargs() if handler else {}))
        # nothing below raises: the switch is whole or not at all
        self.scaler = scaler
        active = scaler if value == "fp16" else None
        self.accelerator.scaler = active
        for optimizer in self.accelerator._optimizers:
            _set_optimizer_scaler(optimizer, active)
        self.accelerator.native_amp = value != "fp32"
        self.accelerator.state._mixed_precision = _TO_ACCELERATE[value]
        self.dtype = _AUTOCAST_DTYPE[value]
        self.precision = value

    def context(self) -> Any:
        """A fresh autocast context for the current precision (None in fp32)."""
        if self.dtype is None:
            return None
        return torch.autocast(self.device_type, dtype=self.dtype, **self.autocast_kwargs)


def _set_optimizer_scaler(optimizer: Any, scaler: torch.amp.GradScaler | None) -> None:
    """Give an AcceleratedOptimizer ``scaler`` (None: step without one), with the step
    patch accelerate installs when it is built with a scaler."""
    if not isinstance(optimizer, AcceleratedOptimizer):
        return
    if scaler is not None and not hasattr(optimizer, "_optimizer_patched_step_method"):
        optimizer._accelerate_step_called = False
        optimizer._optimizer_original_step_method = optimizer.optimizer.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(
            optimizer, optimizer.optimizer.step)
    if scaler is None:
        optimizer._is_overflow = False  # else the scheduler would skip every later step
    optimizer.scaler = scaler


# ---------------------------------------------------------------------- the model's forward

class _OriginalForward(nn.Module):
    """The model's original forward as a module, for ``torch.compile`` to compile (the
    model itself cannot be: its ``forward`` is now :class:`_Forward`, which calls this).
    Holds the model as a submodule; nothing else sees this module."""

    def __init__(self, model: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.original = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs)


class _Forward:
    """The prepared model's ``forward``: the original forward under the current
    precision's autocast with fp32 outputs (what accelerate installs at ``prepare`` for a
    fixed ``mixed_precision``), through the current kernel backend.

    .. note:: Cost per call: an attribute read, plus under compile the compiled view's
       guards; never touches the device.
    """

    def __init__(self, original: Callable[..., Any], precision: _Precision | None,
                 backend: ModelBackend | None) -> None:
        self.original = original
        self.precision = precision
        self.backend = backend
        function = getattr(original, "__func__", None)
        if function is not None:  # accelerate's unwrap_model(keep_fp32_wrapper=False)
            self.__wrapped__ = function  # walks back to the class's own forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.original if self.backend is None else self.backend
        context = None if self.precision is None else self.precision.context()
        if context is None:
            return call(*args, **kwargs)
        with context:
            outputs = call(*args, **kwargs)
        return convert_to_fp32(outputs)


def _original_forward(model: nn.Module, strip_accelerate: bool) -> Callable[..., Any]:
    """The model's forward without a previous run's :class:`_Forward` and, with
    ``strip_accelerate``, without accelerate's fixed mixed-precision wrapper."""
    installed = model.__dict__.get("forward")
    if isinstance(installed, _Forward):
        installed = installed.original
        if not strip_accelerate:
            return installed
    original = model.__dict__.get("_original_forward")  # set by prepare() with native AMP
    if strip_accelerate and installed is not None and original is not None:
        return original
    return installed if installed is not None else model.forward


def _inner_module(model: nn.Module) -> tuple[nn.Module, bool]:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers, and
    whether a ``torch.compile`` wrapper was among them."""
    compiled = False
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(original := model._modules.get("_orig_mod"), nn.Module):
            model, compiled = original, True  # an OptimizedModule
        else:
            return model, compiled


# ---------------------------------------------------------------------- the run

class _GradNormRecorder:
    """Stands in for ``accelerator.clip_grad_norm_(parameters, max_norm, ...)``: calls it
    and keeps the norm it returned (a 0-dim tensor, not read here) for the step's record;
    once the ``max_grad_norm`` knob is set, with the knob's threshold instead of the
    loop's (0: none; the norm is still computed, the gradients multiplied by 1).

    Attributes:
        max_norm: the knob's threshold, or None (the loop's own). loop_max_norm: the
        threshold the loop passed last (0.0 before its first call). calls: calls so far.
    """

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.norm: Any = None
        self.max_norm: float | None = None
        self.loop_max_norm = 0.0
        self.calls = 0

    def __call__(self, parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.loop_max_norm = float(max_norm) if math.isfinite(max_norm) else 0.0
        if self.max_norm is not None:
            max_norm = self.max_norm or math.inf
        self.norm = self.original(parameters, max_norm, *args, **kwargs)
        return self.norm

    @property
    def threshold(self) -> float:
        """The ``max_grad_norm`` knob's value: the threshold in use (0: no clipping)."""
        return self.loop_max_norm if self.max_norm is None else self.max_norm


def _refuse_code(path: Path) -> None:
    """Read first, running no code, what accelerate's ``load_state`` would unpickle in full.

    accelerate (1.15) reads three of a checkpoint's files with a full unpickler, which runs
    any code a crafted file names: ``custom_checkpoint_N.pkl`` (the objects registered
    for checkpointing: ``weights_only=False``), ``scaler.pt`` under FSDP2 (a plain
    ``torch.load``: in full on torch < 2.6 or with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``)
    and the ``.metadata`` of a sharded (``torch.distributed.checkpoint``) state. Each
    found in ``path`` (``.metadata`` at any depth) is read here first with
    ``weights_only`` (:func:`~agent.control.checkpoints.load_tensors`) or
    :class:`~agent.integrations.sharded.MetadataUnpickler`, before anything is loaded.
    Small files (states, not weights), read twice.

    Raises:
        ValueError: such a file holds more than tensors and plain values (nothing of
            the checkpoint is loaded then). OSError: it cannot be read.
    """
    for file in [*sorted(path.glob("custom_checkpoint_*.pkl")), path / "scaler.pt"]:
        try:
            load_tensors(file)
        except FileNotFoundError:
            continue
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{file} holds more than tensors and plain values, which accelerate's "
                f"load_state would unpickle in full (code in it would run): not loaded "
                f"({str(exc).splitlines()[0]})") from None
    for file in sorted(path.rglob(".metadata")):
        try:
            with os.fdopen(open_no_follow(file), "rb") as stream:
                MetadataUnpickler(stream).load()
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{file}: {exc}") from None


class AcceleratorRun(RunBase):
    """gpuwatch's view of one accelerate training loop (made by :func:`attach`).

    The run base (:class:`agent.integrations.run.RunBase`) with accelerate's reads of a
    step, its knobs, its ``save_state`` / ``load_state`` and the loop's data.

    Attributes:
        agent: the :class:`agent.step.core.Agent` (run id, knobs, events).
        accelerator: the Accelerator. model: the prepared model.
        step: optimizer steps taken so far, counted as accelerate takes each one (at the
            :meth:`micro_batch` that ends a window; a resumed run counts on from its
            checkpoint's), so a loop that stops on ``run.step >= N`` takes N.
        epoch: epochs :meth:`loader` has iterated to their end (a resumed run: the
            checkpoint's), i.e. the 0-based index of the epoch in progress: a loop that
            counts epochs resumes with ``for epoch in range(run.epoch, num_epochs)``.
        checkpointing: the :class:`~gpuopt.checkpointing.ActivationCheckpointing` of the
            model's blocks, or None. backend: the
            :class:`~gpuopt.backends.ModelBackend` behind the ``kernels`` knob, or None.
        optimizer_settings: ``lr_scale`` and ``weight_decay`` of the loop's optimizer
            (:class:`gpuopt.optim.OptimizerSettings`), or None.
        autocast: a reusable autocast context following the ``precision`` knob (``with
            run.autocast:`` or ``with run.autocast():``), e.g. for evaluation code outside
            the model's forward; ``accelerator.autocast()`` follows the knob too. Where
            the knob is refused, it is ``accelerator.autocast()``.
    """

    def __init__(self, agent: Agent, accelerator: Accelerator, model: nn.Module,
                 optimizer: Any, tokens_per_sample: int | None) -> None:
        super().__init__(agent, device=accelerator.device, tokens_per_sample=tokens_per_sample)
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.checkpointing: ActivationCheckpointing | None = None
        self.backend: ModelBackend | None = None
        self.optimizer_settings: OptimizerSettings | None = None
        self.autocast = ReusableAutocast(accelerator.autocast)
        self._gradient_state = accelerator.gradient_state
        self._micro_batches = 0
        self._loss_sum: torch.Tensor | None = None
        self._accumulate_seen = False
        self._started = False
        self._precision: _Precision | None = None
        self._inner, self._compiled = _inner_module(model)
        self._forward: _Forward | None = None
        self._forward_lost: str | None = None
        #: run.loader()'s default (attach's loader=), or the ReconfigurableLoader the
        #: loader knobs steer
        self._loader: Any = None
        self._loader_warned = False
        self._data: Any = None  # what run.loader() iterates: a checkpoint keeps its place
        #: the checkpoint's place of the loop's loader (:func:`_loader_place`), put back
        #: when :meth:`loader` gets it; None when none is pending
        self._place: dict[str, Any] | None = None
        #: knobs of the checkpoint resumed from that this run binds only at run.loader()
        self._unbound: dict[str, Any] = {}
        self._grad_norm = _GradNormRecorder(accelerator.clip_grad_norm_)
        self._threshold_shown = 0.0  # the clipping threshold the knob values last said
        self._first_step = 0  # the step this process started from (a resume's)
        self._window_lr: float | None = None
        self._boundary_pending = False  # a window ended; its step is recorded after it
        self._iterating = 0  # loader() generators running
        self._thread = threading.current_thread()  # the training thread
        #: a parameter the optimizer steps (found by a step pre-hook at the first step):
        #: its ``grad`` is None again after ``zero_grad()``, so a step recorded while it
        #: still holds one was recorded before the window's step and zero_grad
        self._probe: torch.Tensor | None = None
        self._after_step = True  # the step being recorded came after step and zero_grad
        self._misplaced_warned = False
        self._hooks: list[Any] = []  # their handles (attach() registers them)

    # ------------------------------------------------------------ the loop's calls

    def loader(self, batches: Iterable[Any] | None = None) -> Iterator[Any]:
        """One epoch of ``batches``, each ``next()`` timed and its samples and tokens counted.

        ``batches`` defaults to the ``loader=`` given to :func:`attach`. Timing each
        ``next()`` (the data wait, host seconds) and counting samples (dim 0 of the batch's
        first tensor) and tokens (``tokens_per_sample`` per sample if declared, else the
        ``input_ids`` of mapping batches); each batch is the data position a checkpoint
        keeps. After ``attach(..., resume_from=)`` the first call is the rest of the
        checkpoint's epoch, from the first micro-batch the saved run had not trained (the
        epoch's iterator made again from the random numbers at its start, the batches
        trained dropped; accelerate's epoch count ``iteration`` and a ReconfigurableLoader's
        own position put back): give it the prepared loader itself, not
        ``accelerator.skip_first_batches``. The first ``next()`` starts the first step's
        clock. A :class:`gpuopt.loader.ReconfigurableLoader` gets the live loader knobs and
        ``micro_batch_size`` (the first one given; later ones are warned about). Evaluation
        data does not go through here. Once ``stop`` applied it yields nothing, so an epoch
        loop's later epochs train nothing.

        Raises:
            ValueError: no ``batches`` and no ``loader=`` at :func:`attach`; or (at the
                first ``next()`` after a resume) the checkpoint's epoch had more batches
                than ``batches`` has.

        .. note:: Costs a clock read and a shape read per micro-batch; after a resume,
           the loading of the saved epoch's trained batches once.
        """
        if self.stopping:  # stop applied in an earlier loader(): this one fetches nothing
            return iter(())
        if batches is None:
            if self._loader is None:
                raise ValueError("run.loader() needs the batches to iterate (or attach(..., "
                                 "loader=...))")
            batches = self._loader
        if self._place is not None:
            place, self._place = self._place, None
            _put_back(batches, place)
            skipped = _skipped(batches)
            if skipped:
                self.agent.event("warning", "run.loader() goes on from the checkpoint's "
                                 f"micro-batch itself: this loader skips {skipped} more "
                                 "(accelerator.skip_first_batches); give it the prepared "
                                 "loader", kind=EventKind.WARNING, step=self.step)
        if isinstance(batches, ReconfigurableLoader):
            self._bind_loader(batches)
        self._data = batches
        return self._iterate(batches)

    def _iterate(self, batches: Iterable[Any]) -> Iterator[Any]:
        if not self._started:
            self._started = True
            self.agent.mark_start()
        self._iterating += 1
        try:
            for batch in self.position.epoch_iterator(batches, self.meter.add):
                if self._window_lr is None:  # a window's first fetch: after the previous
                    self._window_lr = self._lr()  # window's scheduler.step(), before its own
                yield batch
                if self._boundary_pending:  # the iteration that ended a window is over:
                    self._optimizer_step(True)  # step and zero_grad done
                if self.stopping:  # stop applied at that boundary: nothing more fetched
                    return
        finally:
            self._iterating -= 1
            if self._boundary_pending and threading.current_thread() is self._thread:
                self._optimizer_step(True)  # a loop left by `break`

    def micro_batch(self, loss: torch.Tensor | float | None = None) -> None:
        """Call once per micro-batch, after its loss is computed.

        Anywhere in the loop's iteration when batches come from :meth:`loader`; without it,
        after ``optimizer.step()`` / ``zero_grad()``. When accelerate's ``sync_gradients``
        says this micro-batch ends an accumulation window (accelerate stepped the
        optimizer), :attr:`step` counts it at once; the step is recorded (window mean loss,
        micro-batches, samples, tokens, data wait, learning rate, gradient norm if
        ``accelerator.clip_grad_norm_`` ran) and the live commands due are applied once the
        iteration is over: at the next fetch from :meth:`loader` (or at the end of its data,
        or a ``break`` out of it), else at once.

        Args:
            loss: this micro-batch's undivided loss (what ``loss_fn`` returned and was
                given to ``accelerator.backward``), a tensor on any device; it is never
                read on this thread.

        .. note:: Never synchronizes the device; one asynchronous add per micro-batch and
           a few microseconds per optimizer step. Never raises, and counts :attr:`step`
           even after an error of gpuwatch's stopped the observing.
        """
        if self._boundary_pending:  # a window ended and no fetch came since
            self._optimizer_step()
        if not self.broken:
            try:
                self._micro_batches += 1
                if loss is not None:
                    loss = (loss.detach().float() if isinstance(loss, torch.Tensor)
                            else torch.tensor(float(loss)))
                    self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                if self.accelerator.step:
                    self._accumulate_seen = True
            except Exception as exc:  # the first rule: never crash the training
                self.fail("run.micro_batch()", exc)
        if self._gradient_state.sync_gradients:
            self.step += 1
            self._boundary_pending = True
            if not self._iterating:
                self._optimizer_step()

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._probe is None:  # once: the first parameter being stepped
            self._probe = next((p for group in optimizer.param_groups for p in group["params"]
                                if p.grad is not None), None)

    def _optimizer_step(self, after_step: bool = False) -> None:
        """Record the optimizer step :attr:`step` that ended, at its boundary
        (:meth:`agent.integrations.run.RunBase.boundary`); ``after_step``: the loop's iteration is
        known to be over (a fetch from :meth:`loader` came since). Never raises."""
        self._boundary_pending = False
        if self.broken:
            return
        try:
            record = self._record(after_step)
        except Exception as exc:  # the first rule: never crash the training
            self.fail("recording the optimizer step", exc)
            return
        self.boundary(record)

    def _record(self, after_step: bool) -> StepRecord:
        """The step record of the window that ended (its meters start again)."""
        self._after_step = after_step or (self._probe is not None and self._probe.grad is None)
        if not self._after_step and not self._misplaced_warned:
            self._misplaced_warned = True
            self.agent.event("warning", _MISPLACED + "; a precision change due at such a "
                             "step is refused", kind=EventKind.WARNING, step=self.step)
        micro_batches, self._micro_batches = self._micro_batches, 0
        loss_sum, self._loss_sum = self._loss_sum, None
        data_wait_s, _, samples, tokens = self.meter.take()
        grad_norm, self._grad_norm.norm = self._grad_norm.norm, None
        lr: Any
        lr, self._window_lr = self._window_lr, None
        if lr is None:  # no run.loader(): read now (after a scheduler.step() in the loop,
            lr = self._lr()  # this is the next step's rate)
        if self.optimizer_settings is not None:  # every group's rate, as the step used it
            lr = self.optimizer_settings.take_step()[0] or lr
        if self._grad_norm.threshold != self._threshold_shown:  # the loop's own, first seen
            self._threshold_shown = self._grad_norm.threshold
            self.agent.refresh_knobs()
        if (self._forward is not None and self._forward_lost is None
                and self._inner.__dict__.get("forward") is not self._forward):
            self._forward_lost = ("the model's forward was replaced outside gpuwatch (e.g. "
                                  "by unwrap_model(keep_fp32_wrapper=False))")
            self.agent.event("warning", f"{self._forward_lost}: precision and kernels "
                             "changes are refused from now on", kind=EventKind.WARNING,
                             step=self.step)
        skipped = None
        if self._precision is not None and self._precision.precision == "fp16":
            optimizer = self.optimizer
            if isinstance(optimizer, AcceleratedOptimizer):
                skipped = torch.tensor(optimizer.step_was_skipped)  # a host bool already
        return StepRecord(
            step=self.step, micro_batches=micro_batches, samples=samples,
            data_wait_s=data_wait_s,
            loss=None if loss_sum is None else loss_sum / micro_batches, skipped=skipped,
            tokens=tokens, lr=lr, grad_norm=grad_norm)

    def _lr(self) -> float | None:
        if self.optimizer is None:
            return None
        lr = self.optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):  # a tensor lr: read it only if on the host
            return float(lr) if lr.device.type == "cpu" else None
        return None if lr is None else float(lr)

    def close(self, reason: str = "finished") -> None:
        """End the run (:meth:`agent.integrations.run.RunBase.close`), the last step recorded first.

        The last step is recorded first when a loop left :meth:`loader` by ``break`` and its
        iterator is still held. Called at interpreter exit, on SIGTERM and on an uncaught
        exception too. The model keeps following the last precision and kernels."""
        if (not self.closed and self._boundary_pending
                and threading.current_thread() is self._thread):
            self._optimizer_step()
        super().close(reason)

    def uninstall(self) -> None:
        """Give back ``accelerator.clip_grad_norm_`` and the optimizer's step and setting hooks.

        The optimizer step hooks and the optimizer's ``lr_scale`` / ``weight_decay``
        hooks."""
        if self.accelerator.__dict__.get("clip_grad_norm_") is self._grad_norm:
            del self.accelerator.clip_grad_norm_
        for hook in self._hooks:
            hook.remove()
        if self.optimizer_settings is not None:
            self.optimizer_settings.remove()

    # ------------------------------------------------------------ checkpoint and resume

    def data_state(self) -> dict[str, Any]:
        """The data position (:class:`gpuopt.position.DataPosition`'s) and the loop loader's place.

        The loop loader's own place: :func:`_loader_place`."""
        state = self.position.state_dict()
        state["loader"] = _loader_place(self._data)
        return state

    def _save(self, path: Path, knobs: dict[str, Any]) -> None:
        """``checkpoint=now``: accelerate's ``save_state`` (models, optimizers,
        schedulers, GradScaler, RNG states, registered objects) into ``path``, with the
        knob values, the step, the data position (:meth:`data_state`, as
        :data:`DATA_FILE`) and a GradScaler the precision knob made."""
        self.accelerator.save_state(str(path))
        write_knobs_file(path, self.agent, knobs, self.step)
        torch.save(self.data_state(), path / DATA_FILE)
        scaler = self._precision.scaler if self._precision is not None else None
        if scaler is not None and self.accelerator.scaler is None:  # kept while not fp16
            torch.save(scaler.state_dict(), path / GRAD_SCALER_FILE)

    def _apart(self) -> str | None:
        """Why this run's ranks train apart, or None: the launcher started several and
        accelerate runs each as a one-process run (on a CPU without ``cpu=True``)."""
        accelerator, world_size = self.accelerator, self.agent.world_size
        if accelerator.num_processes > 1 or world_size == 1:
            return None
        return (f"the launcher started {world_size} ranks and accelerate runs each as a "
                f"run of its own (distributed_type {accelerator.distributed_type.value}: no "
                "GPU, and no Accelerator(cpu=True)): they train apart, their gradients "
                "never reduced, and an FSDP plugin is not used")

    def _checkpoint_reason(self) -> str | None:
        accelerator = self.accelerator
        apart = self._apart()
        if apart is not None:
            return f"{apart}; rank 0's checkpoint would not hold the other ranks' models"
        if accelerator.num_processes > 1:
            return (f"this run has {accelerator.num_processes} processes, which "
                    "accelerate's save_state writes from together: call "
                    "accelerator.save_state in the loop")
        if accelerator.project_configuration.automatic_checkpoint_naming:
            return ("the Accelerator names its checkpoints itself "
                    "(automatic_checkpoint_naming): call accelerator.save_state in the loop")
        return None

    def resume(self, path: str | os.PathLike) -> None:
        """Continue from a ``checkpoint=now`` checkpoint: states, step, data position, knobs.

        Accelerate's ``load_state`` (model, optimizer, scheduler, GradScaler, random
        numbers, its micro-batch count), the step, the data position (:meth:`loader`'s next
        call goes on from it) and every knob value; one ``resumed`` event names them (the
        loader knobs and ``micro_batch_size`` of a ReconfigurableLoader once :meth:`loader`
        binds them).

        ``max_grad_norm`` is set now, before the loop's first
        ``accelerator.clip_grad_norm_`` call (a live change waits for one): the
        threshold the saved run clipped with from here on (0: none).

        Raises:
            ValueError: a file accelerate would unpickle in full could run code
                (:func:`_refuse_code`; nothing loaded). OSError, ValueError: from
                accelerate's ``load_state`` (not such a checkpoint, or not this run's model
                and optimizer).
        """
        source = os.fspath(path)
        _refuse_code(Path(path))
        self.accelerator.load_state(source)
        saved = read_knobs_file(path)
        self.step = self._first_step = int(saved.get("step", 0))
        knobs = saved.get("knobs", {})
        data_file = Path(path) / DATA_FILE
        data = load_tensors(data_file) if data_file.is_file() else None
        differs = self.no_position(data)
        if data is not None and differs is None:
            self._place = data["loader"]
            self.position.load_state_dict(data, replay="position" not in data["loader"])
        if MAX_GRAD_NORM.name in knobs and MAX_GRAD_NORM.name in self.knobs.knobs:
            self._grad_norm.max_norm = knobs[MAX_GRAD_NORM.name]
        self._unbound = self.restore(knobs, source, differs=differs,
                                     unbound="not bound yet (set when run.loader() binds them)",
                                     from_run=saved.get("run"))
        scaler_file = Path(path) / GRAD_SCALER_FILE
        if (scaler_file.exists() and self._precision is not None
                and self._precision.scaler is not None):
            self._precision.scaler.load_state_dict(load_tensors(scaler_file))

    def rewind_refusal(self) -> str | None:
        """Why accelerate's ``load_state`` cannot load a checkpoint live here, or None.

        With several processes it loads in place, before they could agree that each
        can; and it unpickles the states of objects registered for checkpointing with
        ``weights_only=False`` (code in a checkpoint would run)."""
        if self.accelerator.num_processes > 1:
            return (f"this run has {self.accelerator.num_processes} processes, and "
                    "accelerate's load_state loads in place, on each alone: resume with "
                    "agent.attach(..., resume_from=...)")
        if self.accelerator._custom_objects:
            return ("accelerate loads the states of objects registered with "
                    "register_for_checkpointing with weights_only=False, so code in a "
                    "checkpoint would run: resume with agent.attach(..., resume_from=...) "
                    "from a checkpoint you trust")
        return None

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A ``checkpoint=now`` checkpoint read as :meth:`resume` does, in the snapshot's form.

        In :meth:`state_snapshot`'s form, read as :meth:`resume` reads it: accelerate's
        ``load_state`` (which loads in place: the state now is kept in host memory first and
        put back if anything fails), the data position, the GradScaler the precision knob
        kept, the step and knob values.

        Raises:
            ValueError: it has no data position of gpuwatch's, or a file accelerate would
                unpickle in full could run code (:func:`_refuse_code`, before anything
                loads). OSError, ValueError: from ``load_state``.
        """
        _refuse_code(path)
        before = self.state_snapshot()
        try:
            self.accelerator.load_state(os.fspath(path))
            saved = read_knobs_file(path)
            data_file = Path(path) / DATA_FILE
            data = load_tensors(data_file) if data_file.is_file() else None
            if data is None or self.no_position(data) is not None:
                raise ValueError(f"{path} has no data position of gpuwatch's")
            snapshot = self.state_snapshot()
            scaler_file = Path(path) / GRAD_SCALER_FILE
            if scaler_file.exists() and snapshot["grad_scaler"] is not None:
                snapshot["grad_scaler"] = load_tensors(scaler_file)
        except Exception:
            self.load_snapshot(before)
            raise
        snapshot["data"] = data
        return snapshot, int(saved.get("step", 0)), saved.get("knobs", {})

    def _scaler(self) -> torch.amp.GradScaler | None:
        """The run's GradScaler: the one the precision knob keeps, else accelerate's."""
        if self._precision is not None and self._precision.scaler is not None:
            return self._precision.scaler
        return self.accelerator.scaler

    def live_state(self) -> dict[str, Any]:
        """For a rollback, live: the prepared states, random numbers and data position.

        Every model, optimizer and scheduler the Accelerator prepared, the GradScaler,
        accelerate's micro-batch count, the random numbers and the data position
        (:meth:`data_state`)."""
        accelerator, scaler = self.accelerator, self._scaler()
        return ({
            "models": [model.state_dict() for model in accelerator._models],
            "optimizers": [optimizer.state_dict() for optimizer in accelerator._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in accelerator._schedulers],
            "grad_scaler": None if scaler is None else scaler.state_dict(),
            "micro_batches": accelerator.step,
            "rng": rng_state(self.device), "data": self.data_state()})

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Go back to ``snapshot`` in the middle of the loop.

        The states, accelerate's micro-batch count, the random numbers and the data position
        (:meth:`loader`'s iteration goes back: the epoch made again, accelerate's epoch
        count or a ReconfigurableLoader's position put back)."""
        accelerator, scaler = self.accelerator, self._scaler()
        for targets, states in ((accelerator._models, snapshot["models"]),
                                (accelerator._optimizers, snapshot["optimizers"]),
                                (accelerator._schedulers, snapshot["schedulers"])):
            for target, state in zip(targets, states, strict=True):
                target.load_state_dict(state)
        if scaler is not None and snapshot["grad_scaler"] is not None:
            scaler.load_state_dict(snapshot["grad_scaler"])
        accelerator.step = snapshot["micro_batches"]
        data = snapshot["data"]
        if self.no_position(data) is None:
            _put_back(self._data, data["loader"])
            self.position.load_state_dict(data, replay="position" not in data["loader"])
        set_rng_state(snapshot["rng"])

    # ------------------------------------------------------------ knobs

    def _set_accum_steps(self, value: int) -> None:
        # at a window boundary: restart accelerate's micro-batch count, so the next
        # window is exactly `value` micro-batches, each loss divided by `value` (a live
        # change is refused by _accum_reason until the loop entered accumulate; a resume
        # sets the saved run's value before the loop does)
        self.accelerator.gradient_accumulation_steps = value
        self.accelerator.step = 0

    def _accum_reason(self) -> str | None:
        if not self._accumulate_seen:
            return ("the loop has not entered accelerator.accumulate(model) yet (windows "
                    "are counted there): wrap each micro-batch in `with "
                    "accelerator.accumulate(model):`")
        return None

    def _accum_warning(self, value: int) -> str | None:
        if not self.accelerator._schedulers:
            return None
        return ("the LR scheduler steps once per optimizer step; a schedule planned for a "
                "number of optimizer steps is not re-planned for the new window size")

    def _set_precision(self, value: str) -> None:
        if self._forward_lost:
            raise ValueError(self._forward_lost)
        if not self._after_step:  # the window's gradients are not stepped yet: a new
            raise ValueError(_MISPLACED)  # GradScaler state would unscale the wrong way
        assert self._precision is not None  # the precision knob is bound only with one
        self._precision.set(value)

    def _check_precision(self, value: str) -> None:
        reason = precision_support(value, self.accelerator.device.type) or self._forward_lost
        if reason is not None:
            raise ValueError(reason)

    def _check_kernels(self, value: str) -> None:
        assert self.backend is not None  # the kernels knob is bound only with one
        reason = None
        if value == "triton" and not any(isinstance(module, KernelBackendMixin)
                                         for module in self._inner.modules()):
            reason = (f"{type(self._inner).__name__} has no gpuopt.kernels fused modules: "
                      "triton would change nothing")
        reason = reason or self.backend.support(value) or self._forward_lost
        if reason is not None:
            raise ValueError(reason)

    def _set_kernels(self, value: str) -> None:
        if self._forward_lost:
            raise ValueError(self._forward_lost)
        self._check_kernels(value)
        assert self.backend is not None  # the kernels knob is bound only with one
        self.backend.kernels = value

    def _bind_loader(self, loader: ReconfigurableLoader) -> None:
        """The loader knobs of ``loader`` and its ``micro_batch_size`` (which moves
        ``accum_steps`` to keep the effective batch, so it waits for the loop's
        ``accumulate`` as ``accum_steps`` does); then the values the checkpoint resumed
        from has for them."""
        if NUM_WORKERS.name in self.knobs.knobs:  # bound already
            if loader is not self._loader and not self._loader_warned:
                self._loader_warned = True
                self.agent.event("warning", "the loader knobs steer the first "
                                 "ReconfigurableLoader given to run.loader(); this one "
                                 "keeps its settings", kind=EventKind.WARNING)
            return
        self._loader = loader
        for knob in loader_knobs(loader):
            self.knobs.add(knob)  # (KnobSet.add swaps in a new dict: safe for the I/O thread)
        if ACCUM_STEPS.name in self.knobs.knobs:
            knob = micro_batch_size_knob(
                loader, lambda: self.accelerator.gradient_accumulation_steps,
                self._set_accum_steps)
            fits = knob.check

            def check(value: int) -> None:
                refuse(self._accum_reason())
                if fits is not None:
                    fits(value)

            self.knobs.add(dataclasses.replace(knob, check=check))
        self.agent.refresh_knobs()  # and a new hello announces them
        saved = {name: value for name, value in self._unbound.items()
                 if name in self.knobs.knobs}
        if saved:  # micro_batch_size moves accum_steps: its saved value is set after it
            self._unbound = {}
            saved[ACCUM_STEPS.name] = self.accelerator.gradient_accumulation_steps
            restore_knobs(self.agent, saved, self.resumed_from or "", self.step)

    def _check_max_grad_norm(self, value: float) -> None:
        """Refuse once a step was taken without ``accelerator.clip_grad_norm_`` (the
        command arrives on the I/O thread; before this process's first step it may
        still come)."""
        if self.step > self._first_step and not self._grad_norm.calls:
            raise ValueError(_NO_CLIPPING)

    def _set_max_grad_norm(self, value: float) -> None:
        if not self._grad_norm.calls:
            raise ValueError(_NO_CLIPPING)
        self._grad_norm.max_norm = value

    def _bind_optimizer(self, plain: bool, not_plain: str, checkpoint_dir: Any) -> None:
        """``lr_scale`` and ``weight_decay`` on the loop's optimizer (step hooks);
        ``max_grad_norm`` as the threshold of the loop's ``accelerator.clip_grad_norm_``;
        ``checkpoint`` as accelerate's ``save_state``."""
        knobs = self.knobs
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if not plain:
            for refused in (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM):
                knobs.bind(refused, not_plain)
        elif not isinstance(inner, torch.optim.Optimizer):
            for refused in (LR_SCALE, WEIGHT_DECAY):
                knobs.bind(refused, "no torch optimizer prepared by the accelerator "
                                    "(pass optimizer=)")
        else:
            self.optimizer_settings = OptimizerSettings(inner)
            optimizer_knobs(self.optimizer_settings, knobs)
        if plain:
            knobs.add(Knob(MAX_GRAD_NORM, get=lambda: self._grad_norm.threshold,
                           set=self._set_max_grad_norm, check=self._check_max_grad_norm))
        reason = self._checkpoint_reason()
        if reason is not None:
            knobs.bind(CHECKPOINT, reason)
        else:
            self.bind_checkpoint(self._save, directory=checkpoint_dir,
                                 name="checkpoint-{step}")

    def _bind(self, *, loader: Any, checkpoint_blocks: Any, compile_backend: str,
              checkpoint_dir: Any = None) -> None:
        """Bind every knob this run can apply correctly; the others get their reason."""
        accelerator, knobs, inner = self.accelerator, self.knobs, self._inner
        device_type = accelerator.device.type
        distributed = accelerator.distributed_type
        plain = distributed in _PLAIN
        not_plain = (f"not supported under accelerate's {distributed.value} (it runs the "
                     "model, backward and optimizer step itself)")
        dynamo = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", "NO")
        compiled = getattr(dynamo, "value", dynamo) != "NO" or self._compiled
        compiled_reason = ("the model is already torch.compile'd (accelerate's "
                           "dynamo_backend or by the script)")

        # first: a bad checkpoint_blocks raises before anything is changed
        if not plain:
            knobs.bind(CHECKPOINTING, not_plain)
        elif checkpoint_blocks is None and not find_blocks(inner):
            knobs.bind(CHECKPOINTING, (
                f"{type(inner).__name__} has no repeated blocks to checkpoint (an "
                "nn.ModuleList 'blocks', or of 2+ modules of one type); pass "
                "checkpoint_blocks= (names or nn.Module types of its blocks) to attach()"))
        else:
            checkpointing = self.checkpointing = ActivationCheckpointing(inner,
                                                                         checkpoint_blocks)
            knobs.add(Knob.attribute(CHECKPOINTING, checkpointing, "enabled"))

        knobs.bind(DROPOUT, dropout_knob(inner) if plain else not_plain)
        if not plain:
            knobs.bind(ACCUM_STEPS, not_plain)
        else:
            knobs.add(Knob(ACCUM_STEPS, get=lambda: accelerator.gradient_accumulation_steps,
                           set=self._set_accum_steps,
                           check=lambda value: refuse(self._accum_reason()),
                           warn=self._accum_warning))

        precision_reason = None
        if not plain:
            precision_reason = not_plain
        elif accelerator.mixed_precision not in _FROM_ACCELERATE:
            precision_reason = (f"mixed_precision={accelerator.mixed_precision!r} is managed "
                                "by accelerate's own backend")
        elif not _prepared_optimizers(accelerator):
            precision_reason = ("no optimizer prepared by the accelerator (fp16's GradScaler "
                                "steps through accelerate's prepared optimizer)")
        elif device_type not in ("cpu", "cuda"):
            precision_reason = (f"live precision changes are verified on cpu and cuda, not "
                                f"{device_type}")
        elif compiled:
            precision_reason = compiled_reason
        if precision_reason is None:
            self._precision = precision = _Precision(accelerator, device_type)
            self.autocast = ReusableAutocast(precision.context)
            knobs.add(Knob(PRECISION, get=lambda: precision.precision,
                           set=self._set_precision, check=self._check_precision,
                           warn=lambda value: precision_warning(value, device_type)))
        else:
            knobs.bind(PRECISION, precision_reason)

        kernels_reason = None
        if distributed != DistributedType.NO:
            kernels_reason = (f"torch.compile of the model inside accelerate's "
                              f"{distributed.value} is not verified")
        elif compiled:
            kernels_reason = compiled_reason
        original = _original_forward(inner, strip_accelerate=self._precision is not None)
        if kernels_reason is None:
            self.backend = backend = ModelBackend(_OriginalForward(inner, original),
                                                  accelerator.device,
                                                  compile_backend=compile_backend)
            self.event_sources.append(backend.pop_events)  # compile progress
            knobs.add(Knob(KERNELS, get=lambda: backend.kernels, set=self._set_kernels,
                           check=self._check_kernels))
        else:
            knobs.bind(KERNELS, kernels_reason)
        if self._precision is not None or self.backend is not None:
            self._forward = _Forward(original, self._precision, self.backend)
            inner.forward = self._forward
        self._bind_optimizer(plain, not_plain, checkpoint_dir)

        for spec in LOADER_KNOBS:
            knobs.bind(spec, _LOADER_REASON)
        knobs.bind(MICRO_BATCH_SIZE, _MICRO_BATCH_REASON if plain else not_plain)
        self._loader = loader
        if isinstance(loader, ReconfigurableLoader):
            self._bind_loader(loader)


def _loader_place(batches: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the loop's loader besides the data position: a
    :class:`gpuopt.loader.ReconfigurableLoader`'s own position (``position``: it orders
    its epochs itself), or accelerate's epoch count of a prepared loader (``iteration``:
    its ``set_epoch`` seeds a seedable sampler and a dataset's ``set_epoch`` from it;
    counted on at each epoch's end, so at a boundary it is the epoch in progress's)."""
    if isinstance(batches, ReconfigurableLoader):
        return {"position": batches.save_position()}
    iteration = getattr(batches, "iteration", None)
    return {"iteration": iteration} if isinstance(iteration, int) else {}


def _skipped(batches: Any) -> int:
    """The batches ``accelerator.skip_first_batches`` made ``batches`` skip (at each
    epoch's start: in its batch sampler, its sampler or itself), or 0."""
    return max(getattr(part, "skip_batches", 0) or 0 for part in (
        batches, getattr(batches, "batch_sampler", None), getattr(batches, "sampler", None)))


def _put_back(batches: Any, place: dict[str, Any]) -> None:
    """Put ``batches`` at the ``place`` :func:`_loader_place` saved (before its epoch is
    iterated again)."""
    if "position" in place and isinstance(batches, ReconfigurableLoader):
        batches.restore_position(place["position"])
    elif "iteration" in place and hasattr(batches, "iteration"):
        batches.iteration = place["iteration"]


def _prepared_optimizers(accelerator: Accelerator) -> list[AcceleratedOptimizer]:
    return [optimizer for optimizer in accelerator._optimizers
            if isinstance(optimizer, AcceleratedOptimizer)
            and hasattr(optimizer.optimizer, "register_step_pre_hook")]


def attach(accelerator: Accelerator, *, model: nn.Module | None = None,
           optimizer: Any = None, name: str = "", transport: str = "ipc",
           tokens_per_sample: int | None = None, loader: Iterable[Any] | None = None,
           checkpoint_blocks: Iterable[str | type[nn.Module]] | None = None,
           compile_backend: str = "inductor",
           checkpoint_dir: str | os.PathLike | None = None,
           resume_from: str | os.PathLike | None = None,
           eval_fn: Callable[[], dict[str, Any] | None] | None = None,
           **options: Any) -> AcceleratorRun:
    """Attach a started agent to a loop on ``accelerator``; returns the run.

    See the module docstring for the loop and the knobs. Call it after
    ``accelerator.prepare``.

    The prepared model's ``forward`` is replaced by one that follows the ``precision``
    and ``kernels`` knobs (accelerate's fixed mixed-precision wrapper, if any, is
    replaced by the equivalent live one), and ``accelerator.clip_grad_norm_`` by one
    that also keeps the norm for the step record (given back at
    :meth:`~AcceleratorRun.close`); a step pre-hook on each prepared optimizer notes a
    parameter it steps (see :meth:`~AcceleratorRun.micro_batch`).
    The run ends at interpreter exit, on SIGTERM (where the script has no handler of
    its own) and on an uncaught exception (named in ``bye``), as :func:`agent.session`.

    Args:
        accelerator: the Accelerator the loop uses.
        model: the prepared model (default: the one model prepared by ``accelerator``).
        optimizer: the prepared optimizer whose param group 0 gives the learning rate
            (default: the first one prepared).
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"`` (see :class:`agent.Agent`).
        tokens_per_sample: tokens in one sample, for token models whose batches carry no
            ``input_ids`` (then tokens and tokens/s are reported).
        loader: the loop's data, the default of :meth:`~AcceleratorRun.loader`; a
            :class:`gpuopt.loader.ReconfigurableLoader` gets its loader knobs and
            ``micro_batch_size`` at once (else when :meth:`~AcceleratorRun.loader` first
            gets one).
        checkpoint_blocks: what the ``checkpointing`` knob checkpoints, as
            :func:`gpuopt.checkpointing.find_blocks` targets (default: ``model.blocks``,
            else the model's repeated blocks; with none, the knob is refused).
        compile_backend: the ``torch.compile`` backend of ``kernels=compile``.
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        resume_from: a ``checkpoint=now`` checkpoint to continue from, with nothing
            left to the loop: accelerate's ``load_state`` (model, optimizer, scheduler,
            GradScaler, random numbers), :attr:`~AcceleratorRun.step` and
            :attr:`~AcceleratorRun.epoch` as saved, every knob value (``accum_steps``
            and ``max_grad_norm`` too, before the loop's first ``accumulate`` and
            ``clip_grad_norm_``), and the data position: the next
            ``for batch in run.loader(train_loader)`` starts at the first micro-batch
            the saved run had not trained, in the same shuffled order (no
            ``accelerator.skip_first_batches``). An event names every knob value
            restored (:meth:`AcceleratorRun.resume`).
        options: more :class:`agent.Agent` arguments.

    Raises:
        ValueError: no model or several (pass ``model=``), a bad ``tokens_per_sample``,
            or ``checkpoint_blocks`` that name no module of the model. Nothing is
            changed then.
        OSError, ValueError: ``resume_from`` cannot be loaded by accelerate.

    .. note:: Costs the training thread a few microseconds per optimizer step and one
       asynchronous add per micro-batch; never synchronizes the device.
    """
    if model is None:
        if len(accelerator._models) != 1:
            raise ValueError(f"the accelerator has prepared {len(accelerator._models)} models:"
                             " pass model= (the prepared model the loop trains)")
        model = accelerator._models[0]
    if optimizer is None and accelerator._optimizers:
        optimizer = accelerator._optimizers[0]
    agent = Agent(KnobSet(), name=name, model=_inner_module(model)[0],
                  device=accelerator.device, transport=transport, **options)
    run = AcceleratorRun(agent, accelerator, model, optimizer, tokens_per_sample)
    run._bind(loader=loader, checkpoint_blocks=checkpoint_blocks,
              compile_backend=compile_backend, checkpoint_dir=checkpoint_dir)
    run._hooks = [optimizer.optimizer.register_step_pre_hook(run._on_optimizer_step)
                  for optimizer in _prepared_optimizers(accelerator)]
    run.knobs.add(cpu_threads_knob(run.knobs))
    run.bind_evaluate(eval_fn, _inner_module(model)[0] if model is not None else None,
                      declare="agent.attach(accelerator, eval_fn=...)")
    if resume_from is not None:
        run.resume(resume_from)
    accelerator.clip_grad_norm_ = run._grad_norm
    run.start()
    agent.event("info", "loss: the window's mean of the undivided micro-batch losses; "
                "gradients: accelerate's, each micro-batch loss divided by "
                "gradient_accumulation_steps (a mean of micro-batch means)",
                kind=EventKind.LOSS_NORMALIZATION, normalization="micro_batch_mean")
    apart = run._apart()
    if apart is not None:
        agent.event("warning", apart, kind=EventKind.WARNING)
    atexit.register(run.close)  # (before the agent's own: the last step, then bye)
    return run
