"""The accelerate integration on a real ``accelerate.Accelerator`` (CPU): step records,
and every live knob checked against a plain-torch hand computation of the same
micro-batches, or refused with its reason."""

import gc
import itertools
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import agent  # noqa: E402
from agent.wire import runs  # noqa: E402
from agent.integrations.adapters import NOT_A_MIXTURE  # noqa: E402
from agent.integrations.accelerate import AcceleratorRun  # noqa: E402
from gpuwatch.client import send_command  # noqa: E402
from gpuwatch.history import flat_records  # noqa: E402
from tests.test_security import Payload, _Counter  # noqa: E402
from tests.training import BlockNet, digits_loader, model as make_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LR = 0.1
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def fresh_accelerate(run_dir):
    """accelerate keeps process-wide state (AcceleratorState, GradientState): each test
    starts from none, as a fresh process would."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class SlowDigits(torch.utils.data.Dataset):
    """Digits whose samples take ``delay_s`` each to load (a slow disk)."""

    def __init__(self, n, delay_s=0.0):
        self.x, self.y = (torch.cat(t) for t in zip(*digits_loader(batch_size=n, n=n)))
        self.delay_s = delay_s

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        if self.delay_s:
            time.sleep(self.delay_s)  # the loader's own work, not a wait in the test
        return self.x[index], self.y[index]


@dataclass
class Window:
    """One optimizer step as the test saw it: the parameters and settings before it,
    its micro-batches (x, y, undivided loss) and the parameters after."""

    before: list
    settings: dict
    micro_batches: list = field(default_factory=list)
    after: list = None
    grad_norm: float = None
    skipped: bool = False


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def _settings(accelerator, run):
    scaler = accelerator.scaler
    with accelerator.autocast():  # accelerate's own autocast follows the knob
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
    return {"precision": run.knobs.knobs["precision"].get() if "precision" in run.knobs.knobs
            else "fp32",
            "accum_steps": accelerator.gradient_accumulation_steps,
            "accelerate_step": accelerator.step,
            "scaler": None if scaler is None else scaler.state_dict(),
            "scaler_object": scaler,
            "optimizer_scalers": [opt.scaler for opt in accelerator._optimizers],
            "autocast": autocast,
            "checkpointing": run.checkpointing is not None and run.checkpointing.enabled}


def _train(accelerator, model, optimizer, loader, run, *, scheduler=None, max_norm=None,
           at_boundary=lambda window: None, check_grads=None):
    """The usual accelerate loop, with the three gpuwatch lines, recording each window
    (its settings as its first micro-batch starts: commands apply between windows).
    ``loader``: the loop's data, or an iterator ``run.loader(...)`` already returned.
    ``at_boundary(n)`` runs as window ``n`` ends; a command sent there applies from
    window ``n + 1`` (the agent has recorded ``n - 1`` steps: its reply says so)."""
    windows = []
    starting = True
    for x, y in (loader if isinstance(loader, Iterator) else run.loader(loader)):
        if starting:
            windows.append(Window(_parameters(model), _settings(accelerator, run)))
            starting = False
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if check_grads is not None:
                    check_grads()
                if max_norm is not None:
                    windows[-1].grad_norm = float(
                        accelerator.clip_grad_norm_(model.parameters(), max_norm))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        windows[-1].micro_batches.append((x, y, loss.item()))
        run.micro_batch(loss)
        if accelerator.sync_gradients:
            windows[-1].after = _parameters(model)
            windows[-1].skipped = getattr(optimizer, "step_was_skipped", False)
            starting = True
            at_boundary(len(windows))
    return windows


def _by_hand(make, window, max_norm=None, lr=LR):
    """The window's update in plain torch: autocast and GradScaler as configured, each
    micro-batch's loss divided by accum_steps (accelerate's normalisation), SGD."""
    twin = make()
    with torch.no_grad():
        for parameter, value in zip(twin.parameters(), window.before):
            parameter.copy_(value)
    optimizer = torch.optim.SGD(twin.parameters(), lr=lr)
    precision = window.settings["precision"]
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(window.settings["scaler"])
    for x, y, _ in window.micro_batches:
        with torch.autocast("cpu", dtype=_DTYPE.get(precision, torch.float32),
                            enabled=precision != "fp32"):
            output = twin(x)
        loss = nn.functional.cross_entropy(output.float(), y) / window.settings["accum_steps"]
        (loss if scaler is None else scaler.scale(loss)).backward()
    norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_norm is not None:
        norm = float(nn.utils.clip_grad_norm_(twin.parameters(), max_norm))
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return _parameters(twin), norm


def _assert_updates_by_hand(windows, make, max_norm=None, exact=True):
    for number, window in enumerate(windows, start=1):
        expected, norm = _by_hand(make, window, max_norm)
        for got, want in zip(window.after, expected):
            if exact:
                torch.testing.assert_close(got, want, rtol=0, atol=0,
                                           msg=lambda m: f"step {number}: {m}")
            else:
                torch.testing.assert_close(got, want, msg=lambda m: f"step {number}: {m}")
        if max_norm is not None:
            assert window.grad_norm == pytest.approx(norm, rel=1e-6), number


def _digits(n=256, batch_size=8, delay_s=0.0):
    return torch.utils.data.DataLoader(SlowDigits(n, delay_s), batch_size=batch_size)


def _prepared(accum_steps=1, make=make_model, n=256, delay_s=0.0, **accelerator_options):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum_steps,
                              **accelerator_options)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer,
                                                   _digits(n, delay_s=delay_s))
    return accelerator, model, optimizer, loader


def _records(run):
    path = run.agent.info.log_path
    run.close()
    records = list(flat_records(path))
    steps = {r["step"]: r for r in records if r["type"] == "step"}  # a record a step
    events = [r for r in records if r["type"] == "event"]
    return steps, events, records


def test_attach_in_one_line_records_window_loss_samples_tokens_lr_and_data_wait():
    accelerator, model, optimizer, loader = _prepared(accum_steps=2, n=96, delay_s=0.001)
    scheduler = accelerator.prepare(
        torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 0.5 ** step))
    run = agent.attach(accelerator, name="accelerate-digits", tokens_per_sample=64)
    assert isinstance(run, AcceleratorRun)
    assert runs.find_run(run.agent.run_id).name == "accelerate-digits"
    windows = _train(accelerator, model, optimizer, loader, run, scheduler=scheduler)
    steps, events, records = _records(run)
    assert sorted(steps) == list(range(1, 7)) and len(windows) == 6
    for number, window in enumerate(windows, start=1):
        body = steps[number]
        assert body["micro_batches"] == 2 and body["samples"] == 16
        assert body["tokens"] == 16 * 64 and body["tokens_per_s"] > 0
        # the rate is the step's tokens over its time (any load), not a speed to reach
        assert body["tokens_per_s"] == pytest.approx(body["tokens"] / body["step_time_s"])
        # the loss is the window's mean of undivided micro-batch losses
        assert body["loss"] == pytest.approx(
            sum(loss for _, _, loss in window.micro_batches) / 2, rel=1e-6)
        # the rate this step used (the scheduler then moved on to the next one)
        assert body["lr"] == pytest.approx(LR * 0.5 ** (number - 1))
        assert body["data_wait_s"] > 0
    # each of the 96 samples took >= 1 ms to load, inside the loader's next() (accelerate
    # fetches one batch ahead, so the first window waits for 3 batches, the last for 1)
    assert sum(body["data_wait_s"] for body in steps.values()) >= 96 * 0.001
    assert any(e.get("kind") == "loss_normalization" for e in events)
    assert records[-1]["type"] == "bye" and runs.list_runs() == []


def test_live_accum_steps_change_mid_epoch_matches_a_hand_computation():
    """4 -> 3 when accelerate's micro-batch count is 8 (8 % 3 != 0: a plain change of
    gradient_accumulation_steps made the next window one micro-batch divided by 3)."""
    accelerator, model, optimizer, loader = _prepared(accum_steps=4, n=320)  # 40 batches
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    replies = []

    def at_boundary(window):
        if window == 2:
            replies.append(send_command(info, "accum_steps", 3))

    windows = _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary)
    assert replies[0]["ok"] and replies[0]["apply_step"] == 3, replies
    # accelerate counts micro-batches on (4 at window 2's start); the change restarts it
    assert [w.settings["accelerate_step"] for w in windows[:3]] == [0, 4, 0]
    sizes = [len(w.micro_batches) for w in windows]
    # 2 windows of 4, then exactly 3 each; the epoch's last 2 micro-batches form the
    # short last window of accelerate's end-of-dataloader sync (divided by 3, as in a
    # fresh run with gradient_accumulation_steps=3)
    assert sizes == [4, 4] + [3] * 10 + [2], sizes
    assert [w.settings["accum_steps"] for w in windows] == [4, 4] + [3] * 11
    _assert_updates_by_hand(windows, make_model)
    steps, events, _ = _records(run)
    assert [steps[s]["micro_batches"] for s in sorted(steps)] == sizes
    assert [steps[s]["knobs"]["accum_steps"] for s in sorted(steps)] == [4, 4] + [3] * 11
    assert any(e.get("text") == "accum_steps=3 applied at step 3" for e in events), events


def test_live_precision_bf16_fp16_fp32_fp16_with_one_kept_grad_scaler_and_clipping():
    accelerator, model, optimizer, loader = _prepared(accum_steps=2, n=160)  # 10 steps
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    plan = {2: "bf16", 4: "fp16", 6: "fp32", 8: "fp16"}  # sent as window n ends

    def at_boundary(window):
        if window in plan:
            reply = send_command(info, "precision", plan[window])
            assert reply["ok"] and reply["apply_step"] == window + 1, reply

    windows = _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary,
                     max_norm=1.0)
    settings = [w.settings for w in windows]
    precisions = [s["precision"] for s in settings]
    assert precisions == ["fp32", "fp32", "bf16", "bf16", "fp16", "fp16", "fp32", "fp32",
                          "fp16", "fp16"]
    # accelerate's own autocast follows the knob
    assert [s["autocast"] for s in settings] == [
        False, False, torch.bfloat16, torch.bfloat16, torch.float16, torch.float16, False,
        False, torch.float16, torch.float16]
    # the GradScaler: made once at the first fp16, set on the accelerator and on the
    # prepared optimizer, kept (with its scale) across fp32; 2**16 scale visible
    scaler = settings[4]["scaler_object"]
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 2.0 ** 16
    for number, s in enumerate(settings, start=1):
        expected = scaler if s["precision"] == "fp16" else None
        assert s["scaler_object"] is expected and s["optimizer_scalers"] == [expected], number
    assert settings[4]["scaler"]["scale"] == 2.0 ** 16
    assert not any(w.skipped for w in windows)  # every step stepped
    # every window, clipping included (unscaled first in fp16), equals plain torch
    _assert_updates_by_hand(windows, make_model, max_norm=1.0)
    steps, _, _ = _records(run)
    assert [steps[s]["knobs"]["precision"] for s in sorted(steps)] == precisions
    assert all(steps[s]["grad_norm"] == pytest.approx(windows[s - 1].grad_norm, rel=1e-6)
               for s in steps)
    assert [steps[s].get("grad_scaler_skipped") for s in (4, 5, 6, 7)] == [
        None, False, False, None]
    with run.autocast:  # reusable, after the run too: the last precision, fp16
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert model(torch.zeros(1, 64)).dtype == torch.float32  # fp32 outputs, as accelerate's


def test_a_run_that_starts_in_bf16_switches_live_and_notices_its_forward_replaced():
    """accelerate wraps the prepared model's forward in a fixed bf16 autocast; the run
    replaces it by the live one, and refuses precision once something else replaces it."""
    accelerator, model, optimizer, loader = _prepared(n=32, mixed_precision="bf16")
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    assert run.knobs.knobs["precision"].get() == "bf16"

    def at_boundary(window):
        if window == 2:
            assert send_command(info, "precision", "fp32")["ok"]

    windows = _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary)
    assert [w.settings["precision"] for w in windows] == ["bf16", "bf16", "fp32", "fp32"]
    assert [w.settings["autocast"] for w in windows] == [torch.bfloat16] * 2 + [False] * 2
    _assert_updates_by_hand(windows, make_model)
    assert accelerator.mixed_precision == "no" and not accelerator.native_amp

    accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # strips the live forward
    replies = []

    def after_unwrap(window):
        if window == 2:  # window 1's step has been recorded: the change was seen
            replies.append(send_command(info, "precision", "bf16"))

    _train(accelerator, model, optimizer, loader, run, at_boundary=after_unwrap)
    assert replies[0]["reason"] == ("precision=bf16: the model's forward was replaced "
                                    "outside gpuwatch (e.g. by "
                                    "unwrap_model(keep_fp32_wrapper=False))"), replies
    _, events, _ = _records(run)
    assert any("precision and kernels changes are refused from now on" in e["text"]
               for e in events)


@pytest.mark.parametrize("placement", ["after zero_grad", "before optimizer.step"])
def test_without_run_loader_the_step_is_recorded_at_the_call(placement):
    """Without run.loader() the call itself is the boundary: after zero_grad a precision
    change applies; before optimizer.step it would unscale gradients that were never
    scaled, so it is refused (and the run says why), training unchanged."""
    accelerator, model, optimizer, loader = _prepared(accum_steps=2, n=64)
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    early = placement == "before optimizer.step"
    precisions = []
    for index, (x, y) in enumerate(loader):
        precisions.append(run.knobs.knobs["precision"].get())  # this micro-batch's
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if early:
                run.micro_batch(loss)
            optimizer.step()
            optimizer.zero_grad()
        if not early:
            run.micro_batch(loss)
        if index == 1:  # step 1 is recorded: the earliest is step 3
            assert send_command(info, "precision", "fp16")["ok"]
    steps, events, _ = _records(run)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[s]["micro_batches"] for s in steps] == [2] * 4
    if early:
        assert set(precisions) == {"fp32"} and accelerator.scaler is None
        failed = [e["text"] for e in events if e.get("kind") == "failed"]
        assert failed == ["precision=fp16 failed at step 3: run.micro_batch() ran before "
                          "optimizer.step() and zero_grad() in a window that ended: call it "
                          "after them (zero_grad with set_to_none, the default), or iterate "
                          "run.loader(); kept precision=fp32"], failed
        warned = [e["text"] for e in events if e.get("kind") == "warning"]
        assert any(t.startswith("run.micro_batch() ran before") for t in warned), warned
    else:
        assert precisions == ["fp32"] * 4 + ["fp16"] * 4
        assert accelerator.scaler is not None and optimizer.scaler is accelerator.scaler


def test_checkpointing_toggled_live_every_parameter_gets_its_gradient():
    accelerator, model, optimizer, loader = _prepared(accum_steps=2, make=BlockNet, n=128)
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    states = []

    def at_boundary(window):
        if window in (2, 5):
            assert send_command(info, "checkpointing", window == 2)["ok"]

    def check_grads():
        states.append("forward" in model.blocks[0].__dict__)  # the checkpointed forward
        assert all(p.grad is not None and p.grad.abs().sum() > 0
                   for p in model.parameters() if p.requires_grad)

    windows = _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary,
                     check_grads=check_grads)
    assert states == [False, False, True, True, True, False, False, False]
    assert [w.settings["checkpointing"] for w in windows] == states
    _assert_updates_by_hand(windows, BlockNet)  # recomputation changes no number
    assert "forward" not in model.blocks[0].__dict__  # off again: the blocks as they were
    steps, _, _ = _records(run)
    assert [steps[s]["knobs"]["checkpointing"] for s in sorted(steps)] == states


def test_kernels_compile_live_reports_compile_events_and_trains_as_eager():
    accelerator, model, optimizer, loader = _prepared(n=48)
    run = agent.attach(accelerator, compile_backend="aot_eager")
    info = runs.find_run(run.agent.run_id)

    def at_boundary(window):
        if window == 2:
            refused = send_command(info, "kernels", "triton")
            assert refused["reason"] == ("kernels=triton: Sequential has no gpuopt.kernels "
                                         "fused modules: triton would change nothing"), refused
            assert send_command(info, "kernels", "compile")["ok"]

    windows = _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary)
    assert run.backend.compiled is not None and run.backend.compiled.compiles >= 1
    _assert_updates_by_hand(windows, make_model, exact=False)
    steps, events, _ = _records(run)
    assert [steps[s]["knobs"]["kernels"] for s in sorted(steps)] == ["eager"] * 2 + \
        ["compile"] * 4
    kinds = [e.get("kind") for e in events]
    assert "compiling" in kinds and "compiled" in kinds


def test_lr_scale_and_the_clip_threshold_apply_from_the_next_window_as_by_hand():
    """lr_scale=0.5 halves the optimizer's rate inside its step; max_grad_norm=0.05
    becomes the threshold of the loop's own accelerator.clip_grad_norm_(..., 1.0)."""
    accelerator, model, optimizer, loader = _prepared(n=48)
    run = agent.attach(accelerator)

    def at_boundary(n):
        if n == 2:
            for knob, value in (("lr_scale", 0.5), ("max_grad_norm", 0.05)):
                assert send_command(run.agent.info, knob, value)["ok"]

    windows = _train(accelerator, model, optimizer, loader, run, max_norm=1.0,
                     at_boundary=at_boundary)
    steps, _, _ = _records(run)
    for number, window in enumerate(windows, start=1):
        changed = number >= 3
        expected, norm = _by_hand(make_model, window, 0.05 if changed else 1.0,
                                  lr=LR * (0.5 if changed else 1.0))
        for got, want in zip(window.after, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert steps[number]["lr"] == LR * (0.5 if changed else 1.0)
        assert steps[number]["grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert steps[number]["knobs"]["max_grad_norm"] == (0.05 if changed else 1.0)
    assert optimizer.param_groups[0]["lr"] == LR  # the loop's own rate, between steps


def test_a_loop_that_stops_on_run_step_takes_exactly_that_many_steps():
    """run.step counts a step as accelerate takes it (at the micro-batch that ends its
    window), so `run.step >= 5` stops after 5 optimizer and scheduler steps, not 6; the
    step's record comes later (here at close(): the loop keeps its iterator)."""
    accelerator, model, optimizer, loader = _prepared(accum_steps=2, n=256)  # 32 batches
    scheduler = accelerator.prepare(
        torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 0.5 ** step))
    run = agent.attach(accelerator)
    batches = run.loader(loader)
    micro_batches = 0
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        micro_batches += 1
        run.micro_batch(loss)
        if run.step >= 5:
            break
    assert micro_batches == 10 and scheduler.scheduler.last_epoch == 5
    assert optimizer.param_groups[0]["lr"] == LR * 0.5 ** 5
    steps, _, _ = _records(run)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert [steps[s]["micro_batches"] for s in steps] == [2] * 5


def _epochs_with_a_seedable_sampler(tmp_path, resume_from=None, skip=0):
    """Three epochs of 4 batches (one step each) over a prepared shuffling DataLoader
    whose sampler accelerate seeds with ``data_seed`` + its epoch count, in a
    loop that counts epochs from ``run.epoch``; ``checkpoint=now`` after step 6 (epoch 2).
    ``skip``: the loader given to run.loader() is skip_first_batches(loader, skip).
    Returns the batches trained, the final parameters and the run log's events."""
    from accelerate import DataLoaderConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=7))
    model = make_model(seed=0 if resume_from is None else 1)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=LR),
        torch.utils.data.DataLoader(SlowDigits(32), batch_size=8, shuffle=True))
    if skip:
        loader = accelerator.skip_first_batches(loader, skip)
    run = agent.attach(accelerator, checkpoint_dir=tmp_path, resume_from=resume_from)
    seen = []
    for _ in range(run.epoch, 3):
        for x, y in run.loader(loader):
            seen.append(x)
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            run.micro_batch(loss)
            if run.step == 6 and resume_from is None:
                assert send_command(run.agent.info, "checkpoint", "now")["ok"]
    _, events, _ = _records(run)
    return seen, _parameters(model), events


