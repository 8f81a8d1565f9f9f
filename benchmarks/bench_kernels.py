"""The fused Triton kernels against eager torch and torch.compile, in GB/s (CUDA only).

    python benchmarks/bench_kernels.py [--dtype bf16] [--rows 4096] [--quick]

Ops (``[rows, N]`` inputs, N swept over typical hidden sizes and one irregular size):

- ``bias_gelu``:        ``gelu(x + bias)`` (a linear layer's epilogue), eager
                        :func:`bias_activation_reference` vs :func:`bias_activation`.
- ``ln_dropout_gelu``:  ``gelu(dropout(layer_norm(x), p=0.1))``, eager
                        :func:`layer_norm_dropout_activation_reference` vs
                        :func:`layer_norm_dropout_activation`.

Providers: ``triton`` (the fused kernels), ``eager`` (the torch reference),
``compile`` (``torch.compile`` of the torch reference, ``dynamic=False``: one graph a
shape, compiled before timing). Modes: ``fwd`` and ``fwd+bwd`` (backward with respect
to every input).

Two times a call, each provider the same way:

- **GPU time**: :func:`triton.testing.do_bench_cudagraph`, the calls captured in a CUDA
  graph and replayed, so no launch waits for Python: what the kernels themselves take,
  the time of a call in a step that keeps the GPU busy. Shown as bandwidth: the bytes
  the fused kernel must move (the minimum: forward reads ``x`` and writes ``y``, 2
  passes; backward reads ``dy`` and ``x`` and writes ``dx``, 3 passes; parameters
  negligible) over the time, the same bytes for every provider, so GB/s ratios are
  speed ratios. The torch reference moves more (per-line counts in
  :mod:`gpuopt.kernels.bias_activation` and :mod:`gpuopt.kernels.layer_norm`): its
  GB/s here is "useful" bandwidth, as in Triton's tutorials.
- **Wall time** (us a call): :func:`triton.testing.do_bench`, calls launched one after
  another from Python: where launching them costs more CPU than the GPU's work (small
  inputs, a slow host), this is the CPU's time, as a launch-bound step pays it.

The benchmarks are declared with :func:`triton.testing.perf_report`; they are run here
by a small loop over ``Mark.benchmarks`` rather than ``Mark.run`` (which needs pandas
and matplotlib), so that the ratios can be printed and summarised.

Last line: ``RESULT bias_gelu_vs_eager=<r> bias_gelu_vs_compile=<r>
ln_dropout_gelu_vs_eager=<r> ln_dropout_gelu_vs_compile=<r> bias_gelu_wall_vs_eager=<w>
ln_dropout_gelu_wall_vs_eager=<w> peak_gbps=<g> dtype=<d> rows=<m>``, each ratio the
geometric mean over N of the ``fwd+bwd`` speedup of ``triton`` (time of the other
provider / time of triton; > 1 means the fused kernels are faster), in GPU time, and
the ``wall`` ones in wall time; ``peak_gbps`` the fused kernels' best, in GPU time.
Without a CUDA device it prints why and ``RESULT skipped=no_cuda`` and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch

from gpuopt.kernels import (
    bias_activation,
    bias_activation_reference,
    layer_norm_dropout_activation,
    layer_norm_dropout_activation_reference,
    triton_available,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROVIDERS = ("triton", "eager", "compile")
MODES = ("fwd", "fwd+bwd")
SIZES = [768, 781, 1024, 2048, 4096, 8192]
QUICK_SIZES = [781, 4096]
DROPOUT_P = 0.1
# Passes over the [rows, N] tensor the fused kernels make (see the module docstring).
PASSES = {"fwd": 2, "fwd+bwd": 5}

Op = Callable[..., torch.Tensor]


# Parameters in the input's dtype, so that no provider pays for a cast.
def _bias_gelu_inputs(rows: int, n_cols: int, dtype: torch.dtype, device: str):
    x = torch.randn(rows, n_cols, dtype=dtype, device=device)
    bias = torch.randn(n_cols, dtype=dtype, device=device) * 0.1
    return [x, bias]


def _ln_inputs(rows: int, n_cols: int, dtype: torch.dtype, device: str):
    x = torch.randn(rows, n_cols, dtype=dtype, device=device) * 2.0 + 0.5
    weight = 1.0 + 0.1 * torch.randn(n_cols, dtype=dtype, device=device)
    bias = 0.1 * torch.randn(n_cols, dtype=dtype, device=device)
    return [x, weight, bias]


def _ln_eager(x, weight, bias):
    return layer_norm_dropout_activation_reference(x, weight, bias, 1e-5, DROPOUT_P, "gelu")


def _ln_triton(x, weight, bias):
    return layer_norm_dropout_activation(x, weight, bias, 1e-5, DROPOUT_P, "gelu")


#: op name -> (make inputs, {provider: function of the inputs}).
OPS: dict[str, tuple[Callable, dict[str, Op]]] = {
    "bias_gelu": (_bias_gelu_inputs, {
        "triton": lambda x, b: bias_activation(x, b, "gelu"),
        "eager": lambda x, b: bias_activation_reference(x, b, "gelu"),
    }),
    "ln_dropout_gelu": (_ln_inputs, {
        "triton": _ln_triton,
        "eager": _ln_eager,
    }),
}

_COMPILED: dict[tuple[str, str], Op] = {}


def _provider_fn(op: str, provider: str, mode: str) -> Op:
    functions = OPS[op][1]
    if provider != "compile":
        return functions[provider]
    key = (op, mode)  # one compiled object a mode: the guards on requires_grad differ
    if key not in _COMPILED:
        # one graph a shape and mode, and each is compiled again for the timing that
        # follows (wall after GPU): 6 sizes x 2 modes pass dynamo's default limit of 8
        # graphs a function, past which it runs the function eagerly (the first H200
        # run's compile column at N=4096 and 8192 was eager's)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[key] = torch.compile(functions["eager"], dynamic=False)
    return _COMPILED[key]


def measure_ms(op: str, provider: str, mode: str, n_cols: int, rows: int,
               dtype: torch.dtype, device: str, timing: str) -> tuple[float, float, float]:
    """``(median, p20, p80)`` milliseconds of one call of ``op`` by ``provider``.

    ``timing``: ``"gpu"`` (CUDA graph replay: the kernels' time) or ``"wall"`` (calls
    launched from Python, their launch included)."""
    from triton.testing import do_bench, do_bench_cudagraph

    torch.manual_seed(0)
    inputs = OPS[op][0](rows, n_cols, dtype, device)
    fn = _provider_fn(op, provider, mode)
    if mode == "fwd":
        def call() -> None:
            fn(*inputs)
    else:
        for tensor in inputs:
            tensor.requires_grad_(True)
        dy = torch.randn(rows, n_cols, dtype=dtype, device=device)

        def call() -> None:
            fn(*inputs).backward(dy)
    call()  # compile (Triton, or torch.compile) outside the timing
    bench = do_bench_cudagraph if timing == "gpu" else do_bench
    median, p20, p80 = bench(call, quantiles=[0.5, 0.2, 0.8], grad_to_none=inputs)
    return median, p20, p80


def _declare(rows: int, dtype_name: str, sizes: list[int]):
    import triton.testing

    benchmarks = [
        triton.testing.Benchmark(
            x_names=["N"], x_vals=sizes, line_arg="provider", line_vals=list(PROVIDERS),
            line_names=list(PROVIDERS), styles=[("blue", "-"), ("green", "-"), ("red", "-")],
            ylabel="GB/s", plot_name=f"{op}-{mode}-{dtype_name}",
            args={"op": op, "mode": mode, "rows": rows, "dtype_name": dtype_name})
        for op in OPS for mode in MODES
    ]

    @triton.testing.perf_report(benchmarks)
    def bench(N: int, provider: str, op: str, mode: str, rows: int, dtype_name: str,
              device: str = "cuda", timing: str = "gpu") -> tuple[float, float, float]:
        """GB/s (median, at the 80th and 20th percentile of time) of one call."""
        dtype = DTYPES[dtype_name]
        bytes_moved = PASSES[mode] * rows * N * torch.empty((), dtype=dtype).element_size()
        median, p20, p80 = measure_ms(op, provider, mode, N, rows, dtype, device, timing)
        return tuple(bytes_moved * 1e-6 / ms for ms in (median, p80, p20))

    return bench


def _gpu_gbps(mark, n_cols: int, provider: str, device: str, args: dict) -> float:
    """GB/s in GPU time of one declared benchmark; NaN (said) where the calls cannot be
    captured in a CUDA graph."""
    try:
        return mark.fn(N=n_cols, provider=provider, device=device, **args)[0]
    except Exception as error:  # a capture refused: the other figures still count
        print(f"  ({provider}, N={n_cols}: no GPU time: {type(error).__name__}: "
              f"{str(error)[:200]})")
        torch.cuda.synchronize()
        return math.nan


def run(rows: int, dtype_name: str, sizes: list[int], device: str = "cuda") -> str:
    """Run every declared benchmark, print a table each, and return the RESULT line."""
    mark = _declare(rows, dtype_name, sizes)
    speedups: dict[str, list[float]] = {}
    peak_gbps = 0.0
    element_size = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    for bench in mark.benchmarks:
        bytes_moved = PASSES[bench.args["mode"]] * rows * element_size
        print(f"\n{bench.plot_name} (rows={rows}; GPU time as GB/s of the fused kernel's "
              "bytes; wall us a call)")
        print(f"{'N':>6} " + " ".join(f"{p:>9}" for p in PROVIDERS)
              + f" {'vs eager':>9} {'vs compile':>10} "
              + " ".join(f"{p + ' us':>10}" for p in PROVIDERS) + f" {'vs eager':>9}")
        for n_cols in bench.x_vals:
            gbps = {p: _gpu_gbps(mark, n_cols, p, device, bench.args) for p in PROVIDERS}
            wall_us = {p: bytes_moved * n_cols * 1e-3 / mark.fn(
                N=n_cols, provider=p, device=device, timing="wall", **bench.args)[0]
                for p in PROVIDERS}
            peak_gbps = max(peak_gbps, gbps["triton"])
            vs_eager, vs_compile = (gbps["triton"] / gbps[p] for p in ("eager", "compile"))
            wall_vs_eager = wall_us["eager"] / wall_us["triton"]
            print(f"{n_cols:>6} " + " ".join(f"{gbps[p]:>9.1f}" for p in PROVIDERS)
                  + f" {vs_eager:>8.2f}x {vs_compile:>9.2f}x "
                  + " ".join(f"{wall_us[p]:>10.1f}" for p in PROVIDERS)
                  + f" {wall_vs_eager:>8.2f}x", flush=True)
            if bench.args["mode"] == "fwd+bwd":
                op = bench.args["op"]
                speedups.setdefault(f"{op}_vs_eager", []).append(vs_eager)
                speedups.setdefault(f"{op}_vs_compile", []).append(vs_compile)
                speedups.setdefault(f"{op}_wall_vs_eager", []).append(wall_vs_eager)
    fields = [f"{name}={math.exp(sum(map(math.log, values)) / len(values)):.3f}"
              for name, values in speedups.items()]  # (nan where one time is missing)
    return " ".join(["RESULT", *fields, f"peak_gbps={peak_gbps:.1f}", f"dtype={dtype_name}",
                     f"rows={rows}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rows", type=int, default=4096, help="M, rows of every input")
    parser.add_argument("--quick", action="store_true", help=f"only N in {QUICK_SIZES}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        problem = "no CUDA device (torch.cuda.is_available() is False)"
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        problem = "TRITON_INTERPRET is set: the kernels would run in the interpreter"
    else:
        problem = triton_available("cuda")
    if problem is not None:
        print(f"bench_kernels needs a CUDA device to time the Triton kernels: {problem}")
        print("RESULT skipped=no_cuda")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(run(args.rows, args.dtype, QUICK_SIZES if args.quick else SIZES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
