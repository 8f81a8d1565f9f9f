"""pause, stop and evaluate on a live run: a real Trainer and a real hand-written loop
training on real digits, commanded over real ZeroMQ; every loss checked against an
unsteered twin, bit for bit."""

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import agent
from agent.control.checkpoints import load_checkpoint
from agent.integrations.run import metric_numbers
from agent.step.record import StepRecord
from agent.wire import runs
from examples.steer import plateaued
from gpuopt import Trainer
from gpuwatch.client import RunClient, Subscriber, send_command
from tests.training import Gate, digits_loader, messages, model as make_model, start

STEPS = 16
ROOT = Path(__file__).resolve().parent.parent


class Losses:
    """Trainer callback: each optimizer step's loss, by step."""

    def __init__(self):
        self.by_step = {}

    def on_optimizer_step(self, trainer, stats):
        self.by_step[stats.step] = float(stats.loss)


def _trainer(*callbacks):
    model = make_model()
    losses = Losses()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                      torch.nn.functional.cross_entropy, digits_loader(),
                      callbacks=[losses, *callbacks])
    return trainer, losses


def _held_run(**options):
    """A Trainer that its Gate holds at step 3, attached with ``options``; the run."""
    gate = Gate(hold_at=3)
    trainer, losses = _trainer(gate)
    agent.attach(trainer, **options)
    return trainer, losses, gate, runs.find_run()


def _unsteered_losses():
    trainer, losses = _trainer()
    trainer.fit(max_steps=STEPS)
    return losses.by_step


def _events(seen, kind, knob=None):
    return [m["body"] for m in seen if m["type"] == "event" and m["body"].get("kind") == kind
            and (knob is None or m["body"].get("knob") == knob)]


def _applied(knob, value):
    return lambda m: (m["type"] == "event" and m["body"].get("kind") == "applied"
                      and m["body"].get("knob") == knob and m["body"].get("value") == value)


def test_trainer_pauses_at_a_boundary_takes_commands_there_and_resumes_losing_no_step(run_dir):
    trainer, losses, gate, info = _held_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=STEPS)
        assert gate.reached.wait(30)
        pause = send_command(info, "pause", "on")
        assert pause["ok"], pause
        gate.release.set()
        seen = messages(sub, _applied("pause", "on"))
        held_at = pause["apply_step"] - 1
        assert trainer.step == held_at
        # held at the boundary: a command applies there, at the step after it
        same = send_command(info, "lr_scale", 1.0)
        assert same["ok"] and same["apply_step"] == held_at + 1, same
        seen += messages(sub, _applied("lr_scale", 1.0))
        assert trainer.step == held_at and thread.is_alive()
        again = send_command(info, "pause", "on")  # a person's repeat: said so
        assert again["ok"] and again["after_step"] == held_at, again
        seen += messages(sub, _applied("pause", "on"))
        assert _events(seen, "applied", "pause")[1]["text"].endswith(
            "until pause=off (it was paused already)")
        resume = send_command(info, "pause", "off")
        assert resume["ok"] and resume["apply_step"] == held_at + 1, resume
        seen += messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    steps = [m["body"]["step"] for m in seen if m["type"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # none lost or repeated
    [off] = _events(seen, "applied", "pause")[2:]
    assert off["step"] == held_at + 1 and "goes on" in off["text"]
    assert losses.by_step == _unsteered_losses()


def test_trainer_stops_cleanly_after_a_checkpoint_and_bye_names_the_command(run_dir):
    trainer, losses, gate, info = _held_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=STEPS)
        assert gate.reached.wait(30)
        stop = send_command(info, "stop", "checkpoint")
        assert stop["ok"], stop
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    last = stop["apply_step"] - 1
    assert not thread.is_alive() and trainer.step == last
    assert seen[-1]["body"]["reason"] == f"stopped by stop=checkpoint after step {last}"
    [applied] = _events(seen, "applied", "stop")
    assert applied["text"].startswith(f"stop=checkpoint applied at step {last + 1}: the "
                                      f"training ends after step {last}; checkpoint saved")
    [path] = [part.split(" to ")[1].split(" (")[0] for part in [applied["text"]]]
    saved = load_checkpoint(path)
    assert saved["step"] == last
    assert torch.equal(saved["trainer"]["model"]["0.weight"], trainer.model[0].weight)
    assert sorted(losses.by_step) == list(range(1, last + 1))
    assert runs.list_runs() == []


def test_trainer_evaluates_now_with_the_eval_fn_and_its_metrics_equal_a_hand_call(run_dir):
    held_out = digits_loader(n=1797)[-8:]

    def eval_fn():
        model = trainer.model
        model.eval()
        with torch.no_grad():
            total = sum(torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                        for x, y in held_out)
        return {"val_loss": float(total) / sum(len(y) for _, y in held_out), "note": "x"}

    trainer, losses, gate, info = _held_run(eval_fn=eval_fn)
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=STEPS)
        assert gate.reached.wait(30)
        evaluate = send_command(info, "evaluate", "now")
        # stopped at the same boundary, after it: the weights stay those it evaluated
        stop = send_command(info, "stop", "now", apply_step=evaluate["apply_step"])
        assert evaluate["ok"] and stop["ok"], (evaluate, stop)
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    [event] = _events(seen, "evaluation")
    assert event["step"] == evaluate["apply_step"] - 1 == trainer.step
    assert event["metrics"] == {"val_loss": eval_fn()["val_loss"]}  # numbers only
    assert trainer.model.training is False  # (eval_fn's own; the run had put it back)