def test_a_resume_in_a_later_epoch_keeps_accelerates_epoch_count_and_the_epoch_loop(
        tmp_path):
    """A seedable sampler's order is seeded with accelerate's epoch count (the prepared
    loader's ``iteration``): the resume puts it back, so epoch 2 goes on in its own order
    (at 0 it would be epoch 1's), and ``for epoch in range(run.epoch, 3)`` trains the
    rest of epoch 2 and epoch 3, as the saved run did."""
    seen, params, events = _epochs_with_a_seedable_sampler(tmp_path)
    saved = [e for e in events if e.get("knob") == "checkpoint" and e["kind"] == "applied"]
    assert [e["checkpoint_step"] for e in saved] == [6]
    path = saved[0]["path"]
    assert {"model.safetensors", "optimizer.bin", "gpuwatch.json", "gpuwatch-data.pt"} <= {
        p.name for p in Path(path).iterdir()}
    assert len(seen) == 12 and not torch.equal(seen[0], seen[4])  # epochs in other orders

    again, resumed_params, _ = _epochs_with_a_seedable_sampler(tmp_path, resume_from=path)
    assert len(again) == 6 and all(torch.equal(a, b) for a, b in zip(again, seen[6:]))
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, params))

    # the README once said to skip_first_batches after a resume: that skips twice
    _, _, events = _epochs_with_a_seedable_sampler(tmp_path, resume_from=path, skip=1)
    assert any(e["text"].startswith("run.loader() goes on from the checkpoint's "
                                    "micro-batch itself: this loader skips 1 more")
               for e in events)


