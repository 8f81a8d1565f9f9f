"""The kernel backend switch: which implementation the fused modules run.

Every fused module (:class:`~gpuopt.kernels.FusedLinearBiasActivation`,
:class:`~gpuopt.kernels.FusedLayerNormDropoutActivation`) has a ``backend``:

``"eager"``   the plain-torch reference (``F.linear``, ``F.layer_norm``, ``F.dropout``,
              ``F.gelu``...), numerically what the model computed before it had fused
              modules; runs everywhere.
``"triton"``  the fused Triton kernels; needs a CUDA device at run time, or
              ``TRITON_INTERPRET=1`` set before Triton is first used (Triton's
              interpreter, which runs the kernels on CPU tensors with numpy: slow, for
              tests).

:func:`set_kernel_backend` switches every fused module of a model at once, and
:func:`triton_available` says beforehand whether ``"triton"`` can run on a device.
Triton itself is imported only when a Triton kernel first runs (or when
:func:`triton_available` is asked), so importing :mod:`gpuopt.kernels` stays cheap and
``TRITON_INTERPRET`` is honoured whenever it is set before that.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
from torch import nn

__all__ = ["KERNEL_BACKENDS", "KernelBackendMixin", "set_kernel_backend", "triton_available"]

#: Values of a fused module's ``backend`` (and of :func:`set_kernel_backend`).
KERNEL_BACKENDS = ("eager", "triton")

#: Dtypes the Triton kernels read and write (they compute in float32 inside).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Oldest GPU Triton 3 compiles for (Volta, sm_70).
_MIN_COMPUTE_CAPABILITY = (7, 0)


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (``1``, ``true``...)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401  (asked once; the import takes ~0.5 s)
    except Exception as exc:  # ImportError, or a broken install raising something else
        return f"Triton cannot be imported ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_device_problem(index: int) -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available to this torch build or driver"
    if index >= torch.cuda.device_count():
        return f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)"
    capability = torch.cuda.get_device_capability(index)
    if capability < _MIN_COMPUTE_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return (f"{name} has compute capability {capability[0]}.{capability[1]}; Triton "
                f"needs {_MIN_COMPUTE_CAPABILITY[0]}.{_MIN_COMPUTE_CAPABILITY[1]} or newer")
    return None


def triton_available(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can.

    Args:
        device: Where the model's tensors live (``"cuda"``, ``"cuda:1"``, ``"cpu"``,
            a :class:`torch.device`).

    Returns:
        ``None`` when the fused kernels can run there: a CUDA device of compute
        capability 7.0 or newer with Triton importable, or any device while
        ``TRITON_INTERPRET=1`` (Triton's interpreter). Otherwise the reason, e.g.
        ``"Triton kernels need a CUDA device; this run is on cpu"``.

    .. note:: Cheap after the first call per device (the answer is cached, apart from
       reading ``TRITON_INTERPRET``) and never synchronizes the device.
    """
    device = torch.device(device)
    problem = _triton_import_error()
    if problem is not None:
        return problem
    if interpreting():
        return None
    if device.type != "cuda":
        return f"Triton kernels need a CUDA device; this run is on {device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_problem(index)


def require_triton(tensor: torch.Tensor) -> None:
    """Raise if the Triton kernels cannot run on ``tensor`` (its device or dtype).

    Raises:
        RuntimeError: :func:`triton_available` gives a reason for ``tensor.device``.
        TypeError: ``tensor.dtype`` is not float32, bfloat16 or float16.
    """
    problem = triton_available(tensor.device)
    if problem is not None:
        raise RuntimeError(f"backend 'triton' cannot run here: {problem}")
    if tensor.dtype not in TRITON_DTYPES:
        raise TypeError(f"the Triton kernels take float32, bfloat16 or float16 tensors, "
                        f"got {tensor.dtype}")


@functools.lru_cache(maxsize=None)
def kernels(name: str) -> ModuleType:
    """Import the private Triton kernel module ``gpuopt.kernels._<name>_kernels``.

    Cached: a fused op's forward and backward each ask (an import machinery lookup cost
    5-7 us a call on an H200 machine's host, on a path that is launch-bound for small
    inputs).

    Deferred to the first launch because ``@triton.jit`` decides, when the module is
    imported, between compiling for the GPU and the interpreter (``TRITON_INTERPRET``).
    """
    return importlib.import_module(f"gpuopt.kernels._{name}_kernels")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: it is not; the message names ``what`` and the choices.
    """
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r} (choose from {', '.join(choices)})")
    return value


def check_backend(backend: str) -> str:
    """``backend`` if it is one of :data:`KERNEL_BACKENDS`.

    Raises:
        ValueError: ``backend`` is not one of :data:`KERNEL_BACKENDS`.
    """
    return check_choice("kernel backend", backend, KERNEL_BACKENDS)


class KernelBackendMixin:
    """A module with a switchable ``backend`` (see :data:`KERNEL_BACKENDS`).

    Mixed into the fused ``nn.Module`` s; :func:`set_kernel_backend` finds modules by this
    class.
    """

    _backend: str = "eager"

    @property
    def backend(self) -> str:
        """``"eager"`` (the torch reference) or ``"triton"`` (the fused kernels)."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = check_backend(value)


def set_kernel_backend(model: nn.Module, backend: str) -> int:
    """Set ``backend`` on every fused module in ``model`` (itself included).

    Switching is cheap (an attribute per module; Triton compiles a kernel at its first
    launch with a new shape class or dtype). Between optimizer steps is the safe moment:
    a switch between a forward and its backward is harmless (each autograd node keeps
    the backward of the implementation that ran its forward), but the step then mixes
    the two numerics.

    Args:
        model: Any module; those that are not fused modules are left alone.
        backend: One of :data:`KERNEL_BACKENDS`.

    Returns:
        How many fused modules were set (0 when the model has none).

    Raises:
        ValueError: ``backend`` is unknown; no module is changed.
    """
    check_backend(backend)
    count = 0
    for module in model.modules():
        if isinstance(module, KernelBackendMixin):
            module.backend = backend
            count += 1
    return count
