"""The reference Trainer: accumulation equivalence, live precision switches, GradScaler state."""

import copy

import pytest
import torch
from sklearn.datasets import load_digits

from gpuopt import Trainer
from tests.training import FuncInForward


def _digits(n):
    digits = load_digits()
    x = torch.tensor(digits.data[:n], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:n], dtype=torch.long)
    return x, y


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 10))


def _grads_after_one_step(batch_size, accum_steps, n=64):
    x, y = _digits(n)
    model = _model()
    captured = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured.update({name: p.grad.clone() for name, p in model.named_parameters()})
            return super().step(closure)

    loader = list(zip(x.split(batch_size), y.split(batch_size)))
    trainer = Trainer(model, Capture(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, loader, accum_steps=accum_steps)
    trainer.fit(max_steps=1, epochs=1)
    return captured


def test_gradient_of_k_micro_batches_equals_one_batch_k_times_larger():
    reference = _grads_after_one_step(batch_size=64, accum_steps=1)
    accumulated = _grads_after_one_step(batch_size=16, accum_steps=4)
    for name, grad in reference.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-5, atol=1e-6)


def test_a_partial_last_window_is_divided_by_its_real_size():
    reference = _grads_after_one_step(batch_size=48, accum_steps=1, n=48)
    partial = _grads_after_one_step(batch_size=16, accum_steps=4, n=48)  # 3 of 4 micro-batches
    for name, grad in reference.items():
        torch.testing.assert_close(partial[name], grad, rtol=1e-5, atol=1e-6)


class Recorder:
    def __init__(self, changes):
        self.changes = changes  # step -> {attr: value}, applied at that boundary
        self.seen = []

    def on_optimizer_step(self, trainer, stats):
        self.seen.append((stats.step, stats.micro_batches, trainer.precision,
                          float(stats.loss)))
        for attr, value in self.changes.get(stats.step, {}).items():
            setattr(trainer, attr, value)


def test_accumulation_and_precision_change_at_the_next_window_and_training_goes_on():
    x, y = _digits(512)
    model = _model()
    loader = list(zip(x.split(8), y.split(8)))
    recorder = Recorder({3: {"accum_steps": 4, "precision": "bf16"}, 6: {"precision": "fp32"}})
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                      torch.nn.functional.cross_entropy, loader, callbacks=[recorder])
    trainer.fit(epochs=5)
    steps = recorder.seen
    assert [s[1] for s in steps[:5]] == [1, 1, 1, 4, 4]
    assert [s[2] for s in steps[:8]] == ["fp32"] * 3 + ["bf16"] * 3 + ["fp32"] * 2
    assert steps[-1][3] < steps[0][3] * 0.6  # it learned


def test_grad_scaler_is_created_on_first_fp16_and_kept_across_leaving():
    x, y = _digits(256)
    model = _model()
    loader = list(zip(x.split(32), y.split(32)))
    recorder = Recorder({2: {"precision": "fp16"}, 4: {"precision": "bf16"},
                         6: {"precision": "fp16"}})
    scales = {}

    class Scales:
        def on_optimizer_step(self, trainer, stats):
            scaler = trainer.mixed_precision.scaler
            scales[stats.step] = None if scaler is None else (id(scaler), scaler.get_scale())

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, loader, callbacks=[Scales(), recorder])
    trainer.fit(max_steps=7)
    assert scales[1] is None and scales[2] is None  # created on first entry into fp16
    assert scales[3] is not None
    assert scales[5] == scales[4]  # kept, untouched, while in bf16
    assert scales[7][0] == scales[3][0]  # the same scaler is reused on return


def test_fp16_training_on_cpu_uses_the_scaler_and_learns():
    x, y = _digits(256)
    model = _model()
    before = copy.deepcopy(model.state_dict())
    loader = list(zip(x.split(32), y.split(32)))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                      torch.nn.functional.cross_entropy, loader, precision="fp16")
    trainer.fit(epochs=2)
    assert trainer.mixed_precision.scaler is not None
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_precision_and_bad_accumulation_raise():
    model = _model()
    with pytest.raises(ValueError, match="unknown precision"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.nn.functional.cross_entropy, [], precision="fp8")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, [])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="accum_steps"):
            trainer.accum_steps = bad
    assert trainer.accum_steps == 1
    assert trainer.fit(epochs=1) == 0  # an empty loader ends at once


