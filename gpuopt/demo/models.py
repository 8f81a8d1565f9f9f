"""Models for the demo workloads: a small GPT-style character transformer and a digits CNN.

Both are plain ``nn.Module`` s with nothing demo-specific in them, so every optimization
in :mod:`gpuopt` (autocast, accumulation, activation checkpointing over
``CharTransformer.blocks``, fused kernels, ``torch.compile``) applies to them as to any
model.

Fused kernels: the layers that have a fused form are :mod:`gpuopt.kernels` modules,
subclasses of the ``nn.Linear``/``nn.LayerNorm`` they replace (same parameters,
initialisation and ``state_dict`` keys) whose ``backend`` starts as ``"eager"``, where
they run the same torch ops as before, bit for bit.
:func:`gpuopt.kernels.set_kernel_backend` ``(model, "triton")`` moves them to Triton:

- :class:`CharTransformer`: each block's ``mlp.fc`` (Linear -> GELU, the exact erf GELU of
  ``nn.GELU()``) is a :class:`~gpuopt.kernels.FusedLinearBiasActivation`; ``ln_1``,
  ``ln_2`` and ``ln_f`` are :class:`~gpuopt.kernels.FusedLayerNormDropoutActivation`
  without dropout or activation (plain LayerNorms): ``2 n_layers + 1`` LayerNorms and
  ``n_layers`` MLP input layers in all.
- :class:`DigitsCNN`: the classifier's Linear (no activation follows it) is a
  :class:`~gpuopt.kernels.FusedLinearBiasActivation` with ``activation="identity"``: the
  bias add and its gradient run in Triton.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpuopt.kernels import FusedLayerNormDropoutActivation, FusedLinearBiasActivation

__all__ = ["CausalSelfAttention", "MLP", "Block", "CharTransformer", "DigitsCNN"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via :func:`F.scaled_dot_product_attention`.

    Args:
        d_model: Width of the residual stream ``C``.
        n_heads: Number of heads ``H``; ``C`` must be a multiple of ``H``.
        dropout: Dropout probability on the attention weights and the output, in training.

    Raises:
        ValueError: ``d_model`` is not a multiple of ``n_heads``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        # the attention weights' dropout, drawn by scaled_dot_product_attention from this
        # module's p: a module, so that a live change of every dropout's p reaches it too
        self.attn_dropout = nn.Dropout(dropout)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[B, T, C]`` -> float ``[B, T, C]``; position t attends to ``<= t``."""
        batch, time, channels = x.shape
        # [B, T, 3C] -> 3 x [B, H, T, C/H]
        q, k, v = (
            self.qkv(x)
            .view(batch, time, 3, self.n_heads, channels // self.n_heads)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout.p if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, time, channels)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C) -> dropout.

    ``fc`` is Linear + GELU (exact erf form) as one
    :class:`~gpuopt.kernels.FusedLinearBiasActivation`.
    """

    def __init__(self, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = FusedLinearBiasActivation(d_model, 4 * d_model, activation="gelu")
        self.proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[..., C]`` -> float ``[..., C]``."""
        return self.dropout(self.proj(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Maps ``[B, T, C]`` to ``[B, T, C]`` and takes nothing but ``x``, so it can be wrapped
    whole by activation checkpointing.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = FusedLayerNormDropoutActivation(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_2 = FusedLayerNormDropoutActivation(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[B, T, C]`` -> float ``[B, T, C]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharTransformer(nn.Module):
    """A small decoder-only (GPT-style) transformer over characters.

    Token embedding + learned position embedding -> dropout -> ``n_layers`` pre-LN
    :class:`Block` s in ``self.blocks`` (an ``nn.ModuleList``, the unit of activation
    checkpointing) -> final LayerNorm -> linear head to ``V`` logits. Weights follow
    GPT-2: normal(0, 0.02), residual output projections scaled by ``1/sqrt(2 n_layers)``.

    Args:
        vocab_size: Number of token ids ``V``.
        d_model: Residual stream width ``C``.
        n_heads: Attention heads; ``d_model`` must be a multiple of it.
        n_layers: Number of blocks.
        context_len: Longest sequence ``T`` the position embedding covers.
        dropout: Dropout probability (embeddings, attention, residual branches).
        tie_weights: Share the head's weight with the token embedding (saves ``V x C``
            parameters; the default, as in GPT-2).

    Raises:
        ValueError: a size is not positive or ``d_model`` is not a multiple of ``n_heads``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        context_len: int = 64,
        dropout: float = 0.0,
        *,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        for label, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("n_layers", n_layers),
            ("context_len", context_len),
        ):
            if value < 1:
                raise ValueError(f"{label} must be >= 1, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = FusedLayerNormDropoutActivation(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if tie_weights:
            self.head.weight = self.token_embedding.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        Args:
            idx: LongTensor ``[B, T]`` of token ids in ``[0, V)``, ``T <= context_len``.

        Returns:
            float ``[B, T, V]`` logits; position ``t`` sees tokens ``0..t`` only.

        Raises:
            ValueError: ``idx`` is not 2-D or ``T > context_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be [B, T], got shape {tuple(idx.shape)}")
        time = idx.shape[1]
        if time > self.context_len:
            raise ValueError(f"sequence length {time} exceeds context_len {self.context_len}")
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class DigitsCNN(nn.Module):
    """A small CNN for 10-class digit images.

    ``[conv3x3 -> BatchNorm -> ReLU -> maxpool 2x2] x 2 -> flatten -> dropout -> linear``
    (the linear a :class:`~gpuopt.kernels.FusedLinearBiasActivation`, no activation).
    With the default 16x16 input the feature map before the head is
    ``[channels[1], 4, 4]``.

    Args:
        image_size: Side ``H = W`` of the input images in pixels, a multiple of 4.
        channels: Output channels of the two conv layers.
        num_classes: Number of classes.
        dropout: Dropout probability before the head.

    Raises:
        ValueError: ``image_size`` is not a positive multiple of 4.
    """

    def __init__(
        self,
        image_size: int = 16,
        channels: tuple[int, int] = (48, 96),
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if image_size < 4 or image_size % 4 != 0:
            raise ValueError(f"image_size must be a positive multiple of 4, got {image_size}")
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            FusedLinearBiasActivation(c2 * side * side, num_classes, activation="identity"),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` float ``[B, 1, H, W]`` -> logits float ``[B, num_classes]``."""
        return self.head(self.features(images))
