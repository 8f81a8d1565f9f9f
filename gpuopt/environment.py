"""The environment report: what this Python, PyTorch, CUDA, CPU and Triton can do.

``environment_report()`` gathers it as a dict of plain types (str, int, float, bool,
None, lists and dicts of them), ready for JSON or msgpack: the agent sends it in its
``hello`` message, and ``gpuwatch doctor`` runs this module as a child process::

    python -m gpuopt.environment          # readable text
    python -m gpuopt.environment --json   # the dict as JSON

The report never raises. A probe that fails is recorded in place of its value as a
string ``"error: <ExceptionType>: <message>"`` and the rest of the report is still
gathered; if torch itself cannot be imported, the torch-dependent groups say so.

Groups and keys (memory in bytes, compute capability as ``"major.minor"``):

``python``   ``version``, ``implementation``, ``executable``, ``platform``, ``machine``
``torch``    ``version``, ``git_version``, ``debug``, ``num_threads``,
             ``num_interop_threads``, ``float32_matmul_precision``
``cuda``     ``available``, ``version`` (torch.version.cuda, the CUDA torch was built
             with), ``hip_version``, ``device_count``, ``devices`` (list of ``index``,
             ``name``, ``compute_capability``, ``total_memory_bytes``,
             ``multi_processor_count``), ``bf16_supported``, ``matmul_allow_tf32``,
             ``cudnn_available``, ``cudnn_enabled``, ``cudnn_version``,
             ``cudnn_allow_tf32``
``cpu``      ``count`` (logical CPUs), ``usable_count`` (CPUs this process may run on),
             ``capability`` (the SIMD level torch dispatches to, e.g. ``"AVX512"``),
             ``bf16_autocast``, ``avx512_bf16``, ``amx_tile``, ``precision_advice`` (which
             autocast precision is fast on this CPU, from its flags)
``triton``   ``available``, ``version``, ``error``
``mps``      ``available``, ``built``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["environment_report", "format_report", "main", "usable_cpu_count", "GROUPS"]

#: Top-level keys of the report, in display order.
GROUPS = ("python", "torch", "cuda", "cpu", "triton", "mps")

_TITLES = {
    "python": "Python",
    "torch": "Torch",
    "cuda": "CUDA",
    "cpu": "CPU",
    "triton": "Triton",
    "mps": "MPS (Apple)",
}


def _error(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {exc}"


def _probe(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the error as a string if it raises."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- a probe must never take the report down
        return _error(exc)


def _group(probes: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    return {key: _probe(fn) for key, fn in probes.items()}


def _platform() -> str:
    """``platform.platform()``'s words (e.g. ``Linux-6.1.0-x86_64-with-glibc2.36``), without
    the ``uname -p`` subprocess it starts for the processor: the agent's I/O thread builds
    this report, and a subprocess spawned there while the training thread forks (DataLoader
    workers) can hold it until the forked process exits."""
    system, _, release, _, machine = os.uname()
    words = [system, release, machine]
    if system == "Linux":
        libc, version = platform.libc_ver()
        if libc:
            words += ["with", libc + version]
    return "-".join(words)


def _python_group() -> dict[str, Any]:
    return _group(
        {
            "version": platform.python_version,
            "implementation": platform.python_implementation,
            "executable": lambda: sys.executable,
            "platform": _platform,
            "machine": platform.machine,
        }
    )


def _torch_group(torch: Any) -> dict[str, Any]:
    return _group(
        {
            "version": lambda: str(torch.__version__),
            "git_version": lambda: torch.version.git_version,
            "debug": lambda: bool(torch.version.debug),
            "num_threads": torch.get_num_threads,
            "num_interop_threads": torch.get_num_interop_threads,
            "float32_matmul_precision": torch.get_float32_matmul_precision,
        }
    )


def _cuda_devices(torch: Any) -> list[dict[str, Any]]:
    devices = []
    for index in range(torch.cuda.device_count()):

        def props(index: int = index) -> Any:
            return torch.cuda.get_device_properties(index)

        def name(index: int = index) -> Any:
            return torch.cuda.get_device_name(index)

        def capability(index: int = index) -> str:
            return "{}.{}".format(*torch.cuda.get_device_capability(index))

        devices.append(
            {
                "index": index,
                "name": _probe(name),
                "compute_capability": _probe(capability),
                "total_memory_bytes": _probe(lambda: int(props().total_memory)),
                "multi_processor_count": _probe(lambda: int(props().multi_processor_count)),
            }
        )
    return devices


def _cuda_group(torch: Any) -> dict[str, Any]:
    available = _probe(torch.cuda.is_available)
    on_cuda = available is True

    def bf16_supported() -> bool | None:
        return bool(torch.cuda.is_bf16_supported()) if on_cuda else None

    return {
        "available": available,
        **_group(
            {
                "version": lambda: torch.version.cuda,
                "hip_version": lambda: getattr(torch.version, "hip", None),
                "device_count": lambda: int(torch.cuda.device_count()) if on_cuda else 0,
                "devices": lambda: _cuda_devices(torch) if on_cuda else [],
                "bf16_supported": bf16_supported,
                "matmul_allow_tf32": lambda: bool(torch.backends.cuda.matmul.allow_tf32),
                "cudnn_available": lambda: bool(torch.backends.cudnn.is_available()),
                "cudnn_enabled": lambda: bool(torch.backends.cudnn.enabled),
                "cudnn_version": torch.backends.cudnn.version,
                "cudnn_allow_tf32": lambda: bool(torch.backends.cudnn.allow_tf32),
            }
        ),
    }


def usable_cpu_count() -> int:
    """The CPUs this process may run on.

    Its affinity mask where the platform has one, else every CPU; 1 when the count is
    unknown."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cpu_group(torch: Any) -> dict[str, Any]:
    def private_check(name: str) -> Callable[[], bool | None]:
        # torch.cpu._is_avx512_bf16_supported etc. are private; absent -> None (unknown).
        def check() -> bool | None:
            fn = getattr(torch.cpu, name, None)
            return bool(fn()) if fn is not None else None

        return check

    return _group(
        {
            "count": os.cpu_count,
            "usable_count": usable_cpu_count,
            "capability": lambda: torch.backends.cpu.get_cpu_capability(),
            # CPU autocast supports bfloat16 on every CPU; without native bf16 (AVX512-BF16
            # or AMX) it is emulated and usually slower than float32.
            "bf16_autocast": lambda: True,
            "avx512_bf16": private_check("_is_avx512_bf16_supported"),
            "amx_tile": private_check("_is_amx_tile_supported"),
            "precision_advice": _cpu_precision_advice,
        }
    )


