"""LayerNorm -> Dropout -> activation fused into one read and one write.

Memory traffic per element of ``x [M, N]``, in units of its element size ``s`` (bf16:
2 bytes; the ``[M]`` mean/rstd and ``[N]`` parameters are negligible). The torch
reference, line by line (training, ``0 < p < 1``, ReLU or GELU):

========================================  ==================================  ==========
torch reference                           reads / writes                      passes
========================================  ==================================  ==========
``h = F.layer_norm(x, (N,), w, b)``       read x, write h                     2
``u = F.dropout(h, p)``                   read h, write u, write mask (1 B)   2 (+1 B)
``y = act(u)``                            read u, write y                     2
backward ``du = act'(u) * dy``            read dy, read u, write du           3
backward ``dh = du * mask / (1 - p)``     read du, read mask (1 B), write dh  2 (+1 B)
backward ``dx, dw, db`` of layer_norm     read dh, read x, write dx           3
========================================  ==================================  ==========

Fused (:func:`layer_norm_dropout_activation`): forward reads ``x`` and writes ``y``
(6 passes + 1 byte -> 2 passes); backward reads ``dy`` and ``x`` and writes ``dx``
(8 passes + 1 byte -> 3). Together ``(14 s + 2) M N`` -> ``5 s M N`` bytes, ~0.34 of
the reference's bytes in bf16 (0.35 in fp32): the dropout mask is regenerated from a
Philox seed (``tl.rand(seed, row * N + col)``), never stored, and the backward
recomputes the normalised input instead of keeping ``h``, ``u`` and the mask, so the
activation memory kept for backward drops from ``x, u`` (+ mask) to ``x`` alone.
Without dropout and activation (a plain LayerNorm) the fused kernel moves what
``F.layer_norm`` moves; the demo transformer uses it that way so that the switch of
backends covers its LayerNorms too.

Source: Triton tutorial 05-layer-norm (``_layer_norm_fwd_fused``, the backward's
``dx`` formula and two-stage ``dw``/``db``), 02-fused-softmax (whole rows in registers,
several rows a program for short rows), and linkedin/Liger-Kernel's LayerNorm
(per-program partial ``dw``/``db`` over a row range, sized by the SM count); Triton's
``tl.rand`` seed/offset dropout (tutorial 04-low-memory-dropout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuopt.kernels.activations import activation_reference, check_activation
from gpuopt.kernels.backend import KernelBackendMixin, check_backend, kernels, require_triton

__all__ = [
    "LayerNormDropoutActivation",
    "layer_norm_dropout_activation",
    "layer_norm_dropout_activation_reference",
    "FusedLayerNormDropoutActivation",
]


def layer_norm_dropout_activation_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float = 1e-5, p: float = 0.0, activation: str = "identity",
) -> torch.Tensor:
    """``activation(F.dropout(F.layer_norm(x, (N,), weight, bias, eps), p))``, plain torch.

    With ``p == 0`` and ``"identity"`` this is exactly ``F.layer_norm`` (no dropout or
    activation op runs). Dropout draws its mask from torch's RNG, so for ``p > 0`` the
    fused function drops different elements (same distribution).

    Args:
        x: float ``[..., N]``.
        weight, bias: ``[N]`` or None.
        eps: Added to the variance, as ``nn.LayerNorm``.
        p: Dropout probability in ``[0, 1)``; dropout is applied when ``p > 0``.
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`.
    """
    y = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if p > 0.0:
        y = F.dropout(y, p, training=True)
    return activation_reference(y, activation)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[M, N]`` (a view when it can) with unit column stride."""
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.layer_norm`` gives ``x`` here: float32 under CUDA autocast (where
    ``layer_norm`` is on the run-in-float32 list), else ``x.dtype`` (CPU autocast leaves
    ``layer_norm`` alone)."""
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


class LayerNormDropoutActivation(torch.autograd.Function):
    """LayerNorm over the last dim, dropout, activation: one Triton pass each way.

    Public form: :func:`layer_norm_dropout_activation`
    ``(x, weight, bias, eps=1e-5, p=0.0, activation="identity", seed=None)``.

    Args (of ``apply``):
        x: float32, bfloat16 or float16 ``[..., N]`` with ``N`` up to 16384 (float32)
            or 32768 (16-bit), on a device :func:`triton_available` accepts.
        weight, bias: ``[N]`` of any of those dtypes, or None.
        eps: Added to the (biased) variance.
        p: Dropout probability in ``[0, 1)``; ``0`` for none (pass ``0`` in eval).
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`.
        seed: Philox seed of the dropout mask; None draws one from torch's CPU
            generator (so ``torch.manual_seed`` and activation checkpointing, which
            restores the CPU RNG state, reproduce the mask).

    Returns:
        ``[..., N]`` contiguous: float32 under CUDA autocast (as ``F.layer_norm``),
        else ``x.dtype``. Gradients have the dtypes of ``x``, ``weight``, ``bias``.

    Saved for backward: ``x``, float32 mean and rstd ``[M]``, the seed (an int).

    Raises:
        ValueError: unknown ``activation``, ``p`` outside ``[0, 1)``, parameters not
            ``[N]``, or ``N`` too long to keep a row in registers.
        RuntimeError: Triton cannot run on ``x.device`` (:func:`triton_available`).
        TypeError: a tensor is not float32, bfloat16 or float16.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float = 1e-5, p: float = 0.0,
                activation: str = "identity", seed: int | None = None) -> torch.Tensor:
        check_activation(activation)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        require_triton(x)
        n_cols = x.shape[-1]
        for label, param in (("weight", weight), ("bias", bias)):
            if param is not None:
                if param.shape != (n_cols,):
                    raise ValueError(f"{label} must have shape [{n_cols}], "
                                     f"got {tuple(param.shape)}")
                require_triton(param)
        ops = kernels("layer_norm")
        if n_cols > ops.max_fused_columns(x.dtype):
            raise ValueError(f"rows of {n_cols} {x.dtype} elements do not fit the fused "
                             f"kernel (at most {ops.max_fused_columns(x.dtype)})")
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if p > 0.0 else 0
        out_dtype = _output_dtype(x)
        if x.numel() == 0:
            y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            mean = rstd = torch.empty(0, dtype=torch.float32, device=x.device)
        else:
            y, mean, rstd = ops.layer_norm_fwd(_rows(x), weight, bias, eps, p, seed,
                                               activation, out_dtype)
            y = y.view(x.shape)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.p, ctx.seed, ctx.activation = p, seed, activation
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        if x.numel() == 0:
            return (torch.zeros_like(x) if need_dx else None,
                    torch.zeros_like(weight) if need_dweight else None,
                    torch.zeros_like(bias) if need_dbias else None, None, None, None, None)
        dx, dweight, dbias = kernels("layer_norm").layer_norm_bwd(
            _rows(dy), _rows(x), weight, bias, mean, rstd, ctx.p, ctx.seed, ctx.activation,
            dx_dtype=x.dtype, need_dweight=need_dweight, need_dbias=need_dbias)
        return (dx.view(x.shape) if need_dx else None, dweight, dbias,
                None, None, None, None)


