"""The host CPU a fused op's call costs beside its kernels, against eager torch (no GPU).

    python benchmarks/bench_kernel_host.py [--calls 3000]

Where a step is launch-bound (a small model, a fast GPU, a slow host) what counts is the
host's time a call: an H200 run (README, "On a GPU") found the Triton path at about 500
us of host CPU a forward and backward against eager's 250. This measures the part that is
this project's code, on this machine's CPU: each fused op's forward and backward through
autograd, with the Triton launches replaced by no-ops (``TRITON_INTERPRET=1`` lets the
launchers run on CPU tensors; the stubs take the interpreter's kernels out), so what is
timed is the wrappers' Python, the launchers' arithmetic and allocations, and autograd's.
Beside it, eager torch's forward and backward of the same op on the same small CPU
tensors (its kernels included: tiny here), the host cost a user compares against.

Each figure is the best of 5 repeats of ``--calls`` calls (us a call), one torch thread.
Last line: ``RESULT bias_gelu_host_us=<a> bias_gelu_eager_us=<b> bias_gelu_ratio=<a/b>
ln_dropout_gelu_host_us=<c> ln_dropout_gelu_eager_us=<d> ln_dropout_gelu_ratio=<c/d>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: launchers on CPU tensors

import torch  # noqa: E402

from gpuopt.kernels import (  # noqa: E402
    bias_activation,
    bias_activation_reference,
    layer_norm_dropout_activation,
    layer_norm_dropout_activation_reference,
)
from gpuopt.kernels.backend import kernels  # noqa: E402

#: The Triton kernels each module launches, replaced by no-ops.
KERNELS = {"bias_activation": ("_bias_activation_fwd", "_bias_activation_bwd_dx"),
           "activation": ("_column_sum_bwd",),
           "layer_norm": ("_layer_norm_fwd_fused", "_layer_norm_bwd_dx_fused")}


class NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def best_us(call: Callable[[], None], calls: int, repeats: int = 5) -> float:
    """The best of ``repeats`` means of ``calls`` calls of ``call``, in us (after a warm-up)."""
    for _ in range(min(calls, 200)):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for module, names in KERNELS.items():
        for name in names:
            setattr(kernels(module), name, NoLaunch())
    torch.manual_seed(0)
    x = torch.randn(64, 96, requires_grad=True)
    weight = torch.randn(96, requires_grad=True)
    bias = torch.randn(96, requires_grad=True)
    dy = torch.randn(64, 96)
    ops = {
        "bias_gelu": (lambda: bias_activation(x, bias, "gelu"),
                      lambda: bias_activation_reference(x, bias, "gelu")),
        "ln_dropout_gelu": (
            lambda: layer_norm_dropout_activation(x, weight, bias, 1e-5, 0.1, "gelu"),
            lambda: layer_norm_dropout_activation_reference(x, weight, bias, 1e-5, 0.1,
                                                            "gelu")),
    }
    fields = []
    print(f"us a forward and backward through autograd, best of 5 x {args.calls} calls, "
          f"[64, 96] float32 on the CPU, one torch thread")
    for name, (fused, eager) in ops.items():
        def step(op: Callable[[], torch.Tensor]) -> Callable[[], None]:
            def call() -> None:
                x.grad = weight.grad = bias.grad = None
                op().backward(dy)
            return call

        host, reference = best_us(step(fused), args.calls), best_us(step(eager), args.calls)
        print(f"{name:<16} fused (launches stubbed) {host:7.1f}   eager {reference:7.1f}   "
              f"x{host / reference:.2f}")
        fields += [f"{name}_host_us={host:.1f}", f"{name}_eager_us={reference:.1f}",
                   f"{name}_ratio={host / reference:.2f}"]
    print("RESULT " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
