"""The activations the fused kernels apply, and their torch references.

``"identity"``   ``x``
``"relu"``       ``max(x, 0)``: :func:`torch.nn.functional.relu`
``"gelu"``       ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))``, exact (erf) form:
                 ``F.gelu(x)`` (``approximate="none"``), what :class:`nn.GELU` computes by
                 default and what the demo transformer uses
``"gelu_tanh"``  ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``:
                 ``F.gelu(x, approximate="tanh")`` (GPT-2's GELU)

The Triton kernels compute the same formulas, and their derivatives as torch's
``relu``/``gelu_backward`` do, in float32 (``_activation_kernels.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuopt.kernels.backend import check_choice

__all__ = ["ACTIVATIONS", "activation_reference", "check_activation"]

#: Activation names the fused modules accept.
ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh")


def check_activation(activation: str) -> str:
    """``activation`` if it is one of :data:`ACTIVATIONS`.

    Raises:
        ValueError: ``activation`` is not one of :data:`ACTIVATIONS`.
    """
    return check_choice("activation", activation, ACTIVATIONS)


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply ``activation`` with plain torch ops (``x`` itself for ``"identity"``).

    Args:
        x: Any float tensor; the result has its shape and dtype.
        activation: One of :data:`ACTIVATIONS`.

    Raises:
        ValueError: ``activation`` is unknown.
    """
    if activation == "identity":
        return x
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    check_activation(activation)
    raise AssertionError("unreachable")
