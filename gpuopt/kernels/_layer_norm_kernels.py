"""Triton kernels of :mod:`gpuopt.kernels.layer_norm` and their launchers.

Imported only when a Triton kernel first runs (see :func:`gpuopt.kernels.backend.kernels`).
A program holds ``BLOCK_M`` whole rows (``BLOCK_N >= N``) in registers, so each row is
read once and written once; arithmetic is float32. The dropout mask is never stored:
element ``(row, col)`` is kept when ``tl.rand(seed, row * N + col) >= p``, and the
backward regenerates it from the same seed and offsets.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpuopt.kernels._activation_kernels import (
    _activation_bwd,
    _activation_fwd,
    TILE_ELEMENTS,
    cdiv,
    column_sum,
    launch_options,
    next_power_of_2,
    program_budget,
)

# Longest row held in registers: 64 KiB of input per row (the 05-layer-norm tutorial's
# limit), i.e. N <= 16384 in float32 and N <= 32768 in 16-bit dtypes.
_MAX_FUSED_BYTES = 65536


@triton.jit
def _dropout_keep(seed, rows, cols, N, p):
    """Bernoulli(1 - p) keep mask of the ``[rows, cols]`` block, from Philox."""
    return tl.rand(seed, rows[:, None] * N + cols[None, :]) >= p


@triton.jit(do_not_specialize=["seed"])
def _layer_norm_fwd_fused(X, Y, W, B, Mean, Rstd, M, N, stride_x, stride_y, eps, p, scale,
                          seed,
                          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_DROPOUT: tl.constexpr, ACTIVATION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y = ACTIVATION(dropout(LayerNorm(X) * W + B))`` over rows; saves mean and rstd."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    u = xc * rstd[:, None]
    if HAS_WEIGHT:
        u *= tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        u += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_DROPOUT:
        u = tl.where(_dropout_keep(seed, rows, cols, N, p), u * scale, 0.0)
    y = _activation_fwd(u, ACTIVATION)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["seed"])
def _layer_norm_bwd_dx_fused(DX, DY, DW_partial, DB_partial, X, W, B, Mean, Rstd, M, N,
                             stride_dx, stride_dy, stride_x, rows_per_program, p, scale,
                             seed,
                             HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_DROPOUT: tl.constexpr, ACTIVATION: tl.constexpr,
                             COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DX`` of the fused forward, and this program's partial ``dW``/``dB`` column sums.

    Recomputes ``x_hat = (X - mean) * rstd``, the dropout mask and the activation's
    input from ``X`` (no saved intermediates), then with ``g = dropout'(act'(u) * DY)``:
    ``dW += sum_rows g * x_hat``, ``dB += sum_rows g`` and, with ``h = g * W``,
    ``DX = rstd * (h - mean_cols(h * x_hat) * x_hat - mean_cols(h))``. Program ``i``
    walks rows ``[i * rows_per_program, ...)`` and writes float32 partials to row ``i``
    of ``DW_partial``/``DB_partial`` (Liger-Kernel's scheme; no locks or atomics),
    summed over its rows once the walk ends (``[BLOCK_M, BLOCK_N]`` until then: one
    reduction across warps a program, not one a tile; on an H200, bf16 ``[4096, 4096]``
    without dropout: 192 -> 144 us).
    """
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = group * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        x_hat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        g = dy.to(tl.float32)
        if ACTIVATION != "identity":
            u = x_hat
            if HAS_WEIGHT:
                u = u * w[None, :]
            if HAS_BIAS:
                u = u + b[None, :]
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, rows, cols, N, p)
                u = tl.where(keep, u * scale, 0.0)
            g = _activation_bwd(g, u, ACTIVATION)
            if HAS_DROPOUT:
                g = tl.where(keep, g * scale, 0.0)
        else:
            if HAS_DROPOUT:
                g = tl.where(_dropout_keep(seed, rows, cols, N, p), g * scale, 0.0)
        if COMPUTE_DW:
            dw += g * x_hat  # (0 outside the mask: x_hat and dy are 0 there)
        if COMPUTE_DB:
            db += g
        h = g
        if HAS_WEIGHT:
            h = g * w[None, :]
        c1 = tl.sum(h * x_hat, axis=1) / N
        c2 = tl.sum(h, axis=1) / N
        dx = (h - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
    if COMPUTE_DW:
        tl.store(DW_partial + group * N + cols, tl.sum(dw, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_partial + group * N + cols, tl.sum(db, axis=0), mask=col_mask)


def max_fused_columns(dtype: torch.dtype) -> int:
    """The longest row (``N``) the kernels take for inputs of ``dtype``."""
    return _MAX_FUSED_BYTES // torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=256)
def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = next_power_of_2(n_cols)
    block_m = min(next_power_of_2(n_rows), max(1, TILE_ELEMENTS // block_n))
    return block_m, block_n


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, p: float, seed: int, activation: str,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused LayerNorm forward of ``x [M, N]`` (unit column stride).

    Returns ``(y [M, N] of out_dtype, mean [M] float32, rstd [M] float32)``; dropout with
    probability ``p`` when ``p > 0``."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_m, block_n = _blocks(n_rows, n_cols)
    _layer_norm_fwd_fused[(cdiv(n_rows, block_m),)](
        x, y, weight if weight is not None else x, bias if bias is not None else x,
        mean, rstd, n_rows, n_cols, x.stride(0), y.stride(0), eps, p,
        1.0 / (1.0 - p), seed,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=p > 0.0,
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
        **launch_options(block_m * block_n))
    return y, mean, rstd


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                   p: float, seed: int, activation: str, *, dx_dtype: torch.dtype,
                   need_dweight: bool, need_dbias: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused LayerNorm backward for ``dy`` and ``x`` ``[M, N]`` with unit column stride.

    Returns ``(dx [M, N] of dx_dtype, dweight [N] or None, dbias [N] or None)``; parameter
    gradients have the parameters' dtypes, summed in float32."""
    n_rows, n_cols = x.shape
    dx = torch.empty((n_rows, n_cols), dtype=dx_dtype, device=x.device)
    block_m, block_n = _blocks(n_rows, n_cols)
    row_blocks = cdiv(n_rows, block_m)
    rows_per_program = cdiv(row_blocks, min(row_blocks, program_budget(x.device)))
    rows_per_program *= block_m
    groups = cdiv(n_rows, rows_per_program)
    need_dweight = need_dweight and weight is not None
    need_dbias = need_dbias and bias is not None
    dw_partial = (torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)
                  if need_dweight else x)
    db_partial = (torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)
                  if need_dbias else x)
    _layer_norm_bwd_dx_fused[(groups,)](
        dx, dy, dw_partial, db_partial, x, weight if weight is not None else x,
        bias if bias is not None else x, mean, rstd, n_rows, n_cols,
        dx.stride(0), dy.stride(0), x.stride(0), rows_per_program, p,
        1.0 / (1.0 - p), seed,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_DROPOUT=p > 0.0,
        ACTIVATION=activation, COMPUTE_DW=need_dweight, COMPUTE_DB=need_dbias,
        BLOCK_M=block_m, BLOCK_N=block_n, **launch_options(block_m * block_n))
    # (need_dweight and need_dbias were cleared above where there is no weight or bias)
    dweight = (column_sum(dw_partial, weight.dtype)
               if need_dweight and weight is not None else None)
    dbias = column_sum(db_partial, bias.dtype) if need_dbias and bias is not None else None
    return dx, dweight, dbias
