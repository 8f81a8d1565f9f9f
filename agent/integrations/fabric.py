"""gpuwatch for training loops on Lightning Fabric (``lightning.fabric.Fabric``).

Attach after ``fabric.setup(...)``, and take the window from the run::

    model, optimizer = fabric.setup(model, optimizer)
    train_loader = fabric.setup_dataloaders(train_loader)
    run = agent.attach(fabric, accum_steps=4, max_grad_norm=1.0, lr_scheduler=scheduler)
    for x, y in run.loader(train_loader, epochs=None):  # times each fetch (data wait)
        is_accumulating = run.is_accumulating           # the live window
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss / run.accum_steps)
        if not is_accumulating:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            run.optimizer_step()                        # the boundary: commands apply
            if run.step >= max_steps:
                break

:func:`attach` finds the module and optimizer ``fabric.setup`` wrapped (or takes
``model=`` / ``optimizer=``). The run is :class:`agent.integrations.loop.LoopRun`'s, as a
hand-written loop's: :meth:`~agent.integrations.loop.LoopRun.loader` times and counts the
data (the data position a checkpoint keeps),
:attr:`~agent.integrations.loop.LoopRun.accum_steps` and
:attr:`~agent.integrations.loop.LoopRun.is_accumulating`
say where the window ends, and :meth:`~agent.integrations.loop.LoopRun.optimizer_step`
marks the boundary. The step's loss is the sum of the losses given to ``fabric.backward``
in the window (the window's mean when each is divided by ``run.accum_steps``), or what
``run.optimizer_step(loss)`` is given.

**Knobs** (each applies at an optimizer-step boundary and trains as a fresh run so
configured from that step, or is refused with the reason):

- ``precision`` (fp32 / bf16 / fp16): Fabric's own precision plugin for the value
  (``Precision``: 32-true; ``MixedPrecision``: bf16-mixed, 16-mixed with the run's one
  ``GradScaler``, kept with its scale across switches) set on the strategy, so the wrapped
  module's forward (autocast, input and output casts), ``fabric.backward``, the optimizer
  step, ``fabric.clip_gradients`` and ``fabric.autocast()`` follow it. Refused when the
  Fabric started in another precision (true half precision converts the weights), under a
  strategy with its own precision handling (FSDP, DeepSpeed, XLA, ...), on devices other
  than cpu and cuda; fp16 on a CPU (Fabric runs 16-mixed there as bf16-mixed).
- ``accum_steps`` with ``accum_steps=N``: the loop reads ``run.is_accumulating``
  and divides each loss by ``run.accum_steps``.
- ``kernels``: eager / ``torch.compile`` of the module inside the Fabric wrapper (its own
  forward, switched in place: :class:`gpuopt.backends.ModelBackend`; compiling the
  wrapper would trace Fabric's casts and hooks too); ``triton`` with fused modules on
  CUDA. Refused with several processes and for a module compiled before ``setup``.
- ``checkpointing``: the module's repeated blocks (or ``checkpoint_blocks=``).
- ``lr_scale``, ``weight_decay``: :class:`gpuopt.optim.OptimizerSettings` on the optimizer
  inside the Fabric wrapper; ``max_grad_norm`` with ``max_grad_norm=X`` (0: off): the run
  clips inside ``optimizer.step()`` (after fp16's unscale), so the loop leaves out its own
  ``fabric.clip_gradients``.
- ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``micro_batch_size``: when the
  loop's data is a :class:`gpuopt.loader.ReconfigurableLoader` given to ``run.loader``
  (its batches are moved to ``fabric.device``, as a Fabric loader's are) or ``loader=``.
- ``checkpoint=now``: ``fabric.save`` of the model, optimizer, ``lr_scheduler=``, the
  GradScaler, the random number generators, the step, the knob values and the data
  position; ``attach(fabric, resume_from=PATH)`` reads it with ``fabric.load`` and goes
  on exactly. Refused with several processes.
- ``cpu_threads``; ``memory_fraction``, ``memory_snapshot_steps`` on CUDA.

Under ``ModelParallelStrategy(parallelize_fn, data_parallel_size=N,
tensor_parallel_size=1)`` with a module ``parallelize_fn`` sharded by ``fully_shard``
(FSDP2) the knobs are the same and stay exact (:mod:`agent.integrations.sharded`): the
loop's ``fabric.no_backward_sync`` leaves a window's gradients unreduced until its last
micro-batch, ``max_grad_norm`` clips the global norm over every rank's shards,
``checkpointing`` wraps the ``fully_shard`` blocks, ``precision`` is refused for a
``MixedPrecisionPolicy`` that casts and for fp16, ``kernels`` is refused, and
``checkpoint=now`` writes a ``torch.distributed.checkpoint`` directory every rank writes
its shards, random numbers and data position into (``resume_from=DIR`` on every rank).
With a tensor-parallel dimension (the strategy's 'auto' sizes give a node's devices to
it) every knob that changes the training is refused, saying so.

Imported only when used: ``import agent`` does not import Lightning.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.fabric.wrappers import _FabricDataLoader, _FabricModule, _FabricOptimizer
from torch._dynamo import OptimizedModule

from agent.integrations.adapters import cpu_threads_knob, dropout_knob, precision_knob, refuse
from agent.control.checkpoints import FORMAT
from agent.step.core import Agent
from agent.wire.knobs import (CHECKPOINT, CHECKPOINTING, DROPOUT, KERNELS, LR_SCALE,
                              MAX_GRAD_NORM, MICRO_BATCH_SIZE, PRECISION, WEIGHT_DECAY, KnobSet)
from agent.integrations.loop import (LoopRun, check_accum_steps, model_knobs,
                                     optimizer_settings_knobs)
from agent.integrations.ranks import agree
from agent.integrations.sharded import (fsdp_modules, is_sharded,
                                        load_sharded, save_sharded, sharded_precision)
from gpuopt.backends import ModelBackend
from gpuopt.optim import OptimizerSettings
from gpuopt.precision import precision_support
from gpuopt.saving import rng_state, set_rng_state

__all__ = ["FabricRun", "attach"]

#: Fabric's precision names <-> the ``precision`` knob's values (the ones it switches).
_FROM_FABRIC = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def _knob_value(plugin: Any) -> str | None:
    """The knob value of a Fabric precision plugin, or None for one it cannot switch
    (exact types only: a subclass may change what the plugin does)."""
    if type(plugin) in (FabricPrecision, FabricMixedPrecision):
        return _FROM_FABRIC.get(plugin.precision)
    return None


class _PluginSwitch:
    """The ``precision`` knob's target (an :class:`agent.integrations.adapters.PrecisionPolicy`):
    Fabric's own plugin for each value, set on the strategy (and ``fabric._precision``,
    which ``fabric.autocast()`` reads) at an optimizer-step boundary.

    Attributes:
        scaler: the run's one GradScaler: the Fabric's own (16-mixed from the start) or
            the one made at the first switch to fp16; kept, with its scale, in fp32 and
            bf16.
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.device_type = fabric.device.type
        self.scaler: torch.amp.GradScaler | None = getattr(fabric.strategy.precision,
                                                           "scaler", None)

    @property
    def precision(self) -> str:
        """The precision now: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return _FROM_FABRIC[self.fabric.strategy.precision.precision]

    @precision.setter
    def precision(self, value: str) -> None:
        refuse(_precision_refusal(value, self.device_type))
        plugin: FabricPrecision
        if value == "fp32":
            plugin = FabricPrecision()
        elif value == "bf16":
            plugin = FabricMixedPrecision("bf16-mixed", self.device_type)
        else:
            self.scaler = self.scaler or torch.amp.GradScaler(self.device_type)
            plugin = FabricMixedPrecision("16-mixed", self.device_type, scaler=self.scaler)
        self.fabric.strategy.precision = plugin
        self.fabric._precision = plugin

    def load_scaler(self, state: dict[str, Any]) -> None:
        """Load a GradScaler state (:attr:`scaler`'s, made now if there is none yet)."""
        self.scaler = self.scaler or torch.amp.GradScaler(self.device_type)
        self.scaler.load_state_dict(state)


def _precision_refusal(value: str, device_type: str) -> str | None:
    """Why Fabric cannot train in ``value`` on ``device_type``, or None."""
    if value == "fp16" and device_type == "cpu":
        return ("Fabric has no fp16 AMP on a CPU (it runs precision='16-mixed' as "
                "'bf16-mixed' there): choose bf16")
    return precision_support(value, device_type)


class FabricRun(LoopRun):
    """The agent of one loop on a Lightning Fabric (see :func:`attach`, which makes it).

    The loop run (:class:`agent.integrations.loop.LoopRun`: ``loader``, ``accum_steps``,
    ``is_accumulating``, ``optimizer_step``, ``step``, ``close``) on a Fabric.

    Attributes:
        fabric: the Fabric. model: the module it wrapped (``_FabricModule``).
        optimizer: the optimizer it wrapped (``_FabricOptimizer``), or None.
        lr_scheduler: the scheduler the checkpoints save, or None.
        precision: the ``precision`` knob's target, or None where it is refused.
        model_backend: the ``kernels`` knob's target, or None where it is refused.
    """

    declare = "agent.attach(fabric, {})"
    accum_use = "use run.is_accumulating and run.accum_steps in its loop"

    def __init__(self, agent: Agent, fabric: Fabric, model: _FabricModule,
                 optimizer: _FabricOptimizer | None, *, lr_scheduler: Any,
                 optimizer_settings: OptimizerSettings | None, accum_steps: int | None,
                 tokens_per_sample: int | None, not_plain: str | None) -> None:
        super().__init__(agent, accum_steps=accum_steps, optimizer_settings=optimizer_settings,
                         tokens_per_sample=tokens_per_sample, accum_refused=not_plain)
        self.fabric = fabric
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.precision: _PluginSwitch | None = None
        #: the module's parameters are sharded (DTensors: ``fully_shard`` under a
        #: ModelParallelStrategy): checkpoints are directories every rank writes its part of
        self.sharded = is_sharded(model.module)
        self.model_backend: ModelBackend | None = None
        self._fabric_backward = fabric.backward
        self._loss_sum: torch.Tensor | None = None
        self._backwards = 0
        self._scale_before: torch.Tensor | None = None
        #: the Fabric loader run.loader() iterates, and the epoch its sampler is set to
        #: when it is made again after a resume (Fabric sets it at each iter())
        self._fabric_loader: _FabricDataLoader | None = None
        self._sampler_epoch: int | None = None
        fabric.backward = self._backward  # type: ignore[method-assign] # uninstall() drops it

    # ------------------------------------------------------------ what the loop reads

    def loader(self, batches: Iterable[Any], *, epochs: int | None = 1) -> Iterator[Any]:
        """:meth:`agent.integrations.loop.LoopRun.loader`, with a Fabric loader's sampler epoch.

        A Fabric loader's sampler epoch is put back after a resume (Fabric sets it from its
        count of ``iter()`` calls)."""
        if isinstance(batches, _FabricDataLoader):
            self._fabric_loader = batches
            if self._sampler_epoch is not None:
                batches._num_iter_calls, self._sampler_epoch = self._sampler_epoch, None
        return super().loader(batches, epochs=epochs)

    def _batches(self, batches: Iterable[Any], epochs: int | None) -> Iterator[Any]:
        iterator = super()._batches(batches, epochs)
        if isinstance(batches, _FabricDataLoader):
            return iterator  # (it moves its batches itself)
        return map(self.fabric.to_device, iterator)

    # ------------------------------------------------------------ the window

    def _backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward``: Fabric's own, then the tensor counted into the window's
        loss (an asynchronous add on the device); in fp16 the window's first backward
        keeps the loss scale (a clone), for the step's skipped flag."""
        self._fabric_backward(tensor, *args, **kwargs)
        detached = tensor.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._backwards += 1
        if self._backwards == 1:
            scaler = getattr(self.fabric.strategy.precision, "scaler", None)
            if scaler is not None and scaler._scale is not None:
                self._scale_before = scaler._scale.clone()

    def _take_window(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int | None]:
        skipped = None
        scaler = getattr(self.fabric.strategy.precision, "scaler", None)
        if scaler is not None and self._scale_before is not None:
            skipped = scaler._scale < self._scale_before  # update() backed off: inf/NaN
        window = (self._loss_sum, skipped, self._backwards, None)
        self._loss_sum, self._backwards, self._scale_before = None, 0, None
        return window

    # ------------------------------------------------------------ checkpoints

    def data_state(self) -> dict[str, Any]:
        """:meth:`agent.integrations.loop.LoopRun.data_state`, with the loader's sampler epoch.

        The sampler epoch of the Fabric loader :meth:`loader` iterates."""
        state = super().data_state()
        if self._fabric_loader is not None and self.position.epoch:
            state["sampler_epoch"] = self._fabric_loader._num_iter_calls - 1
        return state

    def save_checkpoint(self, path: Any, knobs: dict[str, Any]) -> None:
        """The ``checkpoint`` command's ``fabric.save``: states, step, knob values, data position.

        The model, optimizer and scheduler (by Fabric), the GradScaler, random number
        generators, step, knob values and data position. A sharded module (:attr:`sharded`)
        is saved by every rank into one directory
        (:func:`agent.integrations.sharded.save_sharded`: its shards, and each rank's own
        random numbers and data position, which ``fabric.save`` would keep rank 0's of)."""
        scaler = None if self.precision is None else self.precision.scaler
        if not self.sharded:
            self.fabric.save(path, self._checkpoint(knobs, {
                "model": self.model, "optimizer": self.optimizer,
                "lr_scheduler": self.lr_scheduler,
                "grad_scaler": {} if scaler is None else scaler.state_dict()}))
            return
        save_sharded(path, self.model.module,
                     None if self.optimizer is None else self.optimizer.optimizer,
                     lambda: self._checkpoint(knobs, {
                         "model": None, "optimizer": None,
                         "lr_scheduler": (None if self.lr_scheduler is None
                                          else self.lr_scheduler.state_dict()),
                         "grad_scaler": {} if scaler is None else scaler.state_dict(),
                         "world_size": self.fabric.world_size}))

    def resume(self, path: str | os.PathLike) -> None:
        """Continue from a checkpoint :meth:`save_checkpoint` wrote, read by ``fabric.load``.

        A sharded module's directory by :func:`agent.integrations.sharded.load_sharded`, on
        every rank. Every state it has, the step, the knob values, the data position and the
        random number generators (an event says which).

        Raises:
            ValueError: it is no such checkpoint, or has a state this run was given
                nothing for (or a GradScaler's, where ``precision`` is refused).
        """
        source = os.fspath(path)
        saved = self._read(source)
        self._load_states(saved, source, model=self.model, optimizer=self.optimizer,
                          lr_scheduler=self.lr_scheduler)
        if saved["grad_scaler"]:
            if self.precision is None:
                raise ValueError(f"{source} has a GradScaler's state, and this run cannot "
                                 f"switch precision ({self.knobs.unsupported[PRECISION.name]})")
            self.precision.load_scaler(saved["grad_scaler"])
        self._sampler_epoch = (saved.get("data") or {}).get("sampler_epoch")
        self._resume_run(saved, source)

    def _read(self, source: str) -> dict[str, Any]:
        """The checkpoint :meth:`save_checkpoint` wrote at ``source``, by ``fabric.load``
        (``weights_only``: no code runs from it); a sharded module's directory by
        :func:`agent.integrations.sharded.load_sharded`, on every rank.

        Raises:
            ValueError: it is no such checkpoint.
        """
        if self.sharded:
            saved = load_sharded(source, self.model.module,
                                 None if self.optimizer is None else self.optimizer.optimizer)
        else:
            saved = self.fabric.load(source, weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(f"{source} is not a checkpoint of gpuwatch's checkpoint command")
        return saved

    def rewind_refusal(self) -> str | None:
        """Several processes cannot rewind: a checkpoint holds one rank's data position.

        And that rank's random numbers (their checkpoint command is refused for it too)."""
        if self.fabric.world_size > 1:
            return ("not with several processes: a checkpoint holds rank 0's data "
                    "position and random numbers, not every rank's")
        return None

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A checkpoint :meth:`save_checkpoint` wrote, read as :meth:`resume` reads it.

        In :meth:`state_snapshot`'s form, with its step and knob values."""
        saved = self._read(os.fspath(path))
        snapshot = {part: saved.get(part) for part in ("model", "optimizer", "lr_scheduler",
                                                      "grad_scaler", "rng", "data")}
        return snapshot, saved["step"], saved["knobs"]

    def live_state(self) -> dict[str, Any]:
        """The states, the random numbers and the data position, live (for a rollback).

        The model's, optimizer's, scheduler's and GradScaler's states."""
        scaler = None if self.precision is None else self.precision.scaler
        return ({
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "lr_scheduler": (None if self.lr_scheduler is None
                             else self.lr_scheduler.state_dict()),
            "grad_scaler": {} if scaler is None else scaler.state_dict(),
            "rng": rng_state(self.device), "data": self.data_state()})

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Go back to ``snapshot`` in the middle of the loop.

        The states, the random numbers and the data position (:meth:`loader`'s iteration
        goes back, the Fabric loader's sampler epoch with it)."""
        self._load_states(snapshot, "the rollback's snapshot", model=self.model,
                          optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
        if snapshot["grad_scaler"] and self.precision is not None:
            self.precision.load_scaler(snapshot["grad_scaler"])
        epoch = snapshot["data"].get("sampler_epoch")
        if epoch is not None and self._fabric_loader is not None:
            self._fabric_loader._num_iter_calls = epoch  # (its iter() counts it up again)
        self._load_position(snapshot["data"])
        set_rng_state(snapshot["rng"])

    def uninstall(self) -> None:
        """Give ``fabric.backward`` back (the precision a person chose stays)."""
        if vars(self.fabric).get("backward") == self._backward:
            del self.fabric.backward


# ---------------------------------------------------------------------- attaching

def _set_up(fabric: Fabric) -> tuple[list[_FabricModule], list[_FabricOptimizer]]:
    """The modules and optimizers ``fabric`` wrapped, found among the live objects
    (Fabric keeps no list). One pass over the garbage collector's objects: tens of ms
    in a large process, once."""
    strategy = fabric.strategy
    models, optimizers = [], []
    for obj in gc.get_objects():
        kind = type(obj)  # (and vars(): no __class__ or __getattr__ of anyone's runs)
        if issubclass(kind, _FabricModule) and vars(obj).get("_strategy") is strategy:
            models.append(obj)
        elif issubclass(kind, _FabricOptimizer) and vars(obj).get("_strategy") is strategy:
            optimizers.append(obj)
    return models, optimizers


def _not_plain(strategy: Any, module: torch.nn.Module) -> str | None:
    """Why the knobs that change the training are refused under ``strategy``, or None
    for single-device and DDP strategies, which leave the module, its gradients and
    the optimizer step to Fabric's wrappers (DeepSpeed, FSDP, XLA, ... do not), and for
    a ``ModelParallelStrategy`` whose ``module`` ``fully_shard`` sharded on a mesh
    without tensor parallelism (FSDP2: the plain backward and optimizer step over
    DTensor shards, :mod:`agent.integrations.sharded`)."""
    if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
        return None
    if type(strategy) is ModelParallelStrategy and fsdp_modules(module):
        mesh = strategy.device_mesh
        tensor_parallel = mesh["tensor_parallel"].size()
        if tensor_parallel == 1:
            return None
        return (f"not supported under Fabric's ModelParallelStrategy with a tensor-parallel "
                f"dimension of {tensor_parallel} ranks (its mesh: data_parallel="
                f"{mesh['data_parallel'].size()}, tensor_parallel={tensor_parallel}; 'auto' "
                "gives every device of a node to tensor parallelism): gpuwatch verifies "
                "fully_shard alone, ModelParallelStrategy(data_parallel_size=<ranks>, "
                "tensor_parallel_size=1)")
    return (f"not supported under Fabric's {type(strategy).__name__} (it runs the module, "
            "backward or optimizer step its own way)")


def _bind(run: FabricRun, knobs: KnobSet, *, checkpoint_blocks: Any, compile_backend: str,
          max_grad_norm: float | None) -> None:
    """Bind every knob the run can apply exactly; the others get their reason."""
    fabric, model, optimizer = run.fabric, run.model, run.optimizer
    strategy = fabric.strategy
    not_plain = _not_plain(strategy, model.module)
    if not_plain is not None:
        for spec in (PRECISION, KERNELS, CHECKPOINTING, LR_SCALE, WEIGHT_DECAY,
                     MAX_GRAD_NORM, MICRO_BATCH_SIZE, DROPOUT):
            knobs.bind(spec, not_plain)
        return
    device_type = fabric.device.type
    if _knob_value(strategy.precision) is None:
        knobs.bind(PRECISION, (
            f"the Fabric's precision is {strategy.precision.precision!r} "
            f"({type(strategy.precision).__name__}); gpuwatch switches only between "
            "Fabric's Precision (32-true) and MixedPrecision (bf16-mixed, 16-mixed)"))
    elif device_type not in ("cpu", "cuda"):
        knobs.bind(PRECISION, f"live precision changes are verified on cpu "
                              f"and cuda, not {device_type}")
    else:
        run.precision = _PluginSwitch(fabric)
        sharded = sharded_precision(model.module)
        knobs.add(dataclasses.replace(
            precision_knob(run.precision),
            check=lambda value: refuse(_precision_refusal(value, device_type)
                                       or (sharded and sharded(value)))))
    inner = model.module
    kernels_refused = None
    if fsdp_modules(inner):
        kernels_refused = "compiling a model sharded by fully_shard is not verified"
    elif fabric.world_size > 1:
        kernels_refused = "torch.compile of the module with several processes is not verified"
    elif isinstance(model._forward_module, OptimizedModule):
        kernels_refused = "the module was torch.compile'd before fabric.setup"
    run.model_backend, _ = model_knobs(knobs, inner, fabric.device,
                                       kernels_refused=kernels_refused,
                                       compile_backend=compile_backend,
                                       checkpoint_blocks=checkpoint_blocks,
                                       declare=run.declare)
    if run.model_backend is not None:
        run.event_sources.append(run.model_backend.pop_events)
    knobs.bind(DROPOUT, dropout_knob(inner))
    if optimizer is not None:
        run.optimizer_settings = optimizer_settings_knobs(
            knobs, optimizer.optimizer, max_grad_norm, declare=run.declare,
            own_clip="fabric.clip_gradients")
    else:
        for spec in (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM):
            knobs.bind(spec, "no optimizer set up by fabric.setup: pass "
                             "agent.attach(fabric, optimizer=optimizer)")


def attach(fabric: Fabric, *, model: _FabricModule | None = None,
           optimizer: _FabricOptimizer | None = None, loader: Any = None,
           lr_scheduler: Any = None, accum_steps: int | None = None,
           max_grad_norm: float | None = None, checkpoint_blocks: Any = None,
           compile_backend: str = "inductor", tokens_per_sample: int | None = None,
           checkpoint_dir: str | os.PathLike | None = None,
           resume_from: str | os.PathLike | None = None,
           eval_fn: Callable[[], dict[str, Any] | None] | None = None, name: str = "",
           transport: str = "ipc", **options: Any) -> FabricRun:
    """Start the agent for a loop on ``fabric`` and return its :class:`FabricRun`.

    See the module docstring for the loop and the knobs. Call it after ``fabric.setup``.

    ``fabric.backward`` is replaced by one that also counts the window's loss (given
    back at :meth:`FabricRun.close`). The run ends at interpreter exit, on SIGTERM (where
    the script has no handler of its own) and on an uncaught exception (named in
    ``bye``), as :func:`agent.session`.

    Args:
        fabric: the Fabric the loop uses.
        model: the module ``fabric.setup`` returned (default: the one it wrapped).
        optimizer: the optimizer ``fabric.setup`` returned (default: the one it wrapped;
            none: the optimizer's knobs are refused).
        loader: the loop's data when it is a :class:`gpuopt.loader.ReconfigurableLoader`,
            to bind its knobs now (else :meth:`FabricRun.loader` binds them).
        lr_scheduler: the loop's LR scheduler (the loop steps it), saved in checkpoints.
        accum_steps: declares the ``accum_steps`` knob and its starting value.
        max_grad_norm: declares the ``max_grad_norm`` knob and its starting value (0: no
            clipping); the run clips inside ``optimizer.step()``.
        checkpoint_blocks: what ``checkpointing`` checkpoints, as
            :func:`gpuopt.checkpointing.find_blocks` targets (default: the module's
            ``blocks``, else its repeated blocks; none: the knob is refused).
        compile_backend: the ``torch.compile`` backend of ``kernels=compile``.
        tokens_per_sample: tokens in one sample, for token models whose batches carry no
            ``input_ids``.
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        resume_from: a ``checkpoint=now`` checkpoint to continue from: its states, step,
            knob values, data position (``run.loader`` goes on where it was) and random
            numbers.
        name, transport, options: as for :class:`agent.Agent`.

    Raises:
        ValueError: no module or several wrapped by ``fabric`` (pass ``model=``), several
            optimizers (pass ``optimizer=``), ``accum_steps < 1``, a bad
            ``max_grad_norm``, ``checkpoint_blocks`` that select nothing, or a
            ``resume_from`` that is no such checkpoint or has a state this run was given
            nothing for. OSError: it cannot be read.

    .. note:: Costs the training thread a few microseconds per optimizer step and one
       asynchronous add per micro-batch; never synchronizes the device. Finding the
       wrapped objects (without ``model=`` and ``optimizer=``) is one pass over the
       process's objects, once.
    """
    check_accum_steps(accum_steps)
    if model is None or optimizer is None:
        models, optimizers = _set_up(fabric)
        if model is None:
            if len(models) != 1:
                raise ValueError(f"the Fabric has set up {len(models)} modules: call "
                                 "agent.attach(fabric) after fabric.setup(model, optimizer),"
                                 " or pass model= (the module the loop trains)")
            model = models[0]
        if optimizer is None and optimizers:
            if len(optimizers) > 1:
                raise ValueError(f"the Fabric has set up {len(optimizers)} optimizers: "
                                 "pass optimizer= (the one that steps the module)")
            optimizer = optimizers[0]
    knobs = KnobSet()
    agent = Agent(knobs, name=name, model=model.module, device=fabric.device,
                  transport=transport, rank=fabric.global_rank, world_size=fabric.world_size,
                  training={"framework": "lightning.fabric",
                            "loss_normalization": "as the loop divides its losses"},
                  **options)
    not_plain = _not_plain(fabric.strategy, model.module)
    run = FabricRun(agent, fabric, model, optimizer, lr_scheduler=lr_scheduler,
                    optimizer_settings=None, accum_steps=accum_steps,
                    tokens_per_sample=tokens_per_sample, not_plain=not_plain)
    try:
        _bind(run, knobs, checkpoint_blocks=checkpoint_blocks,
              compile_backend=compile_backend, max_grad_norm=max_grad_norm)
        knobs.add(cpu_threads_knob(knobs))
        if run.sharded and not_plain is not None:
            knobs.bind(CHECKPOINT, not_plain)
        elif run.sharded:
            run.bind_checkpoint(run.save_checkpoint, directory=checkpoint_dir,
                                every_rank=True, agree=agree,
                                name="step-{step:08d}")
        elif fabric.world_size > 1:
            knobs.bind(CHECKPOINT, (
                "not with several processes: a checkpoint would hold rank 0's data "
                "position and random numbers for every rank"))
        else:
            run.bind_checkpoint(run.save_checkpoint, directory=checkpoint_dir)
        run.bind_evaluate(eval_fn, model.module, declare="agent.attach(fabric, eval_fn=...)")
        if loader is not None:
            run.bind_loader(loader)
        if resume_from is not None:
            run.resume(resume_from)
    except BaseException:
        run.uninstall()
        raise
    run.start()
    return run