def test_knobs_that_cannot_be_right_are_refused_with_their_reason():
    accelerator, model, optimizer, loader = _prepared(n=32)
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    schema = {knob["name"] for knob in run.agent.knobs.schema()}
    assert schema == {"accum_steps", "precision", "kernels", "lr_scale", "weight_decay",
                      "max_grad_norm", "checkpoint", "cpu_threads", "pause", "stop",
                      "recover", "rewind"}

    def reason(knob, value):
        reply = send_command(info, knob, value)
        assert not reply["ok"], reply
        return reply["reason"]

    # before the loop entered accelerator.accumulate(), windows are not counted yet
    assert reason("accum_steps", 2) == (
        "accum_steps=2: the loop has not entered accelerator.accumulate(model) yet "
        "(windows are counted there): wrap each micro-batch in `with "
        "accelerator.accumulate(model):`")
    assert reason("checkpointing", True) == (
        "checkpointing: Sequential has no repeated blocks to checkpoint (an nn.ModuleList "
        "'blocks', or of 2+ modules of one type); pass checkpoint_blocks= (names or "
        "nn.Module types of its blocks) to attach()")
    for knob, value in (("num_workers", 2), ("pin_memory", True), ("prefetch_factor", 4)):
        assert reason(knob, value) == (
            f"{knob}: the loop's data is not a gpuopt.loader.ReconfigurableLoader (a "
            "DataLoader fixes its workers when it is built); give one to run.loader() for "
            "live loader knobs")
    assert reason("memory_fraction", 0.5) == "memory_fraction: needs CUDA; this run is on cpu"
    assert reason("mixture", "0.5,0.5") == f"mixture: {NOT_A_MIXTURE}"

    def at_boundary(n):  # a step was taken without accelerator.clip_grad_norm_
        if n == 2:
            assert reason("max_grad_norm", 1.0).startswith(
                "max_grad_norm=1.0: the loop does not call accelerator.clip_grad_norm_(")

    _train(accelerator, model, optimizer, loader, run, at_boundary=at_boundary)
    run.close()
    with pytest.raises(ValueError, match="no submodule named 'trunk'"):
        agent.attach(accelerator, checkpoint_blocks=["trunk"])  # a typo fails at once

    # a model accelerate compiles itself: no live precision or kernels
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator, model, optimizer, loader = _prepared(n=32, dynamo_backend="aot_eager")
    run = agent.attach(accelerator)
    compiled = ("the model is already torch.compile'd (accelerate's dynamo_backend or by "
                "the script)")
    assert run.knobs.unsupported["precision"] == compiled
    assert run.knobs.unsupported["kernels"] == compiled
    assert "forward" not in model._orig_mod.__dict__  # the model is left as it was
    run.close()


