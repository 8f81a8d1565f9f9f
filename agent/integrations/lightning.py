"""gpuwatch for Lightning (``lightning.pytorch``): one line before ``fit``.

::

    trainer = lightning.pytorch.Trainer(max_steps=1000, accumulate_grad_batches=4)
    agent.attach(trainer)                     # or Trainer(callbacks=[GpuwatchCallback()])
    trainer.fit(model, train_loader)

What each optimizer step reports (one record per optimizer step, i.e. per accumulation
window; Lightning's ``trainer.global_step`` is the step number):

- ``loss``: the window's mean loss as ``training_step`` returned it, undivided. Lightning
  divides each micro-batch's loss by ``accumulate_grad_batches`` before backward and hands
  callbacks that divided value; here it is multiplied back, so under accumulation the
  loss is the mean of the window's micro-batch losses (the convention of
  :class:`gpuopt.Trainer` and :func:`agent.session`).
- ``samples`` (dim 0 of the batch's first tensor), ``tokens`` when ``tokens_per_sample=``
  is given or the batch is a mapping with ``input_ids``.
- ``data_wait_s``: host time inside Lightning's fetch of each training batch (the
  training epoch loop's ``train_dataloader_next`` action, the same interval the
  Lightning profiler measures), summed over the window.
- ``lr`` of the optimizer's first param group as the step used it, ``lr_scale``
  included (``lr_groups``: every group's; read inside the step, before a step-interval
  scheduler moves it), ``grad_norm`` when the Trainer
  clips by norm (``gradient_clip_val``; the norm ``clip_grad_norm_`` returns, which
  Lightning otherwise discards), ``grad_scaler_skipped`` in fp16, and memory (the
  agent's own probes).
- events: validation start and end (sanity check included), checkpoint saved
  (``on_save_checkpoint``), epoch end.

Knobs (each applies at an optimizer-step boundary, in ``on_train_batch_end`` right after
Lightning's optimizer step, and trains as a run configured that way from that step; a
knob Lightning cannot change correctly in this run is refused with the reason):

- ``precision`` fp32 / bf16 / fp16: swaps ``trainer.strategy.precision_plugin`` between
  Lightning's ``Precision`` (32-true) and ``MixedPrecision`` (bf16-mixed, 16-mixed). The
  16-mixed plugin is made once with one ``torch.amp.GradScaler`` (``grad_scaler=`` to
  give your own) and kept, so the scale and its growth tracker survive a switch away
  and back. Refused for other plugins (16-true, 64-true, DeepSpeed, FSDP, bitsandbytes,
  ...) and for manual optimization.
- ``accum_steps``: a change makes windows of exactly the new size starting at the next
  micro-batch (not at the next multiple of it, as Lightning's ``batch_idx % N`` would),
  each starting with Lightning's own ``zero_grad`` hook and each micro-batch's loss
  divided by the window's real size (a last window cut short by the end of the epoch is
  divided by the micro-batches it really has), stepping the optimizer and a
  step-interval LR scheduler once per window; ``max_steps`` still ends the run at that
  optimizer step; the next epoch's windows start at its first batch, as Lightning's.
  Until a first change, Lightning's own accumulation runs untouched. Mechanism: while
  changed, the training epoch loop's ``_accumulated_batches_reached`` and the automatic
  optimization's ``_make_zero_grad_fn`` (Lightning 2.x internals, checked to exist)
  follow gpuwatch's windows, and ``trainer.accumulate_grad_batches`` holds each window's
  real size, which is the divisor Lightning's closure uses. Refused: manual
  optimization, a strategy that accumulates itself (DeepSpeed), a ``training_step`` that
  takes ``dataloader_iter``, ``GradientAccumulationScheduler`` or
  ``StochasticWeightAveraging`` (they set ``accumulate_grad_batches`` themselves), a
  step-interval LR scheduler with ``frequency`` > 1 (Lightning counts that frequency in
  batches) or any step-interval scheduler in a run that ends by epochs (a change of the
  steps per epoch moves where the schedule was planned to end; give ``max_steps``).
- ``checkpointing``: :class:`gpuopt.checkpointing.ActivationCheckpointing` over the
  LightningModule's repeated blocks (its ``blocks`` ModuleList, else its largest
  ModuleList of one type, or ``checkpoint_blocks=`` names); refused when it has none.
- ``kernels`` eager / compile / triton: :class:`gpuopt.backends.ModelBackend` in place on
  the LightningModule: under ``compile`` its ``forward`` runs through one kept
  ``torch.compile`` of it, as Lightning does for a compiled module (``from_compiled``
  compiles ``forward``); only code that calls ``self(...)`` / ``self.forward`` is
  compiled (an event says so when ``training_step`` never called it). ``triton`` switches
  gpuopt's fused modules (refused when the module has none, or where Triton cannot run).
  Refused for a module passed to ``fit`` already compiled, or under strategies other
  than single-device and DDP.
- ``num_workers``, ``pin_memory``, ``prefetch_factor`` when the train dataloader is a
  :class:`gpuopt.loader.ReconfigurableLoader`; a ``torch.utils.data.DataLoader`` fixes
  them when it is built, so they are refused with how to get them. ``micro_batch_size``
  is refused: Lightning counts an epoch's batches once, when it sets up the train
  dataloader (``trainer.num_training_batches``), and would end epochs at the wrong batch.
- ``lr_scale``, ``weight_decay``: :class:`gpuopt.optim.OptimizerSettings` on the run's one
  optimizer (step hooks: the scale multiplies what Lightning's LR schedulers set, inside
  ``optimizer.step`` only, so the schedule keeps its shape and Lightning's
  ``LearningRateMonitor`` shows the schedule's own value; the decay goes to the groups
  that decay). Refused for several optimizers and for strategies that step their own.
- ``max_grad_norm``: the Trainer's ``gradient_clip_val`` (0: None, no clipping), which
  Lightning reads at every step and applies by norm after unscaling in fp16; the norm
  before clipping is reported. Refused under manual optimization, with
  ``gradient_clip_algorithm="value"``, for a module that overrides
  ``configure_gradient_clipping``, and under DeepSpeed / FSDP. The Trainer's own value
  is back after ``fit``.
- ``checkpoint=now``: Lightning's ``trainer.save_checkpoint`` (every rank calls it, rank 0
  writes) into ``<checkpoint_dir>/step-<N>.ckpt``, made atomic. gpuwatch's state rides in
  every Lightning checkpoint as this callback's: the knob values a person chose, the fp16
  GradScaler the precision knob made, and the data position (below).
  ``trainer.fit(module, loader, ckpt_path=...)`` then continues exactly, mid-epoch and
  after live changes too (Lightning alone starts a plain DataLoader's epoch again in a
  new order, and warns that the loader is not resumable: with gpuwatch that is moot).
  Refused under DeepSpeed / FSDP.
- ``memory_fraction``, ``memory_snapshot_steps`` on CUDA
  (:class:`agent.integrations.adapters.MemoryKnobs`).

Data position (a DataLoader): the random number generators just before Lightning made the
epoch's iterator and at the boundary, and Lightning's count of the epoch's batches. A
resume makes the iterator again from the first, drops the batches trained and puts the
second back; after a checkpoint at an epoch's end, it makes the next epoch's iterator at
its first fetch, as the saved run did. A ReconfigurableLoader resumes at its own
position, a loader with ``state_dict`` at Lightning's. Exact for a map-style dataset
ordered by torch's global generator (workers included), unless an ``on_train_start`` or
``on_train_epoch_start`` hook draws random numbers before the epoch's first batch. Not
exact, and said so in the checkpoint's reply and the resume's event: an IterableDataset,
``reload_dataloaders_every_n_epochs``, a sampler with a generator of its own, several
train dataloaders, a ``training_step`` that takes ``dataloader_iter``.

Loss normalization (``hello``'s ``training.loss_normalization``): ``micro_batch_mean``,
Lightning's: a window's gradient is the mean of its micro-batches' mean-loss gradients,
so micro-batches of unequal size weigh alike. Normalizing by the window's samples or
tokens would need the window's size before its first backward, which Lightning's loop
does not fetch ahead; it is not offered here (:class:`gpuopt.Trainer` offers it).

Several ranks (DDP, ``devices=N``): every rank has its own agent; they share one run id
(from the cluster environment's main address and port, since Lightning's launcher starts
ranks as children of rank 0), so ``gpuwatch set`` reaches them all and a command applies
at one optimizer step on every rank. A :class:`gpuopt.loader.ReconfigurableLoader` is not
a DataLoader, so Lightning does not shard it: give it ``num_replicas`` and ``rank``.

FSDP2: ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with a
module that ``configure_model`` sharded by ``fully_shard`` gets the knobs above, exact
(:mod:`agent.integrations.sharded`): the strategy's ``block_backward_sync`` is replaced
while the run lasts by one that leaves a window's gradients unreduced until its last
micro-batch (Lightning's own blocks DDP's reduction only, so FSDP2 would reduce each
micro-batch), ``max_grad_norm`` clips the global norm over every rank's shards,
``checkpointing`` wraps the ``fully_shard`` blocks; ``precision`` is refused for a
``MixedPrecisionPolicy`` that casts and for fp16, ``kernels`` is refused, and
``checkpoint=now`` is the strategy's sharded directory (every rank's shards; the
callbacks' states, gpuwatch's among them, are rank 0's, as under DDP). Under
a tensor-parallel mesh (the strategy's 'auto' sizes) and Lightning's ``FSDPStrategy``
(FSDP1, GPUs only) the knobs that change the module or the step are refused.

When ``fit`` ends (or raises), or the process gets SIGTERM (Lightning's own handler runs
first), the agent closes (``bye`` with the reason) and the trainer and module are put
back as they were before it: Lightning's accumulation, precision plugin, fit and epoch
loops, ``gradient_clip_val``, an eager ``forward``, no checkpointing and no step hooks.

Cost on the training thread: per micro-batch two clock reads around the fetch, a few
attribute reads and one asynchronous add of the loss; per optimizer step a clone of the
GradScaler's scale in fp16 and one :meth:`agent.Agent.optimizer_step`; per epoch two
reads of the random number generators' states (host copies). Nothing reads a tensor's
value or synchronizes the device.

Importing this module imports ``lightning``; ``import agent`` does not import it.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import (Callback, GradientAccumulationScheduler,
                                         StochasticWeightAveraging)
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy,
                                         SingleDeviceStrategy)
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import SIGTERMException

from agent.wire.protocol import EventKind
from agent.integrations.adapters import (cpu_threads_knob, dropout_knob, loader_knobs,
                                         optimizer_knobs, precision_knob, refuse)
from agent.step.core import Agent, ending_reason
from agent.integrations import WindowMeter
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINT, CHECKPOINTING, DROPOUT, EVALUATE,
                              KERNELS, LOADER_KNOBS, LR_SCALE, MAX_GRAD_NORM, MICRO_BATCH_SIZE,
                              PRECISION, WEIGHT_DECAY, Knob, KnobSet)
from agent.step.record import StepRecord
from agent.integrations.run import RunBase
from agent.integrations.sharded import fsdp_modules, gradient_sync_off, sharded_precision
from agent.wire.runs import RUN_ID_ENV
from gpuopt.backends import ModelBackend
from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.data import batch_size
from gpuopt.loader import ReconfigurableLoader
from gpuopt.optim import OptimizerSettings
from gpuopt.position import DataPosition
from gpuopt.precision import precision_support
from gpuopt.saving import rng_state, set_rng_state

__all__ = ["GpuwatchCallback", "attach"]

#: Lightning plugin -> knob value, for the plugins the precision knob switches between.
_MIXED_NAMES = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_MIXED_FLAGS: dict[str, Literal["bf16-mixed", "16-mixed"]] = {"bf16": "bf16-mixed",
                                                              "fp16": "16-mixed"}


def _precision_of(plugin: Any) -> str | None:
    """The knob value of a Lightning precision plugin, or None for one it cannot switch
    (exact types only: a subclass may change what the plugin does)."""
    if type(plugin) is LightningPrecision:
        return "fp32"
    if type(plugin) is LightningMixedPrecision:
        return _MIXED_NAMES.get(plugin.precision)
    return None


def _simple_strategy(strategy: Any) -> bool:
    """Single-device and DDP strategies leave the module and its gradients alone, and so
    does :func:`_fsdp2_strategy`'s; others (DeepSpeed, FSDP, XLA, ...) wrap, shard or
    accumulate them their own way."""
    return ((isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
             and not isinstance(strategy, DeepSpeedStrategy)) or _fsdp2_strategy(strategy))


def _fsdp2_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is a ``ModelParallelStrategy`` whose module ``fully_shard``
    sharded (in ``configure_model``) on a mesh without tensor parallelism: FSDP2 alone,
    whose backward and optimizer step are the plain ones over DTensor shards
    (:mod:`agent.integrations.sharded`). Its 'auto' sizes give a node's devices to
    tensor parallelism: that is not it."""
    return (type(strategy) is ModelParallelStrategy
            and strategy.device_mesh["tensor_parallel"].size() == 1
            and bool(fsdp_modules(strategy.lightning_module)))


