"""The demo workloads: real data, real models, real optimizer steps (CPU, a few seconds)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from gpuopt.demo import (
    DEMO_MODELS,
    CharTransformer,
    DigitsCNN,
    build_demo,
    char_text_dataset,
    digits_dataset,
    pydoc_text,
)


@pytest.fixture(scope="module")
def workloads():
    return {name: build_demo(name) for name in DEMO_MODELS}


def _first_batch(workload, batch_size: int = 8):
    loader = DataLoader(workload.train_dataset, batch_size=batch_size, shuffle=False)
    return next(iter(loader))


def test_transformer_shapes_and_initial_loss(workloads):
    workload = workloads["transformer"]
    inputs, targets = _first_batch(workload)
    vocab_size = workload.train_dataset.vocab_size
    context_len = workload.train_dataset.context_len
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.shape == targets.shape == (8, context_len)
    logits = workload.model(inputs)
    assert logits.shape == (8, context_len, vocab_size)
    loss = workload.loss_fn(logits, targets)
    assert loss.dim() == 0
    # Freshly initialised: close to the uniform guess over the vocabulary.
    assert abs(loss.item() - math.log(vocab_size)) < 0.5
    assert isinstance(workload.model.blocks, nn.ModuleList)
    assert workload.batch_size >= 1 and workload.lr > 0 and workload.name == "transformer"


def test_cnn_shapes(workloads):
    workload = workloads["cnn"]
    images, labels = _first_batch(workload)
    assert images.dtype == torch.float32 and labels.dtype == torch.long
    assert images.shape[:2] == (8, 1) and images.shape[2] == images.shape[3]
    logits = workload.model(images)
    assert logits.shape == (8, 10)
    assert workload.loss_fn(logits, labels).dim() == 0


@pytest.mark.parametrize("name", DEMO_MODELS)
def test_a_few_steps_overfit_a_fixed_batch(name):
    workload = build_demo(name, seed=1)
    inputs, targets = _first_batch(workload, batch_size=8)
    model = workload.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
    losses = []
    for _ in range(30):
        loss = workload.loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses)
    assert losses[-1] < 0.7 * losses[0], losses


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(ValueError, match="transformer.*cnn"):
        build_demo("resnet")


def test_batch_size_override_and_validation():
    assert build_demo("transformer", batch_size=3).batch_size == 3
    with pytest.raises(ValueError, match="batch_size"):
        build_demo("transformer", batch_size=0)


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    first = build_demo("transformer", seed=7)
    assert torch.equal(state, torch.get_rng_state())
    second = build_demo("transformer", seed=7)
    other = build_demo("transformer", seed=8)
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(
        first.model.token_embedding.weight, other.model.token_embedding.weight
    )


def test_char_dataset_is_deterministic_given_a_seed():
    a = char_text_dataset(32, seed=3, num_windows=100)
    b = char_text_dataset(32, seed=3, num_windows=100)
    c = char_text_dataset(32, seed=4, num_windows=100)
    assert len(a) == 100
    assert torch.equal(a.offsets, b.offsets)
    assert not torch.equal(a.offsets, c.offsets)
    inputs, targets = a[5]
    assert torch.equal(inputs, b[5][0])
    # The target is the input shifted by one character.
    assert torch.equal(inputs[1:], targets[:-1])


def test_char_dataset_holds_out_the_end_of_the_text():
    text = pydoc_text()
    train = char_text_dataset(64, split="train")
    val = char_text_dataset(64, split="val")
    assert train.vocab.chars == val.vocab.chars
    assert train.tokens.numel() + val.tokens.numel() == len(text)
    assert 0.04 < val.tokens.numel() / len(text) < 0.06
    assert val.vocab.decode(val.tokens[:200]) == text[train.tokens.numel() :][:200]
    # Training windows stay inside the training text.
    assert int(train.offsets.max()) + 64 + 1 <= train.tokens.numel()
    assert len(val) == (val.tokens.numel() - 1) // 64
    with pytest.raises(ValueError, match="split"):
        char_text_dataset(64, split="test")


def test_vocabulary_round_trip():
    dataset = char_text_dataset(16, num_windows=4)
    text = "def f(x):\n    return x"
    assert dataset.vocab.decode(dataset.vocab.encode(text)) == text


def test_digits_split_is_fixed_and_normalised():
    train = digits_dataset(split="train")
    val = digits_dataset(split="val")
    assert len(train) + len(val) == 1797
    assert torch.equal(train.images, digits_dataset(split="train").images)
    assert train.images.dtype == torch.float32
    assert float(train.images.min()) >= 0.0 and float(train.images.max()) <= 1.0
    assert set(val.labels.tolist()) == set(range(10))
    native = digits_dataset(split="val", image_size=8)
    assert native.images.shape[1:] == (1, 8, 8)


def test_digits_transform_is_applied_per_sample():
    flipped = digits_dataset(split="val", transform=lambda image: image.flip(-1))
    plain = digits_dataset(split="val")
    assert torch.equal(flipped[0][0], plain[0][0].flip(-1))
    assert flipped[0][1] == plain[0][1]


def test_transformer_is_causal_and_checks_length():
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=20, d_model=32, n_heads=4, n_layers=2, context_len=16)
    model.eval()
    idx = torch.randint(0, 20, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 20
    with torch.no_grad():
        assert torch.allclose(model(idx)[:, :10], model(changed)[:, :10], atol=1e-6)
    with pytest.raises(ValueError, match="context_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple"):
        CharTransformer(vocab_size=20, d_model=30, n_heads=4)


def test_cnn_rejects_an_image_size_it_cannot_pool():
    assert DigitsCNN(image_size=8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="multiple of 4"):
        DigitsCNN(image_size=10)