def test_activation_memory_is_measured_every_n_steps_and_after_each_change():
    from gpuopt.demo.models import CharTransformer

    torch.manual_seed(0)
    model = CharTransformer(17, d_model=32, n_heads=2, n_layers=2, context_len=16)
    idx = torch.randint(0, 17, (64, 16))
    loader = list(zip(idx.split(4), torch.roll(idx, -1, 1).split(4)))
    measured = {}

    class Record:
        def on_optimizer_step(self, trainer, stats):
            measured[stats.step] = stats.activation_bytes
            if stats.step == 5:
                trainer.checkpointing = True
            if stats.step == 7:
                trainer.accum_steps = 2  # not a setting that changes activations

    trainer = Trainer(model, torch.optim.AdamW(model.parameters()),
                      lambda logits, t: torch.nn.functional.cross_entropy(
                          logits.flatten(0, 1), t.flatten()),
                      loader, callbacks=[Record()], measure_activations_every=4)
    trainer.fit(max_steps=10)
    assert [step for step, value in measured.items() if value is not None] == [1, 5, 6, 10]
    assert measured[1] == measured[5] and measured[6] < measured[5] / 2
    assert measured[10] == measured[6]
    never = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    trainer.loss_fn, loader, callbacks=[Record()],
                    measure_activations_every=0)
    measured.clear()
    never.fit(max_steps=3)
    assert list(measured.values()) == [None] * 3
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="measure_activations_every"):
            Trainer(model, trainer.optimizer, trainer.loss_fn, loader,
                    measure_activations_every=bad)


def test_a_model_that_refuses_saved_tensor_hooks_trains_on_unmeasured():
    x, y = _digits(64)
    loader = list(zip(x.split(16), y.split(16)))
    trained = {}
    for every in (0, 20):
        torch.manual_seed(7)  # the same dropout masks, unless measuring changed them
        model = FuncInForward()
        seen = []

        class Record:
            def on_optimizer_step(self, trainer, stats):
                seen.append(stats.activation_bytes)

        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.nn.functional.cross_entropy, loader, callbacks=[Record()],
                          measure_activations_every=every)
        trainer.fit(max_steps=4)
        assert seen == [None] * 4
        trained[every] = model.state_dict()
        if every:
            assert trainer.measure_activations_every == 0
            assert "don't yet support saved tensor hooks" in (
                trainer.activation_measurement_error)
    for name, value in trained[0].items():  # the same training as never measuring
        assert torch.equal(value, trained[20][name]), name


def test_a_stop_asked_before_fit_is_honoured_and_the_next_fit_trains():
    x, y = _digits(64)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, list(zip(x.split(8), y.split(8))))
    trainer.stop()  # e.g. a SIGTERM while the script was still setting up
    assert trainer.fit(max_steps=50) == 0
    assert trainer.fit(max_steps=3) == 3


