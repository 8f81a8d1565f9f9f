"""System probes run on the agent's I/O thread at about 1 Hz: host (psutil) and GPUs (NVML).

Never called on the training thread: psutil and NVML calls cost tens of microseconds to
milliseconds each.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psutil

from gpuopt.memory import host_rss_bytes


class Nvml:
    """A lazy NVML wrapper that turns "no driver" into a clean "not available" answer.

    NVML is initialised once, on the first :meth:`sample`; if that fails (no NVIDIA
    driver, no GPU, nvidia-ml-py absent) :attr:`status` holds the reason and every
    later sample returns ``[]`` without trying again.

    Args:
        module: the NVML binding (``pynvml`` from nvidia-ml-py by default); tests pass a
            fake one, since there is no GPU on CI machines.
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module
        self._handles: list[Any] | None = None
        self.status: str | None = None

    def _init(self) -> None:
        try:
            if self._module is None:
                import pynvml

                self._module = pynvml
            self._module.nvmlInit()
            count = self._module.nvmlDeviceGetCount()
            self._handles = [self._module.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            if not self._handles:
                self.status = "no NVIDIA GPU (NVML found no device)"
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
            self._handles = []
            self.status = f"no NVIDIA GPU (NVML unavailable: {exc})"

    def sample(self) -> list[dict[str, Any]]:
        """One reading per GPU.

        Returns:
            A list of maps with ``index``, ``name``, ``util_pct``, ``mem_used_bytes``,
            ``mem_total_bytes``, ``power_w``, ``power_limit_w``, ``temp_c``,
            ``sm_clock_mhz``; a field NVML cannot read on this GPU is None.
            ``[]`` when NVML is unavailable (see :attr:`status`). Never raises.
        """
        if self._handles is None:
            self._init()
        assert self._handles is not None  # _init sets a list ([] when NVML is unavailable)
        nvml = self._module
        gpus = []
        for index, handle in enumerate(self._handles):
            gpus.append({
                "index": index,
                "name": _read(lambda: _text(nvml.nvmlDeviceGetName(handle))),
                "util_pct": _read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "mem_used_bytes": _read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
                "mem_total_bytes": _read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total),
                "power_w": _read(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
                "power_limit_w": _read(
                    lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
                "temp_c": _read(lambda: nvml.nvmlDeviceGetTemperature(handle, 0)),
                "sm_clock_mhz": _read(lambda: nvml.nvmlDeviceGetClockInfo(handle, 1)),
            })
        return gpus


def _read(probe: Any) -> Any:
    try:
        return probe()
    except Exception:  # NVMLError_NotSupported on some boards and fields
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def descendant_pids(pid: int) -> list[int] | None:
    """The pids of the descendants of process ``pid`` (children, their children, ...).

    Read from Linux's ``/proc/<pid>/task/<tid>/children``: a few small files (one a thread
    of each process in the tree), where psutil's ``children(recursive=True)`` reads the
    ``stat`` file of every process on the host (about 1 ms at 80 processes, once a second on
    the agent's I/O thread). Each file is read with three system calls (open, read, close;
    Python's ``open`` makes eight). The kernel's list may miss a child that is created or
    ends while it is read (fine for a 1 Hz CPU reading).

    Returns:
        The pids, parents before their children; None where the kernel has no such
        files (not Linux, or built without ``CONFIG_PROC_CHILDREN``) or ``pid`` is gone.
    """
    if not _PROC_CHILDREN:
        return None
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    found: list[int] = []
    parents = [(pid, threads)]
    while parents:
        parent, tasks = parents.pop()
        for task in tasks:
            try:
                children = _read_small_file(f"/proc/{parent}/task/{task}/children").split()
            except OSError:  # the thread (or the process) ended meanwhile
                continue
            for child in map(int, children):
                found.append(child)
                try:
                    parents.append((child, os.listdir(f"/proc/{child}/task")))
                except OSError:
                    continue
    return found


#: Whether this kernel lists each thread's children in ``/proc`` (``CONFIG_PROC_CHILDREN``;
#: ``/proc/thread-self`` is Linux 3.17 or later, where psutil is asked instead).
_PROC_CHILDREN = os.path.exists("/proc/thread-self/children")


def _read_small_file(path: str) -> bytes:
    """The whole of the file at ``path``: open, read, close (a ``/proc`` file).

    Raises:
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = [os.read(fd, _READ_BYTES)]
        while len(parts[-1]) == _READ_BYTES:  # (a long list: read on to its end)
            parts.append(os.read(fd, _READ_BYTES))
    finally:
        os.close(fd)
    return b"".join(parts)


_READ_BYTES = 16384


class SystemProbe:
    """Host and GPU readings for the ``system`` message.

    Args:
        nvml: the GPU probe (a default :class:`Nvml` when None).
    """

    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml or Nvml()
        self._process = psutil.Process(os.getpid())
        #: the host-wide /proc files read, kept open, by path (:meth:`_read_host_file`)
        self._files: dict[str, int] = {}
        #: the host's CPU times (Linux's /proc/stat, in ticks) at the last reading, or
        #: None where /proc/stat cannot be read (psutil's counters are used there)
        self._host_times = _host_cpu_times(self._read_host_file("/proc/stat"))
        if self._host_times is None:
            psutil.cpu_percent(interval=None)  # primes the counter; the first reading is 0
        #: (monotonic s, this process's CPU s) at the last reading
        self._process_times = (time.monotonic(), time.process_time())
        #: the descendants known, by pid: how each is read (:func:`_open_child`) and its
        #: CPU (s) at the last reading
        self._children: dict[int, tuple[int | psutil.Process, float]] = {}
        #: when the last children's reading was taken (monotonic s), and how many more
        #: readings reuse the pids of the last scan of the process tree
        self._children_at = time.monotonic()
        self._scan_in = 0

    def children_cpu_pct(self) -> float:
        """CPU of the training process's child processes since the last call (100 = one core).

        Compiler workers (torch.compile's inductor compiles in a pool of processes),
        DataLoader workers. A child first seen counts from its next call. The process tree
        is scanned at every :data:`CHILDREN_SCAN_EVERY`-th call, and at the call after a
        child known ended (loader workers end and start together); in between the
        children known are read: a child started meanwhile counts from up to that many
        calls later.

        .. note:: On Linux one ``pread`` a child known (its ``/proc/<pid>/stat``, kept
           open), where psutil opens, reads and closes the file each time (about a third
           of the cost); a scan reads one small file a thread of each process in the tree
           (:func:`descendant_pids`)."""
        now = time.monotonic()
        elapsed, self._children_at = now - self._children_at, now
        known = self._children
        if self._scan_in > 0:
            self._scan_in -= 1
            pids = list(known)
        else:
            self._scan_in = CHILDREN_SCAN_EVERY - 1
            pids = self._descendants()
        total_s, seen = 0.0, {}
        for pid in pids:
            handle, before_s = known.pop(pid, (None, 0.0))
            try:
                if handle is None:  # first seen: counts from the next call
                    handle = _open_child(pid)
                    seen[pid] = (handle, _child_cpu_s(handle))
                else:
                    cpu_s = _child_cpu_s(handle)
                    total_s += max(0.0, cpu_s - before_s)
                    seen[pid] = (handle, cpu_s)
            except (OSError, ValueError, IndexError, psutil.Error):  # it ended meanwhile
                if handle is not None:
                    _close_child(handle)
                self._scan_in = 0
        for handle, _ in known.values():  # no longer in the tree
            _close_child(handle)
        self._children = seen
        return round(total_s / elapsed * 100, 1) if elapsed > 0 else 0.0

    def _descendants(self) -> list[int]:
        """The pids of the training process's descendants (a scan of the process tree)."""
        pids = descendant_pids(self._process.pid)
        if pids is not None:
            return pids
        try:  # no /proc/<pid>/task/<tid>/children here: ask psutil
            return [child.pid for child in self._process.children(recursive=True)]
        except psutil.Error:
            return []

    def _read_host_file(self, path: str) -> bytes | None:
        """The start (1 KiB) of the host-wide ``/proc`` file ``path``; None where it cannot be read.

        Kept open: one ``pread`` a reading (the kernel writes the file anew at offset 0),
        where open, read and close cost about half as much again."""
        try:
            fd = self._files.get(path)
            if fd is None:
                fd = self._files[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 1024, 0)
        except OSError:
            return None

    def close(self) -> None:
        """Close the ``/proc`` files kept open; a later reading opens them again.

        The host's (:meth:`_read_host_file`) and the children's."""
        for handle, _ in self._children.values():
            _close_child(handle)
        for fd in self._files.values():
            os.close(fd)
        self._children, self._files = {}, {}
        self._scan_in = 0

    def host_cpu_pct(self) -> float:
        """CPU of the whole host since the last call, in % of all its cores.

        As ``psutil.cpu_percent``: busy = all but idle and iowait, guest time counted once."""
        times = _host_cpu_times(self._read_host_file("/proc/stat"))
        if times is None or self._host_times is None:
            return psutil.cpu_percent(interval=None)
        previous, self._host_times = self._host_times, times
        delta = [max(0, now - before) for now, before in zip(times, previous)]
        total = sum(delta) - sum(delta[8:10])  # guest times are in user and nice already
        busy = total - delta[3] - delta[4]  # idle, iowait
        return round(min(100.0, max(0.0, busy / total * 100)), 1) if total > 0 else 0.0

    def process_cpu_pct(self) -> float:
        """CPU of the training process since the last call (100 = one core).

        As ``psutil.Process.cpu_percent``, from ``time.process_time`` (no file read)."""
        now, cpu = time.monotonic(), time.process_time()
        (then, before), self._process_times = self._process_times, (now, cpu)
        return round((cpu - before) / (now - then) * 100, 1) if now > then else 0.0

    def sample(self) -> dict[str, Any]:
        """A ``system`` body: the host's and the process's CPU and memory, and the GPUs.

        ``cpu_pct`` (host, % of all cores since the last call), ``process_cpu_pct`` (this
        process; 100 = one core), ``children_cpu_pct`` (its child processes: compiler and
        loader workers; 100 = one core), ``host_mem_used_bytes``, ``host_mem_total_bytes``,
        ``host_rss_bytes``, ``gpus`` and ``gpu_status``; while torch.compile compiles, which
        graph and for how long (:meth:`gpuopt.compile.CompileWatch.progress`:
        ``compiling_graph``, ...).

        .. note:: On Linux about 0.3 ms of the I/O thread a sample here (on a cold cache,
           as once a second), most of it the kernel's writing of ``/proc/meminfo`` and
           ``/proc/stat``: ``/proc`` files read directly, kept open where they can be
           (psutil's readers cost about 0.15 ms each there)."""
        memory = _host_memory_bytes(self._read_host_file("/proc/meminfo"))
        if memory is None:
            reading = psutil.virtual_memory()
            memory = (reading.total, reading.available)
        total, available = memory
        gpus = self.nvml.sample()
        # only where the run uses torch.compile (its module is then imported): a sample
        # never imports it
        watch = getattr(sys.modules.get("gpuopt.compile"), "COMPILE_WATCH", None)
        compiling = watch.progress() if watch is not None else None
        return {
            **(compiling or {}),
            "cpu_pct": self.host_cpu_pct(),
            "process_cpu_pct": self.process_cpu_pct(),
            "children_cpu_pct": self.children_cpu_pct(),
            "host_mem_used_bytes": total - available,
            "host_mem_total_bytes": total,
            "host_rss_bytes": host_rss_bytes(),
            "gpus": gpus,
            "gpu_status": self.nvml.status,
        }


#: :meth:`SystemProbe.children_cpu_pct` scans the process tree at every this-many-th call
#: (about 1 Hz: every 5 s), and reads the children it knows at the others.
CHILDREN_SCAN_EVERY = 5
#: Whether processes are read from Linux's ``/proc/<pid>/stat`` (else through psutil).
_PROC_STAT = os.path.exists("/proc/self/stat")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if _PROC_STAT else 100


def _open_child(pid: int) -> int | psutil.Process:
    """How process ``pid``'s CPU is read: its ``/proc/<pid>/stat`` opened (Linux; the
    descriptor then reads this process only, never one that reuses its pid), else psutil.

    Raises:
        OSError, psutil.Error: it is gone.
    """
    if _PROC_STAT:
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    return psutil.Process(pid)


def _child_cpu_s(handle: int | psutil.Process) -> float:
    """The user and system CPU (s) a child (:func:`_open_child`) has used so far.

    Raises:
        OSError, ValueError, IndexError, psutil.Error: it ended (Linux: ``ESRCH``).
    """
    if isinstance(handle, int):
        text = os.pread(handle, 1024, 0)
        fields = text[text.rindex(b")") + 2:].split()  # after the name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime
    times = handle.cpu_times()
    return times.user + times.system


def _close_child(handle: int | psutil.Process) -> None:
    if isinstance(handle, int):
        os.close(handle)


def _host_cpu_times(text: bytes | None) -> list[int] | None:
    """The host's CPU times from the first line of Linux's ``/proc/stat`` (``text``: its
    start; user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice, in
    ticks); None where it could not be read (``text`` None) or is not that."""
    try:
        line = text.split(b"\n", 1)[0].split() if text is not None else []
        if not line or line[0] != b"cpu":
            return None
        times = [int(field) for field in line[1:11]]
    except ValueError:
        return None
    return times + [0] * (10 - len(times))  # older kernels have fewer columns


def _host_memory_bytes(text: bytes | None) -> tuple[int, int] | None:
    """``(MemTotal, MemAvailable)`` of Linux's ``/proc/meminfo`` (``text``: its start) in
    bytes (psutil's ``total`` and ``available``); None where it could not be read
    (``text`` None) or lacks them (kernels before 3.14: psutil estimates ``available``
    there)."""
    if text is None:
        return None
    fields = {}
    for line in text.split(b"\n", 4)[:4]:
        name, _, rest = line.partition(b":")
        fields[name] = rest
    try:
        return (int(fields[b"MemTotal"].split()[0]) * 1024,
                int(fields[b"MemAvailable"].split()[0]) * 1024)
    except (KeyError, ValueError, IndexError):
        return None
