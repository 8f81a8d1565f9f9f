"""gpuwatch on real Lightning runs: a tiny LightningModule on digits, the agent attached in
one line, commands sent live over the agent's real ZeroMQ socket, and every window after a
change checked against arithmetic done here with plain torch."""

import signal
import threading
import time

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

L = pytest.importorskip("lightning.pytorch")

import agent  # noqa: E402
from agent.wire import runs  # noqa: E402
from agent.integrations.adapters import NOT_A_MIXTURE  # noqa: E402
from agent.integrations.lightning import GpuwatchCallback, attach  # noqa: E402
from agent.wire.knobs import KnobError  # noqa: E402
from gpuwatch.client import Subscriber, send_command  # noqa: E402
from gpuwatch.history import flat_records  # noqa: E402
from tests.contract import BATCH_SIZE, IndexedDigits, run, run_diverging  # noqa: E402
from tests.contract.lightning import LightningDriver  # noqa: E402


def _digits(n):
    digits = load_digits()
    x = torch.tensor(digits.data[:n], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:n], dtype=torch.long)
    return x, y


class Digits(L.LightningModule):
    """An MLP with two residual blocks (``self.blocks``) and SGD without momentum, so an
    optimizer step is ``p -= lr * p.grad`` and can be redone by hand."""

    def __init__(self, lr=0.1, decay=None, blocks=2, freeze_input=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                    for _ in range(blocks))
        self.head = nn.Linear(32, 10)
        self.inp.requires_grad_(not freeze_input)
        self.lr, self.decay = lr, decay
        self.autocast_seen = []

    def forward(self, x):
        h = F.gelu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.autocast_seen.append(torch.get_autocast_dtype("cpu")
                                  if torch.is_autocast_enabled("cpu") else None)
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.decay is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.decay ** s)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _trainer(**options):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **options)


def _loader(n, batch_size=8, dataset=None):
    return DataLoader(dataset or TensorDataset(*_digits(n)), batch_size=batch_size)


def _records(monitor):
    return list(flat_records(monitor.info.log_path))


def _steps(records):
    return {r["step"]: r for r in records if r["type"] == "step"}


class Hold(L.Callback):
    """Stops the training thread at the optimizer step ``at`` until released, so that a
    command can be sent at a known point (before the agent records that step)."""

    def __init__(self, at):
        self.at = at
        self.reached = threading.Event()
        self.release = threading.Event()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(60)


def _fit_with_commands(trainer, model, loader, hold, monitor, commands):
    """Fit in a thread; at ``hold`` send ``commands`` ((knob, value, apply_step)) over
    the agent's command socket; return their replies once fit has returned."""
    thread = threading.Thread(target=trainer.fit, args=(model, loader), daemon=True)
    thread.start()
    assert hold.reached.wait(60), "training did not reach the hold"
    replies = [send_command(monitor.info, knob, value, apply_step=step)
               for knob, value, step in commands]
    hold.release.set()
    thread.join(60)
    assert not thread.is_alive() and trainer.state.status == "finished", trainer.state
    return replies


class Snapshots(L.Callback):
    """The parameters after every optimizer step (and before the first), and the batch
    indices of each step's window."""

    def __init__(self):
        self.params = {}
        self.windows = {}
        self.epochs = {}

    def on_train_start(self, trainer, module):
        self.params[0] = _params(module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        step = trainer.global_step + 1  # the step this micro-batch belongs to
        self.windows.setdefault(step, []).append(batch_idx)
        self.epochs[step] = trainer.current_epoch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.params[trainer.global_step] = _params(module)


def _params(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _hand_step(params, batches, lr, frozen=()):
    """The SGD step of one accumulation window, done here: the mean of the micro-batch
    gradients at ``params``, ``p - lr * grad`` for every parameter not in ``frozen``.
    Returns the new parameters, the window's mean loss and its gradient's norm."""
    model = Digits()
    model.load_state_dict(params)
    grads = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    losses = []
    for x, y in batches:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        for name, p in model.named_parameters():
            grads[name] += p.grad / len(batches)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in grads.values()]))
    return ({name: value if name in frozen else value - lr * grads[name]
             for name, value in params.items()}, torch.stack(losses).mean(), norm)


def _micro_batches(n, batch_size=8):
    x, y = _digits(n)
    return list(zip(x.split(batch_size), y.split(batch_size)))


# ---------------------------------------------------------------------------- reports


