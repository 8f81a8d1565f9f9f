"""System probes run on the agent's I/O thread at about 1 Hz: host (psutil) and GPUs (NVML).

Never called on the training thread: psutil and NVML calls cost tens of microseconds to
milliseconds each.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psutil


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


class SystemProbe:
    """Host and GPU readings for the ``system`` message.

    Args:
        nvml: the GPU probe (a default :class:`Nvml` when None).
    """

    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml or Nvml()
        self._process = psutil.Process(os.getpid())
        psutil.cpu_percent(interval=None)  # primes the counter; the first reading is 0
        self._process.cpu_percent(interval=None)
        self._children: dict[int, psutil.Process] = {}  # by pid: cpu_percent deltas

    def children_cpu_pct(self) -> float:
        """CPU of the training process's child processes (100 = one core), since the
        last call: compiler workers (torch.compile's inductor compiles in a pool of
        processes), DataLoader workers. A child first seen counts from its next call."""
        try:
            children = self._process.children(recursive=True)
        except psutil.Error:
            return 0.0
        total, seen = 0.0, {}
        for child in children:
            known = self._children.get(child.pid)
            try:
                if known is None:
                    child.cpu_percent(interval=None)  # primes it: the first reading is 0
                    seen[child.pid] = child
                else:
                    total += known.cpu_percent(interval=None)
                    seen[child.pid] = known
            except psutil.Error:  # it ended meanwhile
                continue
        self._children = seen
        return total

    def host_rss_bytes(self) -> int:
        """Resident set size of the training process, in bytes."""
        return self._process.memory_info().rss

    def sample(self) -> dict[str, Any]:
        """A ``system`` body: ``cpu_pct`` (host, % of all cores since the last call),
        ``process_cpu_pct`` (this process; 100 = one core), ``children_cpu_pct`` (its
        child processes: compiler and loader workers; 100 = one core), ``host_mem_used_bytes``,
        ``host_mem_total_bytes``, ``host_rss_bytes``, ``gpus`` and ``gpu_status``; while
        torch.compile compiles, which graph and for how long
        (:meth:`gpuopt.compile.CompileWatch.progress`: ``compiling_graph``, ...)."""
        memory = psutil.virtual_memory()
        gpus = self.nvml.sample()
        # only where the run uses torch.compile (its module is then imported): a sample
        # never imports it
        watch = getattr(sys.modules.get("gpuopt.compile"), "COMPILE_WATCH", None)
        compiling = watch.progress() if watch is not None else None
        return {**(compiling or {}),
            "cpu_pct": psutil.cpu_percent(interval=None),
            "process_cpu_pct": self._process.cpu_percent(interval=None),
            "children_cpu_pct": self.children_cpu_pct(),
            "host_mem_used_bytes": memory.total - memory.available,
            "host_mem_total_bytes": memory.total,
            "host_rss_bytes": self.host_rss_bytes(),
            "gpus": gpus,
            "gpu_status": self.nvml.status,
        }
