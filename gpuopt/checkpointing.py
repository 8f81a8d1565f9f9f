"""Activation checkpointing of a model's repeated blocks, switchable between steps.

Checkpointing a block keeps only its inputs from the forward pass and recomputes its
inner activations during backward: the activation memory of ``n`` blocks drops from
``n`` blocks' worth of intermediates to ``n`` block inputs plus one block's
intermediates, for about one extra forward pass of compute (roughly +30% step time for
a transformer whose forward is a third of the step).

:class:`ActivationCheckpointing` switches it on and off at any time between a forward
pass and the next (the trainer does it at the optimizer-step boundary) without creating
or moving parameters: the same ``Parameter`` objects stay in the model, so the
optimizer's state and the model's ``state_dict`` keys stay valid.

Mechanism: while enabled, each chosen block has an instance attribute ``forward`` that
shadows its class's ``forward`` (``nn.Module.__call__`` looks up ``self.forward``) and
runs the original under :func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False``; disabling deletes the attribute, leaving the block exactly as it
was. Forward hooks of the block run once, outside the checkpoint, as before.

``use_reentrant=False`` is passed explicitly: the non-reentrant implementation works
through saved-tensor hooks, so blocks whose inputs do not require grad (a frozen input
embedding) still get parameter gradients, which the reentrant one silently drops, and it
supports keyword arguments and ``torch.autograd.grad``. With ``preserve_rng_state=True``
(torch's default) the RNG state is stashed and restored around the recomputation, so
dropout draws the same mask twice and gradients equal those without checkpointing.

Sources: Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost"
(arXiv:1604.06174, 2016); PyTorch ``torch.utils.checkpoint`` documentation
(https://pytorch.org/docs/stable/checkpoint.html).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

__all__ = ["ActivationCheckpointing", "find_blocks"]

#: Attribute holding the repeated blocks when no targets are given.
DEFAULT_BLOCKS_ATTR = "blocks"


def find_blocks(
    model: nn.Module, targets: Iterable[str | type[nn.Module]] | None = None
) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` pairs that activation checkpointing would wrap.

    Args:
        model: the model.
        targets: what to wrap. None (the default): every module of the
            ``nn.ModuleList`` attribute ``model.blocks``, or without one the repeated
            blocks: the children of the largest ``nn.ModuleList`` of two or more modules
            of one type (``transformer.h`` in GPT-2 and nanoGPT), or without one the
            modules ``torch.distributed.fsdp.fully_shard`` wrapped inside another it
            wrapped, the model included (a sharded ``Sequential``'s blocks under its root
            unit; outermost only). Otherwise names and/or types:
            a name (as in ``model.named_modules()``, e.g. ``"encoder.layers.3"``)
            selects that module, or each child of it if it is an ``nn.ModuleList``
            (which has no ``forward`` of its own); a type selects every submodule that
            is an instance of it, except the model itself and modules inside another
            selected module (nested checkpoints would recompute twice).

    Returns:
        The selected modules in ``named_modules()`` order, each once; possibly empty.

    Raises:
        ValueError: a name does not exist in ``model``, or a target is neither a string
            nor an ``nn.Module`` subclass.
    """
    if targets is None:
        blocks = getattr(model, DEFAULT_BLOCKS_ATTR, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return [(f"{DEFAULT_BLOCKS_ATTR}.{name}", block)
                    for name, block in blocks.named_children()]
        return _repeated_blocks(model) or _sharded_blocks(model)

    names: list[str] = []
    types: list[type[nn.Module]] = []
    for target in targets:
        if isinstance(target, str):
            names.append(target)
        elif isinstance(target, type) and issubclass(target, nn.Module):
            types.append(target)
        else:
            raise ValueError(
                f"checkpointing targets must be module names or nn.Module subclasses, "
                f"got {target!r}")
    chosen: set[int] = set()
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError as exc:
            raise ValueError(f"no submodule named {name!r} in {type(model).__name__}") from exc
        if isinstance(module, nn.ModuleList):
            chosen.update(id(child) for child in module.children())
        else:
            chosen.add(id(module))
    selected: list[tuple[str, nn.Module]] = []
    inside: list[str] = []  # prefixes of selected modules, to skip their descendants
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix) for prefix in inside):
            continue
        if id(module) in chosen or (types and isinstance(module, tuple(types))):
            selected.append((name, module))
            inside.append(name + ".")
    return selected


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the model's largest ``nn.ModuleList`` whose 2+ children are all
    of one type (a transformer's layers: nanoGPT's and GPT-2's ``transformer.h``,
    Llama's ``model.layers``); the first such list on a tie; empty when there is none."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) >= 2
                and len({type(child) for child in module}) == 1
                and (best is None or len(module) > len(best[1]))):
            best = (name, module)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{name}", child) for name, child in best[1].named_children()]


