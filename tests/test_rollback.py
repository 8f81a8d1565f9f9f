"""Safe changes: a change after which the loss goes non-finite is rolled back."""

import pytest
import torch

import agent
from agent import runs
from agent.guard import ChangeGuard
from agent.ledger import Change, ChangeLedger
from gpuopt import Trainer
from gpuwatch.client import Subscriber, send_command
from tests.training import Gate, digits_loader, messages, model as make_model, start


def nan_under_fp16(output, target):
    """Fault injection: the loss is NaN whenever the forward ran in fp16."""
    loss = torch.nn.functional.cross_entropy(output.float(), target)
    return loss * float("nan") if output.dtype == torch.float16 else loss


def test_forced_nan_after_switch_to_fp16_is_rolled_back_and_training_goes_on(run_dir):
    model = make_model()
    gate = Gate(hold_at=3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nan_under_fp16,
                      digits_loader(), callbacks=[gate])
    agent.attach(trainer)
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=100_000)
        assert gate.reached.wait(30)
        reply = send_command(info, "precision", "fp16")
        assert reply["ok"]
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "event"
                        and m["body"].get("kind") == "rolled_back")
        rolled_back_at = seen[-1]["body"]["step"]
        seen += messages(sub, lambda m: m["type"] == "step"
                         and m["body"]["step"] >= rolled_back_at + 20)
        trainer.stop()
        seen += messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    events = [m["body"] for m in seen if m["type"] == "event"]
    rolled = [e for e in events if e.get("kind") == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["value"] == "fp32"
    assert "loss was nan" in rolled[0]["text"] and "after precision=fp16" in rolled[0]["text"]
    steps = {m["body"]["step"]: m["body"] for m in seen if m["type"] == "step"}
    fp16_steps = [s for s, b in steps.items() if b["knobs"]["precision"] == "fp16"]
    assert fp16_steps and max(fp16_steps) < rolled[0]["step"]
    assert all(b["knobs"]["precision"] == "fp32" for s, b in steps.items()
               if s >= rolled[0]["step"])
    assert steps[rolled_back_at + 20]["loss"] < 10  # finite again: training went on
    assert trainer.precision == "fp32"
    for param in model.parameters():  # the GradScaler skipped the NaN steps
        assert torch.isfinite(param).all()


def test_one_rank_of_several_does_not_roll_back_alone(run_dir):
    """A rollback decided by one rank would leave it alone with another precision: with
    several ranks the agent says what to send to all of them instead."""
    from agent.fanout import _Connections  # the raw wire: this rank only

    model = make_model()
    gate = Gate(hold_at=3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nan_under_fp16,
                      digits_loader(), callbacks=[gate])
    agent.attach(trainer, rank=0, world_size=2)
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=40)
        assert gate.reached.wait(30)
        with _Connections([info]) as connection:
            command = {"id": "f16", "knob": "precision", "value": "fp16", "apply_step": 5}
            assert connection.exchange(command, 3.0, None)[0]["ok"]
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye", timeout_s=60)
        thread.join(30)
    texts = [m["body"]["text"] for m in seen if m["type"] == "event"]
    assert not any("rolled back" in t and "not rolled back" not in t for t in texts)
    warning = next(t for t in texts if "not rolled back" in t)
    assert "loss was nan" in warning and warning.endswith(
        "with 2 ranks only a command to every rank may change a knob "
        "(gpuwatch set precision=fp32)")
    assert trainer.precision == "fp16"  # unchanged on this rank, as on the others


def test_guard_rolls_back_after_skipped_steps_in_a_row_and_ends_a_clean_watch():
    ledger = ChangeLedger(guard_steps=20)
    guard = ChangeGuard(ledger, max_skipped_in_row=3)
    ledger.record(Change(10, "precision", "fp16", "bf16"))
    assert guard.watching
    assert guard.on_step(10, 1.0, True) is None
    assert guard.on_step(11, 1.0, True) is None
    rollback = guard.on_step(12, 1.0, True)
    assert rollback.values == {"precision": "bf16"}
    assert "skipped 3 fp16 steps in a row" in rollback.reason
    assert guard.skipped_total == 3
    assert not guard.watching
    assert guard.on_step(13, float("nan"), None) is None  # answered: nothing to undo again
    ledger.record(Change(50, "accum_steps", 4, 1))  # a new episode (more than 20 steps on)
    assert guard.on_step(70, 1.0, None) is None  # 20 clean steps end the watch
    assert not guard.watching
    assert guard.on_step(71, float("inf"), None) is None


def test_out_of_memory_right_after_a_change_rolls_it_back_and_retries_the_batch(run_dir):
    model = make_model()
    gate = Gate(hold_at=3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate],
                      accum_steps=2)
    faults = []

    def oom_under_bf16(trainer):  # fault injection: bf16 "does not fit"
        if trainer.precision == "bf16":
            faults.append(trainer.step + 1)
            raise torch.OutOfMemoryError("injected: CUDA out of memory")

    trainer.fault_injection = oom_under_bf16
    monitor = agent.attach(trainer)
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=30)
        assert gate.reached.wait(30)
        reply = send_command(info, "precision", "bf16")
        assert reply["ok"]
        gate.release.set()
        seen = messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    assert faults == [reply["apply_step"]]  # one OOM, then the retry ran in fp32
    rolled = [m["body"] for m in seen if m["type"] == "event"
              and m["body"].get("kind") == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["value"] == "fp32"
    assert "ran out of memory after precision=bf16" in rolled[0]["text"]
    steps = {m["body"]["step"]: m["body"] for m in seen if m["type"] == "step"}
    assert sorted(steps) == list(range(1, 31))  # no step lost: the batch was retried
    assert steps[reply["apply_step"]]["micro_batches"] == 2
    assert trainer.precision == "fp32" and not monitor.errors


def test_out_of_memory_without_a_recent_change_propagates(run_dir):
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    agent.attach(trainer)

    def oom_at_step_5(trainer):
        if trainer.step == 4:
            raise torch.OutOfMemoryError("injected")

    trainer.fault_injection = oom_at_step_5
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(max_steps=10)
    assert trainer.step == 4
