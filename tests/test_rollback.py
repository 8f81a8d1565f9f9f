"""Safe changes: a change after which the loss goes non-finite is rolled back."""

import pytest
import torch

import agent
from agent.wire import runs
from agent.control.guard import ChangeGuard
from agent.control.ledger import EPISODE_CHANGES_MAX, Change, ChangeLedger
from gpuopt import Trainer
from gpuwatch.client import Subscriber, send_command
from tests.training import Gate, digits_loader, greeted, messages, model as make_model, start


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
        seen += messages(sub, lambda m: m["type"] == "event"
                         and m["body"].get("kind") == "state_restored")
        seen += messages(sub, lambda m: m["type"] == "step" and m["body"]["step"] >= 24)
        trainer.stop()
        seen += messages(sub, lambda m: m["type"] == "bye")
        thread.join(30)
    events = [m["body"] for m in seen if m["type"] == "event"]
    rolled = [e for e in events if e.get("kind") == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["value"] == "fp32"
    assert "loss was nan" in rolled[0]["text"] and "after precision=fp16" in rolled[0]["text"]
    # the state went back to the boundary where fp16 applied: the steps after it are
    # trained again in fp32 (the published steps before the event had fp16 ones)
    restored = next(i for i, m in enumerate(seen) if m["type"] == "event"
                    and m["body"].get("kind") == "state_restored")
    assert "boundary after step 3" in seen[restored]["body"]["text"]
    before = [m["body"] for m in seen[:restored] if m["type"] == "step"]
    after = [m["body"] for m in seen[restored:] if m["type"] == "step"]
    assert any(b["knobs"]["precision"] == "fp16" for b in before)
    assert after[0]["step"] == 4 and all(b["knobs"]["precision"] == "fp32" for b in after)
    assert after[-1]["loss"] < 10  # finite again: training went on
    assert trainer.precision == "fp32"
    for param in model.parameters():
        assert torch.isfinite(param).all()


def test_a_rollback_that_cannot_reach_every_rank_rolls_back_nowhere(run_dir):
    """With several ranks, rank 0's guard sends its rollback to every rank; where one
    cannot be reached (here: rank 1 never started), no rank rolls back alone and the
    warning names the command to send once they all can."""
    from agent.wire.commands import RankConnections  # the raw wire: this rank only

    model = make_model()
    changed, waiting = Gate(hold_at=3), Gate(hold_at=20)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nan_under_fp16,
                      digits_loader(), callbacks=[changed, waiting])
    agent.attach(trainer, rank=0, world_size=2)
    info = runs.find_run()
    with Subscriber(info) as sub:
        thread = start(trainer, max_steps=40)
        assert changed.reached.wait(30)
        with RankConnections([info]) as connection:
            command = {"id": "f16", "knob": "precision", "value": "fp16", "apply_step": 5}
            assert connection.exchange(command, 3.0, None)[0]["ok"]
        changed.release.set()
        assert waiting.reached.wait(30)  # the I/O thread decides from the published steps
        seen = messages(sub, lambda m: m["type"] == "event"
                        and "not rolled back" in m["body"]["text"], timeout_s=60)
        waiting.release.set()
        seen += messages(sub, lambda m: m["type"] == "bye", timeout_s=60)
        thread.join(30)
    texts = [m["body"]["text"] for m in seen if m["type"] == "event"]
    assert not any("rolled back because" in t for t in texts)
    [warning] = [t for t in texts if "not rolled back" in t]
    assert warning.startswith("loss was nan at step 5 after precision=fp16; precision=fp32 "
                              "not rolled back on the 2 ranks: 1 of the run's 2 ranks")
    assert warning.endswith("(gpuwatch set precision=fp32)")
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


class _Losses:
    """Trainer callback: each optimizer step's loss (a step trained again overwrites)."""

    def __init__(self):
        self.by_step = {}

    def on_optimizer_step(self, trainer, stats):
        self.by_step[stats.step] = stats.loss.item()


def test_a_divergence_after_lr_scale_restores_the_state_before_the_change(run_dir):
    """lr_scale=100 on SGD: the loss runs away; the guard sees it above 10x its median
    for 3 steps, before it is inf, and the rollback puts back the model, optimizer and
    data position of the boundary where the change applied: the run then trains on
    exactly as a twin that never made the change (bit-equal losses and weights)."""
    twin_model = make_model()
    twin_losses = _Losses()
    twin = Trainer(twin_model, torch.optim.SGD(twin_model.parameters(), lr=0.1),
                   torch.nn.functional.cross_entropy, digits_loader(), callbacks=[twin_losses])
    twin.fit(max_steps=20)

    model = make_model()
    changed, waiting = Gate(hold_at=6), Gate(hold_at=14)
    losses = _Losses()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader(),
                      callbacks=[changed, waiting, losses])
    monitor = agent.attach(trainer, name="diverging")
    with Subscriber(monitor.info) as sub:
        thread = start(trainer, max_steps=20)
        assert changed.reached.wait(30)
        assert send_command(monitor.info, "lr_scale", 100.0, apply_step=7)["ok"]
        changed.release.set()
        assert waiting.reached.wait(30)  # the I/O thread decides from the published steps
        seen = messages(sub, lambda m: m["type"] == "event"
                        and m["body"].get("kind") == "rollback")
        waiting.release.set()
        thread.join(60)
        seen += messages(sub, lambda m: m["type"] == "bye")
    events = [m["body"] for m in seen if m["type"] == "event"]
    [decided] = [e for e in events if e.get("kind") == "rollback"]
    assert "the loss diverged" in decided["text"] and "after lr_scale=100" in decided["text"]
    restored = [e for e in events if e.get("kind") == "state_restored"]
    assert len(restored) == 1, events
    assert "boundary after step 6" in restored[0]["text"]
    assert trainer.lr_scale == 1.0 and trainer.step == 20
    assert {step: losses.by_step[step] for step in range(7, 21)} == {
        step: twin_losses.by_step[step] for step in range(7, 21)}
    for mine, theirs in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(mine, theirs)


