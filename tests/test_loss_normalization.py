"""Trainer(loss_normalization=...): the window's gradient checked by hand for micro-batches
of unequal size (huggingface/transformers#34191), live changes included, and tokens.

Every optimizer step records the parameters it started from and the gradient it was
given; the test then computes, with a copy of the model at those parameters, the
gradient of the loss the window is meant to be the mean of, for the same micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from sklearn.datasets import load_digits

from gpuopt import Trainer
from gpuopt.trainer import LOSS_NORMALIZATIONS, count_target_tokens

F = torch.nn.functional


def _digits(sizes):
    """Micro-batches of digits with these sizes, in order."""
    digits = load_digits()
    x = torch.tensor(digits.data[:sum(sizes)], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:sum(sizes)], dtype=torch.long)
    return list(zip(x.split(sizes), y.split(sizes)))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))


class Recorder:
    """Optimizer wrapper target: each step's starting parameters and its gradients; and
    a callback recording the StepStats and applying ``changes`` at step boundaries."""

    def __init__(self, model, changes=None):
        self.model, self.changes = model, changes or {}
        self.params, self.grads, self.stats = [], [], []

    def optimizer(self, lr=0.1):
        recorder = self

        class Recording(torch.optim.SGD):
            def step(self, closure=None):
                recorder.params.append({n: p.detach().clone()
                                        for n, p in recorder.model.named_parameters()})
                recorder.grads.append({n: p.grad.clone()
                                       for n, p in recorder.model.named_parameters()})
                return super().step(closure)

        return Recording(self.model.parameters(), lr=lr)

    def on_optimizer_step(self, trainer, stats):
        self.stats.append(stats)
        for attr, value in self.changes.get(stats.step, {}).items():
            setattr(trainer, attr, value)


def _grads_of(model, params, loss_of):
    """Gradients of ``loss_of(copy)`` for a copy of ``model`` holding ``params``."""
    twin = copy.deepcopy(model)
    twin.load_state_dict(params)
    twin.zero_grad()
    loss = loss_of(twin)
    loss.backward()
    return {n: p.grad.clone() for n, p in twin.named_parameters()}, loss.detach()


def _assert_grads(got, expected):
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def _sample_mean(window):
    """The mean cross-entropy over every sample of the window."""
    x = torch.cat([b[0] for b in window])
    y = torch.cat([b[1] for b in window])
    return lambda model: F.cross_entropy(model(x), y)


def _micro_batch_mean(window):
    """The mean of the micro-batches' mean cross-entropies."""
    return lambda model: sum(F.cross_entropy(model(x), y) for x, y in window) / len(window)


SIZES = [5, 17, 3, 11, 8, 2, 9, 4, 6]  # unequal micro-batches


def test_samples_normalisation_gives_the_gradient_of_the_mean_over_every_sample():
    batches = _digits(SIZES[:6])
    results = {}
    for normalization in ("micro_batch_mean", "samples"):
        model = _mlp()
        recorder = Recorder(model)
        trainer = Trainer(model, recorder.optimizer(), F.cross_entropy, batches,
                          accum_steps=3, callbacks=[recorder],
                          loss_normalization=normalization)
        assert trainer.loss_normalization == normalization
        trainer.fit(epochs=1)
        assert [s.micro_batches for s in recorder.stats] == [3, 3]
        assert [s.samples for s in recorder.stats] == [25, 21]
        hand = _sample_mean if normalization == "samples" else _micro_batch_mean
        for step, window in enumerate((batches[:3], batches[3:])):
            expected, loss = _grads_of(model, recorder.params[step], hand(window))
            _assert_grads(recorder.grads[step], expected)
            torch.testing.assert_close(recorder.stats[step].loss, loss, rtol=1e-5, atol=1e-6)
        results[normalization] = recorder.grads[0]
    # with these sizes the two means differ: the default is not the samples' mean
    assert not torch.allclose(results["samples"]["0.weight"],
                              results["micro_batch_mean"]["0.weight"], rtol=1e-3)


def test_live_changes_of_window_and_normalisation_and_a_short_last_window_by_hand():
    batches = _digits(SIZES)
    model = _mlp()
    # step 1: 2 micro-batches, micro-batch mean; then 3 per window, by samples; the data
    # ends after one micro-batch of the fourth window; step 3 goes back to micro-batch mean
    recorder = Recorder(model, {1: {"accum_steps": 3, "loss_normalization": "samples"},
                                3: {"loss_normalization": "micro_batch_mean"}})
    trainer = Trainer(model, recorder.optimizer(), F.cross_entropy, batches, accum_steps=2,
                      callbacks=[recorder])
    trainer.fit(epochs=1)
    windows = [batches[0:2], batches[2:5], batches[5:8], batches[8:9]]
    hands = [_micro_batch_mean, _sample_mean, _sample_mean, _micro_batch_mean]
    assert [s.micro_batches for s in recorder.stats] == [2, 3, 3, 1]
    assert trainer.step == 4
    for step, (window, hand) in enumerate(zip(windows, hands)):
        expected, loss = _grads_of(model, recorder.params[step], hand(window))
        _assert_grads(recorder.grads[step], expected)
        torch.testing.assert_close(recorder.stats[step].loss, loss, rtol=1e-5, atol=1e-6)

    # a last short window by samples: 2 of 3 micro-batches, weighted by their own total
    model = _mlp()
    recorder = Recorder(model)
    Trainer(model, recorder.optimizer(), F.cross_entropy, batches[:5], accum_steps=3,
            callbacks=[recorder], loss_normalization="samples").fit(epochs=1)
    assert [s.micro_batches for s in recorder.stats] == [3, 2]
    expected, _ = _grads_of(model, recorder.params[1], _sample_mean(batches[3:5]))
    _assert_grads(recorder.grads[1], expected)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=13):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx)))