class _SyncAtWindowEnd:
    """The strategy's ``block_backward_sync`` for a module sharded by ``fully_shard``
    (:func:`_fsdp2_strategy`): Lightning calls it around each micro-batch of a window
    but its last, and its own blocks DDP's reduction only, so FSDP2 would reduce every
    micro-batch; this one leaves them unreduced until the window's last
    (:func:`agent.integrations.sharded.gradient_sync_off`)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        module = strategy.lightning_module
        self._block = lambda: gradient_sync_off(module)
        strategy.block_backward_sync = self._block

    def restore(self) -> None:
        """Lightning's own method again."""
        if vars(self.strategy).get("block_backward_sync") is self._block:
            del self.strategy.block_backward_sync


class _Precision:
    """The target of the ``precision`` knob: the strategy's precision plugin, swapped at an
    optimizer-step boundary (duck-types :class:`gpuopt.MixedPrecision` for
    :func:`agent.integrations.adapters.precision_knob`: ``device_type`` and ``precision``).

    Also keeps the gradient norm when the Trainer clips by norm: on the plugins it uses it
    replaces ``clip_grad_by_norm`` (Lightning's two lines, ``clip_grad_norm_`` over the
    optimizer's parameters) by the same call that keeps the norm it returns.
    """

    def __init__(self, strategy: Any, grad_scaler: torch.amp.GradScaler | None) -> None:
        self.strategy = strategy
        self.device_type = strategy.root_device.type
        self.original = strategy.precision_plugin
        self._grad_scaler = grad_scaler
        self._plugins: dict[str, Any] = {}
        name = _precision_of(self.original)
        if name is not None:
            self._plugins[name] = self.original
            self._keep_norm(self.original)
        #: the norm the last ``clip_grad_by_norm`` returned (a 0-dim tensor), or None
        self.grad_norm: torch.Tensor | None = None

    @property
    def precision(self) -> str:
        """Current precision (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
        return _precision_of(self.strategy.precision_plugin) or str(
            self.strategy.precision_plugin.precision)

    @precision.setter
    def precision(self, value: str) -> None:
        reason = precision_support(value, self.device_type)
        if reason is not None:
            raise ValueError(reason)
        plugin = self._plugins.get(value)
        if plugin is None:
            if value == "fp32":
                plugin = LightningPrecision()
            else:
                scaler = None
                if value == "fp16":
                    scaler = self._grad_scaler or torch.amp.GradScaler(self.device_type)
                plugin = LightningMixedPrecision(_MIXED_FLAGS[value], self.device_type, scaler)
            self._keep_norm(plugin)
            self._plugins[value] = plugin
        self.strategy.precision_plugin = plugin

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use now (fp16), else None."""
        return getattr(self.strategy.precision_plugin, "scaler", None)

    def _keep_norm(self, plugin: Any) -> None:
        if type(plugin).clip_grad_by_norm is not LightningPrecision.clip_grad_by_norm:
            return  # a plugin with its own clipping: left alone, no norm reported

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer),
                                                            clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm

    def restore(self) -> None:
        """Put the plugin of before ``fit`` back and the plugins' own clipping."""
        self.strategy.precision_plugin = self.original
        for plugin in self._plugins.values():
            plugin.__dict__.pop("clip_grad_by_norm", None)


