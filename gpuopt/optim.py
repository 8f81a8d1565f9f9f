"""Live optimizer settings: learning-rate multiplier, weight decay, gradient clipping.

A learning-rate multiplier that keeps the schedule's shape, the weight decay of the decaying
param groups, and gradient clipping inside the step.

The learning rate: a scheduler (or the loop) sets each param group's ``lr`` between
optimizer steps. :class:`OptimizerSettings` multiplies it by :attr:`~OptimizerSettings.
lr_scale` only while ``optimizer.step()`` runs (a step pre-hook multiplies, a step post-hook
puts back what was there), so between steps every param group holds the schedule's own,
unscaled value: chainable schedulers that read it (``StepLR``, ``ExponentialLR``,
``CosineAnnealingLR``'s recursive form, ``ReduceLROnPlateau``) do not compound the scale,
closed-form ones (``LambdaLR``, HF's warmup schedules) are unaffected, and a checkpoint
taken between steps holds the schedule's values. A step under ``lr_scale = s`` is the step
of a run whose schedule was ``s`` times higher from then on.

Weight decay: the param groups that decay are those whose ``weight_decay`` is not 0 when
the settings are made (or the groups given as ``decay_groups``; with none decaying,
every group). A new value goes to those groups only, in the proportions they started
with (the first decaying group gets the value itself), so the groups a script keeps at
0 (biases, norms: nanoGPT's and Hugging Face's ``configure_optimizers`` split) stay at 0.

Clipping: with :attr:`~OptimizerSettings.max_grad_norm` > 0 the step pre-hook clips the
global norm of the gradients of the optimizer's parameters to it before the update. Under
a ``GradScaler`` that is after it unscaled them (``GradScaler.step`` unscales first) and
only when the step is taken (a step skipped for inf/NaN gradients runs no hook).

.. note:: Per optimizer step, with the default settings: two hook calls and a list of
   the param groups' ``lr`` (no device work; about a microsecond). A scale adds a
   multiply and a store per group; clipping adds ``clip_grad_norm_`` (asynchronous on the
   device; it returns the norm as a 0-dim device tensor, never read here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class OptimizerSettings:
    """``lr_scale``, ``weight_decay`` and ``max_grad_norm`` of one optimizer, live.

    Each is changeable between optimizer steps of one ``torch.optim.Optimizer`` (see the
    module docstring for how each applies).

    Args:
        optimizer: the optimizer; two step hooks are registered on it (:meth:`remove`
            takes them off).
        decay_groups: indices of the param groups that ``weight_decay`` sets; default:
            those whose ``weight_decay`` is not 0 now, else every group.

    Attributes:
        decay_groups: the indices ``weight_decay`` sets (see above).
        grad_norm: the global gradient norm before clipping in the last step that clipped
            (a 0-dim tensor on the device, not read), or None; :meth:`take_step` hands it
            over.

    Raises:
        ValueError: a ``decay_groups`` index the optimizer does not have.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *,
                 decay_groups: Sequence[int] | None = None) -> None:
        self.optimizer = optimizer
        groups = optimizer.param_groups
        #: weight_decay of each param group when the settings were made (None: it has none)
        self._decay_bases = [group.get("weight_decay") for group in groups]
        if decay_groups is None:
            decay_groups = [i for i, base in enumerate(self._decay_bases) if base]
            if not decay_groups:
                decay_groups = list(range(len(groups)))
        for index in decay_groups:
            if not 0 <= index < len(groups):
                raise ValueError(f"decay_groups: the optimizer has no param group {index} "
                                 f"(it has {len(groups)})")
        self.decay_groups = tuple(decay_groups)
        self._lr_scale = 1.0
        self._max_grad_norm = 0.0
        self._unscaled: list[tuple[dict[str, Any], Any]] | None = None
        self._step_lrs: tuple[Any, ...] | None = None
        self.grad_norm: torch.Tensor | None = None
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    # ------------------------------------------------------------ the settings

    @property
    def lr_scale(self) -> float:
        """The multiplier on every param group's learning rate inside the step.

        1.0: none. Set it between optimizer steps.

        Raises:
            ValueError (on set): not a finite number >= 0.
        """
        return self._lr_scale

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        self._lr_scale = _non_negative("lr_scale", value)

    def weight_decay_reason(self) -> str | None:
        """Why ``weight_decay`` cannot be set on this optimizer, or None."""
        if any(self._decay_bases[i] is None for i in self.decay_groups):
            return (f"{type(self.optimizer).__name__} has no weight_decay in its param "
                    "groups")
        return None

    @property
    def weight_decay(self) -> float:
        """The weight decay of the first decaying param group.

        The others keep their starting proportion to it; groups that started at 0 stay 0.
        Set it between optimizer steps.

        Raises:
            ValueError (on set): not a finite number >= 0, or an optimizer without
                ``weight_decay`` (:meth:`weight_decay_reason`).
        """
        return float(self.optimizer.param_groups[self.decay_groups[0]]["weight_decay"])

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        value = _non_negative("weight_decay", value)
        reason = self.weight_decay_reason()
        if reason is not None:
            raise ValueError(reason)
        reference = self._decay_bases[self.decay_groups[0]]
        groups = self.optimizer.param_groups
        for index in self.decay_groups:
            base = self._decay_bases[index]
            assert base is not None  # weight_decay_reason() said every decay group has one
            # the first group gets the value as given: 0.05 * 0.1 / 0.1 would read back
            # 0.05000000000000001 (and so would every record and reply)
            groups[index]["weight_decay"] = (value * base / reference if reference
                                             and base != reference else value)

    @property
    def decays_every_group(self) -> bool:
        """Whether ``weight_decay`` sets every param group.

        It does when none decayed at the start: nothing tells which groups are biases and
        norms."""
        return (len(self.decay_groups) == len(self._decay_bases)
                and not any(self._decay_bases))

    @property
    def max_grad_norm(self) -> float:
        """Clip the global gradient norm to this inside each step; 0: no clipping.

        Set it between optimizer steps.

        Raises:
            ValueError (on set): not a finite number >= 0.
        """
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._max_grad_norm = _non_negative("max_grad_norm", value)

    # ------------------------------------------------------------ per step

    def take_step(self) -> tuple[tuple[Any, ...] | None, torch.Tensor | None]:
        """``(lrs, grad_norm)`` of the optimizer step taken since the last call.

        The learning rate of each param group as the step used it, as the group held it (a
        float, or a tensor for a rate kept in one: read it with :func:`host_rate`, off the
        training thread), and the norm it clipped (else None). Both None when no step was
        taken (e.g. the GradScaler skipped it)."""
        taken = (self._step_lrs, self.grad_norm)
        self._step_lrs, self.grad_norm = None, None
        return taken

    def effective_lrs(self) -> tuple[Any, ...]:
        """Each param group's learning rate times :attr:`lr_scale`, as a step now uses it.

        Floats, or tensors as :meth:`take_step`'s."""
        scale = self._lr_scale
        return tuple(group["lr"] * scale if scale != 1.0 else group["lr"]
                     for group in self.optimizer.param_groups)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._unscaled is not None:  # the last step raised before its post-hook
            self._put_back()
        if self._max_grad_norm > 0:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None], self._max_grad_norm)
            if isinstance(self.grad_norm, DTensor):  # sharded parameters: every rank's
                self.grad_norm = self.grad_norm.full_tensor()  # norm is the global one
        scale = self._lr_scale
        if scale != 1.0:
            self._unscaled = [(group, group["lr"]) for group in optimizer.param_groups]
            for group, lr in self._unscaled:
                group["lr"] = lr * scale
        self._step_lrs = tuple([group["lr"] for group in optimizer.param_groups])

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._unscaled is not None:
            self._put_back()

    def _put_back(self) -> None:
        assert self._unscaled is not None  # both callers check first
        for group, lr in self._unscaled:
            group["lr"] = lr
        self._unscaled = None

    def remove(self) -> None:
        """Take the hooks off the optimizer (the learning rates are the schedule's)."""
        if self._unscaled is not None:
            self._put_back()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def host_rate(lr: Any) -> float | None:
    """A param group's learning rate as a float, or None.

    A number as it is, a CPU tensor's value; None for a tensor on a device (reading it would
    synchronize) or anything else."""
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None