def _loop_run(data, name, change=None):
    """A hand-written loop over a shuffling DataLoader for 20 optimizer steps. With
    ``change``: ``lr_scale`` set to it at step 7, and at step 12 the loop waits for the
    guard's decision. Returns the model and each step's loss (a step trained again
    overwrites)."""
    torch.manual_seed(5)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, name=name)
    losses = {}
    batches = iter(run.loader(torch.utils.data.DataLoader(data, batch_size=16, shuffle=True),
                              epochs=None))
    with Subscriber(run.agent.info) as sub:
        greeted(sub)
        if change is not None:
            assert send_command(run.agent.info, "lr_scale", change, apply_step=7)["ok"]
        while run.step < 20:
            x, y = next(batches)
            loss = _train_step(run, model, optimizer, x, y)
            losses[run.step] = loss.item()
            if change is not None and run.step == 12:
                change = None
                messages(sub, lambda m: m["type"] == "event"
                         and m["body"].get("kind") == "rollback")
        run.close()
        seen = messages(sub, lambda m: m["type"] == "bye")
    return model, losses, [m["body"] for m in seen if m["type"] == "event"]


def test_a_loops_rollback_restores_its_state_and_data_position(run_dir):
    """The same divergence in a hand-written loop: the rollback puts back the model,
    optimizer, random numbers and the DataLoader's place in its shuffled epoch (the
    epoch is made again from its start and the trained batches dropped)."""
    x, y = zip(*digits_loader(batch_size=1, n=512))
    data = torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y))
    twin, twin_losses, _ = _loop_run(data, "loop-twin")
    model, losses, events = _loop_run(data, "loop-diverging", change=100.0)
    [restored] = [e for e in events if e.get("kind") == "state_restored"]
    assert "boundary after step 6" in restored["text"], restored
    assert "fetched ahead" not in restored["text"]
    assert {step: losses[step] for step in range(7, 21)} == {
        step: twin_losses[step] for step in range(7, 21)}
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)


def test_a_state_over_its_budget_is_counted_on_the_live_tensors_never_copied(run_dir,
                                                                             monkeypatch):
    """The state's size is counted before anything is copied: a state over its budget
    (a large model's Adam state would take its own size in host memory, on the training
    thread, only to be dropped) is never copied, and the rollback's text says why."""
    import agent.integrations.run as run_module
    from agent.integrations.run import StateTooLarge

    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with agent.session(model=model, optimizer=optimizer, name="over-budget") as run:
        x, y = next(iter(digits_loader()))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()  # Adam's two moments: the state is three times the parameters
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step(None)
        parameters_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        copies = []
        copy = run_module.host_copy
        monkeypatch.setattr(run_module, "host_copy",
                            lambda state: copies.append(1) or copy(state))
        with pytest.raises(StateTooLarge) as caught:
            run.state_snapshot(budget_bytes=2 * parameters_bytes)
        assert caught.value.size_bytes >= 3 * parameters_bytes and copies == []
        monkeypatch.setattr(run_module, "ROLLBACK_BUDGET_BYTES", 2 * parameters_bytes)
        run.keep_state(run.step)
        assert copies == []
        level, text = run.restore_state(run.step + 1)
        assert level == "warning" and "is larger than the" in text, text
        assert "kept for rollbacks" in text and "not restored" in text
        snapshot = run.state_snapshot(budget_bytes=4 * parameters_bytes)
        assert copies and snapshot["model"].keys() == model.state_dict().keys()


def test_a_long_run_of_changes_is_cut_into_episodes_of_bounded_length(run_dir):
    """lr_scale changed every 2 steps from step 4 (70 changes, each within guard_steps
    of the one before), then set to 100: the divergence rolls back the latest episode
    only, to the state kept where its first change (change 65) applied, not to the run's
    first change; the ledger never holds more than EPISODE_CHANGES_MAX changes."""
    torch.manual_seed(5)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = agent.session(model=model, optimizer=optimizer, name="many-changes")
    batches = iter(run.loader(digits_loader(), epochs=None))
    held, sent, seen = [], 0, []
    with Subscriber(run.agent.info) as sub:
        greeted(sub)
        while run.step < 160:
            x, y = next(batches)
            _train_step(run, model, optimizer, x, y)
            held.append(len(run.agent._ledger.entries))
            if run.step % 2 == 0 and sent <= 70:  # (once: the steps rolled back repeat)
                sent += 1
                value = 100.0 if sent == 71 else (0.5 if sent % 2 else 1.0)
                reply = send_command(run.agent.info, "lr_scale", value, apply_step=run.step + 2)
                assert reply["ok"], reply
            if run.step == 150 and not seen:  # the guard decides from the steps published
                seen = messages(sub, lambda m: m["type"] == "event"
                                and m["body"].get("kind") == "rollback")
        run.close()
        seen += messages(sub, lambda m: m["type"] == "bye")
    assert max(held) == EPISODE_CHANGES_MAX
    [restored] = [m["body"] for m in seen if m["type"] == "event"
                  and m["body"].get("kind") == "state_restored"]
    first = 2 * (EPISODE_CHANGES_MAX + 1) + 2  # the step change 65 applied at
    assert f"boundary after step {first - 1}" in restored["text"], restored


def _train_step(run, model, optimizer, x, y):
    """One optimizer step of the digits classifier on ``(x, y)``, marked; its loss."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.optimizer_step(loss.detach())
    return loss
