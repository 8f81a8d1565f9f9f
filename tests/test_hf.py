"""The Hugging Face integration on real parts: a real ``transformers.Trainer`` (accelerate
underneath) training a tiny GPT-2 built from its config on characters of a text made
here, the agent on real ZeroMQ sockets, commands through the agent's command socket,
and every window after a live change checked against plain torch arithmetic."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import agent  # noqa: E402
from agent.integrations import hf  # noqa: E402
from gpuopt.precision import precision_warning  # noqa: E402
from gpuwatch.client import send_command  # noqa: E402
from gpuwatch.history import flat_records  # noqa: E402
from tests.training import resume_when_paused  # noqa: E402

SEQ = 16
BATCH = 4
VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Kernels this small run fastest on one thread; on a busy 2-core machine two
    intra-op threads made each step 20x slower (changes no result)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _text(chars=6000):
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
             "judge boxing matches near the old river bank").split()
    rng = random.Random(0)
    out = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(words).capitalize() if rng.random() < 0.1 else rng.choice(words))
    return " ".join(out) + "."


_TEXT = _text()
_ALPHABET = sorted(set(_TEXT))
assert len(_ALPHABET) < VOCAB
_IDS = torch.tensor([_ALPHABET.index(c) + 1 for c in _TEXT])


class Characters(torch.utils.data.Dataset):
    """``n`` windows of SEQ character ids; records the order its items are fetched in
    (the order the Trainer trains them: no workers), optionally slow."""

    def __init__(self, n, offset=0, delay_s=0.0):
        self.n, self.offset, self.delay_s = n, offset, delay_s
        self.fetched = []

    def __len__(self):
        return self.n

    def item(self, i):
        start = (self.offset + i) * SEQ
        return _IDS[start:start + SEQ]

    def __getitem__(self, i):
        self.fetched.append(i)
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow dataset (disk, decoding): the loop waits
        ids = self.item(i)
        return {"input_ids": ids, "labels": ids.clone()}


def _model(seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # GPT2LMHeadModel's name matches no loss type: HF would count every label, not the
    # shifted ones its causal-LM loss predicts (and say so in a warning)
    model.loss_type = "ForCausalLM"
    return model


def _trainer(tmp_path, dataset, *, gas=1, max_steps=8, lr=0.1, schedule="constant",
             callbacks=(), max_grad_norm=0.0, eval_dataset=None, **extra):
    extra = {"save_strategy": "no", **extra}
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
        logging_strategy="no", disable_tqdm=True, max_steps=max_steps,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=gas, dataloader_num_workers=0, optim="sgd",
        learning_rate=lr, lr_scheduler_type=schedule, weight_decay=0.0,
        max_grad_norm=max_grad_norm, seed=0, **extra)
    return Trainer(model=_model(), args=args, train_dataset=dataset,
                   eval_dataset=eval_dataset, callbacks=list(callbacks))


class Snapshots(TrainerCallback):
    """The trainable parameters at the start and after every optimizer step; whether
    every trainable parameter had a gradient at each step, and HF's checkpointing flag."""

    def __init__(self, model):
        self.model = model
        self.params = []
        self.all_grads = []
        self.checkpointing = []

    def _take(self):
        self.params.append({n: p.detach().clone() for n, p in self.model.named_parameters()})

    def on_train_begin(self, args, state, control, **kwargs):
        self._take()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.all_grads.append(all(p.grad is not None for p in self.model.parameters()
                                  if p.requires_grad))
        self.checkpointing.append(hf._hf_checkpointing(self.model))

    def on_step_end(self, args, state, control, **kwargs):
        self._take()


def _records(monitor):
    """The run log: one flat record per message (envelope and body fields)."""
    return list(flat_records(monitor.info.log_path))


def _steps(records):
    return {r["step"]: r for r in records if r["type"] == "step"}


def _events(records, kind):
    return [r for r in records if r["type"] == "event" and r.get("kind") == kind]


