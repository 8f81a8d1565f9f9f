"""Triton kernels of :mod:`gpuopt.kernels.bias_activation` and their launchers.

Imported only when a Triton kernel first runs (see :func:`gpuopt.kernels.backend.kernels`).
Inputs are 2-D ``[M, N]`` with unit column stride and any row stride; arithmetic is
float32; stores round to the output's dtype.
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

_MAX_BLOCK_N = 256


@triton.jit
def _bias_activation_fwd(X, B, Y, M, N, stride_x, stride_y,
                         HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Y = ACTIVATION(X + B)``: one read of X, one write of Y, B read once a tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = _activation_fwd(z, ACTIVATION)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_activation_bwd_dx(DX, DY, S, B, DB_partial, M, N, stride_dx, stride_dy, stride_s,
                            rows_per_program,
                            HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                            SAVED_IS_OUTPUT: tl.constexpr, STORE_DX: tl.constexpr,
                            COMPUTE_DB: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``DX = DY * ACTIVATION'(X + B)`` and this program's column sums of ``DX``.

    ``S`` is what the forward saved: the output ``Y`` when ``SAVED_IS_OUTPUT`` (ReLU:
    ``Y > 0`` exactly where ``X + B > 0``), else the input ``X`` (GELU recomputes
    ``X + B``). Program ``(g, j)`` walks rows ``[g * rows_per_program, ...)`` of column
    block ``j`` and writes its float32 partial bias gradient to ``DB_partial[g, cols]``
    (no atomics: the sum over ``g`` is a second kernel, as Liger-Kernel's LayerNorm).
    The partial sums stay ``[BLOCK_M, BLOCK_N]`` (each thread its own elements) until
    the walk ends: one reduction across the program's warps, not one a tile (on an
    H200, bf16 ``[16384, 4096]``, the whole backward took 441 us with a reduction a
    tile and 176 us so: 0.9 -> 2.3 TB/s of its 3 passes).
    """
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_BIAS and not SAVED_IS_OUTPUT:
        bias = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = group * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        if ACTIVATION == "identity":
            dz = dy
        else:
            s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0)
            s = s.to(tl.float32)
            if SAVED_IS_OUTPUT:
                dz = tl.where(s > 0.0, dy, 0.0)
            else:
                if HAS_BIAS:
                    s += bias[None, :]
                dz = _activation_bwd(dy, s, ACTIVATION)
        if STORE_DX:
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :],
                     dz.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DB:
            db += dz  # (0 outside the mask: dy is loaded as 0 there)
    if COMPUTE_DB:
        tl.store(DB_partial + group * N + cols, tl.sum(db, axis=0), mask=col_mask)


@functools.lru_cache(maxsize=256)
def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = min(next_power_of_2(n_cols), _MAX_BLOCK_N)
    block_m = min(next_power_of_2(n_rows), max(1, TILE_ELEMENTS // block_n))
    return block_m, block_n


def saves_output(activation: str) -> bool:
    """Whether the backward of ``activation`` needs the forward's output.

    ReLU's does (rather than its input, as GELU's); identity needs neither."""
    return activation == "relu"


def bias_activation_fwd(x: torch.Tensor, bias: torch.Tensor | None, activation: str,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """``activation(x + bias)`` into a new contiguous ``[M, N]`` tensor of ``out_dtype``.

    ``x`` is ``[M, N]`` with unit column stride."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    block_m, block_n = _blocks(n_rows, n_cols)
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
    _bias_activation_fwd[grid](
        x, bias if bias is not None else x, y, n_rows, n_cols, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
        **launch_options(block_m * block_n))
    return y


def bias_activation_bwd(dy: torch.Tensor, saved: torch.Tensor | None,
                        bias: torch.Tensor | None, activation: str, *,
                        dx_dtype: torch.dtype, need_dx: bool,
                        need_dbias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``activation(x + bias)``: ``(dx [M, N] or None, dbias [N] or None)``.

    ``saved`` is the forward's output for ReLU, its input ``x`` otherwise (``None`` for
    identity); ``dy`` and ``saved`` are ``[M, N]`` with unit column stride. ``dbias`` has
    ``bias.dtype`` and is summed in float32 from the unrounded ``dx``.
    """
    n_rows, n_cols = dy.shape
    dx = None
    if need_dx:
        dx = dy if activation == "identity" and dy.dtype == dx_dtype else torch.empty(
            (n_rows, n_cols), dtype=dx_dtype, device=dy.device)
    store_dx = need_dx and dx is not dy
    if not (store_dx or need_dbias):
        return dx, None
    block_m, block_n = _blocks(n_rows, n_cols)
    col_blocks = cdiv(n_cols, block_n)
    row_blocks = cdiv(n_rows, block_m)
    groups = max(1, min(row_blocks, program_budget(dy.device) // col_blocks))
    rows_per_program = cdiv(row_blocks, groups) * block_m
    groups = cdiv(n_rows, rows_per_program)
    partial = (torch.empty((groups, n_cols), dtype=torch.float32, device=dy.device)
               if need_dbias else dy)
    saved = saved if saved is not None else dy
    dx_arg = dx if store_dx and dx is not None else dy  # (store_dx: dx is a new tensor)
    _bias_activation_bwd_dx[(groups, col_blocks)](
        dx_arg, dy, saved, bias if bias is not None else dy, partial, n_rows, n_cols,
        dx_arg.stride(0), dy.stride(0), saved.stride(0), rows_per_program,
        HAS_BIAS=bias is not None, ACTIVATION=activation,
        SAVED_IS_OUTPUT=saves_output(activation), STORE_DX=store_dx, COMPUTE_DB=need_dbias,
        BLOCK_M=block_m, BLOCK_N=block_n, **launch_options(block_m * block_n))
    dbias = None
    if need_dbias:
        assert bias is not None  # it needs a gradient, so there is one
        dbias = column_sum(partial, bias.dtype)
    return dx, dbias
