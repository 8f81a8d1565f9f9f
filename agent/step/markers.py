"""Step markers: how the training thread hands a step's loss to the I/O thread without a sync.

The loss (and GPU time), handed over without synchronizing the device.

On the host the marker is the loss itself (or a tuple with the skipped flag and the
gradient norm): the training thread touches no torch code to mark a step, since each
touch costs 3 to 8 us of CPU between real steps (a cold cache: ``.item()`` 3.8,
``.detach()`` 8.2, ``is_cpu`` with ``dim()`` 2.9, session 14's
``benchmarks/bench_overhead.py`` paced loop). The agent's hot path (in C) reads a 0-dim
float32 or float64 loss and gradient norm from the tensor's memory as it marks
(:func:`gpuopt._hotpath.host_items`' read: a few loads, no call), so the marker holds
numbers and the loss's autograd graph goes when the loop lets go of it. Any other host
tensor (another dtype, a subclass, a device other than CUDA's) is the marker as it is, and
the I/O thread reads a batch of them at once; its record holds the loss, with its
autograd graph, until then (a publish interval, at most half a second). When the I/O
thread falls behind (:data:`agent.step.core.LOSSES_HELD_MAX` records queued) the agent
marks those with :meth:`CpuMarker.mark_read`, which reads the loss at once: the graphs
kept are bounded in number.

On CUDA the marker records a CUDA event after the step's kernels and starts a
non-blocking copy of the loss into a slot of a pinned host ring buffer; the I/O thread
polls ``event.query()`` (never blocks) and reads the slot once the event has completed.
When every slot is still in flight (the I/O thread is far behind) the step's loss is
dropped, never waited for.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.step._hot import host_mark

_Tensor = torch.Tensor
#: A CUDA step marker: ``(event, slot, source)`` (:meth:`CudaMarker.mark`).
CudaMark = tuple[torch.cuda.Event, int, torch.Tensor | None]


class CpuMarker:
    """Step markers for a model on the host (or any non-CUDA device)."""

    #: Training thread: ``mark(loss, skipped=None, grad_norm=None)``, the marker of this
    #: step: the loss itself, or ``(loss, skipped, grad_norm)`` (see
    #: :func:`agent.step._hot.host_mark`, in C; no torch call, nothing read). The agent's
    #: hot path makes it without a call, with a float32 or float64 loss and norm read
    #: from memory first.
    mark = staticmethod(host_mark)

    def mark_read(self, loss: torch.Tensor | None, skipped: torch.Tensor | None = None,
                  grad_norm: torch.Tensor | float | None = None) -> Any:
        """Training thread: :meth:`mark`, the loss read now (:func:`host_loss`).

        What the agent marks with while the I/O thread is behind: the marker then holds a
        number, not the tensor with its autograd graph.

        .. note:: One ``.item()`` of a host tensor: 3 to 4 us between real steps."""
        return self.mark(host_loss(loss), skipped, grad_norm)

    def ready(self, marker: Any) -> bool:
        """I/O thread: whether the marker's values can be read without waiting."""
        return True

    def loss(self, marker: Any) -> float | None:
        """I/O thread: the loss as a float (None if it was not recorded)."""
        return host_loss(marker[0] if type(marker) is tuple else marker)

    def skipped(self, marker: Any) -> bool | None:
        """I/O thread: whether the GradScaler skipped the step (None outside fp16)."""
        flag = marker[1] if type(marker) is tuple else None
        return None if flag is None else bool(flag)

    def grad_norm(self, marker: Any) -> float | None:
        """I/O thread: the step's gradient norm (None if it was not given)."""
        norm = marker[2] if type(marker) is tuple else None
        return None if norm is None else float(norm)

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
        # columns: loss, skipped flag, gradient norm (NaN when not recorded)
        self._values = torch.empty(slots, 3, dtype=torch.float32, pin_memory=True)
        self._busy = [False] * slots
        self._next = 0

    def mark(self, loss: torch.Tensor | None, skipped: torch.Tensor | None = None,
             grad_norm: torch.Tensor | float | None = None) -> CudaMark:
        """Training thread: record an event for this step, and copy its loss, skipped flag and norm.

        The loss, the skipped flag and the gradient norm.

        Returns:
            ``(event, slot, source)``; ``slot`` is -1 when no values are kept for this
            step; ``source``: the loss detached (no autograd graph), which the copy
            reads, kept until the marker is dropped once ready (the step's record lets
            go of the loss as it is marked: its memory, on whatever stream made it, is
            not reused before the copy has run), or None.

        .. note:: Never synchronizes: ``Event.record`` and non-blocking device-to-pinned
           copies are all asynchronous.
        """
        slot = -1
        source = None
        if loss is not None and not self._busy[self._next]:
            slot = self._next
            self._busy[slot] = True
            self._next = (slot + 1) % len(self._busy)
            row = self._values[slot]
            source = loss.detach()
            row[0:1].copy_(source.float().reshape(1), non_blocking=True)
            if skipped is None:
                row[1] = float("nan")
            else:
                row[1:2].copy_(skipped.float().reshape(1), non_blocking=True)
            if isinstance(grad_norm, torch.Tensor):
                row[2:3].copy_(grad_norm.detach().float().reshape(1), non_blocking=True)
            else:
                row[2] = float("nan") if grad_norm is None else float(grad_norm)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, slot, source

    #: the marker holds no autograd graph (the copy reads the loss detached)
    mark_read = mark

    def ready(self, marker: CudaMark) -> bool:
        """I/O thread: ``event.query()``; never blocks."""
        return marker[0].query()

    def loss(self, marker: CudaMark) -> float | None:
        """I/O thread, after :meth:`ready`: the loss (None if not recorded)."""
        slot = marker[1]
        return None if slot < 0 else float(self._values[slot, 0])

    def grad_norm(self, marker: CudaMark) -> float | None:
        """I/O thread, after :meth:`ready`: the gradient norm (None if not recorded).

        Call it before :meth:`skipped`, which frees the slot."""
        slot = marker[1]
        if slot < 0:
            return None
        norm = float(self._values[slot, 2])
        return None if norm != norm else norm

    def skipped(self, marker: CudaMark) -> bool | None:
        """I/O thread, after :meth:`ready`: the skipped flag; frees the slot.

        Call it after :meth:`loss` and :meth:`grad_norm`."""
        slot = marker[1]
        if slot < 0:
            return None
        flag = float(self._values[slot, 1])
        self._busy[slot] = False
        return None if flag != flag else flag > 0.5

    def gpu_time_s(self, previous: Any, marker: CudaMark) -> float | None:
        """Seconds of device time between two completed markers (None for the first)."""
        if previous is None:
            return None
        return previous[0].elapsed_time(marker[0]) / 1000.0


def host_loss(loss: Any) -> Any:
    """The loss a host marker holds (:meth:`CpuMarker.mark`), as a number.

    One read already (a float, or an int of an integer loss) as it is, a one-element
    tensor's value (``item()``), a larger one's mean in float32; None for None; any other
    number (a NumPy scalar or 0-dim array) as ``float()`` reads it.

    Raises:
        Exception: what reading it raises (a meta tensor's ``item()``; ``float()`` of a
            value that is not a number: TypeError, ValueError).
    """
    if type(loss) is float or type(loss) is int or loss is None:
        return loss
    if not isinstance(loss, _Tensor):
        return float(loss)
    return loss.item() if loss.numel() == 1 else float(loss.float().mean())


def marker_for(device: torch.device | None) -> CpuMarker | CudaMarker:
    """The marker kind for a model on ``device``."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaMarker(torch.device(device))
    return CpuMarker()
