"""CPU data augmentation for the digits demo: random affine plus elastic distortion.

Source: Simard, Steinkraus and Platt, "Best Practices for Convolutional Neural Networks
Applied to Visual Document Analysis" (ICDAR 2003): elastic distortion is a random
displacement field smoothed by a Gaussian of width ``sigma`` and scaled by ``alpha``.
It is deliberately real CPU work per sample, so that the demo's input pipeline can be
the bottleneck at ``num_workers=0`` and relieved by raising workers live.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _gaussian_kernel(sigma: float) -> torch.Tensor:
    radius = max(1, int(math.ceil(3 * sigma)))
    x = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    return kernel / kernel.sum()


class ElasticAffine:
    """Random affine (rotation, scale, shift) then elastic distortion of one image.

    Args:
        rotation_deg: maximum absolute rotation, degrees.
        scale: maximum relative scale change (0.1: 0.9x to 1.1x).
        shift: maximum shift as a fraction of the image side.
        alpha: elastic displacement strength, in pixels.
        sigma: smoothing of the displacement field, in pixels.
        repeats: how many times the distortion is computed (cost knob; the last one is
            kept). Default 1.

    Call with an image float32 ``[1, H, W]`` in ``[0, 1]``; returns the same shape and
    dtype. Uses torch's global RNG (per DataLoader worker, seeded by the DataLoader).
    """

    def __init__(self, rotation_deg: float = 12.0, scale: float = 0.1, shift: float = 0.08,
                 alpha: float = 2.5, sigma: float = 2.0, repeats: int = 1) -> None:
        self.rotation_deg = rotation_deg
        self.scale = scale
        self.shift = shift
        self.alpha = alpha
        self.sigma = sigma
        self.repeats = repeats
        self._kernel = _gaussian_kernel(sigma)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            out = self._distort(image)
        return out

    def _distort(self, image: torch.Tensor) -> torch.Tensor:
        _, height, width = image.shape
        angle = math.radians((torch.rand(()).item() * 2 - 1) * self.rotation_deg)
        factor = 1.0 + (torch.rand(()).item() * 2 - 1) * self.scale
        tx, ty = ((torch.rand(2) * 2 - 1) * self.shift * 2).tolist()
        cos, sin = math.cos(angle) / factor, math.sin(angle) / factor
        theta = torch.tensor([[[cos, -sin, tx], [sin, cos, ty]]], dtype=torch.float32)
        grid = F.affine_grid(theta, [1, 1, height, width], align_corners=False)
        # elastic: smooth a random field with a separable Gaussian, in pixels -> [-1, 1] units
        field = torch.rand(2, 1, height, width) * 2 - 1
        k = self._kernel
        pad = k.numel() // 2
        field = F.conv2d(F.pad(field, (pad, pad, 0, 0), mode="reflect"), k.view(1, 1, 1, -1))
        field = F.conv2d(F.pad(field, (0, 0, pad, pad), mode="reflect"), k.view(1, 1, -1, 1))
        field = field / field.abs().amax().clamp_min(1e-6) * self.alpha
        displacement = torch.stack((field[0, 0] * 2 / width, field[1, 0] * 2 / height), -1)
        grid = grid + displacement.unsqueeze(0)
        out = F.grid_sample(image.unsqueeze(0), grid, mode="bilinear",
                            padding_mode="zeros", align_corners=False)
        return out[0].clamp_(0.0, 1.0)