def test_evaluate_now_keeps_tensors_numpy_scalars_and_non_finite_values_as_numbers(run_dir):
    """An eval_fn's tensors (one element), NumPy scalars, nan and inf are numbers of the
    evaluation event; an integer too large for a float is left out with a note, after
    the evaluation ran, and the training goes on."""
    def eval_fn():
        return {"val_loss": torch.tensor(0.25), "acc": np.float32(0.5), "seen": np.int64(7),
                "top1": torch.tensor([0.75]), "nan": float("nan"), "inf": torch.tensor(
                    float("inf")), "huge": 10 ** 400, "ok": True, "per_class": torch.ones(3),
                "name": "x"}

    trainer, losses, gate, info = _held_run(eval_fn=eval_fn)
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=6)
        assert gate.reached.wait(30)
        evaluate = send_command(info, "evaluate", "now")
        assert evaluate["ok"], evaluate
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    [event] = _events(seen, "evaluation")
    metrics = event["metrics"]
    assert math.isnan(metrics.pop("nan"))
    assert metrics == {"val_loss": 0.25, "acc": 0.5, "seen": 7.0, "top1": 0.75,
                       "inf": math.inf}
    assert event["text"] == (f"evaluation at step {evaluate['apply_step'] - 1}: "
                             "val_loss=0.25, acc=0.5, seen=7, top1=0.75, nan=nan, inf=inf; "
                             "left out: huge (an integer too large for a float)")
    [applied] = _events(seen, "applied", "evaluate")
    # the applied event's line has them too (a one-line event log shows it last)
    assert applied["text"].endswith(": val_loss=0.25, acc=0.5, seen=7, top1=0.75, nan=nan, "
                                    "inf=inf; left out: huge (an integer too large for a "
                                    "float)")
    assert sorted(losses.by_step) == list(range(1, 7))


def test_an_evaluation_of_only_non_numbers_says_so():
    assert metric_numbers({"name": "x", "flag": np.bool_(True), "big": -(10 ** 400)}) == (
        {}, "no numbers; left out: big (an integer too large for a float)")
    assert metric_numbers(None) == ({}, "no numbers")


def test_a_run_without_eval_fn_refuses_evaluate_saying_what_to_pass(run_dir):
    trainer, _ = _trainer()
    monitor = agent.attach(trainer)
    try:
        reply = send_command(runs.find_run(), "evaluate", "now")
        assert not reply["ok"] and "eval_fn=" in reply["reason"], reply
    finally:
        monitor.close()


def _loop(run, data, losses, held=None):
    """A hand-written loop on ``run``: one optimizer step per batch; ``held`` (an Event
    pair) holds it after step 3 until released."""
    model, optimizer = run.model, run.optimizer
    for x, y in run.loader(data, epochs=None):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run.optimizer_step(loss)
        losses[run.step] = loss.item()
        if held is not None and run.step == 3:
            held[0].set()
            assert held[1].wait(30)
        if run.step == STEPS:
            break
    run.close()


def _session(data):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = agent.session(model=model, optimizer=optimizer)
    run.model, run.optimizer = model, optimizer
    return run


def _paused_after_step_3(run, data, losses, info, sub):
    """``(thread, reply)``: :func:`_loop` on ``run`` in a thread, held after step 3 while
    ``pause=on`` is sent (``reply``), then let go: paused at the boundary the reply
    names, its ``applied`` event seen on ``sub``, the thread alive."""
    held = (threading.Event(), threading.Event())
    thread = threading.Thread(target=_loop, args=(run, data, losses, held), daemon=True)
    thread.start()
    assert held[0].wait(30)
    pause = send_command(info, "pause", "on")
    assert pause["ok"], pause
    held[1].set()
    messages(sub, _applied("pause", "on"))
    assert run.step == pause["apply_step"] - 1 and thread.is_alive()
    return thread, pause


def test_a_loop_pauses_and_resumes_with_the_losses_of_an_unpaused_twin_then_stops(run_dir):
    data = digits_loader()
    twin, twin_losses = _session(data), {}
    _loop(twin, data, twin_losses)
    run, losses = _session(data), {}
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread, pause = _paused_after_step_3(run, data, losses, info, sub)
        # sent while paused, for a later step: unpaused, the loop could be past it first
        stop = send_command(info, "stop", "now", apply_step=pause["apply_step"] + 5)
        assert stop["ok"], stop
        assert send_command(info, "pause", "off")["ok"]
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    last = stop["apply_step"] - 1
    assert seen[-1]["body"]["reason"] == f"stopped by stop=now after step {last}"
    assert run.stopping and sorted(losses) == list(range(1, last + 1))  # loader() ended
    assert losses == {step: twin_losses[step] for step in losses}