def _plan(micro_batches_per_epoch, gas, changes, max_steps):
    """Window sizes of a fresh HF run with ``gas`` changed to ``changes[step]`` from
    that optimizer step on: windows of N micro-batches from the change on, an epoch's
    last one cut at the epoch's end."""
    sizes = []
    while len(sizes) < max_steps:
        used = 0
        while used < micro_batches_per_epoch and len(sizes) < max_steps:
            gas = changes.get(len(sizes) + 1, gas)
            sizes.append(min(gas, micro_batches_per_epoch - used))
            used += sizes[-1]
    return sizes


def _window_loss(model, dataset, indices_per_micro_batch, autocast=None, per_micro_batch=False):
    """The window's loss as HF normalises it: with ``num_items_in_batch`` (models that
    take it, as causal LMs) the summed token losses of all its micro-batches over the
    window's number of predicted tokens; otherwise (``per_micro_batch``) the mean of the
    micro-batch means, each divided by the window's real size."""
    sums, counts = [], []
    for indices in indices_per_micro_batch:
        ids = torch.stack([dataset.item(i) for i in indices])
        context = (torch.autocast("cpu", dtype=autocast) if autocast is not None
                   else torch.autocast("cpu", enabled=False))
        with context:
            logits = model(input_ids=ids).logits
        logits = logits[:, :-1].float()
        targets = ids[:, 1:]
        sums.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum"))
        counts.append(targets.numel())
    if per_micro_batch:
        return sum(total / count for total, count in zip(sums, counts)) / len(sums)
    return sum(sums) / sum(counts)


def _check_windows(snapshots, dataset, sizes, steps, *, autocast=None, rtol=1e-3,
                   atol=0.0, clip=None, per_micro_batch=False):
    """For every optimizer step k: the update of every parameter is the window's own
    gradient, computed here with plain torch from the parameters before step k and
    exactly the micro-batches of that window, times the learning rate the step used;
    the reported loss is that window's loss and the reported grad norm its norm.
    ``clip``: the max_grad_norm of every step, or ``clip(k)`` that of step k (None: none)."""
    hand = _model()
    fetched = dataset.fetched
    position = 0
    for k, size in enumerate(sizes, 1):
        before, after = snapshots.params[k - 1], snapshots.params[k]
        with torch.no_grad():
            for name, param in hand.named_parameters():
                param.copy_(before[name])
        hand.zero_grad()
        micro = [fetched[position + BATCH * m: position + BATCH * (m + 1)] for m in range(size)]
        position += BATCH * size
        dtype = autocast(k) if callable(autocast) else autocast
        loss = _window_loss(hand, dataset, micro, dtype, per_micro_batch)
        loss.backward()
        grads = {n: p.grad for n, p in hand.named_parameters()}
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        body = steps[k]
        assert body["micro_batches"] == size, k
        assert body["loss"] == pytest.approx(loss.item(), rel=1e-3 if dtype else 1e-5), k
        assert body["grad_norm"] == pytest.approx(norm.item(), rel=2e-2 if dtype else 1e-4), k
        limit = clip(k) if callable(clip) else clip
        factor = 1.0 if limit is None else min(1.0, limit / (norm.item() + 1e-6))
        for name, grad in grads.items():
            update = body["lr"] * factor * grad
            error = (after[name] - (before[name] - update)).abs().max().item()
            rounding = 4 * torch.finfo(torch.float32).eps * before[name].abs().max().item()
            assert error <= rtol * update.abs().max().item() + rounding + atol, (k, name)