class _Accumulation:
    """The ``accum_steps`` knob: Lightning's accumulation until the first change, then
    windows of ``size`` micro-batches counted from the boundary of the change (and from
    each epoch's first batch).

    Window arithmetic, for batch index ``b`` of the epoch and the anchor ``a`` (the first
    batch of the first window after the change, 0 in later epochs): the window of ``b``
    starts at ``a + (b - a) // size * size``; ``b`` ends it when ``(b - a + 1) % size ==
    0`` (and Lightning steps at an epoch's last batch anyway); its micro-batches are
    divided by ``min(size, num_training_batches - start)``. An epoch whose length is not
    known ends a window early only by running out of data: that window's gradients are
    then scaled to its real size before the step (:meth:`before_optimizer_step`).
    """

    #: Lightning internals this relies on (present in 2.x; absent -> knob refused)
    INTERNALS = (("fit_loop.epoch_loop", "_accumulated_batches_reached"),
                 ("fit_loop.epoch_loop.automatic_optimization", "_make_zero_grad_fn"),
                 ("fit_loop.epoch_loop.batch_progress.current", "ready"))

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.epoch_loop = trainer.fit_loop.epoch_loop
        self.optimization = self.epoch_loop.automatic_optimization
        self.original = trainer.accumulate_grad_batches
        self.size = trainer.accumulate_grad_batches
        self.engaged = False
        self.anchor = 0

    @property
    def value(self) -> int:
        """The knob's value: micro-batches per optimizer step."""
        return self.size if self.engaged else self.trainer.accumulate_grad_batches

    def set(self, value: int) -> None:
        """Training thread, at a boundary: windows of ``value`` from the next batch."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"accum_steps must be an integer >= 1, got {value!r}")
        if not self.engaged:
            # engaging is replacing these two methods of Lightning's loops
            self.epoch_loop._accumulated_batches_reached = (  # type: ignore[method-assign]
                self._accumulated_batches_reached)
            self.optimization._make_zero_grad_fn = (  # type: ignore[method-assign]
                self._make_zero_grad_fn)
        self.engaged = True
        self.size = value
        self.anchor = self.epoch_loop.batch_progress.current.ready  # the next batch's index

    def on_epoch_start(self) -> None:
        """An epoch starts: its windows start at its first batch."""
        self.anchor = 0

    def _window_start(self, batch_idx: int) -> int:
        return self.anchor + (batch_idx - self.anchor) // self.size * self.size

    def _divisor(self, start: int) -> int:
        """The real size of the window starting at batch ``start``: ``size``, or fewer
        where the epoch (of known length) ends first."""
        total = self.trainer.num_training_batches
        if not math.isfinite(total):
            return self.size
        return max(1, min(self.size, int(total) - start))

    def _accumulated_batches_reached(self) -> bool:
        """Replaces the epoch loop's: does the current batch end its window?"""
        batch_idx = self.epoch_loop.batch_progress.current.ready - 1
        return (batch_idx - self.anchor + 1) % self.size == 0

    def _make_zero_grad_fn(self, batch_idx: int, optimizer: Any) -> Any:
        """Replaces the automatic optimization's (called before each micro-batch's
        closure): Lightning's own zero_grad, hooks included, at the first micro-batch of
        each window and only there; and the window's real size set where Lightning's
        closure reads its divisor (``trainer.accumulate_grad_batches``)."""
        trainer = self.trainer
        start = self._window_start(batch_idx)
        divisor = self._divisor(start)
        if batch_idx != start:
            trainer.accumulate_grad_batches = divisor
            return None
        trainer.accumulate_grad_batches = 1  # Lightning's function, asked at a window start
        try:
            return type(self.optimization)._make_zero_grad_fn(self.optimization, batch_idx,
                                                              optimizer)
        finally:
            trainer.accumulate_grad_batches = divisor

    def before_optimizer_step(self, optimizer: Any) -> None:
        """A window that ran out of data early: scale its gradients to its real size.

        Ran out before its planned size (an epoch of unknown length, or a dataloader shorter
        than its ``len``): its gradients are scaled from ``1/divisor`` to ``1/real size``
        before clipping and the step."""
        if not self.engaged:
            return
        batch_idx = self.epoch_loop.batch_progress.current.ready - 1
        start = self._window_start(batch_idx)
        real, divisor = batch_idx - start + 1, self._divisor(start)
        if real >= divisor:
            return
        factor = divisor / real
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(factor)

    def restore(self) -> None:
        """Lightning's accumulation as before ``fit``."""
        if self.engaged:
            self.epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
            self.optimization.__dict__.pop("_make_zero_grad_fn", None)
            self.engaged = False
        self.trainer.accumulate_grad_batches = self.original


def _clipping_refusal(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """Why ``max_grad_norm`` cannot be Lightning's ``gradient_clip_val`` in this run, or
    None."""
    if not module.automatic_optimization:
        return ("the LightningModule uses manual optimization: Lightning clips only under "
                "automatic optimization (call self.clip_gradients in training_step)")
    if not _simple_strategy(trainer.strategy):
        return f"{type(trainer.strategy).__name__} clips gradients its own way"
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        return ("the Trainer clips by value (gradient_clip_algorithm='value'); "
                "max_grad_norm is a norm")
    if (type(module).configure_gradient_clipping
            is not pl.LightningModule.configure_gradient_clipping):
        return (f"{type(module).__name__} overrides configure_gradient_clipping, which "
                "decides how (and whether) it clips")
    return None


def _accumulation_refusal(trainer: pl.Trainer, module: pl.LightningModule) -> str | None:
    """Why ``accum_steps`` cannot change correctly in this run, or None."""
    strategy = trainer.strategy
    if not module.automatic_optimization:
        return ("the LightningModule uses manual optimization (automatic_optimization is "
                "False): its training_step steps the optimizer itself")
    if strategy.handles_gradient_accumulation:
        return f"{type(strategy).__name__} accumulates gradients itself"
    for path, name in _Accumulation.INTERNALS:
        owner: Any = trainer
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            return (f"this Lightning ({lightning.__version__}) has no {path}.{name}, which "
                    "gpuwatch's accumulation windows use (written for Lightning 2.x)")
    if isinstance(trainer.fit_loop._data_fetcher, _DataLoaderIterDataFetcher):
        return ("training_step takes the dataloader iterator (dataloader_iter), so "
                "Lightning does not know which micro-batch a step has")
    # Trainer.callbacks: set by Lightning's callback connector, not declared on the class
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, (GradientAccumulationScheduler, StochasticWeightAveraging)):
            return (f"the {type(callback).__name__} callback sets accumulate_grad_batches "
                    "itself")
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step":
            continue
        if config.frequency != 1:
            return (f"a step-interval LR scheduler ({type(config.scheduler).__name__}) has "
                    f"frequency={config.frequency}, which Lightning counts in batches, not "
                    "optimizer steps: it would step at other optimizer steps after a change")
        if trainer.max_steps < 0 or trainer.fit_loop.max_epochs not in (None, -1):
            return (f"this run ends by epochs and has a step-interval LR scheduler "
                    f"({type(config.scheduler).__name__}): a change of accum_steps changes "
                    "the optimizer steps per epoch, so the schedule would no longer end where "
                    "it was planned; give Trainer(max_steps=...) (and no max_epochs) to "
                    "allow it")
    return None