def test_loader_knobs_of_a_reconfigurable_loader_change_workers_mid_epoch():
    from gpuopt.loader import ReconfigurableLoader

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    dataset = SlowDigits(128)
    loader = ReconfigurableLoader(dataset, batch_size=8)
    run = agent.attach(accelerator)
    assert "num_workers" in run.knobs.unsupported
    batches = run.loader(loader)  # binds the loader knobs
    assert "num_workers" in run.knobs.knobs and "num_workers" not in run.knobs.unsupported
    info = runs.find_run(run.agent.run_id)

    def at_boundary(window):
        if window == 2:
            assert send_command(info, "num_workers", 1)["ok"]

    windows = _train(accelerator, model, optimizer, batches, run, at_boundary=at_boundary)
    seen = torch.cat([x for w in windows for x, _, _ in w.micro_batches])
    assert torch.equal(seen.sort(dim=0).values, dataset.x.sort(dim=0).values)  # all, once
    _assert_updates_by_hand(windows, make_model)
    steps, _, _ = _records(run)
    assert [steps[s]["knobs"]["num_workers"] for s in sorted(steps)] == [0, 0] + [1] * 6
    loader.close()


def test_a_mixture_loader_given_to_run_loader_binds_the_mixture_knob():
    from torch.utils.data import TensorDataset

    from agent.wire.knobs import KnobError
    from gpuopt.mixture import MixtureLoader

    accelerator = Accelerator(cpu=True)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    run = agent.attach(accelerator)
    assert run.knobs.unsupported["mixture"] == NOT_A_MIXTURE
    x, y = (torch.cat(t) for t in zip(*digits_loader(batch_size=64, n=128)))
    loader = MixtureLoader([TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])],
                           [1, 3], batch_size=8)
    run.loader(loader)  # binds the loader knobs, mixture among them
    knob = run.knobs.knobs["mixture"]
    assert "mixture" not in run.knobs.unsupported and knob.get() == "0.25,0.75"
    assert run.knobs.validate("mixture", "1,1") == "0.5,0.5"
    with pytest.raises(KnobError, match="3 weights, and this run's mixture has 2"):
        run.knobs.validate("mixture", "1,1,1")
    knob.set("0.5,0.5")  # as the agent applies it at a boundary
    assert loader.weights == (0.5, 0.5)
    run.close()