class SleepyDigits(Dataset):
    """Digits whose every sample takes 2 ms to load: the loop waits for data."""

    def __init__(self, n):
        self.x, self.y = _digits(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        time.sleep(0.002)
        return self.x[index], self.y[index]


class SaveAt(L.Callback):
    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and not self.path.exists():
            trainer.save_checkpoint(self.path)


def test_one_line_attach_reports_undivided_loss_data_wait_lr_tokens_and_events(run_dir,
                                                                                tmp_path):
    module = Digits()
    before = _params(module)
    trainer = _trainer(max_steps=6, accumulate_grad_batches=2, num_sanity_val_steps=1,
                       limit_val_batches=1, gradient_clip_val=100.0,
                       callbacks=[SaveAt(3, tmp_path / "c.ckpt")])
    monitor = agent.attach(trainer, name="lightning-digits", tokens_per_sample=64)
    assert runs.find_run().run_id == monitor.run_id  # live from attach on
    trainer.fit(module, _loader(64, dataset=SleepyDigits(64)), _loader(16))

    records = _records(monitor)
    steps = _steps(records)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and trainer.global_step == 6  # max_steps
    for body in steps.values():
        assert body["micro_batches"] == 2 and body["samples"] == 16
        assert body["tokens"] == 16 * 64 and body["tokens_per_s"] > 0
        # the rate is the step's tokens over its time (any load), not a speed to reach
        assert body["tokens_per_s"] == pytest.approx(body["tokens"] / body["step_time_s"])
        assert body["data_wait_s"] >= 16 * 0.002 * 0.9  # 16 samples of 2 ms each
        assert body["lr"] == pytest.approx(0.1)
        assert body["knobs"]["accum_steps"] == 2 and body["knobs"]["precision"] == "fp32"
    # the first window's loss: the mean of its two micro-batch losses, not divided by 2;
    # its gradient norm: the one Lightning's clipping computed
    _, loss, norm = _hand_step(before, _micro_batches(16), lr=0.1)
    assert steps[1]["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert steps[1]["loss"] > 2.0  # ln(10) at the start: undivided
    assert steps[1]["grad_norm"] == pytest.approx(float(norm), rel=1e-4)

    first_step = next(i for i, r in enumerate(records) if r["type"] == "step")
    hello = [r for r in records[:first_step] if r["type"] == "hello"][-1]
    assert hello["name"] == "lightning-digits"
    assert hello["model"] == {"name": "Digits",
                              "params": sum(p.numel() for p in module.parameters())}
    assert [k["name"] for k in hello["knobs"]] == [
        "pause", "stop", "recover", "rewind", "precision", "accum_steps", "kernels",
        "checkpointing",
        "lr_scale", "weight_decay", "max_grad_norm", "checkpoint", "cpu_threads", "evaluate"]
    assert hello["training"] == {"framework": f"lightning {L.__version__}",
                                 "loss_normalization": "micro_batch_mean"}
    events = [(r["kind"], r.get("step"), r.get("sanity_check")) for r in records
              if r["type"] == "event"]
    assert events[:2] == [("evaluation_start", 0, True), ("evaluation", 0, True)]
    assert ("checkpoint", 3, None) in events
    epoch_end = events.index(("epoch_end", 4, None))  # 8 batches, 2 per step
    assert events[epoch_end - 2:epoch_end] == [("evaluation_start", 4, False),
                                               ("evaluation", 4, False)]
    assert [r["text"] for r in records if r.get("kind") == "epoch_end"] == [
        "epoch 0 ended at step 4", "epoch 1 stopped at step 6: max_steps reached"]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == "finished"
    assert runs.list_runs() == []  # the run file is gone


class Failing(Digits):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_training_closes_the_run_with_the_reason_and_a_new_fit_reattaches(
        run_dir):
    callback = GpuwatchCallback()
    trainer = _trainer(max_steps=4, callbacks=[callback])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), _loader(64))
    first = callback.agent
    records = _records(first)
    assert sorted(_steps(records)) == [1, 2]
    assert records[-1]["type"] == "bye"
    assert records[-1]["reason"] == "error: RuntimeError('boom')"
    trainer = _trainer(max_steps=3, callbacks=[callback])
    trainer.fit(Digits(), _loader(64))
    assert callback.agent is not first and sorted(_steps(_records(callback.agent))) == [1, 2, 3]
    assert runs.list_runs() == []


def test_tokens_are_counted_from_input_ids(run_dir):
    class Tokens(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(17, 8)
            self.out = nn.Linear(8, 17)

        def training_step(self, batch, batch_idx):
            logits = self.out(self.embed(batch["input_ids"]))
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, 17, (32, 12))
    data = [{"input_ids": ids[i], "labels": ids[i].roll(-1)} for i in range(32)]
    trainer = _trainer(max_steps=3)
    monitor = attach(trainer)
    trainer.fit(Tokens(), DataLoader(data, batch_size=4))
    steps = _steps(_records(monitor))
    assert [s["tokens"] for s in steps.values()] == [4 * 12] * 3
    assert [s["samples"] for s in steps.values()] == [4] * 3