class _Kernels:
    """The ``kernels`` knob: :class:`gpuopt.backends.ModelBackend` in place on the
    LightningModule, and a warning when ``compile`` had nothing to compile."""

    def __init__(self, module: pl.LightningModule, device: torch.device,
                 compile_backend: str) -> None:
        self.module = module
        self.backend = ModelBackend(module, device, compile_backend=compile_backend,
                                    in_place=True)
        self._compile_steps = 0  # boundaries seen under compile, up to 2

    def support(self, value: str) -> str | None:
        """Why ``value`` cannot run in this run, or None (I/O thread; cheap)."""
        return self.backend.support(value)

    def set(self, value: str) -> None:
        """Training thread, at a boundary; atomic (a failure restores the previous)."""
        previous = self.backend.kernels
        try:
            self.backend.kernels = value
        except Exception:
            self.backend.kernels = previous
            raise

    def events(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Compile events since the last boundary, with a warning once for a step without forward.

        A warning once when compile ran a whole step without the module's forward being
        called."""
        events = self.backend.pop_events()
        compiled = self.backend.compiled
        if compiled is not None and compiled.enabled and self._compile_steps < 2:
            # the first call is the boundary of the switch itself; the second follows a
            # whole step under compile
            self._compile_steps += 1
            if (self._compile_steps == 2 and compiled.compiles == 0
                    and compiled.fallbacks == 0):
                events.append(("warning", "kernels=compile compiles the LightningModule's "
                               "forward, but training_step did not call it (self(...) or "
                               "self.forward(...)): nothing is compiled", {}))
        return events

    def restore(self) -> None:
        """Back to eager (the module's own forward)."""
        if self.backend.kernels != "eager":
            self.backend.kernels = "eager"


class _ValidateNow:
    """``evaluate=now`` in Lightning: the training epoch loop's "validate now?"
    (``_should_check_val_fx``, asked at the end of each training batch) answers yes once
    after the command applied, so that Lightning runs its own validation loop there, as
    at a ``val_check_interval`` (its hooks, loggers and callbacks all see it)."""

    def __init__(self, epoch_loop: Any) -> None:
        self.loop = epoch_loop
        self.due = False
        self._ask = epoch_loop._should_check_val_fx

    def install(self) -> None:
        self.loop._should_check_val_fx = self.should_check_val

    def should_check_val(self, data_fetcher: Any) -> bool:
        if self.due:
            self.due = False
            return True
        return self._ask(data_fetcher)

    def restore(self) -> None:
        self.loop.__dict__.pop("_should_check_val_fx", None)


class _FetchTimer:
    """Data wait: host time inside Lightning's fetch of each training batch. Wraps the
    training epoch loop's ``_on_before_fetch`` / ``_on_after_fetch`` (which start and
    stop the profiler's ``train_dataloader_next`` action around ``next()`` of the
    dataloader), keeping the profiler's own work out of the measured time."""

    def __init__(self, epoch_loop: Any) -> None:
        self.loop = epoch_loop
        self.wait_s = 0.0
        self._started: float | None = None
        self._before = epoch_loop._on_before_fetch
        self._after = epoch_loop._on_after_fetch

    def install(self) -> None:
        self.loop._on_before_fetch = self.before_fetch
        self.loop._on_after_fetch = self.after_fetch

    def before_fetch(self) -> None:
        self._before()
        self._started = time.perf_counter()

    def after_fetch(self) -> None:
        if self._started is not None:
            self.wait_s += time.perf_counter() - self._started
            self._started = None
        self._after()

    def take(self) -> float:
        """Seconds waited since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def restore(self) -> None:
        for name in ("_on_before_fetch", "_on_after_fetch"):
            self.loop.__dict__.pop(name, None)


class _EpochIterators:
    """Where Lightning makes each epoch's iterator of the train data: the fit loop's
    ``setup_data`` (the first epoch's, a resume's, a reload's) and the training epoch
    loop's ``on_run_start`` (each later epoch's). Both are wrapped on the instances: each
    notes the random number generators just before it runs and, when it made a new
    iterator, hands them to the data position as the epoch's start
    (:meth:`gpuopt.position.DataPosition.epoch_made`), from which a resume makes the
    epoch again.

    .. note:: Costs one :func:`gpuopt.saving.rng_state` per call (twice an epoch).
    """

    def __init__(self, trainer: pl.Trainer, position: DataPosition,
                 device: torch.device) -> None:
        self.fit_loop = trainer.fit_loop
        self.epoch_loop = trainer.fit_loop.epoch_loop
        self.position = position
        self.device = device
        self._setup_data = self.fit_loop.setup_data
        self._on_run_start = self.epoch_loop.on_run_start
        self.fit_loop.setup_data = self.setup_data  # type: ignore[method-assign]
        self.epoch_loop.on_run_start = self.on_run_start  # type: ignore[method-assign]

    def setup_data(self) -> None:
        """The fit loop's ``setup_data``, noted."""
        self._noting(self._setup_data)

    def on_run_start(self, data_fetcher: Any) -> None:
        """The epoch loop's ``on_run_start``, noted."""
        self._noting(lambda: self._on_run_start(data_fetcher))

    def _noting(self, make: Callable[[], Any]) -> None:
        rng = rng_state(self.device)
        before = self.iterator()
        make()
        if self.iterator() is not before:
            self.position.epoch_made(rng)

    def iterator(self) -> Any:
        """The train data's iterator now (the CombinedLoader's), or None before one."""
        return getattr(self.fit_loop._combined_loader, "_iterator", None)

    def _fetcher(self) -> Any:
        fetcher = self.fit_loop._data_fetcher
        assert fetcher is not None  # training started: setup_data made it
        return fetcher

    def replay(self) -> None:
        """A resume mid-epoch: the epoch's iterator made again and its trained batches dropped.

        Lightning made the epoch's iterator anew, from its first batch: the iterator is made
        again from the epoch's start, with the samplers set to the epoch (as Lightning sets
        them only later), its trained batches dropped, and the generators as at the
        checkpoint's boundary (:meth:`gpuopt.position.DataPosition.replay_epoch`)."""
        combined = self._fetcher().combined_loader
        for loader in combined.flattened:
            _set_sampler_epoch(loader, self.fit_loop.trainer.current_epoch)
        self.position.replay_epoch(combined)

    def make_at_first_fetch(self, rng: dict[str, Any] | None) -> None:
        """A resume at an epoch's end: the next epoch's iterator is made at its first fetch.

        Lightning would go on with an iterator it made before the generators were back: the
        next epoch's iterator is made at its first fetch, where the saved run made it, from
        the generators set to ``rng`` (None: as they are then)."""
        fetcher = self._fetcher()
        combined = fetcher.combined_loader

        def batches() -> Iterator[Any]:
            if rng is not None:
                set_rng_state(rng)
            self._noting(lambda: iter(combined))
            while True:
                try:
                    yield next(combined)
                except StopIteration:
                    return

        fetcher.iterator = batches()

    def restore(self) -> None:
        self.fit_loop.__dict__.pop("setup_data", None)
        self.epoch_loop.__dict__.pop("on_run_start", None)


#: The parts of Lightning's fit loop state (``fit_loop.state_dict()``) that count
#: optimizer steps (and the scheduler steps and logged steps that go with them); the
#: rest is its epoch and batch progress, which goes with the data
_STEP_COUNTS = ("epoch_loop.state_dict", "epoch_loop.scheduler_progress",
                "epoch_loop.automatic_optimization.optim_progress",
                "epoch_loop.manual_optimization.optim_step_progress")


def _split_loops(fit_loop: dict[str, Any]) -> dict[str, Any]:
    """A fit loop state as a snapshot's ``loops`` (its optimizer-step counts) and
    ``progress`` (the rest: epoch and batch progress, validation's). A recovery keeps the
    progress from now, with the data, and puts the step counts back from the kept state."""
    return {"loops": {key: value for key, value in fit_loop.items() if key in _STEP_COUNTS},
            "progress": {key: value for key, value in fit_loop.items()
                         if key not in _STEP_COUNTS}}


def _not_restarting(loop: Any) -> None:
    """Clear the ``restarting`` flag that ``load_state_dict`` sets on ``loop`` and every
    loop in it (it makes Lightning's loops resume from a checkpoint's start)."""
    loop._restarting = False
    for child in vars(loop).values():
        if isinstance(child, pl.loops.loop._Loop):
            _not_restarting(child)


class _Run(RunBase):
    """One ``fit`` under the agent: the run base with Lightning's reads of a step, its
    knobs, its checkpoint and its data position; each callback hook is one call here."""

    def __init__(self, agent: Agent, trainer: pl.Trainer, options: dict[str, Any]) -> None:
        super().__init__(agent, device=trainer.strategy.root_device,
                         tokens_per_sample=options.get("tokens_per_sample"))
        self.trainer = trainer
        self.options = options
        self.precision: _Precision | None = None
        self.accumulation: _Accumulation | None = None
        self.kernels: _Kernels | None = None
        self.sharded_sync: _SyncAtWindowEnd | None = None
        self.checkpointing: ActivationCheckpointing | None = None
        self.fetch: _FetchTimer | None = None
        self.epochs: _EpochIterators | None = None
        self.validate_now: _ValidateNow | None = None
        self.optimizer_settings: OptimizerSettings | None = None
        self._clip_val = trainer.gradient_clip_val  # the Trainer's own, put back at the end
        self.fitting = False
        self.started = False
        self._global_step = 0
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._lr: float | None = None
        self._scale_before: torch.Tensor | None = None

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule of the ``fit`` under way."""
        return self.trainer.lightning_module

    # ------------------------------------------------------------ setup

    def fit_start(self) -> None:
        """``fit`` starts: the module is known, and each epoch's start is noted.

        The callback's ``setup``, before Lightning makes the first epoch's iterator."""
        self.fitting = True
        module = self.module
        self.agent.params = sum(p.numel() for p in module.parameters())
        self.agent.model_name = type(module).__name__
        self.agent.refresh_knobs()  # announced: hello names the model now
        try:
            self.epochs = _EpochIterators(self.trainer, self.position, self.device)
        except Exception as exc:  # the first rule: never crash the training
            self.fail("following the train data", exc)

    def train_start(self, restored: dict[str, Any] | None) -> None:
        """``on_train_start``: bind the knobs, resume from ``restored`` and start timing steps.

        The dataloader and optimizer are known: bind the knobs (the agent announces them),
        resume from ``restored`` (this callback's state in the checkpoint of
        ``fit(ckpt_path=...)``) and start timing steps."""
        trainer, knobs = self.trainer, self.agent.knobs
        targets = self.options.get("checkpoint_blocks")
        if targets is not None:  # asked for by name: a mistake in them is the caller's
            ActivationCheckpointing(self.module, targets)
        if self.broken:
            return
        try:
            self.step = self._global_step = trainer.global_step
            if _fsdp2_strategy(trainer.strategy):
                self.sharded_sync = _SyncAtWindowEnd(trainer.strategy)
            self._bind_precision(knobs)
            self._bind_accumulation(knobs)
            self._bind_model_knobs(knobs)
            self._bind_loader_knobs(knobs)
            self._bind_optimizer_knobs(knobs)
            self._bind_checkpoint(knobs)
            knobs.add(cpu_threads_knob(knobs))
            knobs.bind(DROPOUT, dropout_knob(self.module))
            knobs.bind(MICRO_BATCH_SIZE, (
                "Lightning counts an epoch's batches once, when it sets up the train "
                "dataloader (trainer.num_training_batches), so batches of another size "
                "would end its epochs at the wrong batch: set the DataLoader's batch_size "
                "and accumulate_grad_batches, and resume from a checkpoint"))
            self.fetch = _FetchTimer(trainer.fit_loop.epoch_loop)
            self.fetch.install()
            self.validate_now = _ValidateNow(trainer.fit_loop.epoch_loop)
            self.validate_now.install()
            knobs.add(Knob(EVALUATE, get=lambda: None, set=self._evaluate_now,
                           check=lambda value: self._check_evaluate()))
            if restored is not None:
                self._resume(restored)
        except Exception as exc:  # the first rule: never crash the training
            self.fail("binding the knobs", exc)
            return
        self.agent.refresh_knobs()  # a new hello announces the schema
        self.agent.mark_start()
        self.started = True

    def _bind_precision(self, knobs: KnobSet) -> None:
        trainer = self.trainer
        self.precision = _Precision(trainer.strategy, self.options.get("grad_scaler"))
        if not self.module.automatic_optimization:
            knobs.bind(PRECISION, (
                "the LightningModule uses manual optimization: gpuwatch cannot tell where "
                "its accumulation windows end, so a precision switch could meet "
                "gradients of another precision"))
        elif not _simple_strategy(trainer.strategy):
            knobs.bind(PRECISION,
                       f"{type(trainer.strategy).__name__} has its own precision handling")
        elif _precision_of(self.precision.original) is None:
            knobs.bind(PRECISION, (
                f"the Trainer's precision plugin is {type(self.precision.original).__name__} "
                f"(precision={trainer.precision!r}); gpuwatch switches only between "
                "Lightning's Precision (32-true) and MixedPrecision (16-mixed, bf16-mixed)"))
        else:
            knobs.add(precision_knob(self.precision, sharded_precision(self.module)))

    def _bind_accumulation(self, knobs: KnobSet) -> None:
        reason = _accumulation_refusal(self.trainer, self.module)
        if reason is not None:
            knobs.bind(ACCUM_STEPS, reason)
            return
        self.accumulation = accumulation = _Accumulation(self.trainer)
        knobs.add(Knob(ACCUM_STEPS, get=lambda: accumulation.value, set=accumulation.set))

    def _bind_model_knobs(self, knobs: KnobSet) -> None:
        module, strategy = self.module, self.trainer.strategy
        if not _simple_strategy(strategy):
            why = (f"{type(strategy).__name__} wraps or shards the module; gpuwatch changes "
                   "the module only under single-device and DDP strategies")
            for refused in (KERNELS, CHECKPOINTING):
                knobs.bind(refused, why)
            return
        if fsdp_modules(module):
            knobs.bind(KERNELS, "compiling a model sharded by fully_shard is not verified")
        elif getattr(module, "_compiler_ctx", None) is not None or "forward" in module.__dict__:
            knobs.bind(KERNELS, (
                "the LightningModule was given to fit already compiled (or has a forward "
                "of its own set on the instance): gpuwatch leaves its forward alone"))
        else:
            self.kernels = kernels = _Kernels(module, self.device,
                                              self.options.get("compile_backend", "inductor"))
            self.event_sources.append(kernels.events)
            knobs.add(Knob(KERNELS, get=lambda: kernels.backend.kernels, set=kernels.set,
                           check=lambda value: refuse(kernels.support(value))))
        targets = self.options.get("checkpoint_blocks")
        try:
            self.checkpointing = checkpointing = ActivationCheckpointing(module, targets)
        except ValueError as exc:
            if targets is not None:
                raise
            knobs.bind(CHECKPOINTING,
                       f"{exc} (attach(trainer, checkpoint_blocks=[...]) names them)")
        else:
            knobs.add(Knob.attribute(CHECKPOINTING, checkpointing, "enabled"))

    def _bind_optimizer_knobs(self, knobs: KnobSet) -> None:
        """``lr_scale`` and ``weight_decay`` on the one optimizer (step hooks, see
        :mod:`gpuopt.optim`); ``max_grad_norm`` as the Trainer's ``gradient_clip_val``
        (Lightning reads it at every step, after unscaling in fp16)."""
        trainer = self.trainer
        optimizers = trainer.optimizers
        reason = None
        if not _simple_strategy(trainer.strategy):
            reason = f"{type(trainer.strategy).__name__} steps the optimizer its own way"
        elif len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
            reason = (f"this run has {len(optimizers)} optimizers; gpuwatch sets the "
                      "learning rate and weight decay of a run with one")
        if reason is None:
            self.optimizer_settings = OptimizerSettings(optimizers[0])
            optimizer_knobs(self.optimizer_settings, knobs)
        else:
            for refused in (LR_SCALE, WEIGHT_DECAY):
                knobs.bind(refused, reason)
        reason = _clipping_refusal(trainer, self.module)
        if reason is not None:
            knobs.bind(MAX_GRAD_NORM, reason)
            return
        knobs.add(Knob(MAX_GRAD_NORM, get=lambda: float(trainer.gradient_clip_val or 0.0),
                       set=lambda value: setattr(trainer, "gradient_clip_val",
                                                 value or None)))

    def end_loop(self) -> None:
        """Lightning's own stop, ``trainer.should_stop`` (as ``EarlyStopping``'s), after this batch.

        The fit loop ends after this batch, its end hooks and callbacks run. The fit's
        ``min_steps`` and ``min_epochs`` are lowered to what is done, as Lightning ignores
        ``should_stop`` until both are met (the command stops it all the same)."""
        fit_loop = self.trainer.fit_loop
        if fit_loop.min_epochs:
            fit_loop.min_epochs = min(fit_loop.min_epochs,
                                      fit_loop.epoch_progress.current.completed)
        if fit_loop.epoch_loop.min_steps:
            fit_loop.epoch_loop.min_steps = min(fit_loop.epoch_loop.min_steps,
                                                fit_loop.epoch_loop.global_step)
        self.trainer.should_stop = True

    def _check_evaluate(self) -> None:
        if not self.trainer.enable_validation:
            raise ValueError("this fit has no validation (no val_dataloaders, no "
                             "validation_step, or limit_val_batches=0)")

    def _evaluate_now(self, value: str) -> dict[str, Any]:
        self._check_evaluate()
        assert self.validate_now is not None  # bound with it
        self.validate_now.due = True
        return {"text": "Lightning's validation loop runs at the end of this batch; its "
                        "metrics in the evaluation event"}

    def _bind_checkpoint(self, knobs: KnobSet) -> None:
        """``checkpoint=now``: Lightning's ``trainer.save_checkpoint`` (every rank calls
        it; rank 0 writes), made atomic; gpuwatch's knob values and data position ride
        along as this callback's state (:meth:`saved_state`)."""
        strategy = self.trainer.strategy
        if not _simple_strategy(strategy):
            knobs.bind(CHECKPOINT, (
                f"{type(strategy).__name__} saves sharded checkpoints from every rank; "
                "use Lightning's ModelCheckpoint"))
            return
        # (the whole state, said: without weights_only Lightning logs that it defaults)
        self.bind_checkpoint(lambda path, knobs: self.trainer.save_checkpoint(
                                 path, weights_only=False),
                             step=lambda: self.trainer.global_step,
                             directory=self.options.get("checkpoint_dir"),
                             name="step-{step:08d}.ckpt", every_rank=True)

    def _bind_loader_knobs(self, knobs: KnobSet) -> None:
        trainer = self.trainer
        loader = trainer.train_dataloader
        # set by Lightning's data connector, not declared on the Trainer class
        reloads = trainer.reload_dataloaders_every_n_epochs  # type: ignore[attr-defined]
        if isinstance(loader, ReconfigurableLoader) and not reloads:
            for knob in loader_knobs(loader):
                knobs.add(knob)
            return
        if isinstance(loader, ReconfigurableLoader):
            why = (f"the Trainer reloads the train dataloader every {reloads} epochs, "
                   "replacing the ReconfigurableLoader gpuwatch would reconfigure")
        else:
            why = (f"the train dataloader is a {type(loader).__name__}, whose workers are "
                   "fixed when it is built: pass a gpuopt.loader.ReconfigurableLoader as "
                   "train_dataloaders (or from train_dataloader()) to change them live")
        for spec in LOADER_KNOBS:
            knobs.bind(spec, why)

    # ------------------------------------------------------------ checkpoint and resume

    def saved_state(self) -> dict[str, Any]:
        """What every Lightning checkpoint of this ``fit`` keeps of gpuwatch: this callback's state.

        The run's id, the knob values a person chose, the data position
        (:meth:`data_state`), whether ``accum_steps`` was changed (the windows are then
        gpuwatch's, counted from the change) and, once the precision knob made one, the
        kept fp16 GradScaler's state (Lightning saves only the plugin the Trainer started
        with). Training thread; reads the random number generators (host work)."""
        state: dict[str, Any] = {"run": self.agent.run_id, "knobs": self.chosen_knobs()[0],
                                 "data": self.data_state(),
                                 "accumulation_changed": bool(self.accumulation
                                                              and self.accumulation.engaged)}
        precision = self.precision
        plugin = precision._plugins.get("fp16") if precision else None
        if plugin is not None and precision is not None and plugin is not precision.original:
            state["grad_scaler"] = plugin.scaler.state_dict()
        return state

    def data_state(self) -> dict[str, Any]:
        """The data position, a loader's own, and whether validation follows this batch.

        The data position (:class:`gpuopt.position.DataPosition`'s: the generators at the
        epoch's start and now, with Lightning's count of the epoch's batches), a
        ReconfigurableLoader's own position, and whether Lightning validates right after
        this batch (a resume skips that validation, and its random numbers)."""
        fit_loop = self.trainer.fit_loop
        progress = fit_loop.epoch_loop.batch_progress.current
        self.position.fetched_in_epoch = progress.ready
        state = self.position.state_dict()
        fetcher = fit_loop._data_fetcher
        state["validation_follows"] = (progress.completed < progress.ready  # in its batch
                                       and fetcher is not None
                                       and fit_loop.epoch_loop._should_check_val_fx(fetcher))
        loader = self._train_loader()
        if isinstance(loader, ReconfigurableLoader):
            state["loader"] = loader.save_position()
        return state

    def data_reason(self, value: Any = None) -> str | None:
        """Why a resume from a checkpoint now would not train this run's next batches, or None.

        The batches this run goes on to. Any thread: attribute reads."""
        trainer, fit_loop = self.trainer, self.trainer.fit_loop
        # set by Lightning's data connector, not declared on the Trainer class
        reloads = trainer.reload_dataloaders_every_n_epochs  # type: ignore[attr-defined]
        if reloads:
            return (f"the Trainer reloads the train dataloader every {reloads} epochs "
                    "(reload_dataloaders_every_n_epochs): a resume cannot make a reloaded "
                    "epoch's batches again")
        if isinstance(fit_loop._data_fetcher, _DataLoaderIterDataFetcher):
            return ("training_step takes the dataloader iterator (dataloader_iter), so "
                    "Lightning does not count the batches it trained")
        combined = fit_loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        if len(loaders) != 1:
            return (f"the Trainer has {len(loaders)} train dataloaders; a resume makes the "
                    "epoch again only of one")
        loader = loaders[0]
        if isinstance(loader, (ReconfigurableLoader, _Stateful)):
            return None  # its own position: ReconfigurableLoader's, or Lightning's resume
        if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
            return (f"the train dataset is an IterableDataset "
                    f"({type(loader.dataset).__name__}): a resume starts it again")
        samplers = (loader, getattr(loader, "sampler", None),
                    getattr(getattr(loader, "batch_sampler", None), "sampler", None))
        if any(getattr(part, "generator", None) is not None for part in samplers):
            return ("the train dataloader draws its order from a torch.Generator of its own "
                    "(generator=...), which a checkpoint does not keep: leave it to "
                    "torch's global generator")
        if self.position.epoch == 0:
            return ("the train data was set up before gpuwatch followed this fit, so the "
                    "checkpoint has no data position")
        return None

    def _train_loader(self) -> Any:
        combined = self.trainer.fit_loop._combined_loader
        return combined.flattened[0] if combined is not None and combined.flattened else None

    def _resume(self, saved: dict[str, Any]) -> None:
        """Training thread, at ``on_train_start`` of ``fit(ckpt_path=...)`` (Lightning has
        restored its own state): the kept GradScaler, gpuwatch's accumulation windows,
        the data position and generators at the checkpoint's boundary, then every knob
        value (one ``resumed`` event, which says what will differ)."""
        plugin = self.precision._plugins.get("fp16") if self.precision else None
        if "grad_scaler" in saved and plugin is not None:
            plugin.scaler.load_state_dict(saved["grad_scaler"])
        knobs = saved.get("knobs", {})
        # a checkpoint at its epoch's last batch: Lightning goes on with the next epoch
        ended = (self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
                 >= self.trainer.num_training_batches)
        if saved.get("accumulation_changed") and self.accumulation is not None:
            self.accumulation.set(knobs[ACCUM_STEPS.name])  # windows from this boundary
            if ended:  # (Lightning calls no on_train_epoch_start for that epoch)
                self.accumulation.on_epoch_start()
        data, differs = saved.get("data"), self.data_reason()
        if data is None or data["epoch_rng"] is None:
            differs = ("the checkpoint has no data position (its run set up the train data "
                       "before gpuwatch followed it): Lightning starts the epoch again")
        else:
            self._position_data(data, differs is None, ended)
        self.restore(knobs, str(self.trainer.ckpt_path), differs=differs,
                     from_run=saved.get("run"))

    def _position_data(self, data: dict[str, Any], exact: bool, ended: bool) -> None:
        """Put the train data and the generators back at the checkpoint's boundary: a
        ReconfigurableLoader at its own position (a stateful loader: Lightning did); a
        DataLoader's epoch made again from its start with the trained batches dropped,
        or at an epoch's end the next epoch's iterator made at its first fetch, from
        the generators at the boundary (or, when the saved run validated right after
        it, as Lightning's resume leaves them after iterating the validation
        dataloaders in place of that validation: the same draws)."""
        loader = self._train_loader()
        if isinstance(loader, ReconfigurableLoader):
            loader.restore_position(data["loader"])
            fetcher = self.trainer.fit_loop._data_fetcher
            assert fetcher is not None  # training started: setup_data made it
            iter(fetcher)  # the rest of its epoch, or the next
        replay = (exact and self.epochs is not None
                  and not isinstance(loader, (ReconfigurableLoader, _Stateful)))
        self.position.load_state_dict(data, replay=replay and not ended)  # generators too
        if not replay or self.epochs is None:
            return
        if ended:
            self.epochs.make_at_first_fetch(None if data["validation_follows"]
                                            else data["rng"])
        else:
            self.epochs.replay()

    def rewind_refusal(self) -> str | None:
        """A strategy that saves sharded checkpoints from every rank cannot rewind.

        Its checkpoint command is refused too."""
        strategy = self.trainer.strategy
        # (ModelParallelStrategy first: its mesh, which _simple_strategy reads, does not
        # exist before the processes have initialized, when this is asked)
        if type(strategy) is ModelParallelStrategy or not _simple_strategy(strategy):
            return (f"{type(strategy).__name__} saves sharded checkpoints from every rank, "
                    "which are not loaded into a live run")
        return None

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A checkpoint of ``trainer.save_checkpoint``, read as ``fit(ckpt_path=...)`` reads it.

        The ``checkpoint`` command's, or any of this fit's with gpuwatch's state; read
        through the strategy's ``load_checkpoint`` with ``weights_only`` (no code runs from
        it, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says), in :meth:`state_snapshot`'s
        form: the windows counted from its boundary as a resume counts them
        (:meth:`_resume`).

        Raises:
            ValueError: it has no state of gpuwatch's (no data position to go back to).
            pickle.UnpicklingError: it holds more than tensors and plain values.
        """
        saved = self.trainer.strategy.load_checkpoint(path, weights_only=True)
        state = next((saved.get("callbacks", {}).get(callback.state_key)
                      for callback in self.trainer.callbacks  # type: ignore[attr-defined]
                      if isinstance(callback, GpuwatchCallback)), None)
        if not state or not state.get("data") or state["data"].get("epoch_rng") is None:
            raise ValueError(f"{path} has no data position of gpuwatch's (it was not "
                             "saved by a fit gpuwatch followed from its start)")
        data, knobs = state["data"], state.get("knobs", {})
        accumulation = (bool(state.get("accumulation_changed")),
                        knobs.get(ACCUM_STEPS.name, self.trainer.accumulate_grad_batches))
        return ({"model": saved["state_dict"], "optimizers": saved["optimizer_states"],
                 "schedulers": saved["lr_schedulers"],
                 "grad_scaler": state.get("grad_scaler", saved.get("MixedPrecision")),
                 **_split_loops(saved["loops"]["fit_loop"]), "accumulation": accumulation,
                 "rng": data["rng"], "data": data},
                int(saved["global_step"]), knobs)

    def _fp16_scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 plugin's GradScaler (in use, or kept while in another precision)."""
        plugin = self.precision._plugins.get("fp16") if self.precision else None
        return getattr(plugin, "scaler", None)

    #: a recovery goes on from the epoch and batch the data is at now (a state kept in
    #: the previous epoch would end this one at the kept batch: its last batches never
    #: trained) with the kept optimizer-step counts
    recovery_data_keys = ("data", "rng", "progress")

    def drop_refusal(self, snapshot: Any, micro_batches: int) -> str:
        """Why Lightning's data cannot skip micro-batches: its epoch loop counts each batch.

        Its fetcher and batch progress count every batch the epoch loop trains: a batch
        drawn and dropped would shift them."""
        return ("Lightning's epoch loop counts every batch it fetches (its batch progress "
                "and fetcher), so none can be dropped between them: use skip_windows=None "
                "(every window trained since)")

    def live_state(self) -> dict[str, Any]:
        """For a rollback, live: states, progress, windows, random numbers, data position.

        The module's, optimizers', schedulers' and fp16 GradScaler's states, the fit loop's
        optimizer-step counts (``loops``) and epoch and batch progress (``progress``), the
        accumulation windows, the random numbers and the data position
        (:meth:`data_state`).

        Raises:
            ValueError: the train data cannot be put back live (:meth:`data_reason`).
        """
        reason = self.data_reason() if self.epochs is not None else (
            "gpuwatch did not follow the train data from fit's start")
        if reason is not None:
            raise ValueError(f"the train data cannot be put back live: {reason}")
        trainer, scaler = self.trainer, self._fp16_scaler()
        return ({
            "model": self.module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict()
                           for config in trainer.lr_scheduler_configs],
            "grad_scaler": None if scaler is None else scaler.state_dict(),
            **_split_loops(trainer.fit_loop.state_dict()),
            "accumulation": None if self.accumulation is None else (
                self.accumulation.engaged, self.accumulation.size),
            "rng": rng_state(self.device), "data": self.data_state()})

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Go back to ``snapshot`` in the middle of ``fit``, at ``on_train_batch_end``.

        At the same hook, ``on_train_batch_end``. The states, the loops' progress
        (Lightning's epoch and step counts go back, its epoch loop goes on with the
        snapshot's epoch), the train data's iterator made again at the snapshot's batch
        (:meth:`_EpochIterators.replay`; a ReconfigurableLoader at its own position) and the
        random numbers."""
        trainer, scaler = self.trainer, self._fp16_scaler()
        self.module.load_state_dict(snapshot["model"])
        schedulers: list[Any] = [config.scheduler for config in trainer.lr_scheduler_configs]
        for targets, states in ((trainer.optimizers, snapshot["optimizers"]),
                                (schedulers, snapshot["schedulers"])):
            for target, state in zip(targets, states, strict=True):
                target.load_state_dict(state)
        if scaler is not None and snapshot["grad_scaler"] is not None:
            scaler.load_state_dict(snapshot["grad_scaler"])
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict({**snapshot["loops"], **snapshot["progress"]})
        _not_restarting(fit_loop)  # going on, not starting again from a checkpoint
        self._global_step = trainer.global_step
        if self.accumulation is not None:
            engaged, size = snapshot["accumulation"]
            if engaged:  # windows counted from the batch the data is at: the snapshot's
                self.accumulation.set(size)  # boundary, or now's in a recovery
            else:
                self.accumulation.restore()  # Lightning's own again
        data = snapshot["data"]
        loader = self._train_loader()
        if isinstance(loader, ReconfigurableLoader):
            loader.restore_position(data["loader"])
        self.position.load_state_dict(data, replay=not isinstance(loader, ReconfigurableLoader))
        assert self.epochs is not None  # a snapshot is taken only with it
        self.epochs.replay()
        fetcher = self.epochs._fetcher()
        fetcher.fetched = data["fetched_in_epoch"]
        fetcher.done = fetcher.length is not None and fetcher.fetched >= fetcher.length
        set_rng_state(snapshot["rng"])

    # ------------------------------------------------------------ per batch

    def on_epoch_start(self) -> None:
        if self.accumulation is not None:
            self.accumulation.on_epoch_start()

    def before_optimizer_step(self, optimizer: Any) -> None:
        """Inside Lightning's optimizer step, after the window's last backward, before clipping.

        After the window's last backward (and the GradScaler's unscale), before clipping and
        the step itself."""
        if self.accumulation is not None:
            self.accumulation.before_optimizer_step(optimizer)
        if self.broken or not self.started:
            return
        try:
            lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
            self._lr = float(lr) if isinstance(lr, (int, float)) else None
            assert self.precision is not None  # started: start() made it
            scaler = self.precision.scaler
            scale = getattr(scaler, "_scale", None)  # torch.amp has no public tensor form
            self._scale_before = scale.clone() if isinstance(scale, torch.Tensor) else None
        except Exception as exc:  # the first rule: never crash the training
            self.fail("reading the optimizer step", exc)

    def on_batch_end(self, outputs: Any, batch: Any) -> None:
        """``on_train_batch_end``: count the micro-batch; at a boundary, report the step.

        At a boundary (the optimizer stepped in this batch) report the step and let the
        agent apply commands."""
        if self.broken or not self.started:
            return
        try:
            self._count(outputs, batch)
            if self.trainer.global_step != self._global_step:
                self._boundary()
        except Exception as exc:  # the first rule: never crash the training
            self.fail("reporting a step", exc)

    def _count(self, outputs: Any, batch: Any) -> None:
        assert self.fetch is not None  # started: start() made it
        self.meter.add(batch, self.fetch.take())
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        # Lightning divided it by accumulate_grad_batches (automatic optimization only)
        divisor = self.trainer.accumulate_grad_batches if self.module.automatic_optimization else 1
        loss = loss.detach()
        self._loss_sum = (loss * divisor if self._loss_sum is None
                          else self._loss_sum.add(loss, alpha=divisor))
        self._losses += 1

    def _boundary(self) -> None:
        trainer = self.trainer
        self._global_step = trainer.global_step
        wait_s, micro_batches, samples, tokens = self.meter.take()
        loss_sum = self._loss_sum  # (None exactly when no loss was counted)
        loss = loss_sum / self._losses if loss_sum is not None and self._losses else None
        skipped = None
        scaler = self.precision.scaler if self.precision is not None else None
        if self._scale_before is not None and scaler is not None:
            scale = scaler._scale  # None only before the scaler's first scale()
            assert scale is not None  # it scaled this window: a scale was read before
            skipped = scale < self._scale_before  # update() backed off: inf/NaN
        grad_norm = self.precision.grad_norm if self.precision is not None else None
        lr: Any = self._lr
        if self.optimizer_settings is not None:  # every group's rate, as the step used it
            lr = self.optimizer_settings.take_step()[0] or lr
        if lr is None and trainer.optimizers:
            value = trainer.optimizers[0].param_groups[0].get("lr")
            lr = float(value) if isinstance(value, (int, float)) else None
        self._loss_sum, self._losses, self._lr, self._scale_before = None, 0, None, None
        if self.precision is not None:
            self.precision.grad_norm = None
        self.boundary(StepRecord(
            step=trainer.global_step, micro_batches=max(micro_batches, 1), samples=samples,
            data_wait_s=wait_s, loss=loss, skipped=skipped, tokens=tokens, lr=lr,
            grad_norm=grad_norm))

    # ------------------------------------------------------------ events

    def event(self, kind: str, text: str, **fields: Any) -> None:
        """An ``info`` event at the current optimizer step (any hook; one deque append)."""
        if not self.broken:
            self.agent.event("info", text, kind=kind, step=self.trainer.global_step, **fields)

    def validation_start(self) -> None:
        sanity = self.trainer.sanity_checking
        self.event(EventKind.EVALUATION_START, "validation sanity check started" if sanity
                   else f"validation started at step {self.trainer.global_step}",
                   sanity_check=sanity)

    def validation_end(self) -> None:
        sanity = self.trainer.sanity_checking
        if sanity:
            self.event(EventKind.EVALUATION, "validation sanity check ended",
                       sanity_check=sanity)
        elif not self.broken:
            self.publish_evaluation(self.trainer.global_step,
                                    dict(self.trainer.callback_metrics), sanity_check=False)
        if self.started and not sanity and self.meter.fetched == 0 and not self.broken:
            self.agent.mark_start()  # at a boundary: the next step's time leaves it out

    def epoch_end(self) -> None:
        trainer = self.trainer
        epoch, step = trainer.current_epoch, trainer.global_step
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        cut = (0 < trainer.max_steps <= step
               and isinstance(trainer.num_training_batches, int)
               and batches < trainer.num_training_batches)  # Lightning ends it on max_steps
        self.event(EventKind.EPOCH_END, f"epoch {epoch} stopped at step {step}: max_steps reached"
                   if cut else f"epoch {epoch} ended at step {step}", epoch=epoch)

    def checkpoint_saved(self) -> None:
        self.event(EventKind.CHECKPOINT_SAVED, "checkpoint saved at step "
                   f"{self.trainer.global_step} (epoch {self.trainer.current_epoch})")

    # ------------------------------------------------------------ the end

    def uninstall(self) -> None:
        """Put the trainer and module back as before ``fit`` (called once, by :meth:`close`)."""
        self.trainer.gradient_clip_val = self._clip_val
        if self.optimizer_settings is not None:
            self.optimizer_settings.remove()
        for part in (self.accumulation, self.fetch, self.precision, self.kernels,
                     self.epochs, self.validate_now, self.sharded_sync):
            if part is not None:
                try:
                    part.restore()
                except Exception as exc:  # noqa: BLE001 -- closing must go on
                    self.fail(f"restoring {type(part).__name__}", exc)
        if self.checkpointing is not None:
            self.checkpointing.enabled = False


def _lightning_run_id(trainer: pl.Trainer) -> str | None:
    """A run id every rank of a Lightning job derives alike, or None to leave it to
    :func:`agent.wire.runs.shared_run_id` (one process; ``$GPUWATCH_RUN_ID`` set; torchrun).

    Lightning's own launcher (``devices=N``) starts ranks 1.. as children of rank 0,
    which starts from a shell: the launcher-based id of ``shared_run_id`` differs between
    them. What they share is the main address and port of the strategy's cluster
    environment (rank 0 picks the port once and hands it to its children), so the id is a
    hash of those. Reading them in rank 0 before ``fit`` fixes the port Lightning's
    launcher will use (as it would itself).
    """
    if trainer.world_size <= 1 or os.environ.get(RUN_ID_ENV):
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        return None
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None:  # no cluster environment: the default id
        return None
    try:
        key = f"{environment.main_address}|{environment.main_port}"
    except Exception:  # noqa: BLE001 -- no cluster environment: the default id
        return None
    return "lightning-" + hashlib.sha256(key.encode()).hexdigest()[:8]


class GpuwatchCallback(Callback):
    """The Lightning callback of gpuwatch: measures every optimizer step of ``fit``.

    It serves the live knobs; see the module docstring for what is reported, the knobs and
    what each refusal means.

    ``Trainer(callbacks=[GpuwatchCallback()])`` starts its agent when ``fit`` starts;
    :func:`attach` starts it at once (and returns it). The knobs are bound, and announced
    to dashboards with a new ``hello``, when training starts (``on_train_start``: they
    depend on the module, the optimizer and the dataloader); until then a command is
    refused as naming an unknown knob. The agent closes (``bye``, run file removed) when
    ``fit`` returns or raises; a later ``fit`` with the same callback gets a new agent
    (:attr:`agent`).

    Args:
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"`` (see :class:`agent.Agent`).
        tokens_per_sample: tokens in one sample, for tokens/s when batches carry no
            ``input_ids``.
        checkpoint_blocks: the submodules to checkpoint (names or types, see
            :func:`gpuopt.checkpointing.find_blocks`); default: the module's ``blocks``
            or its repeated blocks.
        compile_backend: the ``torch.compile`` backend of ``kernels=compile``
            (``"inductor"``; ``"aot_eager"`` compiles much faster on small CPUs).
        grad_scaler: the ``torch.amp.GradScaler`` of fp16 (default: a new one on the
            module's device), when the Trainer does not start in 16-mixed.
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        options: more :class:`agent.Agent` arguments (``listen``, ``queue_size``, ...).

    Raises:
        ValueError: ``tokens_per_sample`` not an integer >= 1 (when ``fit`` starts;
            ``checkpoint_blocks`` that select nothing raise there too).

    .. note:: Hooks are one call each into a plain class; per micro-batch they cost a few
       microseconds on the host and never read tensor values (see the module docstring).
    """

    def __init__(self, *, name: str = "", transport: str = "ipc",
                 tokens_per_sample: int | None = None,
                 checkpoint_blocks: Iterable[Any] | None = None,
                 compile_backend: str = "inductor",
                 grad_scaler: torch.amp.GradScaler | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, **options: Any) -> None:
        WindowMeter(batch_size, tokens_per_sample)  # validates tokens_per_sample now
        self.name = name
        self.transport = transport
        self.run_options = {"tokens_per_sample": tokens_per_sample,
                            "checkpoint_blocks": (None if checkpoint_blocks is None
                                                  else list(checkpoint_blocks)),
                            "compile_backend": compile_backend, "grad_scaler": grad_scaler,
                            "checkpoint_dir": checkpoint_dir}
        self.agent_options = options
        #: the agent of the current (or next) ``fit``
        self.agent: Agent | None = None
        self._run: _Run | None = None  # the current (or next) fit's
        self._restored: dict[str, Any] | None = None  # from fit(ckpt_path=...)

    def state_dict(self) -> dict[str, Any]:
        """In every Lightning checkpoint of a ``fit``: gpuwatch's knob values and data position.

        Of a ``fit`` under way, with a GradScaler the precision knob made; restored by
        ``fit(ckpt_path=...)``."""
        run = self._run
        if run is None or not run.started:
            return {}
        try:
            return run.saved_state()
        except Exception as exc:  # the first rule: never crash the training (or its save)
            run.agent.report_error("saving gpuwatch's state in a checkpoint", exc)
            return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``fit(ckpt_path=...)``: the knob values and data position are set when training starts.

        Once the knobs are bound (an event says which)."""
        self._restored = dict(state_dict) or None

    def __getstate__(self) -> dict[str, Any]:
        # spawned processes (ddp_spawn) get the settings and make their own agent
        return {**self.__dict__, "agent": None, "_run": None}

    def new_agent(self, trainer: pl.Trainer, module: pl.LightningModule | None) -> Agent:
        """A started agent for ``trainer``'s next ``fit``, kept in :attr:`agent`, and its run.

        Its knobs are bound when training starts; SIGTERM and an uncaught exception end it
        with ``bye``."""
        options = dict(self.agent_options)
        options.setdefault("rank", trainer.global_rank)
        options.setdefault("world_size", trainer.world_size)
        options.setdefault("training", {
            "framework": f"lightning {lightning.__version__}",
            # Lightning divides each micro-batch's mean loss by the window size
            "loss_normalization": "micro_batch_mean"})
        options.setdefault("run_id", _lightning_run_id(trainer))
        self.agent = Agent(KnobSet(), name=self.name, model=module,
                           device=trainer.strategy.root_device, transport=self.transport,
                           **options)
        self._run = _Run(self.agent, trainer, self.run_options)
        self._run.start()
        return self.agent

    # hooks: one call each

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._begin(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restored, self._restored = self._restored, None
        self._call("train_start", restored)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("on_epoch_start")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        self._call("before_optimizer_step", optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._call("on_batch_end", outputs, batch)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("validation_start")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("validation_end")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("epoch_end")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._call("checkpoint_saved")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish("finished")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        # Lightning's own SIGTERM handler stops fit with this exception
        self._finish("stopped by SIGTERM" if isinstance(exception, SIGTERMException)
                     else ending_reason(exception))

    # plumbing

    def _begin(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self._run is None:  # (attach() made one, before the module was known)
            self.new_agent(trainer, module)
        assert self._run is not None  # new_agent made it
        self._run.fit_start()

    def _call(self, method: str, *args: Any) -> None:
        if self._run is not None and self._run.fitting:
            getattr(self._run, method)(*args)

    def _finish(self, reason: str) -> None:
        run = self._run
        if run is not None and run.fitting:  # (a validate() before fit leaves it be)
            self._run = None
            run.close(reason)


def attach(trainer: pl.Trainer, *, name: str = "", transport: str = "ipc",
           loggers: bool = False, **options: Any) -> Agent:
    """Attach gpuwatch to a ``lightning.pytorch.Trainer`` before ``fit``; return its started agent.

    Adds a :class:`GpuwatchCallback` and returns its started agent (its knobs are bound when
    training starts; see there).

    Args:
        trainer: the Trainer.
        name, transport: as for :class:`agent.Agent`.
        loggers: also log gpuwatch's measurements and knob changes to the Trainer's
            loggers (:class:`agent.integrations.lightning_loggers.GpuwatchLoggers`).
        options: :class:`GpuwatchCallback` arguments (``tokens_per_sample``,
            ``checkpoint_blocks``, ``compile_backend``, ``grad_scaler``,
            ``checkpoint_dir``) and more :class:`agent.Agent` arguments.

    Raises:
        TypeError: ``trainer`` is not a Lightning Trainer.
        ValueError: the trainer already has a GpuwatchCallback, a bad option, or
            ``resume_from=`` (Lightning resumes with ``fit(ckpt_path=...)``).
    """
    if not isinstance(trainer, pl.Trainer):
        raise TypeError(f"expected a lightning.pytorch.Trainer, got {type(trainer).__name__}")
    if "resume_from" in options:
        raise ValueError("a Lightning run resumes through Lightning: trainer.fit(module, "
                         "ckpt_path=PATH) (gpuwatch's knob values come back with it)")
    # Trainer.callbacks: set by Lightning's callback connector, not declared on the class
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if any(isinstance(callback, GpuwatchCallback) for callback in callbacks):
        raise ValueError("this Trainer already has a GpuwatchCallback")
    callback = GpuwatchCallback(name=name, transport=transport, **options)
    agent = callback.new_agent(trainer, None)
    callbacks.append(callback)
    if loggers:
        from agent.integrations.lightning_loggers import GpuwatchLoggers

        callbacks.append(GpuwatchLoggers())
    return agent
