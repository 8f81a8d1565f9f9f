"""Triton helpers shared by the fused kernels.

Activations, their derivatives, and the column reduction that finishes a bias or LayerNorm
weight gradient.

Imported only when a Triton kernel first runs (see :func:`gpuopt.kernels.backend.kernels`).
All arithmetic is float32. ``ACTIVATION`` is a ``tl.constexpr`` string from
:data:`gpuopt.kernels.activations.ACTIVATIONS`, so each activation compiles to its own
straight-line code.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _tanh(x):
    # tanh from exp (portable across backends and the interpreter). x is clamped at 20,
    # where tanh is 1.0 in float32, so that exp cannot overflow; for very negative x exp
    # underflows to 0, giving -1.
    return 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(x, 20.0)) + 1.0)


# Constants are tl.constexpr (Triton refuses plain globals) and multiply a block from the
# right: ``constexpr * block`` would stay a constexpr under the interpreter.


@triton.jit
def _activation_fwd(x, ACTIVATION: tl.constexpr):
    """``ACTIVATION(x)`` for a float32 block ``x``."""
    if ACTIVATION == "relu":
        y = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        y = 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))
    elif ACTIVATION == "gelu_tanh":
        y = 0.5 * x * (1.0 + _tanh((x + x * x * x * _GELU_KAPPA) * _SQRT_2_OVER_PI))
    else:
        y = x
    return y


@triton.jit
def _activation_bwd(dy, x, ACTIVATION: tl.constexpr):
    """``dy * ACTIVATION'(x)`` for float32 blocks, as torch's ``relu``/``gelu_backward``."""
    if ACTIVATION == "relu":
        dx = tl.where(x > 0.0, dy, 0.0)
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
        dx = dy * (cdf + x * pdf)
    elif ACTIVATION == "gelu_tanh":
        x_sq = x * x
        t = _tanh((x + x_sq * x * _GELU_KAPPA) * _SQRT_2_OVER_PI)
        d_inner = (1.0 + x_sq * (3.0 * _GELU_KAPPA)) * _SQRT_2_OVER_PI
        dx = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)
    else:
        dx = dy
    return dx


@triton.jit
def _column_sum_bwd(Partial, Out, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Out[n] = sum_g Partial[g, n]``: the second stage of a weight/bias gradient.

    ``Partial`` is float32 ``[G, N]`` (one row per program of the first stage); ``Out``
    is ``[N]`` in the parameter's dtype. As ``_layer_norm_bwd_dwdb`` in Triton's
    05-layer-norm tutorial, one program per ``BLOCK_N`` columns.
    """
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(0, G, BLOCK_G):
        groups = start + tl.arange(0, BLOCK_G)
        mask = (groups < G)[:, None] & col_mask[None, :]
        acc += tl.load(Partial + groups[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(Out + cols, tl.sum(acc, axis=0).to(Out.dtype.element_ty), mask=col_mask)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints, in plain Python.

    ``triton.cdiv`` and ``triton.next_power_of_2`` are JIT functions in Triton 3.9: a
    call from the host goes through the JIT's call path, about 11 us each here (nine of
    them a fused forward and backward: half its host time). These are the host's."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= ``n`` (1 for ``n <= 1``), in plain Python (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def column_sum(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum float32 ``partial [G, N]`` over its rows into a new ``[N]`` tensor of ``dtype``."""
    groups, n_cols = partial.shape
    out = torch.empty(n_cols, dtype=dtype, device=partial.device)
    block_n = min(next_power_of_2(n_cols), 256)
    block_g = min(next_power_of_2(groups), 32)
    _column_sum_bwd[(cdiv(n_cols, block_n),)](
        partial, out, groups, n_cols, BLOCK_G=block_g, BLOCK_N=block_n,
        **launch_options(block_g * block_n))
    return out


#: Elements per tile of the fused kernels: 16 KiB of fp32 registers per program, a size at
#: which elementwise Triton kernels reach DRAM bandwidth on A100/H100 class GPUs.
TILE_ELEMENTS = 4096


def program_budget(device: torch.device) -> int:
    """How many programs a reduction's first stage should run on ``device``.

    Four per streaming multiprocessor on CUDA (Liger-Kernel sizes its LayerNorm backward
    by the SM count the same way); 8 under the interpreter, where programs run one after
    another and fewer, longer ones cost the same.
    """
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None
                             else torch.cuda.current_device())
    return 8


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


@functools.lru_cache(maxsize=None)
def launch_options(tile_elements: int) -> dict[str, object]:
    """Launch options for a program of ``tile_elements``.

    Warps as the 02-fused-softmax / 05-layer-norm tutorials (about 8 elements a thread, up
    to 8 warps) and, for the long rows of a LayerNorm, Liger-Kernel's ``calculate_settings``
    (16 warps from 8192 elements, 32 from 32768); FMA contraction on, stated so (Triton 3.9
    warns when it is left to its default). Cached: the same dict for a size, which callers
    pass on with ``**`` and never change."""
    if tile_elements >= 32768:
        num_warps = 32
    elif tile_elements >= 8192:
        num_warps = 16
    else:
        num_warps = min(max(tile_elements // 256, 1), 8)
    return {"num_warps": num_warps, "enable_fp_fusion": True}
