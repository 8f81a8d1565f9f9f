"""Measuring memory: a profiled step, cheap allocator readings, a cap, and snapshots.

* :func:`profile_memory` runs one forward (and backward) under ``torch.profiler`` and
  reports the peak and the operators that allocate most.
* :func:`memory_stats` reads the caching allocator's counters (CUDA) and the process's
  resident set (host): cheap, never synchronizes, fit for a 1 Hz sampler.
* :func:`set_memory_fraction` caps this process's share of a GPU's memory.
* :class:`MemorySnapshot` records the CUDA allocator's history for N optimizer steps and
  dumps a snapshot for https://pytorch.org/memory_viz.
* :class:`SavedActivations` counts the bytes autograd keeps for backward during a
  forward pass: the activation memory that checkpointing and lower precision reduce,
  measured the same way on every device.

Sources: PyTorch "Profiling your PyTorch Module" and ``torch.profiler`` documentation
(``profile_memory=True``), "CUDA semantics: memory management"
(``torch.cuda.memory_stats``, ``set_per_process_memory_fraction``) and
"Understanding CUDA Memory Usage" (``torch.cuda.memory._record_memory_history``,
``_dump_snapshot``; underscore-named but the documented way to take snapshots),
"Hooks for saved tensors" (``torch.autograd.graph.saved_tensors_hooks``).
"""

from __future__ import annotations

import enum
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = [
    "MemoryProfile",
    "MemorySnapshot",
    "OperatorMemory",
    "SavedActivations",
    "SnapshotState",
    "format_bytes",
    "host_rss_bytes",
    "memory_stats",
    "profile_memory",
    "set_memory_fraction",
]


def format_bytes(num_bytes: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units); None -> ``"n/a"``."""
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # unreachable; keeps type checkers content


def _cuda_reason(device: torch.device, what: str) -> str | None:
    """Why ``what`` cannot be done on ``device``, or None when it is a usable CUDA device."""
    if device.type != "cuda":
        return f"{what} needs CUDA; this run is on {device.type}"
    if not torch.cuda.is_available():
        return f"{what} needs CUDA, which is not available here"
    return None


# -- profile_memory ---------------------------------------------------------------------


@dataclass(frozen=True)
class OperatorMemory:
    """One operator's allocations in a :class:`MemoryProfile`.

    Attributes:
        name: the operator, e.g. ``"aten::addmm"``.
        self_memory_bytes: bytes it allocated minus bytes it freed, not counting the
            operators it called, summed over its calls (the profiler's "Self CPU Mem" /
            "Self CUDA Mem" column). Output tensors still alive count; temporaries do not.
        count: number of calls.
    """

    name: str
    self_memory_bytes: int
    count: int


@dataclass(frozen=True)
class MemoryProfile:
    """What :func:`profile_memory` measured.

    Attributes:
        device: where the model ran, e.g. ``"cpu"`` or ``"cuda:0"``.
        backward: whether a backward pass was included.
        peak_bytes: the most memory held by tensors allocated during the profiled call,
            above what was allocated when it began: activations kept for backward,
            gradients, temporaries. CUDA: ``torch.cuda.max_memory_allocated`` minus
            ``memory_allocated`` before the call (the caching allocator's reserved
            memory, what ``nvidia-smi`` shows, is larger). CPU: the running sum of the
            profiler's allocation and free records of torch's CPU allocator, at its
            highest (memory from Python objects or other libraries is not included).
        baseline_bytes: bytes allocated by torch when the call began (CUDA only; None
            on CPU, whose allocator keeps no count): parameters, optimizer state,
            anything else alive.
        top_operators: the operators with the largest ``self_memory_bytes``, largest
            first.
    """

    device: str
    backward: bool
    peak_bytes: int
    baseline_bytes: int | None
    top_operators: tuple[OperatorMemory, ...]

    def format(self) -> str:
        """A short report for people: the peak, then a table of the top operators."""
        what = "forward+backward" if self.backward else "forward"
        baseline = ("" if self.baseline_bytes is None
                    else f" (over {format_bytes(self.baseline_bytes)} already allocated)")
        lines = [f"Memory profile on {self.device}, one {what}: peak "
                 f"{format_bytes(self.peak_bytes)}{baseline}"]
        if self.top_operators:
            width = max(len("operator"), *(len(op.name) for op in self.top_operators))
            lines.append(f"  {'operator':<{width}}  {'self memory':>12}  {'calls':>6}")
            for op in self.top_operators:
                lines.append(f"  {op.name:<{width}}  {format_bytes(op.self_memory_bytes):>12}"
                             f"  {op.count:>6}")
        return "\n".join(lines)


def profile_memory(
    model: nn.Module,
    sample_input: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    top: int = 10,
) -> MemoryProfile:
    """Profile the memory of one ``model(sample_input)``, and its backward if asked.

    Runs under ``torch.profiler.profile(profile_memory=True, record_shapes=True)``, with
    the model in its current mode (train/eval) and autocast state (call it inside the
    autocast context to profile a mixed-precision step). The run leaves no trace: each
    parameter's ``.grad`` is set aside and put back, buffers (BatchNorm running
    statistics) are restored, and the RNG state is forked, so it may be called in the
    middle of training, between optimizer steps.

    Args:
        model: the module, on its device.
        sample_input: passed as ``model(sample_input)``, already on the model's device
            (a tensor, or whatever the model takes as its one argument).
        loss_fn: if given, ``loss_fn(output, target)`` must return a scalar tensor, and
            its backward is profiled too.
        target: the second argument of ``loss_fn``.
        top: how many operators to list (>= 0).

    Returns:
        A :class:`MemoryProfile`.

    Raises:
        ValueError: ``top`` is negative.

    .. note:: Cost: one forward (and backward) with the profiler on, several times
       slower than a plain step, plus a copy of the buffers. On CUDA it synchronizes
       the device before and after, and resets the device's peak-memory counters
       (``torch.cuda.reset_peak_memory_stats``): a ``mem_peak_*`` reading afterwards
       covers only the time since.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an integer >= 0, got {top!r}")
    device = _device_of(model, sample_input)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    params = [p for p in model.parameters()]
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if cuda else []
    baseline = None
    try:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=rng_devices):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                baseline = torch.cuda.memory_allocated(device)
            with torch.profiler.profile(activities=activities, profile_memory=True,
                                        record_shapes=True) as prof:
                output = model(sample_input)
                if loss_fn is not None:
                    loss_fn(output, target).backward()
                del output
            if cuda:
                torch.cuda.synchronize(device)
                assert baseline is not None  # read above, on CUDA
                peak = torch.cuda.max_memory_allocated(device) - baseline
            else:
                peak = _cpu_peak_from_profile(prof)
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        with torch.no_grad():
            for buffer, saved in saved_buffers:
                buffer.copy_(saved)
    averages = prof.key_averages()
    usage = (lambda a: a.self_device_memory_usage) if cuda else (lambda a: a.self_cpu_memory_usage)
    ranked = sorted((a for a in averages if usage(a) > 0), key=usage, reverse=True)[:top]
    operators = tuple(OperatorMemory(a.key, int(usage(a)), int(a.count)) for a in ranked)
    return MemoryProfile(str(device), loss_fn is not None, int(peak), baseline, operators)


