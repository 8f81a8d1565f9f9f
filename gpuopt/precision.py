"""Mixed precision: autocast to bf16 or fp16, with a GradScaler for fp16, switchable live.

Source: PyTorch "Automatic Mixed Precision" (torch.amp, https://pytorch.org/docs/stable/amp.html)
and Micikevicius et al., "Mixed Precision Training" (ICLR 2018) for loss scaling.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


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


def precision_warning(precision: str, device_type: str) -> str | None:
    """A performance warning for a precision that runs but is slow here, or None.

    On most CPUs fp16 autocast runs many times slower than fp32 (13-21x measured on a
    2-core x86 CPU without AVX512-FP16), because matmuls fall back to slow paths.
    """
    if precision == "fp16" and device_type == "cpu":
        return ("fp16 autocast on CPU is typically 10-20x slower than fp32 "
                "(no native fp16 matmul); prefer bf16 on CPU")
    return None


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

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Context for the forward pass (and loss) of one micro-batch."""
        if self._precision == "fp32":
            yield
            return
        with torch.autocast(self.device_type, dtype=_AUTOCAST_DTYPE[self._precision]):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already window-divided) loss; scaled in fp16."""
        if self._precision == "fp16":
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place before clipping (fp16 only; otherwise a no-op)."""
        if self._precision == "fp16":
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The optimizer step; in fp16 through the GradScaler (which skips the step on
        inf/NaN gradients and backs off its scale).

        Returns:
            In fp16, a 0-dim bool tensor on the device, True when the GradScaler skipped
            this step (its scale went down: ``update()`` backs off exactly when it found
            inf/NaN gradients); None in fp32 and bf16. It is not read here: reading it
            would synchronize the device.

        .. note:: In fp16 the GradScaler's inf check synchronizes the device once per
           optimizer step (inherent to ``GradScaler.step``); bf16 and fp32 do not.
        """
        if self._precision != "fp16":
            optimizer.step()
            return None
        self.scaler.step(optimizer)
        scale_before = self.scaler._scale.clone()  # torch.amp has no public tensor form
        self.scaler.update()
        return self.scaler._scale < scale_before