def test_a_paused_loop_goes_on_when_its_agent_can_take_no_more_commands(run_dir):
    """A pause holds the loop until a command ends it; when the agent's I/O thread ends
    (here stopped alone, as a crash of it would end it), no command can come any more:
    the hold ends and the loop trains on to its end, no step lost."""
    data = digits_loader()
    run, losses = _session(data), {}
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread, pause = _paused_after_step_3(run, data, losses, info, sub)
    run.agent._io.stop(5)
    thread.join(30)
    assert not thread.is_alive() and sorted(losses) == list(range(1, STEPS + 1))


def test_plateau_compares_the_means_of_the_last_two_windows():
    assert not plateaued([3.0, 2.0, 1.0], 2, 0.01)  # fewer than two windows
    assert not plateaued([4.0, 4.0, 2.0, 2.0], 2, 0.5)  # fell by half: 2 <= 4 x 0.5
    assert plateaued([4.0, 4.0, 2.0, 2.02], 2, 0.5)  # 2.01 > 2
    assert plateaued([1.0, 1.0, 1.0, 1.0], 2, 0.01)  # flat


def test_the_steer_example_says_so_and_ends_on_a_run_without_lr_scale(run_dir):
    """A loop with no optimizer has no lr_scale: steer.py says so at the run's first step
    and exits 1, no traceback; a window below 1 is refused before it connects."""
    run = agent.session(name="no-optimizer")
    info = runs.find_run()
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "steer.py"), info.run_id, "--window", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert script.stdout.readline() == f"following {info.run_id}\n", script.stderr.read()
        for _ in range(400):  # flat losses (a plateau) until the script has seen a step
            if script.poll() is not None:
                break
            run.optimizer_step(torch.tensor(1.0))
            try:
                script.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        out, err = script.communicate(timeout=60)
    finally:
        run.close()
        if script.poll() is None:
            script.kill()
    assert script.returncode == 1 and out == "", (out, err)
    assert err == f"steer: run {info.run_id} has no lr_scale knob to halve\n"
    refused = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "steer.py"), "--window", "0"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert refused.returncode == 2
    assert "--window must be at least 1, got 0" in refused.stderr


def test_a_run_client_is_made_once_its_subscription_is_live_or_says_why_not(run_dir):
    """A RunClient returns once the run's greeting came (so it misses no step published
    after), keeping that message; against a run that is gone it says so within its
    timeout, and leaves no socket open."""
    monitor = agent.Agent(name="client").start()
    try:
        with RunClient(monitor.info) as client:
            first = next(client.records(timeout_s=0))  # (kept: no wait)
            # its greeting, or what the run publishes on its own (a beat, the 1 Hz system
            # sample: one came first under two CPU burners)
            assert first["type"] in ("hello", "state", "heartbeat", "system")
            monitor.optimizer_step(StepRecord(1, 8, 0.0, torch.tensor(0.5), step=1))
            assert next(client.steps(timeout_s=10))["step"] == 1
    finally:
        monitor.close()
    with pytest.raises(TimeoutError, match=f"run {monitor.run_id} sent nothing within 0.3 s"):
        RunClient(monitor.info, timeout_s=0.3)


def test_the_steer_example_halves_lr_scale_of_a_live_run_at_each_plateau(run_dir):
    """examples/steer.py in its own process against a live Trainer (trained until the
    test stops it): with any fall too small (--min-improvement 1), each 4-step window
    pair is a plateau, so lr_scale goes to 0.5 then 0.25, each from the step its event
    names (the learning rate the steps report halves with it), and the script ends with
    the run."""
    gate = Gate(hold_at=1)
    trainer, _ = _trainer(gate)
    agent.attach(trainer)
    info = runs.find_run()
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "steer.py"), info.run_id, "--window", "4",
         "--min-improvement", "1", "--max-halvings", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert script.stdout.readline() == f"following {info.run_id}\n", script.stderr.read()
        with Subscriber(info) as sub:  # (the script's is live once it said "following")
            assert sub.recv(10) is not None  # (and this one once the run greeted it)
            thread = start(trainer)  # until stopped: the script's pace is its own
            gate.release.set()
            # (or the script ended early: the assertions below say how)
            seen = messages(sub, lambda m: _applied("lr_scale", 0.25)(m)
                            or script.poll() is not None)
            assert send_command(info, "stop", "now")["ok"]
            seen += messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
        out, err = script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 0, err
    halvings = _events(seen, "applied", "lr_scale")
    assert [event["value"] for event in halvings] == [0.5, 0.25]
    steps = {m["body"]["step"]: m["body"] for m in seen if m["type"] == "step"}
    *said, last = out.splitlines()
    assert said == [event["text"] for event in halvings]
    assert last == (f"steer: followed run {info.run_id} for {len(steps):,} steps "
                    f"({min(steps):,}..{max(steps):,}); lr_scale halved 2 times, to 0.25")
    for step, body in steps.items():
        scale = 0.25 if step >= halvings[1]["step"] else (
            0.5 if step >= halvings[0]["step"] else 1.0)
        assert body["knobs"]["lr_scale"] == scale and body["lr"] == 3e-3 * scale, step
