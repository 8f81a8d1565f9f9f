"""Mixed precision: autocast to bf16 or fp16, with a GradScaler for fp16, switchable live.

Source: PyTorch "Automatic Mixed Precision" (torch.amp, https://pytorch.org/docs/stable/amp.html)
and Micikevicius et al., "Mixed Precision Training" (ICLR 2018) for loss scaling.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, overload

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


_PRECISION_NAMES: dict[str | torch.dtype, str] = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@overload
def precision_name(value: str) -> str: ...
@overload
def precision_name(value: torch.dtype) -> str | torch.dtype: ...
def precision_name(value: str | torch.dtype) -> str | torch.dtype:
    """The precision name (``"fp32"``, ``"bf16"``, ``"fp16"``) of ``value``.

    ``value`` is such a name, a torch dtype (``torch.bfloat16``) or a dtype's name
    (``"bfloat16"``, as nanoGPT's ``dtype``). Anything else is returned unchanged (for the
    caller to refuse)."""
    return _PRECISION_NAMES.get(value, value)


def precision_support(precision: str, device_type: str) -> str | None:
    """Why ``precision`` cannot run on ``device_type``, or None when it can.

    Args:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device_type: ``"cuda"``, ``"cpu"``, ... (``torch.device.type``).

    .. note:: Cheap and never synchronizes the device (asks the CUDA driver for the
       device's capability once, on CUDA only).
    """
    if precision not in PRECISIONS:
        return f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})"
    if precision == "fp32":
        return None
    if device_type == "cuda":
        if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name()
            return f"{name} has no native bf16 (compute capability 8.0+ needed)"
        return None
    if device_type == "cpu":
        return None  # torch supports both on CPU autocast; fp16 is slow, see precision_warning
    if device_type == "mps" and precision == "bf16":
        return "bf16 autocast is not supported on MPS by this torch build"
    if not torch.amp.is_autocast_available(device_type):
        return f"autocast is not available on {device_type}"
    return None


@functools.cache
def cpu_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX tiles).

    Only then can bf16 autocast be faster than fp32. Without them CPU autocast emulates
    bf16, which made a small transformer 10-19x slower than fp32 on a 2-core x86 CPU.

    .. note:: Asked once (cached); reads CPU flags through torch, no device work.
    """
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(bool(check()) for check in checks if check is not None)


def precision_warning(precision: str, device_type: str) -> str | None:
    """A warning for a precision that runs but is slow on this hardware, or None.

    True to the machine: on a CPU, bf16 is advised only when the CPU has native bf16
    (:func:`cpu_native_bf16`).

    On most CPUs fp16 autocast runs many times slower than fp32 (13-21x measured on a
    2-core x86 CPU without AVX512-FP16), because matmuls fall back to slow paths; bf16
    without AVX512-BF16 or AMX is emulated (10-19x slower on a small transformer).
    """
    if device_type != "cpu" or precision == "fp32":
        return None
    native_bf16 = cpu_native_bf16()
    if precision == "fp16":
        return ("fp16 autocast on CPU is typically 10-20x slower than fp32 (no native fp16 "
                "matmul); " + ("prefer bf16 on this CPU (it has native bf16)" if native_bf16
                              else "this CPU has no native bf16 either (no AVX512-BF16/AMX): "
                                   "prefer fp32"))
    if not native_bf16:
        return ("bf16 autocast on this CPU is emulated (no AVX512-BF16 or AMX) and typically "
                "several times slower than fp32: prefer fp32 here")
    return None


class ReusableAutocast:
    """A reusable, re-entrant autocast context that follows a live precision.

    Each ``with`` enters the context that ``make_context()`` gives at that moment (None:
    nothing, as in fp32), so one stored object (a hand-written loop's ``ctx``) follows a
    live precision, in evaluation code too, and may be nested.

    Args:
        make_context: returns a fresh context manager (e.g. ``torch.autocast(...)``) or
            None; called at each entry.
    """

    def __init__(self, make_context: Callable[[], Any]) -> None:
        self._make_context = make_context
        self._active: list[Any] = []

    def __enter__(self) -> None:
        context = self._make_context()
        if context is not None:
            context.__enter__()
        self._active.append(context)

    def __exit__(self, *exc_info: Any) -> None:
        context = self._active.pop()
        if context is not None:
            context.__exit__(*exc_info)

    def __call__(self) -> "ReusableAutocast":
        return self  # ``with mp.autocast():`` and ``with ctx:`` alike


class SwitchableGradScaler:
    """A ``torch.amp.GradScaler`` lookalike that follows a live precision.

    It follows a :class:`MixedPrecision`'s precision: in fp16 every call goes to the
    policy's one kept GradScaler (its scale and growth tracker survive switches); in fp32
    and bf16 it behaves as a disabled GradScaler (``scale`` returns the loss, ``step`` calls
    ``optimizer.step()``, ``update`` does nothing). A hand-written loop replaces ``scaler =
    torch.amp.GradScaler(...)`` with it and keeps its ``scaler.scale(loss).backward()``,
    ``scaler.unscale_``, ``scaler.step``, ``scaler.update`` lines.

    It also keeps, for the agent: :attr:`skipped` (fp16: a 0-dim bool tensor, True when
    the last ``update()`` backed off because the step found inf/NaN gradients; else
    None) and :attr:`loss_sum` (the sum of the detached losses passed to :meth:`scale`
    since :meth:`take_window`, on the device: the window's mean loss when each
    micro-batch loss was divided by the window size). :attr:`before_backward`, when set,
    is called with the window's micro-batch count so far (1 for the first) each time
    :meth:`scale` is (the loop's next call is that micro-batch's ``backward()``): a
    sharded run turns its gradient reduction on for the window's last one only.

    .. note:: Adds one asynchronous device add per micro-batch (the loss sum) and, in
       fp16, a clone of the scale per step; never synchronizes the device itself (the
       GradScaler's own inf check in ``step`` does, as without gpuwatch).
    """

    def __init__(self, policy: "MixedPrecision") -> None:
        self._policy = policy
        self._scale_before: torch.Tensor | None = None
        self.skipped: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None
        self.micro_batches = 0
        self.before_backward: Callable[[int], None] | None = None

    def _active(self) -> torch.amp.GradScaler | None:
        return self._policy.scaler if self._policy.precision == "fp16" else None

    def is_enabled(self) -> bool:
        """True in fp16."""
        return self._active() is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale in fp16; ``loss`` itself otherwise."""
        detached = loss.detach()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.micro_batches += 1
        if self.before_backward is not None:
            self.before_backward(self.micro_batches)
        scaler = self._active()
        return loss if scaler is None else scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients in place (fp16 only)."""
        scaler = self._active()
        if scaler is not None:
            scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``, through the GradScaler in fp16 (skipped on inf/NaN)."""
        scaler = self._active()
        if scaler is None:
            self._scale_before = None
            return optimizer.step(*args, **kwargs)
        scale = scaler._scale  # torch.amp has no public tensor form
        # as GradScaler.step's own check (None until the first scale())
        assert scale is not None, "scaler.step() before scaler.scale(loss)"
        self._scale_before = scale.clone()
        return scaler.step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """The GradScaler's scale update (fp16 only); sets :attr:`skipped`."""
        scaler = self._active()
        if scaler is None or self._scale_before is None:
            self.skipped = None
            return
        scaler.update(new_scale)
        assert scaler._scale is not None  # update() of a scaler that stepped keeps a scale
        self.skipped = scaler._scale < self._scale_before
        self._scale_before = None

    def get_scale(self) -> float:
        """The current loss scale (1.0 outside fp16).

        Synchronizes the device, as GradScaler's does."""
        scaler = self._active()
        return 1.0 if scaler is None else scaler.get_scale()

    def take_window(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """``(loss_sum, skipped, micro_batches)`` of the window that just ended.

        The next window starts afresh."""
        window = (self.loss_sum, self.skipped, self.micro_batches)
        self.loss_sum, self.skipped, self.micro_batches = None, None, 0
        return window

    def state_dict(self) -> dict[str, Any]:
        """The kept GradScaler's state (empty before fp16 was first used)."""
        return {} if self._policy.scaler is None else self._policy.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a GradScaler state saved by :meth:`state_dict` (creates the scaler)."""
        if state:
            if self._policy.scaler is None:
                self._policy.scaler = torch.amp.GradScaler(self._policy.device_type)
            self._policy.scaler.load_state_dict(state)


class MixedPrecision:
    """The precision policy of a training loop: autocast context, backward, optimizer step.

    fp32 runs without autocast; bf16 runs under ``torch.autocast(dtype=torch.bfloat16)``
    with no loss scaling; fp16 runs under ``torch.autocast(dtype=torch.float16)`` with a
    :class:`torch.amp.GradScaler`, created on first entry into fp16 and kept (with its
    scale and growth tracker) when leaving fp16, so a return to fp16 resumes from it.

    Changing :attr:`precision` is only valid between optimizer steps (the trainer does
    this at the optimizer-step boundary); mid-window it would mix scaled and unscaled
    gradients.

    Args:
        device_type: ``torch.device.type`` of the model (``"cpu"``, ``"cuda"``).
        precision: initial precision.

    Raises:
        ValueError: ``precision`` unknown or unsupported on ``device_type`` (the message
            gives the reason).
    """

    def __init__(self, device_type: str, precision: str = "fp32") -> None:
        self.device_type = device_type
        self.scaler: torch.amp.GradScaler | None = None
        self._precision = "fp32"
        self.precision = precision
        self._autocast = ReusableAutocast(self._autocast_context)
        #: The GradScaler lookalike for loops that call ``scaler.scale(loss).backward()``
        #: themselves (:class:`SwitchableGradScaler`).
        self.grad_scaler = SwitchableGradScaler(self)

    @property
    def precision(self) -> str:
        """Current precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        reason = precision_support(value, self.device_type)
        if reason is not None:
            raise ValueError(reason)
        if value == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type)
        self._precision = value

    def _autocast_context(self) -> Any:
        if self._precision == "fp32":
            return None
        return torch.autocast(self.device_type, dtype=_AUTOCAST_DTYPE[self._precision])

    def autocast(self) -> ReusableAutocast:
        """Context for the forward pass (and loss) of one micro-batch.

        Autocast to the current precision (nothing in fp32). The same reusable object each
        time, so ``ctx = mp.autocast()`` may be stored and entered again and again (also
        nested, and in evaluation code), always following the precision current at entry."""
        return self._autocast

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already window-divided) loss; scaled in fp16."""
        if self._precision == "fp16":
            assert self.scaler is not None  # made when the precision was set to fp16
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place before clipping (fp16 only; otherwise a no-op)."""
        if self._precision == "fp16":
            assert self.scaler is not None  # made when the precision was set to fp16
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The optimizer step; in fp16 through the GradScaler.

        The GradScaler skips the step on inf/NaN gradients and backs off its scale.

        Returns:
            In fp16, a 0-dim bool tensor on the device, True when the GradScaler skipped
            this step (its scale went down: ``update()`` backs off exactly when it found
            inf/NaN gradients); None in fp32 and bf16. It is not read here: reading it
            would synchronize the device.

        .. note:: In fp16 the GradScaler's inf check synchronizes the device once per
           optimizer step (inherent to ``GradScaler.step``); bf16 and fp32 do not.
        """
        self.grad_scaler.step(optimizer)
        self.grad_scaler.update()
        return self.grad_scaler.skipped