def _device_of(model: nn.Module, sample_input: Any) -> torch.device:
    first = next(model.parameters(), None)
    if first is not None:
        return first.device
    if isinstance(sample_input, torch.Tensor):
        return sample_input.device
    return torch.device("cpu")


def _cpu_peak_from_profile(prof: torch.profiler.profile) -> int:
    """Highest running sum of the CPU allocation (+) and free (-) records, in time order.

    Reads the profiler's raw event list (``prof.profiler.kineto_results``), the same
    records ``key_averages`` is built from; if a torch version lacks it, falls back to
    the sum of the positive per-operator self memory (an upper bound of the peak).
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    records = [e for e in results.events() if e.name() == "[memory]"
               and e.device_type() == torch.autograd.DeviceType.CPU]
    records.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for record in records:
        current += record.nbytes()
        peak = max(peak, current)
    return peak


# -- memory_stats and set_memory_fraction ----------------------------------------------


def memory_stats(device: torch.device | str | int | None = None) -> dict[str, int | None]:
    """Current memory readings for a ``step`` or ``system`` message.

    Always the host side: ``host_rss_bytes`` (resident set of this process now) and
    ``host_peak_rss_bytes`` (its highest since start, ``getrusage().ru_maxrss``, never
    below the RSS read with it; None where unavailable). For a CUDA device also, from
    the caching allocator (``torch.cuda.memory_stats``): ``mem_allocated_bytes`` (held by tensors),
    ``mem_reserved_bytes`` (held by the allocator, what the driver sees),
    ``mem_peak_allocated_bytes``, ``mem_peak_reserved_bytes`` (since start or the last
    ``reset_peak_memory_stats``), ``num_alloc_retries`` (allocations that had to free
    cached blocks and retry: a sign of fragmentation or of running near the limit) and
    ``num_ooms`` (out-of-memory errors raised). Before CUDA is initialized they are 0.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an index or a ``torch.device``;
            None means CPU.

    Raises:
        ValueError: a CUDA device while CUDA is not available.

    .. note:: Cheap (tens of microseconds) and never synchronizes the device: the
       allocator's counters live on the host. Safe from any thread.
    """
    device = _as_device(device)
    rss, peak = host_rss_bytes(), _host_peak_rss_bytes()
    if rss is not None and peak is not None and peak < rss:
        # (the kernel's high-water mark lags its per-thread RSS counters by up to 64
        # pages: 262,144 bytes below the RSS read a moment before was seen)
        peak = rss
    stats: dict[str, int | None] = {"host_rss_bytes": rss, "host_peak_rss_bytes": peak}
    if device.type == "cuda":
        reason = _cuda_reason(device, "reading CUDA memory statistics")
        if reason is not None:
            raise ValueError(reason)
        raw = torch.cuda.memory_stats(device)
        stats.update({
            "mem_allocated_bytes": raw.get("allocated_bytes.all.current", 0),
            "mem_reserved_bytes": raw.get("reserved_bytes.all.current", 0),
            "mem_peak_allocated_bytes": raw.get("allocated_bytes.all.peak", 0),
            "mem_peak_reserved_bytes": raw.get("reserved_bytes.all.peak", 0),
            "num_alloc_retries": raw.get("num_alloc_retries", 0),
            "num_ooms": raw.get("num_ooms", 0),
        })
    return stats


#: The host: what ``None`` means (a torch.device is immutable: one serves every reading).
_CPU = torch.device("cpu")


def _as_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch.device; no torch call for None or a torch.device (a reading
    of each ``steps`` batch comes here: made anew, one cost 20 to 50 us between batches)."""
    if device is None:
        return _CPU
    if type(device) is torch.device:
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


