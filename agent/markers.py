"""Step markers: how the training thread hands a step's loss (and GPU time) to the I/O
thread without synchronizing the device.

On CPU the loss is already on the host: the marker is the detached tensor itself. On CUDA
the marker records a CUDA event after the step's kernels and starts a non-blocking copy of
the loss into a slot of a pinned host ring buffer; the I/O thread polls ``event.query()``
(never blocks) and reads the slot once the event has completed. When every slot is still
in flight (the I/O thread is far behind) the step's loss is dropped, never waited for.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuMarker:
    """Loss markers for a model on the host (or any non-CUDA device)."""

    def mark(self, loss: torch.Tensor | None) -> Any:
        """Training thread: return the marker of this step (the detached loss).

        .. note:: Does not copy or read the tensor's data."""
        return None if loss is None else loss.detach()

    def ready(self, marker: Any) -> bool:
        """I/O thread: whether the marker's values can be read without waiting."""
        return True

    def loss(self, marker: Any) -> float | None:
        """I/O thread: the loss as a float (None if it was not recorded)."""
        return None if marker is None else float(marker.float().mean())

    def gpu_time_s(self, previous: Any, marker: Any) -> float | None:
        """Device time between two markers; None on the host."""
        return None


class CudaMarker:
    """Loss and GPU step-time markers on CUDA: events plus a pinned ring of loss slots.

    Args:
        device: the CUDA device of the model.
        slots: ring size: how many steps may be in flight before losses are dropped.
    """

    def __init__(self, device: torch.device, slots: int = 256) -> None:
        self.device = device
        self._losses = torch.empty(slots, dtype=torch.float32, pin_memory=True)
        self._busy = [False] * slots
        self._next = 0

    def mark(self, loss: torch.Tensor | None) -> tuple[torch.cuda.Event, int]:
        """Training thread: record an event (and copy the loss) for this step.

        Returns:
            ``(event, slot)``; ``slot`` is -1 when no loss is kept for this step.

        .. note:: Never synchronizes: ``Event.record`` and a non-blocking device-to-pinned
           copy are both asynchronous.
        """
        slot = -1
        if loss is not None and not self._busy[self._next]:
            slot = self._next
            self._busy[slot] = True
            self._next = (slot + 1) % len(self._busy)
            self._losses[slot:slot + 1].copy_(loss.detach().float().reshape(1),
                                              non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, slot

    def ready(self, marker: tuple[torch.cuda.Event, int]) -> bool:
        """I/O thread: ``event.query()``; never blocks."""
        return marker[0].query()

    def loss(self, marker: tuple[torch.cuda.Event, int]) -> float | None:
        """I/O thread, after :meth:`ready`: read and free the loss slot."""
        slot = marker[1]
        if slot < 0:
            return None
        value = float(self._losses[slot])
        self._busy[slot] = False
        return value

    def gpu_time_s(self, previous: Any, marker: tuple[torch.cuda.Event, int]) -> float | None:
        """Seconds of device time between two completed markers (None for the first)."""
        if previous is None:
            return None
        return previous[0].elapsed_time(marker[0]) / 1000.0


def marker_for(device: torch.device | None) -> CpuMarker | CudaMarker:
    """The marker kind for a model on ``device``."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaMarker(torch.device(device))
    return CpuMarker()