@pytest.mark.slow
def test_sigterm_ends_the_run_cleanly(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from accelerate import Accelerator
import agent
from tests.training import digits_loader, model as make_model

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = make_model()
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
run = agent.attach(accelerator, name="sigterm-loop")
print(run.agent.info.log_path, flush=True)
while True:
    for x, y in run.loader(digits_loader(batch_size=8)):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step(); optimizer.zero_grad()
        run.micro_batch(loss)
        if run.step == 3:
            print("stepping", flush=True)
""")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               text=True, env=os.environ.copy())
    try:
        log_path = process.stdout.readline().strip()
        assert process.stdout.readline().strip() == "stepping"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == -signal.SIGTERM
    finally:
        process.kill()
    last = list(flat_records(log_path))[-1]
    assert last["type"] == "bye" and last["reason"] == "stopped by SIGTERM"
    assert runs.list_runs() == []


def test_stop_ends_run_loader_at_its_boundary_after_a_pause_lost_no_window(run_dir):
    """The shared run base in accelerate: pause=on for step 3 holds after step 2 until
    pause=off (queued before, for step 4: a held run of one rank applies it there), then
    stop=now for step 5 ends run.loader() there: four windows, and bye names it."""
    accelerator, model, optimizer, loader = _prepared(n=96)
    run = agent.attach(accelerator)
    info = runs.find_run(run.agent.run_id)
    for knob, value, step in (("pause", "on", 3), ("pause", "off", 4), ("stop", "now", 5)):
        reply = send_command(info, knob, value, apply_step=step)
        assert reply["ok"] and reply["apply_step"] == step, reply
    windows = _train(accelerator, model, optimizer, loader, run)
    assert len(windows) == 4 and run.step == 4 and run.stopping
    steps, events, records = _records(run)
    assert sorted(steps) == [1, 2, 3, 4]
    applied = [(e["knob"], e["value"], e["step"]) for e in events if e["kind"] == "applied"]
    # pause=off, sent for step 4, applied at the held boundary, before step 3 (one rank
    # takes what was due at the step after next there too)
    assert applied == [("pause", "on", 3), ("pause", "off", 3), ("stop", "now", 5)]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 4")


def test_stop_ends_an_epoch_loop_no_later_epochs_loader_fetches_a_batch(run_dir):
    """stop=now in an epoch-counting loop (``for epoch in range(run.epoch, n)``: each
    epoch a new run.loader()): every later epoch's run.loader() ends before its first
    fetch. (Each one fetched and trained a micro-batch: after stop for step 3, 12 more
    epochs trained 12 micro-batches, 3 more optimizer steps recorded after the stop.)"""
    accelerator, model, optimizer, loader = _prepared(accum_steps=4, n=64)  # 8 batches
    run = agent.attach(accelerator)
    reply = send_command(runs.find_run(run.agent.run_id), "stop", "now", apply_step=3)
    assert reply["ok"], reply
    windows = []
    for _ in range(run.epoch, 13):
        windows += _train(accelerator, model, optimizer, loader, run)
    assert [len(w.micro_batches) for w in windows] == [4, 4] and run.step == 2
    steps, _, records = _records(run)
    assert sorted(steps) == [1, 2]
    assert records[-1]["type"] == "bye" and records[-1]["reason"] == (
        "stopped by stop=now after step 2")


def _checkpointed(tmp_path, *, register):
    """Three steps, saved by ``checkpoint=now`` after step 1 (``register``: with an object
    registered for checkpointing); returns the accelerator, model, optimizer, the loader's
    iterator, the live run and the checkpoint's directory."""
    accelerator, model, optimizer, loader = _prepared(n=64)
    if register:
        accelerator.register_for_checkpointing(_Counter())
    run = agent.attach(accelerator, checkpoint_dir=tmp_path / "saved")

    def at_boundary(n):
        if n == 1:
            assert send_command(run.agent.info, "checkpoint", "now")["ok"]

    batches = run.loader(loader)
    _train(accelerator, model, optimizer, itertools.islice(batches, 3), run,
           at_boundary=at_boundary)
    path = run._checkpoints.path(1)
    assert (path / "optimizer.bin").is_file(), sorted(path.iterdir())
    return accelerator, model, optimizer, batches, run, path


def _craft(path, name, marker):
    """Put a file at ``path / name`` that runs code (makes ``marker``) when unpickled in
    full."""
    if name == ".metadata":  # a sharded state's metadata (plain pickle)
        (path / "pytorch_model_fsdp_0").mkdir()
        (path / "pytorch_model_fsdp_0" / name).write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": Payload(marker)}, path / name)


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "scaler.pt", ".metadata"])
def test_a_crafted_file_in_a_checkpoint_runs_no_code_on_resume(tmp_path, name):
    """A checkpoint is untrusted: the files accelerate's load_state unpickles in full (a
    registered object's state, FSDP2's GradScaler, a sharded state's metadata) are read
    first running no code; a crafted one is refused by name and nothing is loaded."""
    _, _, _, _, run, path = _checkpointed(tmp_path, register=True)
    run.close()
    marker = tmp_path / "ran"
    _craft(path, name, marker)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator, model, _, _ = _prepared(n=64)
    accelerator.register_for_checkpointing(_Counter())
    before = _parameters(model)
    with pytest.raises(ValueError, match=f"{name}.*not loaded|{name}.*could run code"):
        agent.attach(accelerator, resume_from=path)
    assert not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(_parameters(model), before))