# ---------------------------------------------------------------------------- knobs


def test_live_accum_steps_change_mid_epoch_trains_each_window_as_computed_by_hand(run_dir):
    """accum_steps 2 -> 3 after step 2 (batch 3 of 17, not a multiple of 3): the windows
    are batches 4-6, 7-9, 10-12, 13-15, then 16 alone (the epoch's end, divided by 1),
    then 0-2 and 3-5 of the next epoch; each update is lr * the mean gradient of exactly
    those micro-batches (no stale gradient from the window before), the step-interval LR
    schedule moves once per optimizer step, and the run ends at max_steps."""
    module = Digits(lr=0.1, decay=0.9)
    snapshots, hold = Snapshots(), Hold(at=2)
    trainer = _trainer(max_steps=9, accumulate_grad_batches=2, callbacks=[snapshots, hold])
    monitor = attach(trainer)
    replies = _fit_with_commands(trainer, module, _loader(136), hold, monitor,
                                 [("accum_steps", 3, None), ("num_workers", 2, None)])
    assert replies[0]["ok"] and replies[0]["apply_step"] == 3, replies[0]
    assert not replies[1]["ok"] and "ReconfigurableLoader" in replies[1]["reason"]

    windows = {step: (snapshots.epochs[step], batches)
               for step, batches in snapshots.windows.items()}
    assert windows == {1: (0, [0, 1]), 2: (0, [2, 3]), 3: (0, [4, 5, 6]),
                       4: (0, [7, 8, 9]), 5: (0, [10, 11, 12]), 6: (0, [13, 14, 15]),
                       7: (0, [16]), 8: (1, [0, 1, 2]), 9: (1, [3, 4, 5])}
    assert trainer.global_step == 9
    batches = _micro_batches(136)
    steps = _steps(_records(monitor))
    for step, (_, indices) in windows.items():
        lr = 0.1 * 0.9 ** (step - 1)
        expected, loss, _ = _hand_step(snapshots.params[step - 1],
                                    [batches[i] for i in indices], lr)
        for name, value in snapshots.params[step].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6,
                                       msg=f"step {step} {name}")
        assert steps[step]["micro_batches"] == len(indices)
        assert steps[step]["loss"] == pytest.approx(float(loss), rel=1e-5)
        assert steps[step]["lr"] == pytest.approx(lr)
        assert steps[step]["knobs"]["accum_steps"] == (2 if step < 3 else 3)
    # fit is over: Lightning's own accumulation is back
    assert trainer.accumulate_grad_batches == 2
    assert "_accumulated_batches_reached" not in trainer.fit_loop.epoch_loop.__dict__


def test_lr_scale_and_max_grad_norm_change_each_update_as_computed_by_hand(run_dir):
    """lr_scale=0.5 from step 3 halves what the LambdaLR schedule sets (its shape kept);
    max_grad_norm=0.05 from step 5 is Lightning's gradient_clip_val: each update is then
    lr x 0.05/norm x the gradient, and the step reports the norm before clipping."""
    module = Digits(lr=0.1, decay=0.9)
    snapshots, hold = Snapshots(), Hold(at=2)
    trainer = _trainer(max_steps=6, callbacks=[snapshots, hold])
    monitor = attach(trainer)
    replies = _fit_with_commands(trainer, module, _loader(64), hold, monitor,
                                 [("lr_scale", 0.5, None), ("max_grad_norm", 0.05, 5)])
    assert all(reply["ok"] for reply in replies), replies
    steps = _steps(_records(monitor))
    batches = _micro_batches(64)
    for step in range(1, 7):
        lr = 0.1 * 0.9 ** (step - 1) * (0.5 if step >= 3 else 1.0)
        before = snapshots.params[step - 1]
        unit, _, norm = _hand_step(before, [batches[step - 1]], 1.0)  # before - gradient
        factor = min(1.0, 0.05 / (float(norm) + 1e-6)) if step >= 5 else 1.0
        for name, value in snapshots.params[step].items():
            expected = before[name] - lr * factor * (before[name] - unit[name])
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7,
                                       msg=f"step {step} {name}")
        assert steps[step]["lr"] == pytest.approx(lr)
        if step >= 5:
            assert factor < 1 and steps[step]["grad_norm"] == pytest.approx(float(norm),
                                                                             rel=1e-5)
    assert trainer.gradient_clip_val is None  # the Trainer's own again after fit
    assert module.trainer.optimizers[0]._optimizer_step_pre_hooks == {}