#: (pid, descriptor) of this process's /proc/self/statm, kept open: one ``pread`` a
#: reading instead of open, read and close (each a system call that lets another thread
#: take the GIL). Opened again in a forked child (/proc/self was resolved at open).
_statm: tuple[int, int] | None = None
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_bytes() -> int | None:
    """Resident set size of this process now, in bytes; None where it cannot be read.

    On Linux one ``pread`` of ``/proc/self/statm``, kept open; elsewhere psutil's reading.
    Safe from any thread; never raises."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 -- a reading, never an error
        return None


def _host_peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux/BSD: KiB


def set_memory_fraction(fraction: float, device: torch.device | str | int | None = None) -> None:
    """Cap this process's CUDA caching allocator at ``fraction`` of the device's memory.

    An allocation that would go over raises ``torch.OutOfMemoryError`` as if the GPU
    were that small (after freeing cached blocks): a way to rehearse a smaller GPU, or
    to share one between processes. ``torch.cuda.set_per_process_memory_fraction``.

    Args:
        fraction: in ``(0, 1]``.
        device: the CUDA device; None means CPU and is refused.

    Raises:
        ValueError: ``fraction`` is not a number in ``(0, 1]``, or ``device`` is not a
            usable CUDA device (the message says why: "a per-process memory fraction
            needs CUDA; this run is on cpu").
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or math.isnan(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be a number in (0, 1], got {fraction!r}")
    device = _as_device(device)
    reason = _cuda_reason(device, "a per-process memory fraction")
    if reason is not None:
        raise ValueError(reason)
    torch.cuda.set_per_process_memory_fraction(float(fraction), device)


# -- MemorySnapshot ---------------------------------------------------------------------


class SnapshotState(enum.Enum):
    """States of :class:`MemorySnapshot`."""

    IDLE = "idle"
    RECORDING = "recording"


class MemorySnapshot:
    """Records the CUDA allocator's history for a number of optimizer steps, then dumps it.

    A small state machine the training loop ticks at each optimizer step::

        snapshot = MemorySnapshot("cuda")
        snapshot.start(3, "/tmp/step.pickle")     # IDLE -> RECORDING
        ...
        path = snapshot.on_optimizer_step()       # None, None, then the path: -> IDLE

    The file is a pickle for https://pytorch.org/memory_viz (drag and drop): every
    allocation and free with its Python and C++ stack, and the segments at the end.

    Args:
        device: the CUDA device (history recording itself is process-wide).
        max_entries: how many allocation events to keep (the oldest are dropped).

    Raises:
        ValueError: ``device`` is not a usable CUDA device ("a CUDA memory snapshot
            needs CUDA; this run is on cpu"), or ``max_entries < 1``.

    .. note:: Cost while recording: a stack capture per allocation and free (a few
       microseconds each; more with many small tensors) and up to ``max_entries``
       records in host memory (about 1 KB each with stacks). Dumping pickles them on
       the training thread (tens of milliseconds to seconds). Off, it costs nothing.
    """

    def __init__(self, device: torch.device | str | int | None = None, *,
                 max_entries: int = 100_000) -> None:
        self.device = _as_device(device)
        reason = _cuda_reason(self.device, "a CUDA memory snapshot")
        if reason is not None:
            raise ValueError(reason)
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self.state = SnapshotState.IDLE
        self.steps_left = 0
        self.path: str | None = None

    @property
    def recording(self) -> bool:
        """Whether the history is being recorded."""
        return self.state is SnapshotState.RECORDING

    def start(self, steps: int, path: str | os.PathLike[str]) -> None:
        """Start recording now; dump to ``path`` after ``steps`` optimizer steps.

        Raises:
            ValueError: ``steps < 1``, the directory of ``path`` does not exist, or a
                recording is already running.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"cannot write a snapshot to {path!r}: no directory {directory!r}")
        if self.recording:
            raise ValueError(f"a memory snapshot is already recording ({self.steps_left} "
                             f"steps left, to {self.path!r})")
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=self.max_entries)
        self.state = SnapshotState.RECORDING
        self.steps_left = steps
        self.path = path

    def on_optimizer_step(self) -> str | None:
        """Count one optimizer step; at the last one dump, stop and return the path.

        None otherwise (and always when idle)."""
        if not self.recording:
            return None
        self.steps_left -= 1
        if self.steps_left > 0:
            return None
        return self.stop()

    def stop(self, *, dump: bool = True) -> str | None:
        """Stop recording now; dump first unless ``dump=False``.

        Returns the path written, or None (idle, or not dumped)."""
        if not self.recording:
            return None
        path = self.path
        try:
            if dump:
                torch.cuda.memory._dump_snapshot(path)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.state = SnapshotState.IDLE
            self.steps_left = 0
        return path if dump else None


# -- SavedActivations -------------------------------------------------------------------


class SavedActivations:
    """Bytes of the tensors autograd saves for backward while the context is open.

    Usage::

        with SavedActivations(model) as saved:
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        saved.bytes  # e.g. 18_338_816 for the demo transformer, 2_544_128 checkpointed

    It installs a ``torch.autograd.graph.saved_tensors_hooks`` pair whose pack hook
    notes each saved tensor's storage and hands the tensor back unchanged, so training
    is not altered. The result counts each storage once (a view and its base, or a
    tensor saved by two operators, count once, at the storage's full size) and leaves
    out the storages of ``model``'s parameters and buffers, which live anyway. What
    remains is the activation memory the graph holds until backward frees it, including
    autocast's low-precision weight copies.

    Activation checkpointing shows as it works: ``torch.utils.checkpoint``
    (``use_reentrant=False``) saves each checkpointed block's inputs outside its own
    hooks (counted here) and stores placeholders for the block's inner activations under
    its inner hooks (not counted: only the innermost hook pair applies). Tensors saved
    inside a ``torch.compile``-d region are those the compiled graph keeps for its
    backward, which is what it holds.

    Args:
        model: whose parameters and buffers are not counted; None counts everything.

    Attributes:
        bytes: total bytes of the distinct storages saved so far (int; 0 before use).
        saved_tensors: how many times a tensor was saved (pack hook calls).

    Autograd's own check that a saved tensor was not modified in place before backward
    (which it skips for hooked tensors) is made by the unpack hook, with the same error.
    Only the innermost hook pair applies, so under hooks of your own (e.g.
    ``save_on_cpu``) opening this one would set yours aside: check
    :meth:`blocked_reason` first.

    .. note:: Costs the thread one Python call per saved tensor (about a microsecond;
       the demo transformer saves 61 a forward), so a training loop opens it for one
       micro-batch now and then, not always. Reads only host metadata (storage pointer
       and size, version counter): never synchronizes the device, never copies a tensor.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.bytes = 0
        self.saved_tensors = 0
        self._seen: set[int] = set()
        if model is not None:
            for tensor in (*model.parameters(), *model.buffers()):
                self._seen.add(_storage_key(tensor))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @staticmethod
    def blocked_reason() -> str | None:
        """Why this thread should not open a :class:`SavedActivations` now, or None.

        Saved-tensor hooks of someone else's are active (they would be set aside), or
        saved-tensor hooks are disabled here."""
        graph = torch._C._autograd
        try:
            # a private probe torch's stubs leave out; a torch without it raises the
            # AttributeError handled below
            if not graph._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
                return "saved-tensor hooks are disabled here"
            if graph._top_saved_tensors_default_hooks(False) is not None:
                return "other saved-tensor hooks are active"
        except AttributeError:  # a torch without these probes: nothing to go by
            return None
        return None

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.saved_tensors += 1
        key = _storage_key(tensor)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += _storage_nbytes(tensor)
        return tensor, tensor._version

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)


def _unpack(saved: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The saved tensor, after autograd's in-place check (skipped for hooked tensors)."""
    tensor, version = saved
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by "
            f"an inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead (checked by "
            "gpuopt.memory.SavedActivations for autograd)")
    return tensor


def _storage_key(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage; ``id(tensor)`` for tensors without one
    (sparse, nested, tensor subclasses without storage)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return tensor.numel() * tensor.element_size()