#: ``layer_norm_dropout_activation(x, weight, bias, eps=1e-5, p=0.0,
#: activation="identity", seed=None)``: see :class:`LayerNormDropoutActivation`.
layer_norm_dropout_activation = LayerNormDropoutActivation.apply


@torch.compiler.disable
def _layer_norm_dropout_activation_outside_compile(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    p: float, activation: str,
) -> torch.Tensor:
    # Under torch.compile the kernels run as they are, between two graphs (a graph
    # break), instead of being traced through the launcher.
    return layer_norm_dropout_activation(x, weight, bias, eps, p, activation)


class FusedLayerNormDropoutActivation(KernelBackendMixin, nn.LayerNorm):
    """``activation(dropout(LayerNorm(x)))`` over the last dim, as one module.

    An :class:`nn.LayerNorm` (same parameters, ``state_dict`` keys, initialisation and
    ``isinstance``) with dropout and an activation after it. With the defaults
    (``dropout=0.0``, ``"identity"``) it is a drop-in LayerNorm whose backend can switch.

    - ``backend="eager"``: :func:`layer_norm_dropout_activation_reference`, i.e.
      ``F.layer_norm``, then ``F.dropout`` only when training with ``dropout > 0``, then
      the activation only when not ``"identity"``.
    - ``backend="triton"``: :func:`layer_norm_dropout_activation`, one Triton pass
      forward and one backward (bytes in the module docstring); left out of the graph
      under ``torch.compile`` (a graph break).

    Args:
        normalized_shape: ``N``, the last dim (an int or a 1-tuple).
        eps, elementwise_affine, bias, device, dtype: As :class:`nn.LayerNorm`.
        dropout: Dropout probability in ``[0, 1)``, applied in training only.
        activation: One of :data:`~gpuopt.kernels.activations.ACTIVATIONS`.
        backend: ``"eager"`` or ``"triton"``.

    Shapes: ``[..., N]`` -> ``[..., N]``; dtypes as ``F.layer_norm`` (float32 under CUDA
    autocast, else the input's).

    Raises:
        ValueError: ``normalized_shape`` has more than one dim, ``dropout`` is outside
            ``[0, 1)``, or ``activation``/``backend`` is unknown.
        RuntimeError: (in forward) backend ``"triton"`` where Triton cannot run.
    """

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *,
                 dropout: float = 0.0, activation: str = "identity", backend: str = "eager",
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias,
                         device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"only the last dim can be normalised, got normalized_shape "
                             f"{tuple(self.normalized_shape)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout_p = float(dropout)
        self.activation = check_activation(activation)
        self.backend = check_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[..., N]`` -> float ``[..., N]``."""
        p = self.dropout_p if self.training else 0.0
        if self.backend == "eager":
            return layer_norm_dropout_activation_reference(
                x, self.weight, self.bias, self.eps, p, self.activation)
        return _layer_norm_dropout_activation_outside_compile(
            x, self.weight, self.bias, self.eps, p, self.activation)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, dropout={self.dropout_p}, "
                f"activation={self.activation}, backend={self.backend}")