class Validating(LightningDriver):
    """The contract's Lightning run, validating at each epoch's end."""

    name = "lightning-validating"

    def val_loader(self):
        return DataLoader(IndexedDigits(), batch_size=32)


class DistributedOrder(LightningDriver):
    """The contract's Lightning run over a DistributedSampler (one replica): its order is
    drawn from its seed and epoch, which Lightning sets only once the epoch loop runs."""

    name = "lightning-distributed-sampler"

    def loader(self):
        data = IndexedDigits()
        return DataLoader(data, batch_size=BATCH_SIZE, sampler=DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=5))


@pytest.mark.parametrize("driver, after", [(Validating(), 8), (DistributedOrder(), 11)],
                         ids=["epoch-end-then-validation", "distributed-sampler-epoch-1"])
def test_checkpoint_now_is_lightnings_own_and_resumes_exactly_where_the_contract_does_not(
        driver, after, run_dir, tmp_path):
    """checkpoint=now is trainer.save_checkpoint, made atomic, with gpuwatch's state as the
    callback's; fit(ckpt_path=) goes on bit for bit (16 batches an epoch, 2 per step)
    after epoch 0's last batch (step 8), whose validation Lightning's resume skips, and
    mid-epoch 1 (step 11) under a sampler whose order depends on the epoch."""
    twin = run(driver, steps=13, commands=[("checkpoint", "now", after + 1)],
               checkpoint_dir=tmp_path)
    path = tmp_path / f"step-{after:08d}.ckpt"
    saved = twin.events("applied")
    assert [(e["path"], e["checkpoint_step"]) for e in saved] == [(str(path), after)]
    assert path.stat().st_size == saved[0]["size_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # atomic: nothing else
    state = torch.load(path, weights_only=False)["callbacks"]["GpuwatchCallback"]
    assert state["knobs"]["accum_steps"] == 2 and not state["accumulation_changed"]
    assert (state["data"]["epoch"], state["data"]["fetched_in_epoch"]) == (
        (1, 16) if after == 8 else (2, 6))
    assert state["data"]["validation_follows"] == (after == 8)

    resumed = run(driver, steps=13, commands=[], checkpoint_dir=tmp_path / "again",
                  resume_from=path)
    want, got = twin.steps(), resumed.steps()
    assert sorted(got) == list(range(after + 1, 14))
    for step in got:
        assert resumed.recorder.window(step) == twin.recorder.window(step), step
        assert got[step]["loss"] == want[step]["loss"], step
    for mine, theirs in zip(resumed.params, twin.params):
        assert torch.equal(mine, theirs)
    [event] = resumed.events("resumed")
    assert event["text"] == (f"resumed from {path} at step {after} with recover=off, "
                             "precision=fp32, accum_steps=2, kernels=eager, lr_scale=1.0, "
                             "weight_decay=0.05, max_grad_norm=0.0, "
                             f"cpu_threads={torch.get_num_threads()}, "
                             "dropout=0.2")
    assert [e["text"] for e in resumed.events("epoch_end")] == [  # no epoch twice or lost
        e["text"] for e in twin.events("epoch_end") if e["step"] > after]


class Stream(torch.utils.data.IterableDataset):
    """The task's samples in an order drawn at each pass."""

    def __iter__(self):
        data = IndexedDigits()
        return (data[int(i)] for i in torch.randperm(len(data)))


class Streaming(LightningDriver):
    name = "lightning-stream"

    def loader(self):
        return DataLoader(Stream(), batch_size=BATCH_SIZE)


def test_data_a_resume_cannot_make_again_is_said_by_the_checkpoint_and_the_resume(
        run_dir, tmp_path):
    twin = run(Streaming(), steps=4, commands=[("checkpoint", "now", 3)],
               checkpoint_dir=tmp_path)
    why = "the train dataset is an IterableDataset (Stream): a resume starts it again"
    reply = twin.recorder.replies["checkpoint"]
    assert reply["ok"] and reply["warning"] == f"a resume from it will not be exact: {why}"
    path = tmp_path / "step-00000002.ckpt"
    resumed = run(Streaming(), steps=4, commands=[], checkpoint_dir=tmp_path / "again",
                  resume_from=path)
    [event] = resumed.events("resumed")
    assert event["level"] == "warning"
    assert event["text"].endswith(f"; not as in the saved run: {why}")
    assert sorted(resumed.steps()) == [3, 4]


def test_a_rollback_where_the_data_cannot_go_back_says_the_weights_were_not_restored(
        run_dir, tmp_path):
    """An IterableDataset cannot be put back live: the rollback sets precision back and
    its event says why the training state was not kept, rather than pretend."""
    result = run_diverging(Streaming(), tmp_path)
    [rolled] = [e for e in result.events("rolled_back") if e["knob"] == "precision"]
    assert rolled["value"] == "fp32"
    [restored] = result.events("state_restored")
    assert restored["level"] == "warning"
    assert restored["text"].startswith(
        "the weights were not restored (the state could not be kept (ValueError: the "
        "train data cannot be put back live: the train dataset is an IterableDataset "
        "(Stream): a resume starts it again)): training goes on from them")


class Gradients(L.Callback):
    """Which trainable parameters have a non-zero gradient at each optimizer step, the
    GradScaler's scale and a gradient before and after unscaling."""

    def __init__(self):
        self.complete = {}
        self.scaled = {}
        self.checkpointed = {}

    def on_after_backward(self, trainer, module):
        self._after_backward = module.head.weight.grad.clone()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        step = trainer.global_step + 1
        self.complete[step] = all(p.grad is not None and bool(p.grad.abs().sum() > 0)
                                  for p in module.parameters() if p.requires_grad)
        self.checkpointed[step] = all("forward" in block.__dict__ for block in module.blocks)
        scaler = trainer.precision_plugin.__dict__.get("scaler")
        if scaler is not None:
            self.scaled[step] = (scaler.get_scale(), self._after_backward,
                                 module.head.weight.grad.clone())


def test_live_precision_fp16_trains_through_a_kept_working_grad_scaler(run_dir):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    module, gradients, hold = Digits(), Gradients(), Hold(at=2)
    trainer = _trainer(max_steps=10, callbacks=[gradients, hold])
    monitor = attach(trainer, grad_scaler=scaler)
    replies = _fit_with_commands(trainer, module, _loader(128, batch_size=16), hold, monitor,
                                 [("precision", "fp16", None), ("precision", "bf16", 6),
                                  ("precision", "fp16", 8)])
    assert [r["ok"] for r in replies] == [True] * 3 and replies[0]["apply_step"] == 3
    assert "slower than fp32" in replies[0]["warning"]  # fp16 on a CPU: said so

    fp16 = [3, 4, 5, 8, 9, 10]
    steps = _steps(_records(monitor))
    assert [steps[s]["knobs"]["precision"] for s in range(1, 11)] == (
        ["fp32"] * 2 + ["fp16"] * 3 + ["bf16"] * 2 + ["fp16"] * 3)
    assert module.autocast_seen == ([None] * 2 + [torch.float16] * 3 + [torch.bfloat16] * 2
                                    + [torch.float16] * 3)
    assert all(steps[s]["grad_scaler_skipped"] is False for s in fp16)
    assert not any("grad_scaler_skipped" in steps[s] for s in (1, 2, 6, 7))
    # the one GradScaler scaled every fp16 backward and was unscaled before each step...
    assert sorted(gradients.scaled) == fp16
    for step, (scale, after_backward, unscaled) in gradients.scaled.items():
        torch.testing.assert_close(after_backward, unscaled * scale, rtol=1e-3, atol=1e-6)
    # ...and stepped and updated: its scale doubled every 2 good steps, kept across bf16
    assert [gradients.scaled[s][0] for s in fp16] == [256.0, 256.0, 512.0, 512.0, 1024.0,
                                                      1024.0]
    assert scaler.get_scale() == 2048.0
    assert all(steps[s]["loss"] < steps[1]["loss"] for s in (9, 10))  # it learned
    assert type(trainer.precision_plugin).__name__ == "Precision"  # restored after fit


def test_checkpointing_toggled_live_every_trainable_parameter_gets_its_gradient(run_dir):
    module, gradients, snapshots, hold = (Digits(freeze_input=True), Gradients(), Snapshots(),
                                          Hold(at=2))
    trainer = _trainer(max_steps=6, callbacks=[gradients, snapshots, hold])
    monitor = attach(trainer)
    replies = _fit_with_commands(trainer, module, _loader(64), hold, monitor,
                                 [("checkpointing", True, None), ("checkpointing", False, 6)])
    assert all(r["ok"] for r in replies)
    assert gradients.checkpointed == {1: False, 2: False, 3: True, 4: True, 5: True, 6: False}
    assert all(gradients.complete.values()), gradients.complete
    batches = _micro_batches(64)
    for step in range(1, 7):  # and the updates are those without checkpointing
        expected, _, _ = _hand_step(snapshots.params[step - 1], [batches[step - 1]], 0.1,
                                 frozen={"inp.weight", "inp.bias"})
        for name, value in snapshots.params[step].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    steps = _steps(_records(monitor))
    assert [steps[s]["knobs"]["checkpointing"] for s in range(1, 7)] == (
        [False] * 2 + [True] * 3 + [False])
    assert not any("forward" in block.__dict__ for block in module.blocks)


def test_kernels_compile_live_then_back_to_eager(run_dir):
    module, hold = Digits(), Hold(at=2)
    trainer = _trainer(max_steps=6, callbacks=[hold])
    monitor = attach(trainer, compile_backend="aot_eager")
    replies = _fit_with_commands(trainer, module, _loader(64), hold, monitor,
                                 [("kernels", "compile", None), ("kernels", "eager", 5)])
    assert all(r["ok"] for r in replies)
    records = _records(monitor)
    kinds = [r["kind"] for r in records if r["type"] == "event"]
    assert "compiling" in kinds and "compiled" in kinds and "warning" not in kinds
    steps = _steps(records)
    assert [steps[s]["knobs"]["kernels"] for s in range(1, 7)] == (
        ["eager"] * 2 + ["compile"] * 2 + ["eager"] * 2)
    assert all(steps[s]["loss"] < 3 for s in steps)
    assert "forward" not in module.__dict__


# ---------------------------------------------------------------------------- refusals


class Manual(L.LightningModule):
    """Manual optimization and no repeated blocks."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _refusal(monitor, knob, value):
    with pytest.raises(KnobError) as refused:
        monitor.knobs.validate(knob, value)
    return str(refused.value)


def test_knobs_that_cannot_change_correctly_are_refused_with_the_reason(run_dir):
    callback = GpuwatchCallback(name="manual")
    trainer = _trainer(max_steps=3, callbacks=[callback])
    trainer.fit(Manual(), _loader(64))
    monitor = callback.agent
    assert monitor.name == "manual"
    assert "manual optimization" in _refusal(monitor, "accum_steps", 2)
    assert "manual optimization" in _refusal(monitor, "precision", "bf16")
    assert "manual optimization" in _refusal(monitor, "max_grad_norm", 1.0)
    monitor.knobs.validate("lr_scale", 0.5)  # applies in the optimizer's step, manual too
    assert "nothing to checkpoint" in _refusal(monitor, "checkpointing", True)
    assert "checkpoint_blocks" in _refusal(monitor, "checkpointing", True)
    assert "no gpuopt fused modules" in _refusal(monitor, "kernels", "triton")
    for knob, value in (("num_workers", 2), ("pin_memory", True), ("prefetch_factor", 4)):
        reason = _refusal(monitor, knob, value)
        assert "DataLoader" in reason and "ReconfigurableLoader" in reason
    assert "needs CUDA" in _refusal(monitor, "memory_fraction", 0.5)
    assert _refusal(monitor, "mixture", "0.5,0.5") == f"mixture: {NOT_A_MIXTURE}"
    steps = _steps(_records(monitor))
    assert sorted(steps) == [1, 2, 3]  # still measured: one record per optimizer step
    assert all(s["loss"] > 1.0 for s in steps.values())  # manual: not divided at all

    # a run that ends by epochs with a step-interval schedule: the schedule would move
    trainer = _trainer(max_epochs=1)
    monitor = attach(trainer)
    trainer.fit(Digits(decay=0.9), _loader(32))
    assert "ends by epochs" in _refusal(monitor, "accum_steps", 2)

    # clipping by value, or a module that decides its clipping: not a norm to set
    trainer = _trainer(max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    monitor = attach(trainer)
    trainer.fit(Digits(), _loader(8))
    assert "clips by value" in _refusal(monitor, "max_grad_norm", 1.0)

    class OwnClipping(Digits):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            pass

    trainer = _trainer(max_steps=1)
    monitor = attach(trainer)
    trainer.fit(OwnClipping(), _loader(8))
    assert "overrides configure_gradient_clipping" in _refusal(monitor, "max_grad_norm", 1.0)


def test_a_reconfigurable_loader_gives_the_loader_knobs(run_dir):
    from gpuopt.loader import ReconfigurableLoader

    loader = ReconfigurableLoader(TensorDataset(*_digits(64)), batch_size=8, shuffle=False)
    module, snapshots, hold = Digits(), Snapshots(), Hold(at=2)
    trainer = _trainer(max_steps=8, callbacks=[snapshots, hold])
    monitor = attach(trainer)
    replies = _fit_with_commands(trainer, module, loader, hold, monitor,
                                 [("num_workers", 1, None)])
    assert replies[0]["ok"], replies[0]
    steps = _steps(_records(monitor))
    assert [steps[s]["knobs"]["num_workers"] for s in range(1, 9)] == [0] * 2 + [1] * 6
    batches = _micro_batches(64)  # every batch once, in order, across the switch
    for step in range(1, 9):
        expected, _, _ = _hand_step(snapshots.params[step - 1], [batches[step - 1]], 0.1)
        torch.testing.assert_close(snapshots.params[step]["head.weight"],
                                   expected["head.weight"], rtol=1e-5, atol=1e-6)
    loader.close()


class Targets(L.Callback):
    """Each training batch's targets, by the step it trains."""

    def __init__(self):
        self.by_step = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.by_step[trainer.global_step + 1] = batch[1]


def test_a_mixture_loader_gives_the_mixture_knob_from_its_step(run_dir):
    """mixture=1,9 sent at step 2 applies at step 3: its records say so, and the 48
    samples of steps 3-8 hold within 6 binomial standard deviations of 43 from the
    second dataset (labels 5-9; at the first weights, 0.3, it would be 14)."""
    from gpuopt.mixture import MixtureLoader

    x, y = _digits(1797)
    loader = MixtureLoader([TensorDataset(x[y < 5], y[y < 5]),
                            TensorDataset(x[y >= 5], y[y >= 5])], [0.7, 0.3], batch_size=8)
    targets, hold = Targets(), Hold(at=2)
    trainer = _trainer(max_steps=8, callbacks=[targets, hold])
    monitor = attach(trainer)
    replies = _fit_with_commands(trainer, Digits(), loader, hold, monitor,
                                 [("mixture", "1,9", None)])
    assert replies[0]["ok"] and replies[0]["value"] == "0.1,0.9", replies[0]
    steps = _steps(_records(monitor))
    assert [steps[s]["knobs"]["mixture"] for s in range(1, 9)] == (
        ["0.7,0.3"] * 2 + ["0.1,0.9"] * 6)
    second = sum(int((targets.by_step[s] >= 5).sum()) for s in range(3, 9))
    assert abs(second - 48 * 0.9) <= 6 * (48 * 0.9 * 0.1) ** 0.5, second
    assert abs(second - 48 * 0.3) > 6 * (48 * 0.3 * 0.7) ** 0.5


_SIGTERM_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import agent
from tests.test_lightning import Digits, _loader, _trainer


class Stopped(Digits):
    def on_train_batch_end(self, *args):  # (after the callbacks': step 3 is recorded)
        if self.trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop, mid-fit


trainer = _trainer(max_steps=1000)
print(agent.attach(trainer, name="sigterm-fit").info.log_path, flush=True)
trainer.fit(Stopped(), _loader(256))
"""


@pytest.mark.slow
def test_sigterm_mid_fit_ends_the_run_with_bye_after_lightnings_own_handler(run_dir,
                                                                              tmp_path):
    """Lightning's SIGTERM handler runs first (it stops fit with an exception at the
    batch's end), then the run's, installed at attach: either ends the run, and the
    other waits for it; the process dies of the signal, its run log ends with bye."""
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "sigterm_fit.py"
    script.write_text(_SIGTERM_SCRIPT.format(repo=str(pathlib.Path(__file__).parents[1])))
    process = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == -signal.SIGTERM, process.stderr[-2000:]
    records = list(flat_records(process.stdout.splitlines()[0]))
    assert sorted(_steps(records)) == [1, 2, 3]
    assert [r["reason"] for r in records if r["type"] == "bye"] == ["stopped by SIGTERM"]
    assert records[-1]["type"] == "bye"
    assert runs.list_runs() == []


# ---------------------------------------------------------------------------- ranks

_DDP_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import lightning.pytorch as L
import agent
from tests.test_lightning import Digits, _loader, _trainer


class Pause(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == 0 and trainer.global_step == 2 and not hasattr(self, "done"):
            self.done = True
            print("paused", flush=True)
            sys.stdin.readline()


trainer = _trainer(devices=2, strategy="ddp", max_steps=9, accumulate_grad_batches=2,
                   callbacks=[Pause()])
agent.attach(trainer)
trainer.fit(Digits(), _loader(256))
"""


@pytest.mark.slow
def test_ddp_ranks_share_a_run_and_change_accum_steps_at_one_step(run_dir, tmp_path):
    """Lightning's own launcher (devices=2): both ranks join one run id, and a command
    reaches both and applies at the same optimizer step, with the same windows."""
    import pathlib
    import subprocess
    import sys

    repo = str(pathlib.Path(__file__).resolve().parents[1])
    script = tmp_path / "ddp_run.py"
    script.write_text(_DDP_SCRIPT.format(repo=repo))
    process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        while (line := process.stdout.readline()) and line.strip() != "paused":
            pass
        assert line.strip() == "paused", "rank 0 never reached step 2"
        ranks = runs.run_ranks(runs.find_run().run_id)
        assert [info.rank for info in ranks] == [0, 1]
        assert ranks[0].run_id.startswith("lightning-")
        reply = send_command(ranks[0], "accum_steps", 3, timeout_s=20)
        assert reply["ok"] and reply["ranks"] == [0, 1], reply
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.wait(120) == 0
    finally:
        process.kill()
    logs = [list(flat_records(info.log_path)) for info in ranks]
    windows = [[(s["step"], s["micro_batches"], s["knobs"]["accum_steps"])
                for s in log if s["type"] == "step"] for log in logs]
    assert windows[0] == windows[1] and len(windows[0]) == 9
    expected, batch = [], 0  # 16 batches per rank and epoch; windows restart with it
    for step in range(1, 10):
        accum = 2 if step < reply["apply_step"] else 3
        size = min(accum, 16 - batch)
        expected.append((step, size, accum))
        batch = (batch + size) % 16
    assert windows[0] == expected


class LoggingDigits(Digits):
    """Digits that logs its validation loss (``val_loss``, the epoch's mean)."""

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss


def test_pause_resume_then_validate_and_stop_at_one_boundary_are_lightnings_own(run_dir):
    """pause=on holds after step 2 until pause=off: the losses equal an unpaused twin's;
    evaluate=now runs Lightning's validation loop after step 4 (its val_loss equals
    trainer.validate by hand on the stopped model); stop=now there is should_stop:
    fit ends as Lightning ends it, and bye names the command."""
    twin = _trainer(max_steps=6, num_sanity_val_steps=0)
    twin_monitor = attach(twin)
    twin.fit(LoggingDigits(), _loader(64), _loader(32))
    twin_steps = _steps(_records(twin_monitor))
    module, hold = LoggingDigits(), Hold(at=1)
    trainer = _trainer(max_steps=6, num_sanity_val_steps=0, callbacks=[hold])
    monitor = attach(trainer)
    thread = threading.Thread(target=trainer.fit, args=(module, _loader(64), _loader(32)),
                              daemon=True)
    with Subscriber(monitor.info) as sub:
        thread.start()
        assert hold.reached.wait(60)
        replies = [send_command(monitor.info, knob, value, apply_step=step) for knob, value, step
                   in (("pause", "on", 3), ("evaluate", "now", 5), ("stop", "now", 5))]
        assert all(reply["ok"] for reply in replies), replies
        hold.release.set()
        for message in sub:
            body = message.get("body") or {}
            if body.get("kind") == "applied" and body.get("knob") == "pause":
                break
        assert trainer.global_step == 2 and thread.is_alive()
        resumed = send_command(monitor.info, "pause", "off")
        assert resumed["ok"] and resumed["apply_step"] == 3, resumed
        thread.join(60)
    assert not thread.is_alive() and trainer.state.status == "finished"
    records = _records(monitor)
    steps = _steps(records)
    assert sorted(steps) == [1, 2, 3, 4] and trainer.global_step == 4
    assert [steps[k]["loss"] for k in steps] == [twin_steps[k]["loss"] for k in steps]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 4")
    [event] = [r for r in records if r["type"] == "event" and r.get("kind") == "evaluation"]
    assert event["step"] == 4
    [by_hand] = trainer.validate(module, _loader(32), verbose=False)
    assert event["metrics"]["val_loss"] == by_hand["val_loss"]


@pytest.mark.parametrize("minimum", [{"min_steps": 20}, {"min_epochs": 3}])
def test_stop_now_ends_a_fit_whose_min_steps_or_min_epochs_are_not_met(run_dir, minimum):
    """Lightning keeps training on should_stop until min_steps and min_epochs are met;
    stop=now ends the fit at its step all the same (8 steps an epoch here)."""
    hold = Hold(at=1)
    trainer = _trainer(max_steps=40, num_sanity_val_steps=0, callbacks=[hold], **minimum)
    monitor = attach(trainer)
    [reply] = _fit_with_commands(trainer, Digits(), _loader(64), hold, monitor,
                                 [("stop", "now", 3)])
    assert reply["ok"], reply
    records = _records(monitor)
    assert sorted(_steps(records)) == [1, 2] and trainer.global_step == 2
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 2")