def test_one_line_attach_reports_every_window_with_hf_loss_tokens_data_wait_and_events(
        run_dir, tmp_path):
    train = Characters(32, delay_s=0.002)
    trainer = _trainer(tmp_path, train, gas=2, max_steps=6, lr=0.05, max_grad_norm=1.0,
                       eval_strategy="steps", eval_steps=3, save_strategy="steps",
                       save_steps=4, eval_dataset=Characters(8, offset=40))
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    monitor = agent.attach(trainer, name="hf-run")  # the one line
    assert monitor.info.name == "hf-run"
    output = trainer.train()
    assert output.global_step == 6
    records = _records(monitor)
    steps = _steps(records)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for body in steps.values():
        assert body["samples"] == 2 * BATCH and body["tokens"] == 2 * BATCH * SEQ
        assert body["tokens_per_s"] == pytest.approx(body["tokens"] / body["step_time_s"])
        assert body["data_wait_s"] > 0.002  # inside HF's fetch of the window
        assert body["lr"] == pytest.approx(0.05)
    # accelerate's loader reads one batch ahead: an epoch's waits add up to its items'
    assert sum(steps[k]["data_wait_s"] for k in range(1, 5)) >= 32 * 0.002
    _check_windows(snapshots, train, [2] * 6, steps, clip=1.0)
    assert [e["step"] for e in _events(records, "evaluation")] == [3, 6]
    assert "eval_loss" in _events(records, "evaluation")[0]["metrics"]
    assert len(_events(records, "evaluation_start")) == 2
    saved = _events(records, "checkpoint")
    assert [e["step"] for e in saved] == [4, 6] and os.path.isdir(saved[0]["path"])
    epochs = [(e["epoch"], e["complete"]) for e in _events(records, "epoch_end")]
    assert epochs == [(1, True), (2, False)]  # 4 windows an epoch; max_steps in the 2nd
    assert any("train_loss" in e["logs"] for e in _events(records, "log"))
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == "finished"
    hello = next(r for r in records if r["type"] == "hello")
    assert hello["training"] == {"framework": f"transformers {transformers.__version__}",
                                 "loss_normalization": "tokens"}
    names = {knob["name"] for knob in hello["knobs"]}
    assert {"precision", "accum_steps", "checkpointing", "kernels", "lr_scale",
            "weight_decay", "max_grad_norm", "cpu_threads", "checkpoint"} <= names