@pytest.mark.parametrize("name", ["scaler.pt", ".metadata"])
def test_a_rewind_to_a_crafted_checkpoint_runs_no_code_and_the_run_goes_on(tmp_path, name):
    """``rewind`` to a checkpoint holding a crafted file: refused with the file's name in a
    ``failed`` event, no code runs, the state is as it was and training goes on."""
    accelerator, model, optimizer, batches, run, path = _checkpointed(tmp_path,
                                                                      register=False)
    marker = tmp_path / "ran"
    _craft(path, name, marker)

    def at_boundary(n):
        if n == 1:
            assert send_command(run.agent.info, "rewind", "1")["ok"]

    windows = _train(accelerator, model, optimizer, itertools.islice(batches, 3), run,
                     at_boundary=at_boundary)
    assert len(windows) == 3 and not marker.exists()
    _assert_updates_by_hand(windows, make_model)  # each from the one before: no rewind
    steps, events, _ = _records(run)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    failed = [e for e in events if e["kind"] == "failed" and e.get("knob") == "rewind"]
    assert len(failed) == 1 and name in failed[0]["text"], failed
    assert not [e for e in events if e["kind"] == "branched"]


def test_a_closed_run_lets_its_accelerator_model_and_optimizer_go():
    """After ``run.close()`` nothing of gpuwatch's holds the run, its agent or the model
    and optimizer it was attached to (its exit hook held them until the process ended)."""
    accelerator, model, optimizer, loader = _prepared(n=64)
    run = agent.attach(accelerator)
    _train(accelerator, model, optimizer, loader, run)
    run.close()
    gone = [weakref.ref(held) for held in (run, run.agent, model, optimizer, accelerator)]
    del accelerator, model, optimizer, loader, run
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)
