"""Bias + activation fused into one pass over a linear layer's output.

A linear layer followed by an activation, ``act(x @ W^T + b)``, is a matmul and then
elementwise work on its ``[M, N]`` output. :class:`FusedLinearBiasActivation` runs the
matmul without bias (torch) and the rest as one Triton kernel; backward computes the
activation's input gradient and the bias gradient (a column reduction) in one Triton
pass plus a small second reduction.

Memory traffic per element of the ``[M, N]`` output, in units of its element size ``s``
(bf16: 2 bytes), the bias and the ``[G, N]`` partial sums being negligible (``N`` and
``G N`` against ``M N``). The torch reference, line by line:

=================================  ============================  =============
torch reference                    reads / writes                passes
=================================  ============================  =============
``z = x + bias``                   read x, write z               2
``y = act(z)``                     read z, write y               2
backward ``dz = act'(z) * dy``     read dy, read z, write dz     3
backward ``dbias = dz.sum(0)``     read dz                       1
=================================  ============================  =============

Fused: forward reads ``x`` and writes ``y`` (2 passes, 4 -> 2); backward reads ``dy``
and ``x`` (``y`` for ReLU), writes ``dx`` and sums ``dbias`` in registers (3 passes,
4 -> 3). Forward and backward together: 8 -> 5 passes, ``8 s M N`` -> ``5 s M N`` bytes,
so a memory-bound step of this part should take ~0.6 of the reference's time. (Against
``F.linear`` with the bias in cuBLAS's epilogue the forward moves the same bytes,
``act`` alone being 2 passes; the gain is then the backward's 4 -> 3.) The memory kept
for backward is that of the reference: ReLU keeps its output, GELU its input.

Source: Triton tutorials 02-fused-softmax and 05-layer-norm (row-block kernels, two-stage
column reduction); linkedin/Liger-Kernel (recomputation of GELU in backward from its
input; partial sums per program reduced afterwards, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuopt.kernels.activations import activation_reference, check_activation
from gpuopt.kernels.backend import KernelBackendMixin, check_backend, kernels, require_triton

__all__ = [
    "BiasActivation",
    "bias_activation",
    "bias_activation_reference",
    "FusedLinearBiasActivation",
]


def bias_activation_reference(x: torch.Tensor, bias: torch.Tensor | None,
                              activation: str = "gelu") -> torch.Tensor:
    """``activation(x + bias)`` with torch ops: what :func:`bias_activation` computes.

    The bias is cast to ``x.dtype`` first (as ``F.linear`` under autocast does), so the
    result has ``x``'s dtype whatever the bias's.

    Args:
        x: float ``[..., N]``.
        bias: float ``[N]`` or None.
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`.
    """
    z = x if bias is None else x + bias.to(x.dtype)
    return activation_reference(z, activation)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[M, N]`` (a view when it can) with unit column stride."""
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class BiasActivation(torch.autograd.Function):
    """``activation(x + bias)`` in one Triton pass forward and one backward.

    Public form: :func:`bias_activation` ``(x, bias, activation="gelu")``.

    Args (of ``apply``):
        x: float32, bfloat16 or float16 ``[..., N]``, any strides (copied only if the
            last dim is not contiguous), on a device :func:`triton_available` accepts.
        bias: ``[N]`` of any of those dtypes, or None (the activation alone).
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`.

    Returns:
        ``[..., N]`` contiguous, of ``x.dtype``; the gradients have the dtypes of ``x``
        and ``bias``. Autocast does not change the dtypes (torch's own ``relu`` and
        ``gelu`` run in their input's dtype under autocast too); computing is float32.

    Raises:
        ValueError: unknown ``activation``, or ``bias`` is not ``[N]``.
        RuntimeError: Triton cannot run on ``x.device`` (:func:`triton_available`).
        TypeError: ``x`` is not float32, bfloat16 or float16.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None,
                activation: str = "gelu") -> torch.Tensor:
        check_activation(activation)
        require_triton(x)
        if bias is not None and bias.shape != x.shape[-1:]:
            raise ValueError(f"bias must have shape [{x.shape[-1]}], got {tuple(bias.shape)}")
        if bias is not None:
            require_triton(bias)
        ops = kernels("bias_activation")
        if x.numel() == 0:
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        else:
            y = ops.bias_activation_fwd(_rows(x), bias, activation, x.dtype).view(x.shape)
        saved = None if activation == "identity" else y if ops.saves_output(activation) else x
        ctx.save_for_backward(saved, bias)
        ctx.activation = activation
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, bias = ctx.saved_tensors
        need_dx, need_dbias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if dy.numel() == 0:
            dx = torch.zeros(dy.shape, dtype=ctx.x_dtype, device=dy.device) if need_dx else None
            dbias = torch.zeros_like(bias) if need_dbias else None
            return dx, dbias, None
        dx, dbias = kernels("bias_activation").bias_activation_bwd(
            _rows(dy), None if saved is None else _rows(saved), bias, ctx.activation,
            dx_dtype=ctx.x_dtype, need_dx=need_dx, need_dbias=need_dbias)
        return None if dx is None else dx.view(dy.shape), dbias, None