@pytest.mark.parametrize("normalised", ["by_tokens", "per_micro_batch"])
def test_accum_steps_change_live_every_window_matches_plain_torch_and_ends_at_max_steps(
        run_dir, tmp_path, normalised):
    # 8 micro-batches an epoch; HF plans 4 windows an epoch (gas 2) and 4 epochs for 16
    # steps. 2 -> 1 at step 3 (more windows in epoch 1 than HF planned), 1 -> 4 at step 8
    # (a window starting at micro-batch 1 of epoch 2, not a multiple of 4; fewer windows
    # per epoch, so 6 epochs to reach max_steps).
    train = Characters(32)
    per_micro_batch = normalised == "per_micro_batch"
    max_steps = 10 if per_micro_batch else 16
    trainer = _trainer(tmp_path, train, gas=2, max_steps=max_steps, lr=0.2,
                       schedule="linear")
    if per_micro_batch:  # a model without num_items_in_batch: HF divides by the window
        trainer.model_accepts_loss_kwargs = False  # size (current_gradient_accumulation_steps)
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    monitor = hf.attach(trainer)
    changes = {3: 1, 8: 4}
    for step, value in changes.items():
        reply = send_command(monitor.info, "accum_steps", value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    output = trainer.train()
    assert output.global_step == max_steps == trainer.state.global_step
    records = _records(monitor)
    steps = _steps(records)
    assert sorted(steps) == list(range(1, max_steps + 1))
    sizes = _plan(8, 2, changes, max_steps)
    assert sizes == [2, 2, 1, 1, 1, 1, 1, 4, 3, 4, 4, 4, 4, 4, 4, 4][:max_steps]
    assert [steps[k]["micro_batches"] for k in sorted(steps)] == sizes
    for k, body in steps.items():  # the LR schedule goes on by optimizer step
        assert body["lr"] == pytest.approx(0.2 * (max_steps - (k - 1)) / max_steps), k
        assert body["samples"] == BATCH * sizes[k - 1]
        assert body["knobs"]["accum_steps"] == (2 if k < 3 else 1 if k < 8 else 4)
    _check_windows(snapshots, train, sizes, steps, per_micro_batch=per_micro_batch)
    applied = _events(records, "applied")
    assert [(e["step"], e["value"]) for e in applied] == [(3, 1), (8, 4)]
    assert trainer.args.gradient_accumulation_steps == 4
    if not per_micro_batch:
        assert [e["complete"] for e in _events(records, "epoch_end")] == [True] * 5 + [False]
        assert trainer.state.num_train_epochs == 6  # 4 planned
        assert "planned step 16" in _events(records, "plan")[0]["text"]


def test_precision_switches_live_with_a_real_grad_scaler(run_dir, tmp_path):
    train = Characters(32)
    trainer = _trainer(tmp_path, train, gas=1, max_steps=9, lr=0.1)
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    raw = []  # the embedding's gradient as backward produced it (scaled in fp16)
    trainer.model.transformer.wte.weight.register_hook(lambda grad: raw.append(grad.clone()))

    class Unscaled(TrainerCallback):
        seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.append(model.transformer.wte.weight.grad.clone())

    trainer.add_callback(Unscaled())
    dtypes = _record_dtypes(trainer.model)
    monitor = hf.attach(trainer)
    changes = {3: "bf16", 5: "fp16", 8: "fp32"}
    for step, value in changes.items():
        reply = send_command(monitor.info, "precision", value, apply_step=step)
        assert reply["ok"], reply
        assert reply.get("warning") == precision_warning(value, "cpu")  # true to this CPU
    trainer.train()
    records = _records(monitor)
    steps = _steps(records)
    precision = {k: ("fp32" if k < 3 else "bf16" if k < 5 else "fp16" if k < 8 else "fp32")
                 for k in range(1, 10)}
    assert {k: body["knobs"]["precision"] for k, body in steps.items()} == precision
    autocast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert dtypes == [autocast[precision[k]] for k in range(1, 10)]  # one forward a step
    policy = _callback(trainer).run.policy
    grad_scaler = policy.scaler  # made at the first switch to fp16, kept after it
    assert isinstance(grad_scaler, torch.amp.GradScaler)
    assert trainer.accelerator.scaler is policy.grad_scaler is trainer.optimizer.scaler
    assert grad_scaler.get_scale() == 65536.0  # the initial scale, never backed off
    assert grad_scaler._growth_tracker.item() == 3  # three fp16 steps stepped and updated
    for k in range(1, 10):  # fp16 steps: backward made 65536x gradients, unscaled before
        ratio = 65536.0 if precision[k] == "fp16" else 1.0  # the step (and clipping)
        assert torch.allclose(raw[k - 1] / ratio, Unscaled.seen[k - 1]), k
    for k in range(1, 10):
        assert ("grad_scaler_skipped" in steps[k]) == (precision[k] == "fp16"), k
    hand = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    _check_windows(snapshots, train, [1] * 9, steps, autocast=lambda k: hand[precision[k]],
                   rtol=1e-2)


def _record_dtypes(model):
    """The dtype of a linear layer's output at every training forward (autocast's)."""
    seen = []
    layer = model.transformer.h[0].attn.c_attn
    layer.register_forward_hook(lambda module, args, output: seen.append(output.dtype)
                                if module.training else None)
    return seen


def test_a_run_started_in_bf16_switches_live_from_accelerates_autocast(run_dir, tmp_path):
    train = Characters(32)
    trainer = _trainer(tmp_path, train, gas=1, max_steps=6, lr=0.1, bf16=True)
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    dtypes = _record_dtypes(trainer.model)
    monitor = hf.attach(trainer)
    assert monitor.knobs.knobs["precision"].get() == "bf16"
    for step, value in {3: "fp32", 5: "fp16"}.items():
        assert send_command(monitor.info, "precision", value, apply_step=step)["ok"]
    trainer.train()
    steps = _steps(_records(monitor))
    precision = {1: "bf16", 2: "bf16", 3: "fp32", 4: "fp32", 5: "fp16", 6: "fp16"}
    assert [steps[k]["knobs"]["precision"] for k in range(1, 7)] == list(precision.values())
    autocast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert dtypes == [autocast[p] for p in precision.values()]
    assert "_original_forward" not in trainer.model.__dict__  # accelerate's wrapper is gone
    assert _callback(trainer).run.policy.scaler._growth_tracker.item() == 2
    hand = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    _check_windows(snapshots, train, [1] * 6, steps, autocast=lambda k: hand[precision[k]],
                   rtol=1e-2)


def _callback(trainer):
    return next(callback for callback in trainer.callback_handler.callbacks
                if isinstance(callback, hf.GpuwatchCallback))


def test_checkpointing_toggles_live_and_every_parameter_still_gets_its_gradient(
        run_dir, tmp_path):
    train = Characters(32)

    class Commands(TrainerCallback):  # the agent starts at on_train_begin here
        def on_train_begin(self, args, state, control, **kwargs):
            info = watcher.agent.info
            self.replies = [send_command(info, "checkpointing", True, apply_step=3),
                            send_command(info, "checkpointing", False, apply_step=6)]

    watcher = hf.GpuwatchCallback()
    commands = Commands()
    trainer = _trainer(tmp_path, train, gas=2, max_steps=8, lr=0.1,
                       callbacks=[watcher, commands])
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    trainer.train()
    assert all(reply["ok"] for reply in commands.replies), commands.replies
    assert snapshots.checkpointing == [False, False, True, True, True, False, False, False]
    assert all(snapshots.all_grads)
    steps = _steps(_records(watcher.agent))
    assert [steps[k]["knobs"]["checkpointing"] for k in range(1, 9)] == snapshots.checkpointing
    _check_windows(snapshots, train, [2] * 8, steps)
    assert not getattr(trainer.model, "_require_grads_hooks", None)  # left as it was


def test_lr_scale_and_max_grad_norm_apply_from_their_step_as_plain_torch_computes(
        run_dir, tmp_path):
    """lr_scale=0.5 from step 3 halves what HF's linear schedule sets (its shape kept),
    max_grad_norm=0.5 from step 4 is args.max_grad_norm; weight_decay goes to HF's decay
    group only (no biases, no LayerNorm)."""
    train = Characters(32)
    trainer = _trainer(tmp_path, train, max_steps=6, lr=0.2, schedule="linear")
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    monitor = hf.attach(trainer)
    for knob, value, step in (("lr_scale", 0.5, 3), ("max_grad_norm", 0.5, 4),
                              ("weight_decay", 0.1, 6)):
        reply = send_command(monitor.info, knob, value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    trainer.train()
    steps = _steps(_records(monitor))
    for k in range(1, 7):
        schedule = 0.2 * (6 - (k - 1)) / 6
        assert steps[k]["lr"] == pytest.approx(schedule * (0.5 if k >= 3 else 1.0)), k
        assert steps[k]["lr_groups"] == [steps[k]["lr"]] * 2  # HF's two groups
    _check_windows(snapshots, train, [1] * 5, steps, clip=lambda k: 0.5 if k >= 4 else None)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    assert trainer.args.max_grad_norm == 0.5  # as set: HF reads it at every step


def test_checkpoint_now_is_hfs_own_checkpoint_with_the_knobs_and_the_data_position(
        run_dir, tmp_path):
    """(The resume from it is the contract's: tests/contract/hf.py.)"""
    trainer = _trainer(tmp_path, Characters(32), max_steps=6, lr=0.2, schedule="linear")
    monitor = hf.attach(trainer, checkpoint_dir=tmp_path / "saved")
    for knob, value, step in (("lr_scale", 0.5, 3), ("checkpoint", "now", 5)):
        reply = send_command(monitor.info, knob, value, apply_step=step)
        assert reply["ok"] and "warning" not in reply, reply
    trainer.train()
    path = tmp_path / "saved" / "checkpoint-4"
    saved = _events(_records(monitor), "applied")[-1]
    assert (saved["knob"], saved["path"], saved["checkpoint_step"]) == ("checkpoint", str(path), 4)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "gpuwatch.json"} <= {p.name for p in path.iterdir()}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # made atomic
    ours = json.loads((path / "gpuwatch.json").read_text())
    assert ours["knobs"]["lr_scale"] == 0.5 and ours["step"] == 4
    assert ours["data"] == {"epoch": 0, "micro_batches": 4}  # 8 micro-batches an epoch


@pytest.mark.parametrize("saved_after, position", [(3, {"epoch": 0, "micro_batches": 8}),
                                                    (6, {"epoch": 2, "micro_batches": 4})])
def test_hfs_own_checkpoint_after_a_live_accum_steps_change_resumes_exactly(
        run_dir, tmp_path, saved_after, position):
    """HF's save_steps checkpoints get gpuwatch's knobs and data position too. 8
    micro-batches an epoch, gas 2 -> 4 at step 2: windows 2, 4, 2 | 4, 4 | 4, 4 | 4 (HF
    planned 2 epochs of 4 windows). Saved after step 3 (epoch 0 used up), HF's own
    count (3 steps, 4 an epoch, gas 2) would resume at micro-batch 6 of epoch 0; after
    step 6 (micro-batch 4 of epoch 2), at micro-batch 4 of epoch 1, and end after its 2
    planned epochs. ``train(resume_from_checkpoint=True)`` finds the checkpoint, and the
    resumed steps are the twin's, bit for bit."""
    twin = _trainer(tmp_path, Characters(32), gas=2, max_steps=8, lr=0.2, schedule="linear",
                    save_strategy="steps", save_steps=saved_after)
    monitor = hf.attach(twin)
    assert send_command(monitor.info, "accum_steps", 4, apply_step=2)["ok"]
    twin.train()
    twin_records = _records(monitor)
    want = _steps(twin_records)
    assert [want[k]["micro_batches"] for k in range(1, 9)] == [2, 4, 2, 4, 4, 4, 4, 4]
    path = tmp_path / "out" / f"checkpoint-{saved_after}"
    ours = json.loads((path / "gpuwatch.json").read_text())
    assert ours["data"] == position and ours["knobs"]["accum_steps"] == 4
    assert not _events(_records(monitor), "warning")
    for later in path.parent.glob("checkpoint-*"):  # (HF saves at the last step too)
        if int(later.name.split("-")[1]) > saved_after:
            shutil.rmtree(later)

    other = _model(seed=1).state_dict()  # (before the Trainer seeds its sampler)
    fresh = _trainer(tmp_path, Characters(32), gas=2, max_steps=8, lr=0.2,
                     schedule="linear")
    fresh.model.load_state_dict(other)  # the checkpoint's weights must win
    resumed = hf.attach(fresh)
    fresh.train(resume_from_checkpoint=True)
    records = _records(resumed)
    event = _events(records, "resumed")[0]
    assert event["text"].startswith(f"resumed from {path} at step {saved_after} with ")
    assert "accum_steps=4" in event["text"] and event["level"] == "info"
    got = _steps(records)
    assert sorted(got) == list(range(saved_after + 1, 9))
    for k in got:
        assert got[k]["micro_batches"] == want[k]["micro_batches"], k
        assert got[k]["loss"] == want[k]["loss"], k
    for mine, theirs in zip(fresh.model.parameters(), twin.model.parameters()):
        assert torch.equal(mine, theirs)
    # the epochs that end after the resume are numbered as the twin's were (a user's
    # resumed run said "epoch 1 ended" where HF was in its fourth); HF saves a step's
    # checkpoint before its epoch's end, which the resumed run then says
    ends = [(e["epoch"], e["step"]) for e in _events(records, "epoch_end")]
    assert ends and ends == [(e["epoch"], e["step"]) for e in _events(twin_records, "epoch_end")
                             if e["step"] >= saved_after], ends


def test_a_sampler_a_resume_cannot_replay_is_said_before_saving_and_on_resume(
        run_dir, tmp_path):
    unseeded = {"accelerator_config": {"use_seedable_sampler": False}}
    trainer = _trainer(tmp_path, Characters(32), max_steps=3, **unseeded)
    monitor = hf.attach(trainer, checkpoint_dir=tmp_path / "saved")
    replies = []

    class Ask(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                replies.append(send_command(monitor.info, "checkpoint", "now"))

    trainer.add_callback(Ask())
    trainer.train()
    reason = hf._sampler_reason(trainer.callback_handler.train_dataloader)
    assert reason is not None and "use_seedable_sampler" in reason
    assert replies[0]["ok"], replies
    assert replies[0]["warning"] == f"a resume from it will not be exact: {reason}"
    path = _events(_records(monitor), "applied")[-1]["path"]

    fresh = _trainer(tmp_path, Characters(32), max_steps=3, **unseeded)
    resumed = hf.attach(fresh)
    fresh.train(resume_from_checkpoint=path)
    event = _events(_records(resumed), "resumed")[0]
    assert event["level"] == "warning"
    assert event["text"].endswith(f"; not as in the saved run: {reason}")


SIGTERM_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import TrainerCallback
import agent
from tests.test_hf import Characters, _trainer
from pathlib import Path

class Announce(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            print("stepping", flush=True)

trainer = _trainer(Path({tmp!r}), Characters(32), max_steps=100000,
                   callbacks=[Announce()])
monitor = agent.attach(trainer, name="hf-sigterm")
print(monitor.info.log_path, flush=True)
trainer.train()
"""


@pytest.mark.slow
def test_sigterm_ends_the_run_with_bye(run_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SIGTERM_SCRIPT.format(root=str(Path(__file__).parent.parent),
                                            tmp=str(tmp_path)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        log_path = process.stdout.readline().strip()
        assert process.stdout.readline().strip() == "stepping", process.stderr.read()
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    last = list(flat_records(log_path))[-1]
    assert last["type"] == "bye" and last["reason"] == "stopped by SIGTERM"
    assert [p for p in os.listdir(run_dir) if p != "logs"] == []  # run file and sockets


def test_an_optimizer_without_weight_decay_refuses_it_once_train_made_it(run_dir, tmp_path):
    model = _model()
    args = _trainer(tmp_path, Characters(8), max_steps=2).args
    trainer = Trainer(model=model, args=args, train_dataset=Characters(8),
                      optimizers=(torch.optim.Rprop(model.parameters()), None))
    monitor = hf.attach(trainer)
    replies = []

    class Ask(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                replies.append(send_command(monitor.info, "weight_decay", 0.1))

    trainer.add_callback(Ask())
    trainer.train()
    assert replies[0]["reason"] == "weight_decay=0.1: Rprop has no weight_decay in its param groups"


def test_knobs_the_trainer_cannot_apply_are_refused_with_the_reason(run_dir, tmp_path):
    trainer = _trainer(tmp_path, Characters(32))
    monitor = hf.attach(trainer)
    try:
        for knob, value in (("num_workers", 2), ("pin_memory", True),
                            ("prefetch_factor", 4)):
            reply = send_command(monitor.info, knob, value)
            assert not reply["ok"] and reply["reason"] == f"{knob}: {hf.LOADER_REASON}"
        reply = send_command(monitor.info, "memory_fraction", 0.5)
        assert reply["reason"] == "memory_fraction: needs CUDA; this run is on cpu"
        reply = send_command(monitor.info, "mixture", "0.5,0.5")
        assert not reply["ok"] and reply["reason"] == f"mixture: {hf.MIXTURE_REASON}"
        reply = send_command(monitor.info, "kernels", "triton")
        assert not reply["ok"] and "GPT2LMHeadModel has none" in reply["reason"]
    finally:
        monitor.close()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(32):
                ids = Characters(32).item(i)
                yield {"input_ids": ids, "labels": ids.clone()}

    streamed = _trainer(tmp_path, Stream())
    monitor = hf.attach(streamed)
    try:
        reply = send_command(monitor.info, "accum_steps", 2)
        assert not reply["ok"] and "the training dataset has no length" in reply["reason"]
    finally:
        monitor.close()


def test_an_error_in_training_closes_the_run_and_reaches_the_caller(run_dir, tmp_path):
    class Broken(Characters):
        def __getitem__(self, i):
            if len(self.fetched) == 10:
                raise OSError("disk gone")
            return super().__getitem__(i)

    trainer = _trainer(tmp_path, Broken(32), max_steps=8)
    monitor = hf.attach(trainer)
    with pytest.raises(OSError, match="disk gone"):
        trainer.train()
    records = _records(monitor)
    assert records[-1]["type"] == "bye" and "disk gone" in records[-1]["reason"]
    assert sorted(_steps(records)) == [1]  # accelerate reads a batch ahead of step 2
    assert [p for p in os.listdir(run_dir) if p != "logs"] == []  # run file and sockets


def test_kernels_compile_switches_live_and_trains_the_same_windows(run_dir, tmp_path):
    train = Characters(32)
    trainer = _trainer(tmp_path, train, gas=2, max_steps=8, lr=0.1)
    snapshots = Snapshots(trainer.model)
    trainer.add_callback(snapshots)
    monitor = hf.attach(trainer, compile_backend="aot_eager")  # inductor: minutes here
    for step, value in {3: "compile", 7: "eager"}.items():
        assert send_command(monitor.info, "kernels", value, apply_step=step)["ok"]
    trainer.train()
    records = _records(monitor)
    steps = _steps(records)
    kernels = ["eager"] * 2 + ["compile"] * 4 + ["eager"] * 2
    assert [steps[k]["knobs"]["kernels"] for k in range(1, 9)] == kernels
    assert _events(records, "compiling") and _events(records, "compiled")
    assert _callback(trainer).run.forward.compiled.compiles >= 1
    _check_windows(snapshots, train, [2] * 8, steps)


def test_pause_resume_then_evaluate_and_stop_at_one_boundary_are_hfs_own(run_dir, tmp_path):
    """pause=on holds after step 2 until pause=off: no step lost or repeated (the losses
    equal an unpaused twin's); evaluate=now is HF's evaluate() after step 4, whose
    eval_loss a hand call on the stopped model equals; stop=now at the same boundary
    ends train() there through HF's own flag, on_train_end closing the run."""
    evaluation = Characters(8, offset=40)
    twin = _trainer(tmp_path, Characters(32), max_steps=6, eval_dataset=evaluation)
    twin_monitor = hf.attach(twin)
    twin.train()
    twin_steps = _steps(_records(twin_monitor))
    trainer = _trainer(tmp_path, Characters(32), max_steps=6, eval_dataset=evaluation)
    monitor = hf.attach(trainer)
    for knob, value, step in (("pause", "on", 3), ("evaluate", "now", 5), ("stop", "now", 5)):
        reply = send_command(monitor.info, knob, value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    resumer, resumed = resume_when_paused(monitor.info)
    trainer.train()
    resumer.join(30)
    assert resumed and resumed[0]["ok"] and resumed[0]["apply_step"] == 3, resumed
    records = _records(monitor)
    steps = _steps(records)
    assert sorted(steps) == [1, 2, 3, 4] and trainer.state.global_step == 4
    assert [steps[k]["loss"] for k in steps] == [twin_steps[k]["loss"] for k in steps]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 4")
    [event] = _events(records, "evaluation")
    assert event["step"] == 4
    assert event["metrics"]["eval_loss"] == trainer.evaluate()["eval_loss"]