def _cpu_precision_advice() -> str:
    from gpuopt.precision import cpu_native_bf16

    if cpu_native_bf16():
        return ("native bf16 (AVX512-BF16 or AMX): bf16 autocast can beat fp32; "
                "fp16 autocast is slow on CPU")
    return ("no native bf16 (no AVX512-BF16, no AMX): bf16 and fp16 autocast are "
            "emulated and several times slower than fp32; keep fp32 on this CPU")


def _mps_group(torch: Any) -> dict[str, Any]:
    return _group(
        {
            "available": lambda: bool(torch.backends.mps.is_available()),
            "built": lambda: bool(torch.backends.mps.is_built()),
        }
    )


def _triton_group() -> dict[str, Any]:
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 -- absent (ImportError) or installed but broken
        return {"available": False, "version": None, "error": _error(exc)}
    return {
        "available": True,
        "version": _probe(lambda: str(triton.__version__)),
        "error": None,
    }


def environment_report() -> dict[str, Any]:
    """Gather the environment report.

    Imports torch and, inside this call, triton. On a CUDA machine the device probes
    (properties, bf16 support) may initialise CUDA; no setting is changed.

    Returns:
        A dict with one sub-dict per group in :data:`GROUPS` (see the module docstring for
        the keys), holding only str, int, float, bool, None, lists and dicts, so that
        ``json.dumps`` and ``msgpack.packb`` accept it. Memory sizes are in bytes.

    .. note:: Never raises. A probe that fails records ``"error: <Type>: <message>"``
       in place of its value; if torch cannot be imported, each torch-dependent group
       is ``{"error": ...}``.
    """
    report: dict[str, Any] = {"python": _python_group()}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 -- report without torch rather than fail
        missing = {"error": _error(exc)}
        for group in ("torch", "cuda", "cpu", "mps"):
            report[group] = dict(missing)
        report["triton"] = _triton_group()
        return {group: report[group] for group in GROUPS}
    for group, build in (
        ("torch", _torch_group),
        ("cuda", _cuda_group),
        ("cpu", _cpu_group),
    ):
        report[group] = _probe(functools.partial(build, torch))
    report["triton"] = _probe(_triton_group)
    report["mps"] = _probe(lambda: _mps_group(torch))
    return report


