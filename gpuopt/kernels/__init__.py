"""Fused Triton kernels with forward and backward, behind a backend switch.

Two fusions of memory-bound elementwise work, each as a plain-torch reference, a
``torch.autograd.Function`` over private Triton kernels, a public function
(``Function.apply``) and an ``nn.Module`` with ``backend`` in :data:`KERNEL_BACKENDS`:

- :class:`FusedLinearBiasActivation`: ``act(x @ W^T + b)``, a torch matmul then
  :func:`bias_activation`; 8 -> 5 passes forward and backward together.
- :class:`FusedLayerNormDropoutActivation`: ``act(dropout(LayerNorm(x)))``, as
  :func:`layer_norm_dropout_activation`; 14 passes (+ a 1-byte mask, twice) -> 5.

(a pass being one read or write of the ``[M, N]`` tensor; per-line counts in
:mod:`gpuopt.kernels.bias_activation` and :mod:`gpuopt.kernels.layer_norm`.)

Activations: :data:`ACTIVATIONS` (``"gelu"`` is the exact erf GELU of ``nn.GELU()``).
Inputs: float32, bfloat16, float16, any shape (rows of any length, masked), under
autocast or not; kernels compute in float32.

Switching: :func:`set_kernel_backend` ``(model, "triton")`` on a whole model;
:func:`triton_available` ``(device)`` says first whether Triton can run there (a CUDA
device, or anywhere with ``TRITON_INTERPRET=1`` set before the first kernel runs, for
tests). Triton is imported only when a kernel first runs.

Sources: Triton tutorials 02-fused-softmax, 04-low-memory-dropout, 05-layer-norm;
linkedin/Liger-Kernel.
"""

from gpuopt.kernels.activations import ACTIVATIONS, activation_reference
from gpuopt.kernels.backend import KERNEL_BACKENDS, set_kernel_backend, triton_available
from gpuopt.kernels.bias_activation import (
    BiasActivation,
    FusedLinearBiasActivation,
    bias_activation,
    bias_activation_reference,
)
from gpuopt.kernels.layer_norm import (
    FusedLayerNormDropoutActivation,
    LayerNormDropoutActivation,
    layer_norm_dropout_activation,
    layer_norm_dropout_activation_reference,
)

__all__ = [
    "ACTIVATIONS",
    "KERNEL_BACKENDS",
    "BiasActivation",
    "FusedLayerNormDropoutActivation",
    "FusedLinearBiasActivation",
    "LayerNormDropoutActivation",
    "activation_reference",
    "bias_activation",
    "bias_activation_reference",
    "layer_norm_dropout_activation",
    "layer_norm_dropout_activation_reference",
    "set_kernel_backend",
    "triton_available",
]