#: ``bias_activation(x, bias, activation="gelu")``: see :class:`BiasActivation`.
bias_activation = BiasActivation.apply


@torch.compiler.disable
def _bias_activation_outside_compile(x: torch.Tensor, bias: torch.Tensor | None,
                                     activation: str) -> torch.Tensor:
    # Under torch.compile the kernels run as they are, between two graphs (a graph
    # break), instead of being traced through the launcher.
    return bias_activation(x, bias, activation)


class FusedLinearBiasActivation(KernelBackendMixin, nn.Linear):
    """``activation(x @ W^T + b)``: an :class:`nn.Linear` with its activation fused in.

    A drop-in for ``nn.Linear`` followed by ``nn.ReLU``/``nn.GELU`` (or by nothing, with
    ``activation="identity"``): same parameters, initialisation, ``state_dict`` keys and
    ``isinstance(module, nn.Linear)``.

    - ``backend="eager"``: ``activation(F.linear(x, W, b))``, plain torch, bit for bit
      what ``nn.Linear`` + ``nn.GELU()`` (etc.) compute.
    - ``backend="triton"``: ``F.linear(x, W)`` (torch matmul, no bias), then
      :func:`bias_activation` (one Triton pass; see the module docstring for bytes).
      Under ``torch.compile`` that call is left out of the graph (a graph break).

    Dtypes follow ``F.linear``: under autocast the matmul output is the autocast dtype
    and so is the result; outside autocast ``x`` and the parameters must share a dtype.
    The bias is added in float32 before rounding (``F.linear`` rounds ``x W^T`` and the
    sum per its GEMM epilogue), so the two backends agree to the output dtype's rounding.

    Args:
        in_features, out_features, bias, device, dtype: As :class:`nn.Linear`.
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`;
            ``"gelu"`` is the exact (erf) GELU of ``nn.GELU()``.
        backend: ``"eager"`` or ``"triton"``; change later with :attr:`backend` or
            :func:`~gpuopt.kernels.set_kernel_backend`.

    Shapes: ``[..., in_features]`` -> ``[..., out_features]``.

    Raises:
        ValueError: unknown ``activation`` or ``backend``.
        RuntimeError: (in forward) backend ``"triton"`` where Triton cannot run.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 activation: str = "gelu", backend: str = "eager",
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = check_activation(activation)
        self.backend = check_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[..., in_features]`` -> float ``[..., out_features]``."""
        if self.backend == "eager":
            return activation_reference(F.linear(x, self.weight, self.bias), self.activation)
        return _bias_activation_outside_compile(F.linear(x, self.weight), self.bias,
                                                self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}, backend={self.backend}"