def _format_bytes(num_bytes: Any) -> str:
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool):
        return str(num_bytes)
    return f"{num_bytes} ({num_bytes / 2**30:.1f} GiB)"


def _format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _lines(group: str, values: Any) -> list[tuple[str, str]]:
    if not isinstance(values, dict):  # the whole group failed: an error string
        return [("error", _format_value(values))]
    if group == "cuda" and values.get("available") is False:
        rows = [("status", "no CUDA device (torch.cuda.is_available() is False)")]
        rows += [
            (key, _format_value(value))
            for key, value in values.items()
            if key not in ("devices", "device_count", "bf16_supported")
        ]
        return rows
    rows = []
    for key, value in values.items():
        if key == "devices" and isinstance(value, list):
            for device in value:
                prefix = f"device {device.get('index', '?')}"
                for dkey, dvalue in device.items():
                    if dkey == "index":
                        continue
                    text = (
                        _format_bytes(dvalue)
                        if dkey.endswith("_bytes")
                        else _format_value(dvalue)
                    )
                    rows.append((f"{prefix} {dkey}", text))
            continue
        rows.append((key, _format_value(value)))
    return rows


def format_report(report: dict[str, Any]) -> str:
    """Render a report from :func:`environment_report` as readable text.

    One heading per group (Python, Torch, CUDA, CPU, Triton, MPS), then aligned
    ``key: value`` lines; when CUDA is not available the CUDA group says
    ``no CUDA device`` and an installed Triton says its kernels need one. Groups the
    function does not know are appended at the end.

    Args:
        report: The dict from :func:`environment_report` (or one decoded from its JSON).

    Returns:
        The text, ending in a newline.
    """
    groups = [g for g in GROUPS if g in report] + [g for g in report if g not in GROUPS]
    sections = [(g, _lines(g, report[g])) for g in groups]
    cuda, triton = report.get("cuda"), report.get("triton")
    if (isinstance(cuda, dict) and cuda.get("available") is False
            and isinstance(triton, dict) and triton.get("available")):
        for group, rows in sections:  # installed, but its kernels cannot run here
            if group == "triton":
                rows.append(("kernels", "need a CUDA device; none here (kernels=triton "
                                        "is refused; tests use TRITON_INTERPRET=1)"))
    width = max((len(key) for _, rows in sections for key, _ in rows), default=0)
    out = []
    for group, rows in sections:
        out.append(_TITLES.get(group, group))
        out.extend(f"  {key + ':':<{width + 1}} {value}" for key, value in rows)
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Print the environment report as text, or as JSON with ``--json``.

    Returns:
        The exit status, 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m gpuopt.environment",
        description="Report what this Python, PyTorch, CUDA, CPU and Triton can do.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
