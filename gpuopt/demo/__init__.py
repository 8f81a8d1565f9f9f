"""Demo workloads for ``gpuwatch demo``: real models on real data, no downloads.

``build_demo(name)`` returns a :class:`DemoWorkload`: a model, its loss, a training
dataset, a batch size and a learning rate, ready for any training loop::

    workload = build_demo("transformer")
    loader = DataLoader(workload.train_dataset, batch_size=workload.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=workload.lr)
    for inputs, targets in loader:
        loss = workload.loss_fn(workload.model(inputs), targets)
        ...

Workloads (default sizes; step = DataLoader batch with ``num_workers=0``, forward,
backward and AdamW step, median measured on a 2-core AVX-512 CPU with 2 torch threads):

``"transformer"``  :class:`CharTransformer` (d_model 128, 4 heads, 2 layers, context 64,
                   tied head, ~0.42 M parameters) on Python's documentation text at the
                   character level (V ~ 100), batch 16, lr 1e-3: ~21 ms a step; the
                   training loss falls from ~ln(V) = 4.5 to ~2.3 nats within 300 steps.
``"cnn"``          :class:`DigitsCNN` (48 and 96 channels, ~58 k parameters) on
                   scikit-learn's handwritten digits upsampled to 16x16, batch 64,
                   lr 3e-3: ~9 ms a step; validation accuracy passes 95% within ~50 steps.

Sizes are chosen so that one step costs milliseconds on a CPU: the point is to watch and
tune a live run, not to train a good model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gpuopt.demo.augment import ElasticAffine
from gpuopt.demo.data import (
    CharTextDataset,
    CharVocabulary,
    DigitsDataset,
    char_text_dataset,
    digits_dataset,
    pydoc_text,
)
from gpuopt.demo.models import CharTransformer, DigitsCNN

__all__ = [
    "DEMO_MODELS",
    "DemoWorkload",
    "build_demo",
    "next_token_loss",
    "classification_loss",
    "CharTransformer",
    "DigitsCNN",
    "CharTextDataset",
    "CharVocabulary",
    "DigitsDataset",
    "char_text_dataset",
    "digits_dataset",
    "pydoc_text",
]

#: Names accepted by :func:`build_demo`.
DEMO_MODELS = ("transformer", "cnn")

# Default sizes (see the module docstring for the step times they give).
TRANSFORMER_CONTEXT_LEN = 64
TRANSFORMER_D_MODEL = 128
TRANSFORMER_N_HEADS = 4
TRANSFORMER_N_LAYERS = 2
TRANSFORMER_BATCH_SIZE = 16
TRANSFORMER_LR = 1e-3
CNN_IMAGE_SIZE = 16
CNN_BATCH_SIZE = 64
CNN_LR = 3e-3


@dataclass
class DemoWorkload:
    """One demo training job: what a training loop needs besides the loop.

    Attributes:
        model: The model, on the CPU, in training mode, initialised from the seed.
        loss_fn: ``loss_fn(output, target) -> scalar loss`` (0-dim float tensor, mean
            over the batch), where ``output = model(inputs)`` for ``(inputs, target)``
            from ``train_dataset``.
        train_dataset: Map-style dataset of ``(inputs, target)`` pairs.
        batch_size: Default micro-batch size in samples.
        name: The workload's name, one of :data:`DEMO_MODELS`.
        lr: A learning rate that works with AdamW at ``batch_size``.
        val_dataset: Held-out dataset of the same kind, or ``None``.
    """

    model: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train_dataset: Dataset
    batch_size: int
    name: str
    lr: float
    val_dataset: Dataset | None = None


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits.

    Args:
        logits: float ``[B, T, V]``.
        targets: LongTensor ``[B, T]`` of token ids in ``[0, V)``.

    Returns:
        0-dim float tensor, in nats per token.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits ``[B, K]`` against labels LongTensor ``[B]``."""
    return F.cross_entropy(logits, labels)


def build_demo(model_name: str, *, seed: int = 0, batch_size: int | None = None) -> DemoWorkload:
    """Build a demo workload by name.

    The model's initial weights (and, for the transformer, the training-window offsets)
    depend only on ``seed``; the digits' train/validation split is fixed. The global RNG
    state is left as it was (the model is built under :func:`torch.random.fork_rng`).

    Args:
        model_name: ``"transformer"`` (character-level GPT on Python's documentation)
            or ``"cnn"`` (handwritten digits); see the module docstring for sizes.
        seed: Seed of the model initialisation and of the training-data windows.
        batch_size: Micro-batch size in samples; ``None`` for the workload's default.

    Returns:
        A :class:`DemoWorkload`.

    Raises:
        ValueError: ``model_name`` is not one of :data:`DEMO_MODELS`, or
            ``batch_size < 1``.
    """
    if model_name not in DEMO_MODELS:
        raise ValueError(
            f"unknown demo model {model_name!r}; choose one of: {', '.join(DEMO_MODELS)}"
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if model_name == "transformer":
        train = char_text_dataset(TRANSFORMER_CONTEXT_LEN, split="train", seed=seed)
        val = char_text_dataset(TRANSFORMER_CONTEXT_LEN, split="val")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CharTransformer(
                train.vocab_size,
                d_model=TRANSFORMER_D_MODEL,
                n_heads=TRANSFORMER_N_HEADS,
                n_layers=TRANSFORMER_N_LAYERS,
                context_len=TRANSFORMER_CONTEXT_LEN,
            )
        return DemoWorkload(
            model=model,
            loss_fn=next_token_loss,
            train_dataset=train,
            batch_size=batch_size or TRANSFORMER_BATCH_SIZE,
            name=model_name,
            lr=TRANSFORMER_LR,
            val_dataset=val,
        )
    digits_train = digits_dataset(split="train", image_size=CNN_IMAGE_SIZE,
                                  transform=ElasticAffine())
    digits_val = digits_dataset(split="val", image_size=CNN_IMAGE_SIZE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cnn = DigitsCNN(image_size=CNN_IMAGE_SIZE)
    return DemoWorkload(
        model=cnn,
        loss_fn=classification_loss,
        train_dataset=digits_train,
        batch_size=batch_size or CNN_BATCH_SIZE,
        name=model_name,
        lr=CNN_LR,
        val_dataset=digits_val,
    )