def _sharded_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules inside ``model`` that ``fully_shard`` wrapped inside another module it
    wrapped (``model`` itself included): the FSDP2 units a sharded model gathers one at a
    time under its root unit (a ``fully_shard``-ed ``Sequential``'s blocks, whether the
    ``Sequential`` is ``model`` or inside it, as a LightningModule's), outermost only, in
    ``named_modules()`` order; empty when there is none. Checkpointing one recomputes its
    forward after FSDP2's pre-backward hook gathered its parameters again."""
    modules = list(model.named_modules())
    units = [name for name, module in modules if isinstance(module, FSDPModule)]

    def inside(name: str, outer: str) -> bool:
        return name != outer and (outer == "" or name.startswith(outer + "."))

    selected: list[tuple[str, nn.Module]] = []
    for name, module in modules:
        if (name in units and any(inside(name, unit) for unit in units)
                and not any(inside(name, chosen) for chosen, _ in selected)):
            selected.append((name, module))
    return selected


class _CheckpointedForward:
    """The ``forward`` installed on a block: its original forward under checkpoint.

    Checkpoints only when autograd records (``torch.is_grad_enabled()``); under
    ``no_grad`` / ``inference_mode`` there is nothing to save, so it calls the original
    directly.
    """

    def __init__(self, original: Callable[..., Any], preserve_rng_state: bool) -> None:
        self.original = original
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        return checkpoint(self.original, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def _original_forward(module: nn.Module) -> Callable[..., Any]:
    """The block's forward without any checkpointing installed on it."""
    installed = module.__dict__.get("forward")
    if isinstance(installed, _CheckpointedForward):
        return installed.original
    return module.forward


class ActivationCheckpointing:
    """Activation checkpointing over a model's repeated blocks, on or off at any step.

    Example::

        checkpointing = ActivationCheckpointing(model)        # model.blocks, off
        checkpointing.enabled = True                          # from the next forward
        ...
        checkpointing.enabled = False                         # and back

    Args:
        model: the model; it is modified in place only by the per-block ``forward``
            attribute while enabled (parameters, buffers, module tree and ``state_dict``
            keys never change).
        targets: the modules to checkpoint, as in :func:`find_blocks` (default: each
            module of ``model.blocks``, else the model's repeated blocks). Each must take
            and return tensors (or nested tensors) and be deterministic apart from the RNG.
        enabled: switch on at once.
        preserve_rng_state: stash and restore the CPU and device RNG states around the
            recomputation so dropout matches (torch's default; False is faster when the
            blocks draw no random numbers).

    Raises:
        ValueError: there is nothing to checkpoint: ``targets`` is None and the model
            has no blocks :func:`find_blocks` would find, or ``targets``
            selects no module; or a target is unknown (see :func:`find_blocks`). A
            trainer that catches this should leave the ``checkpointing`` knob out of
            its schema.

    .. note:: Cost when enabled: one extra forward of each checkpointed block per
       backward, and a stash of the RNG state per block call (a small host copy on
       CPU; on CUDA a device-to-host copy of the generator state, which does not
       synchronize). Memory saved: the intermediates inside each block. Switching is
       O(number of blocks) attribute assignments and never touches the device. Under
       ``torch.compile`` a switch changes the traced code, so the first call after each
       switch direction compiles once (guards on the blocks' ``forward`` attribute).

    .. note:: Switch only between a forward pass and the next one, never between a
       forward and its backward (the trainer switches at the optimizer-step boundary).
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Iterable[str | type[nn.Module]] | None = None,
        *,
        enabled: bool = False,
        preserve_rng_state: bool = True,
    ) -> None:
        targets = None if targets is None else list(targets)
        selected = find_blocks(model, targets)
        if not selected:
            if targets is None:
                reason = (f"{type(model).__name__} has no non-empty nn.ModuleList attribute "
                          f"{DEFAULT_BLOCKS_ATTR!r} and no nn.ModuleList of repeated blocks")
            else:
                reason = f"the targets {targets!r} select no module of {type(model).__name__}"
            raise ValueError(f"nothing to checkpoint: {reason}; pass targets= with the "
                             "names or types of the repeated blocks")
        self.model = model
        self.preserve_rng_state = preserve_rng_state
        self.names: tuple[str, ...] = tuple(name for name, _ in selected)
        self.modules: tuple[nn.Module, ...] = tuple(module for _, module in selected)
        # made once and reused at every switch: torch.compile guards on their identity,
        # so each on/off state compiles once, not once per switch
        self._forwards = tuple(_CheckpointedForward(_original_forward(module), preserve_rng_state)
                               for module in self.modules)
        self._enabled = False
        self.enabled = enabled

    def __len__(self) -> int:
        """Number of checkpointed blocks."""
        return len(self.modules)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self)} blocks, enabled={self._enabled}, "
                f"first={self.names[0]!r})")

    @property
    def enabled(self) -> bool:
        """Whether the blocks run under checkpoint; set it between forward passes."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"enabled must be a bool, got {value!r}")
        if value == self._enabled:
            return
        for module, forward in zip(self.modules, self._forwards):
            if value:
                self._install(module, forward)
            else:
                self._remove(module, forward)
        self._enabled = value

    @staticmethod
    def _install(module: nn.Module, forward: _CheckpointedForward) -> None:
        if isinstance(module.__dict__.get("forward"), _CheckpointedForward):
            return  # already wrapped (by another instance over the same model)
        module.forward = forward

    @staticmethod
    def _remove(module: nn.Module, forward: _CheckpointedForward) -> None:
        if module.__dict__.get("forward") is not forward:
            return  # not ours
        original = forward.original
        if getattr(original, "__self__", None) is module and \
                getattr(original, "__func__", None) is getattr(type(module), "forward", None):
            del module.forward  # the class's own forward shows through again
        else:
            module.forward = original  # an instance-level forward that was there before