def _token_loss(logits, targets):
    """Mean over the targets that are not padding (-100)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _padded_batches(shapes, vocab=13):
    """(input, target) micro-batches of these (batch, length) shapes, each sequence's
    tail padded in the targets with -100 (a different amount per sequence)."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for b, t in shapes:
        idx = torch.randint(0, vocab, (b, t), generator=generator)
        targets = torch.randint(0, vocab, (b, t), generator=generator)
        for row in range(b):
            targets[row, t - (row % t):] = -100
        batches.append((idx, targets))
    return batches


def test_tokens_normalisation_counts_real_tokens_and_leaves_padding_out():
    batches = _padded_batches([(2, 9), (5, 3), (1, 12), (3, 4)])
    real = [int((t != -100).sum()) for _, t in batches]
    model = TinyLM()
    recorder = Recorder(model)
    trainer = Trainer(model, recorder.optimizer(), _token_loss, batches, accum_steps=2,
                      callbacks=[recorder], loss_normalization="tokens",
                      count_tokens=count_target_tokens)
    trainer.fit(epochs=1)
    assert [s.tokens for s in recorder.stats] == [real[0] + real[1], real[2] + real[3]]
    for step in range(2):
        window = batches[2 * step:2 * step + 2]
        def logits_targets(m, w=window):  # every real token of the window, one mean
            return (torch.cat([m(x).flatten(0, 1) for x, _ in w]),
                    torch.cat([t.flatten() for _, t in w]))
        expected, loss = _grads_of(model, recorder.params[step],
                                   lambda m: F.cross_entropy(*logits_targets(m)))
        _assert_grads(recorder.grads[step], expected)
        torch.testing.assert_close(recorder.stats[step].loss, loss, rtol=1e-5, atol=1e-6)


def test_tokens_per_sample_is_reported_and_nothing_when_undeclared():
    batches = _digits([4, 6, 4])
    model = _mlp()
    recorder = Recorder(model)
    Trainer(model, recorder.optimizer(), F.cross_entropy, batches, accum_steps=2,
            callbacks=[recorder], tokens_per_sample=64).fit(epochs=1)
    assert [s.tokens for s in recorder.stats] == [640, 256]
    assert [s.samples for s in recorder.stats] == [10, 4]
    # "tokens" with a fixed count per sample is the samples' mean
    model = _mlp()
    tokens = Recorder(model)
    Trainer(model, tokens.optimizer(), F.cross_entropy, batches, accum_steps=2,
            callbacks=[tokens], tokens_per_sample=64,
            loss_normalization="tokens").fit(epochs=1)
    expected, _ = _grads_of(model, tokens.params[0], _sample_mean(batches[:2]))
    _assert_grads(tokens.grads[0], expected)

    model = _mlp()
    plain = Recorder(model)
    Trainer(model, plain.optimizer(), F.cross_entropy, batches, callbacks=[plain]).fit(epochs=1)
    assert [s.tokens for s in plain.stats] == [None] * 3


def test_samples_normalisation_in_fp16_steps_through_the_grad_scaler():
    batches = _digits(SIZES)
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    recorder = Recorder(model)
    trainer = Trainer(model, recorder.optimizer(lr=0.5), F.cross_entropy, batches,
                      accum_steps=3, callbacks=[recorder], precision="fp16",
                      loss_normalization="samples")
    trainer.fit(epochs=2)
    assert trainer.mixed_precision.scaler is not None
    # the recorded gradients are unscaled (GradScaler.step unscales before the step)
    expected, _ = _grads_of(model, recorder.params[0], _sample_mean(batches[:3]))
    for name, grad in expected.items():
        torch.testing.assert_close(recorder.grads[0][name], grad, rtol=0.05, atol=2e-3)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_settings_raise_and_change_nothing():
    model = _mlp()
    def make(**kw):
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                       [], **kw)
    assert LOSS_NORMALIZATIONS == ("micro_batch_mean", "samples", "tokens")
    assert make().loss_normalization == "micro_batch_mean"
    with pytest.raises(ValueError, match="loss_normalization must be one of"):
        make(loss_normalization="mean")
    with pytest.raises(ValueError, match="needs tokens_per_sample or count_tokens"):
        make(loss_normalization="tokens")
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="tokens_per_sample"):
            make(tokens_per_sample=bad)
    with pytest.raises(ValueError, match="not both"):
        make(tokens_per_sample=4, count_tokens=count_target_tokens)
    trainer = make()
    for bad in ("tokens", "sample", None):
        with pytest.raises(ValueError):
            trainer.loss_normalization = bad
        assert trainer.loss_normalization == "micro_batch_mean"

    negative = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                       _digits([4]), count_tokens=lambda batch: -1)
    with pytest.raises(ValueError, match="count_tokens returned -1"):
        negative.fit(epochs=1)
    with pytest.raises(ValueError, match="count_target_tokens needs"):
        count_target_tokens(torch.zeros(3))
    assert count_target_tokens({"labels": torch.tensor([[1, -100, 2]])}) == 2
    assert count_target_tokens({"input_ids": torch.zeros(1, 3),
                                "attention_mask": torch.tensor([[1, 1, 0]])}) == 2