class _InplaceAfterSave(torch.nn.Module):
    """A bug autograd catches: sigmoid keeps its output for backward, then it is
    modified in place."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        out = torch.sigmoid(self.net(x))
        out.mul_(2)
        return out


@pytest.mark.parametrize("every", [0, 1])
def test_measuring_keeps_autograds_in_place_check(every):
    x, y = _digits(32)
    model = _InplaceAfterSave()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, list(zip(x.split(8), y.split(8))),
                      measure_activations_every=every)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        trainer.fit(max_steps=2)


def test_hooks_of_the_callers_own_are_left_in_charge_and_errors_are_not_retried():
    x, y = _digits(64)
    model = _model()
    seen = []

    class Record:
        def on_optimizer_step(self, trainer, stats):
            seen.append(stats.activation_bytes)

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, list(zip(x.split(16), y.split(16))),
                      callbacks=[Record()], measure_activations_every=1)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t,
                                                  lambda t: t):
        trainer.fit(max_steps=3)
    assert seen == [None] * 3 and len(packed) >= 3 * 3  # theirs saw every micro-batch
    trainer.fit(max_steps=4)
    assert seen[-1] is not None  # measured once their hooks are gone

    calls = []

    def failing_loss(output, target):
        calls.append(1)
        raise RuntimeError("the model's own error")

    failing = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), failing_loss,
                      list(zip(x.split(16), y.split(16))), measure_activations_every=1)
    with pytest.raises(RuntimeError, match="the model's own error"):
        failing.fit(max_steps=1)
    assert len(calls) == 1 and failing.activation_measurement_error is None


class _EpochTaggedDigits(torch.utils.data.Dataset):
    """Digits whose target carries the epoch the loading copy of the dataset was set to:
    ``(x, [label, epoch])``."""

    def __init__(self, n=96):
        self.x, self.y = _digits(n)
        self.epoch = -1
        self.calls = []

    def __len__(self):
        return len(self.y)

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.calls.append(epoch)

    def __getitem__(self, index):
        return self.x[index], torch.tensor([int(self.y[index]), self.epoch])


def _epoch_recording_loss(seen):
    def loss(output, target):
        seen.append(target[:, 1].tolist())
        return torch.nn.functional.cross_entropy(output, target[:, 0])
    return loss


def test_the_dataset_epoch_reaches_persistent_workers_of_the_trainers_loader():
    from gpuopt.loader import ReconfigurableLoader

    dataset = _EpochTaggedDigits()
    loader = ReconfigurableLoader(dataset, 8, num_workers=2, persistent_workers=True)
    seen = []

    class Switch:  # a live loader change mid-epoch, at an optimizer-step boundary
        def on_optimizer_step(self, trainer, stats):
            if stats.step == 8:
                trainer.loader.reconfigure(num_workers=1)
            if stats.step == 17:
                trainer.loader.reconfigure(num_workers=0)

    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      _epoch_recording_loss(seen), loader, callbacks=[Switch()])
    trainer.fit(epochs=3)
    loader.close()
    assert trainer.step == 36 and len(seen) == 36  # 12 micro-batches per epoch
    for epoch in range(3):
        assert {e for batch in seen[12 * epoch:12 * (epoch + 1)] for e in batch} == {epoch}
    assert dataset.calls == [0, 1, 2]  # once per epoch here (the workers set their own)
    assert loader.dataset_restarts == 0


def test_a_plain_dataloader_gets_set_epoch_and_a_warning_when_workers_persist():
    dataset = _EpochTaggedDigits(32)
    seen = []
    model = _model()
    loader = torch.utils.data.DataLoader(dataset, batch_size=16)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _epoch_recording_loss(seen),
            loader).fit(epochs=2)
    assert dataset.calls == [0, 1] and seen == [[0] * 16] * 2 + [[1] * 16] * 2

    stale = torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=1,
                                        persistent_workers=True)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      _epoch_recording_loss(seen), stale)
    with pytest.warns(RuntimeWarning, match="pytorch/pytorch#97326"):
        trainer.fit(epochs=1)
    del stale


def test_activations_are_measured_again_after_the_state_goes_back():
    """After the state goes back to an earlier step (a rewind, a rollback: its
    ``load_state_dict``), the last measurement's step lies ahead: it must not hold the
    next measurement off until training passes it again."""
    import copy

    x, y = _digits(64)
    measured = {}

    class Record:
        def on_optimizer_step(self, trainer, stats):
            measured[stats.step] = stats.activation_bytes

    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, list(zip(x.split(8), y.split(8))),
                      callbacks=[Record()], measure_activations_every=4)
    trainer.fit(max_steps=2)
    back = copy.deepcopy(trainer.state_dict())
    trainer.fit(max_steps=9)
    assert [step for step, value in measured.items() if value is not None] == [1, 5, 9]
    trainer.load_state_dict(back)
    measured.clear()
    trainer.fit(max_steps=5)
    assert measured[3] is not None and sorted(measured) == [3, 4, 5]
