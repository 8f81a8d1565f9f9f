"""Loss-spike recovery's parts on their own: the policy's checks and words, the spike
watch's rule (``tests/test_contract.py`` recovers real runs of every integration, and
``tests/test_ranks.py`` a DDP job), the refusal where no state is kept, and the knobs
panel's line."""

from __future__ import annotations

import math

import pytest
import torch

import agent
from agent.control.desk import Pending
from agent.control.ledger import Rollback
from agent.control.recovery import MIN_STEPS, Recovery, SpikeWatch
from agent.integrations.run import RunBase
from agent.wire import protocol
from gpuopt.position import DataPosition
from gpuwatch.state import RunState
from gpuwatch.widgets.knobs import _knob_line
from tests.conftest import wait_until


@pytest.mark.parametrize("bad", [dict(keep_every_steps=0), dict(keep_states=0),
                                 dict(spike_steps=1), dict(spike_mads=0.0),
                                 dict(spike_mads=math.nan), dict(lr_scale=-1.0),
                                 dict(lr_steps=-1), dict(budget_bytes=0),
                                 dict(keep_every_steps=2.5), dict(keep_states=True),
                                 dict(max_repeats=-1), dict(max_repeats=1.0),
                                 dict(skip_windows=-1), dict(skip_windows=2.5),
                                 dict(skip_windows=True)])
def test_a_setting_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Recovery(**bad)


def test_the_policy_in_a_few_words():
    assert Recovery().describe() == "every 25 x2, 3 steps > 6 MAD"
    assert Recovery(lr_scale=0.5, lr_steps=100).describe() == (
        "every 25 x2, 3 steps > 6 MAD, lr x0.5 for 100")
    assert Recovery(max_repeats=3).describe() == (
        "every 25 x2, 3 steps > 6 MAD, off after 3 repeats")
    assert Recovery(skip_windows=200, lr_scale=0.5, lr_steps=100).describe() == (
        "every 25 x2, 3 steps > 6 MAD, skip 200, lr x0.5 for 100")
    assert Recovery(skip_windows=0).describe() == "every 25 x2, 3 steps > 6 MAD, skip 0"
    assert Recovery(keep_every_steps=4, keep_states=3).repeat_span_steps == 12


def test_a_drop_draws_the_next_batches_across_an_epoch_and_drops_them():
    """An epoch of 5 batches: 3 trained, then 4 dropped (3, 4 and the next epoch's 0,
    1): the next batch is that epoch's 2; each dropped one counts as fetched and
    trained, so the 4 yielded since the window are the ones fetched ahead."""
    position = DataPosition()
    batches = position.iterate([torch.tensor(i) for i in range(5)], epochs=None)
    got = [int(next(batches)) for _ in range(3)]
    position.window_done(3)
    position.drop(4)
    assert position.state_dict()["dropping"] == 4  # (a checkpoint now keeps it)
    got += [int(next(batches)) for _ in range(4)]
    assert got == [0, 1, 2, 2, 3, 4, 0]
    assert (position.epoch, position.fetched_total, position.trained_total,
            position.ahead, position.dropping) == (3, 11, 7, 4, 0)


def test_a_drop_calls_a_fetch_function_for_training_batches_only():
    """``run.timed(get_batch)``: the next training call calls it 2 more times first;
    an evaluation's call (under ``no_grad``) neither drops nor is dropped."""
    position = DataPosition()
    calls: list[str] = []

    def get_batch(split: str) -> torch.Tensor:
        calls.append(split)
        return torch.tensor(len(calls))

    fetch = position.timed_fetch(get_batch)
    assert int(fetch("train")) == 1
    position.drop(2)
    with torch.no_grad():
        assert int(fetch("val")) == 2
    assert int(fetch("train")) == 5 and calls == ["train", "val", "train", "train", "train"]
    assert (position.fetched_total, position.trained_total) == (4, 2)


def _watch(**settings) -> SpikeWatch:
    watch = SpikeWatch(Recovery(**settings))
    watch.on = True
    losses = [2.0 + 0.01 * (i % 5) for i in range(20)]  # median 2.02, MAD 0.01
    assert watch.observe(list(range(1, 21)), losses) is None
    return watch


def test_a_spike_is_spike_steps_losses_in_a_row_above_the_margin():
    watch = _watch()
    # limit: 2.02 + 6 x max(1.4826 x 0.01, 2% of 2.02) = 2.2624
    assert watch.observe([21, 22, 23, 24], [2.3, 2.3, 2.0, 2.26]) is None  # no row of 3
    spike = watch.observe([25, 26, 27], [2.3, math.nan, 9.0])  # NaN counts as above
    assert spike is not None and (spike.first, spike.last, spike.loss) == (25, 27, 9.0)
    assert spike.median == pytest.approx(2.02) and spike.limit == pytest.approx(2.2624)
    assert "steps 25-27" in spike.describe()
    # waiting for the recovery: the old branch's next steps are not judged...
    assert watch.observe([28, 29, 30], [9.0, 9.0, 9.0]) is None
    # ...until a step at or before the spike's first comes (the new branch)
    assert watch.observe([21, 22, 23], [9.0, 9.0, 9.0]) is not None


def test_one_noisy_step_is_not_a_spike_nor_are_steps_while_off():
    watch = _watch()
    for step in range(21, 60, 2):
        assert watch.observe([step, step + 1], [1e6, 2.0]) is None
    watch.on = False
    assert watch.observe([61, 62, 63], [1e6, 1e6, 1e6]) is None
    fresh = SpikeWatch(Recovery())
    fresh.on = True  # too few losses to know the run's level: nothing is judged
    assert fresh.observe(list(range(1, MIN_STEPS + 1)),
                         [1.0] * (MIN_STEPS - 3) + [1e6] * 3) is None


def test_a_change_that_shifts_the_loss_starts_a_new_level_and_others_do_not():
    """dropout=0.5 raises the loss from 2.02 to 3.0: not a spike (the level starts again
    after the change, from MIN_STEPS losses); a spike above the new level still is. A
    command (checkpoint=now), recover itself, a failed change, a knob whose change
    does not move the loss's level (accum_steps) or dropout=0.5 when it was 0.5 ("no
    change") leaves the level as it was."""
    watch = _watch()
    watch.on_event({"kind": "applied", "knob": "dropout", "value": 0.5, "step": 21})
    assert watch.observe(list(range(21, 21 + MIN_STEPS + 5)),
                         [3.0 + 0.01 * (i % 5) for i in range(MIN_STEPS + 5)]) is None
    spike = watch.observe([40, 41, 42], [9.0] * 3)
    assert spike is not None and spike.median == pytest.approx(3.02)
    for event in ({"kind": "applied", "knob": "checkpoint", "value": "now"},
                  {"kind": "applied", "knob": "recover", "value": "on"},
                  {"kind": "failed", "knob": "dropout", "value": 0.5},
                  {"kind": "applied", "knob": "accum_steps", "value": 3},
                  # a setting to the value it had: nothing was set (a script re-sending
                  # it every few steps left no step judged, no spike recovered)
                  {"kind": "applied", "knob": "dropout", "value": 0.5, "previous": 0.5}):
        again = _watch()
        again.on_event(event)
        assert again.observe([21, 22, 23], [9.0] * 3) is not None, event
    rolled = _watch()  # a rollback's values put back: a change too
    rolled.on_event({"kind": "rolled_back", "knob": "mixture", "value": "1,1"})
    assert rolled.observe([21, 22, 23], [9.0] * 3) is None


def test_a_refused_recovery_rearms_the_watch():
    watch = _watch()
    assert watch.observe([21, 22, 23], [9.0] * 3) is not None
    watch.rearm()
    assert watch.observe([24, 25, 26], [9.0] * 3) is not None


def test_recover_on_is_refused_where_no_state_is_kept(run_dir):
    plain = RunBase(agent.Agent())
    assert "keeps no training state" in plain.knobs.unsupported["recover"]
    plain.close()
    run = agent.session(name="no-model")  # a loop with no model nor optimizer
    try:
        with pytest.raises(ValueError, match="keeps no training state"):
            run.knobs.knobs["recover"].set("on")
        assert run.knobs.knobs["recover"].get() == "off"
    finally:
        run.close()


def test_recover_on_keeps_the_state_at_once_and_off_drops_it(run_dir):
    model = torch.nn.Linear(4, 2)
    run = agent.session(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                        name="keeps", recover=Recovery(keep_every_steps=3))
    try:
        knob = run.knobs.knobs["recover"]
        assert knob.detail == "every 3 x2, 3 steps > 6 MAD"
        assert "the state after step 0 kept" in knob.set("on")["text"]
        assert knob.get() == "on" and run.agent.spikes.on
        knob.set("off")
        assert knob.get() == "off" and not run.agent.spikes.on
    finally:
        run.close()


def test_the_knobs_panel_shows_the_settings_after_the_value():
    state = RunState()
    state.schema = {"recover": {"name": "recover", "kind": "choice",
                                "detail": "every 25 x2\x1b[31m, lr x0.5 for 100"}}
    state.knobs = {"recover": "on"}
    line = _knob_line(state, "recover", 0.0, None)
    assert (line.value, line.detail) == ("on", "every 25 x2\u241b[31m, lr x0.5 for 100")
    assert line.render(8, 60).plain.rstrip() == (
        "recover on (every 25 x2\u241b[31m, lr x0.5 for 100)")
    state.knobs = {"recover": "off"}
    assert _knob_line(state, "recover", 0.0, None).detail == ""


def test_the_ring_keeps_the_latest_states_within_its_budget(run_dir):
    model = torch.nn.Linear(4, 2)  # 10 parameters: 40 bytes of weights
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    run = agent.session(model=model, optimizer=optimizer, name="ring",
                        recover=Recovery(keep_every_steps=2, keep_states=2))
    try:
        run.knobs.knobs["recover"].set("on")
        for _ in range(7):
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step()
        assert [kept[0] for kept in run._ring] == [4, 6]
    finally:
        run.close()
    # the oldest go before a copy is made: never the ring full and a new copy beside it
    def kept_while_copying(keep_states: int, budget_bytes: int) -> tuple[list, list]:
        held = []  # (states kept, their bytes) as each copy is made
        run = agent.session(model=model, optimizer=optimizer, name="ring",
                            recover=Recovery(keep_every_steps=1, keep_states=keep_states,
                                             budget_bytes=budget_bytes))
        snapshot = run.state_snapshot

        def counted(budget):
            held.append((len(run._ring), sum(kept[2] for kept in run._ring)))
            return snapshot(budget)

        run.state_snapshot = counted
        try:
            run.knobs.knobs["recover"].set("on")
            for _ in range(8):
                run.optimizer_step()
            return held, [kept[2] for kept in run._ring]
        finally:
            run.close()

    held, sizes = kept_while_copying(3, 1 << 30)
    assert len(sizes) == 3 and max(count for count, _ in held) == 2
    size = sizes[0]
    held, sizes = kept_while_copying(9, 2 * size + size // 2)  # room for 2
    assert sizes == [size, size] and max(count for count, _ in held) == 1
    assert max(total for _, total in held) == size


def _events_of(run) -> list[dict]:
    """A list the run's events are appended to as the agent makes them."""
    events: list[dict] = []
    run.agent.add_listener(lambda record: events.append(record)
                           if record["type"] == "event" else None)
    return events


def _train_poisoned(run_dir, steps: int, poisoned, policy: Recovery,
                    changes: dict[int, tuple[str, object]] | None = None):
    """A linear regression's session to step ``steps`` with ``recover=on`` from step 0,
    one window a step; the windows ``poisoned`` (their numbers in training order, from
    1: the data, which a recovery skips past) have their targets x 1000. The training
    waits at each poisoned window's boundary until the spike watch has judged the step
    (the I/O thread publishes twice a second) and, when it completes a spike, has
    queued its recovery (else, under load, the training could pass the kept states
    first), so that each spike is recovered from at the boundary after the next step.
    ``changes``: knob values set at the boundary after a window (its number). Returns
    the run's events, the steps it trained and the ``recover`` knob's value at the
    end."""
    torch.manual_seed(0)
    true_w = torch.randn(4, 1)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), 0.02)
    run = agent.session(model=model, optimizer=optimizer, name="repeats", recover=policy)
    events = _events_of(run)
    watch, windows, trained = run.agent.spikes, 0, []
    try:
        run.knobs.knobs["recover"].set("on")
        while run.step < steps and windows < 10 * steps:  # (endless recoveries: fail)
            windows += 1
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(windows))
            y = x @ true_w * (1000.0 if windows in poisoned else 1.0)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            done = run.step + 1
            trained.append(done)
            run.optimizer_step(loss.detach())
            if windows in (changes or {}):
                name, value = (changes or {})[windows]
                run.knobs.knobs[name].set(value)
            if watch.on and windows in poisoned:  # judged; a spike's recovery queued
                wait_until(lambda: watch._last_step == done and (  # (or applied now)
                    watch.waiting_since is None or run.step != done or any(
                        p.command_id.startswith(protocol.RECOVERY_ID_PREFIX)
                        for p in list(run.agent._desk.pending))),
                    f"step {done} judged", poll_s=0.002)
        recover = run.knobs.knobs["recover"].get()
    finally:
        run.close()
    return events, trained, recover


@pytest.mark.slow
def test_a_spike_that_recurs_after_max_repeats_recoveries_turns_recover_off(run_dir):
    """Every window from the 21st is poisoned: the spike (steps 21-23) recurs on each
    new branch from step 20, within the 8 steps the kept states cover: the first and
    max_repeats=2 repeats are recovered from, the third repeat turns recover off with
    one warning, and the run trains on to its last step."""
    events, trained, recover = _train_poisoned(
        run_dir, 30, range(21, 10_000), Recovery(keep_every_steps=4, keep_states=2))
    branched = [e for e in events if e.get("kind") == "branched"]
    assert [(e["branch"], e["parent"], e["step"]) for e in branched] == [
        (1, 0, 20), (2, 1, 20), (3, 2, 20)], branched
    [warning] = [e for e in events if e["level"] == "warning"]
    for said in ("loss spike", "steps 21-23", "the spike recurs after 3 recoveries in a "
                 "row (each within 8 steps of the last one's fork at step 20)",
                 "its cause is not in the skipped data", "recover is off"):
        assert said in warning["text"], (said, warning["text"])
    assert recover == "off" and trained[-1] == 30
    assert trained.count(21) == 4  # the first branch and the 3 recovered ones


def test_a_recovery_says_which_settings_went_back_with_the_state(run_dir):
    """weight_decay set after the kept state (step 20) and before the spike lives in the
    optimizer's state: the recovery puts it back, and its branched event says so
    (the demo's dropout=0.1 was undone unsaid)."""
    events, trained, _ = _train_poisoned(
        run_dir, 30, range(23, 26), Recovery(keep_every_steps=4, keep_states=2,
                                             max_repeats=0), changes={21: ("weight_decay",
                                                                           0.001)})
    [branched] = [e for e in events if e.get("kind") == "branched"]
    assert branched["step"] == 20
    assert branched["text"].endswith("; back as at step 20: weight_decay=0.0"), branched
    assert trained[-1] == 30


def test_spikes_far_apart_are_each_recovered_from(run_dir):
    """Two spikes 40 windows apart, with max_repeats=0 (a repeat would turn recover
    off): the second begins far past the first recovery's fork, so both recover."""
    events, trained, recover = _train_poisoned(
        run_dir, 70, set(range(21, 24)) | set(range(61, 64)),
        Recovery(keep_every_steps=4, keep_states=2, max_repeats=0))
    branched = [e for e in events if e.get("kind") == "branched"]
    assert [(e["branch"], e["step"]) for e in branched] == [(1, 20), (2, 56)], branched
    assert not [e for e in events if e["level"] == "warning"], events
    assert recover == "on" and trained[-1] == 70


def test_a_persons_change_that_raises_the_loss_is_not_undone_as_a_spike(run_dir):
    """Measured by a new user: dropout=0.1 raised the loss, the spike watch took it for a
    spike and the recovery went back past the change (dropout quietly 0.0 again; here,
    before the fix: 3 recoveries to step 80, then recover off). A noisy linear
    regression (its loss settles near 1.0) behind an nn.Dropout trains with recover=on;
    dropout=0.1, a real command, raises the loss to about 1.8 for good: above the spike
    limit (1.46), below the change guard's divergence (10x). No recovery, no spike
    warning, and dropout stays 0.1 to the end."""
    from agent.wire.commands import send_command

    torch.manual_seed(0)
    true_w = torch.randn(4, 1)
    model = torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), 0.05)
    run = agent.session(model=model, optimizer=optimizer, name="level",
                        recover=Recovery(keep_every_steps=4, keep_states=2))
    events = _events_of(run)
    watch, losses = run.agent.spikes, []
    try:
        run.knobs.knobs["recover"].set("on")
        for window in range(1, 111):
            generator = torch.Generator().manual_seed(window)
            x = torch.randn(256, 4, generator=generator)
            y = x @ true_w + torch.randn(256, 1, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            done = run.step + 1
            run.optimizer_step(loss.detach())
            if window == 80:
                reply = send_command(run.agent.info, "dropout", 0.1)
                assert reply["ok"] and reply["apply_step"] == 82, reply
            if window > 80:  # each step judged before the next (as a slow step would be)
                wait_until(lambda: watch._last_step == done, f"step {done} judged",
                           poll_s=0.002)
        dropout = run.knobs.knobs["dropout"].get()
    finally:
        run.close()
    before, after = sorted(losses[70:80])[5], sorted(losses[90:110])[10]
    assert 1.5 * before < after < 10 * before, (before, after)
    assert not [e for e in events if e.get("kind") == "branched"], events
    assert not [e for e in events if "loss spike" in e.get("text", "")], events
    assert dropout == 0.1 and run.step == 110


#: A recovery that halves lr_scale for the 10 steps after the state it goes back to.
_LR_HALVED = Recovery(keep_every_steps=5, keep_states=2, lr_scale=0.5, lr_steps=10)


class _Regression:
    """A linear regression under :func:`agent.session` with ``recover=on`` from step 0
    and a checkpoint directory; the test is its training thread. Window ``n`` of a
    branch trains on data seeded ``seed_base + n``."""

    def __init__(self, checkpoint_dir, policy: Recovery) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), 0.1)
        self.run = agent.session(model=self.model, optimizer=self.optimizer, name="branches",
                                 recover=policy, checkpoint_dir=checkpoint_dir)
        self.run.knobs.knobs["recover"].set("on")

    def train_to(self, step: int, seed_base: int = 0) -> None:
        while self.run.step < step:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(
                seed_base + self.run.step + 1))
            loss = torch.nn.functional.mse_loss(self.model(x), x.sum(1, keepdim=True))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.run.optimizer_step(loss.detach())

    def recover_from_a_spike_at_12(self) -> None:
        """Train to step 12 and recover from a spike at step 11: back to step 10, and
        under :data:`_LR_HALVED` lr_scale 1.0 -> 0.5 until step 20."""
        self.train_to(12)
        self.run.recover(12, 11, "loss spike: test")
        assert (self.run.step, self.run.knobs.knobs["lr_scale"].get(),
                self.run._lr_back) == (10, 0.5, (20, 1.0))

    def roll_back_lr_scale_to_half(self, path: str, changes: list[str]) -> dict[int, float]:
        """Roll ``changes`` back to lr_scale=0.5 at the next boundary, then train to step 24.

        ``path``: ``"guard"`` (the guard's rollback: the knobs, then the state kept for
        them) or ``"out_of_memory"`` (the knobs alone, at once). Returns lr_scale after
        each step from there (the value the next step trains with)."""
        run, desk = self.run, self.run.agent._desk
        if path == "guard":
            desk.schedule_rollback(Rollback({"lr_scale": 0.5}, changes, "test: the loss rose"),
                                   run.step + 1)
            self.train_to(run.step + 1)
        else:
            assert desk.roll_back(run.step + 1, "test: out of memory")
        seen = {}
        while run.step < 24:
            seen[run.step] = run.knobs.knobs["lr_scale"].get()
            self.train_to(run.step + 1)
        return seen

    def ring(self) -> list[int]:
        return [kept[0] for kept in self.run._ring]

    def weight(self) -> torch.Tensor:
        return self.model.weight.detach().clone()


def test_the_states_kept_for_recoveries_are_the_branch_being_trained(run_dir, tmp_path):
    """A rewind to a checkpoint drops every state the recovery kept (another lineage:
    they are not this branch's past) and keeps one at the fork; a rollback drops those
    past its fork; a later spike then goes back to the new branch's own state (the
    abandoned branch's step 10 was kept at the same step number)."""
    loop = _Regression(tmp_path, Recovery(keep_every_steps=5, keep_states=3))
    run = loop.run
    try:
        loop.train_to(7)
        run.knobs.knobs["checkpoint"].set("now")
        loop.train_to(12)
        assert loop.ring() == [0, 5, 10]
        old10 = run._ring[-1][1]["model"]["weight"]
        run.knobs.knobs["rewind"].set("7")
        assert (run.step, run.branch, loop.ring()) == (7, 1, [7])
        loop.train_to(10, seed_base=1000)  # other data on the new branch
        new10 = loop.weight()
        assert not torch.equal(new10, old10)
        loop.train_to(11, seed_base=1000)
        run.keep_state(11)  # as a guarded change does, then a rollback to it
        loop.train_to(16, seed_base=1000)
        assert loop.ring() == [7, 10, 15]
        run.restore_state(17, "rolled back: test")
        assert (run.step, run.branch, loop.ring()) == (11, 2, [7, 10])
        run.recover(11, 11, "loss spike: test")
        assert (run.step, run.branch) == (10, 3)
        assert torch.equal(loop.weight(), new10)
    finally:
        run.close()


@pytest.mark.parametrize("path", ["guard", "out_of_memory"])
def test_a_rollback_of_a_persons_lr_scale_during_a_recovery_brings_its_end_back(
        run_dir, tmp_path, path):
    """A recovery scales lr_scale 1.0 -> 0.5 until step 20; a person's lr_scale=0.2 at
    step 15 ends that plan (the person's value holds); a rollback of it sets 0.5 back,
    and with it the plan's end: lr_scale is 1.0 again after step 20 (the out-of-memory
    rollback: knobs only), or at once (the guard's: the state too, which ends a
    recovery's scaled steps as every rewind does). Before, 0.5 stayed for the rest of
    the run: the recovery's lowered learning rate, for good."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    events = _events_of(run)
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        assert send_command(run.agent.info, "lr_scale", 0.2)["ok"]
        loop.train_to(16)
        assert (lr.get(), run._lr_back) == (0.2, None)
        seen = loop.roll_back_lr_scale_to_half(path, ["lr_scale=0.2"])
    finally:
        run.close()
    rolled = [e["text"] for e in events if e.get("kind") == "rolled_back"]
    assert rolled and rolled[-1].startswith("lr_scale=0.5 applied at step "), rolled
    if path == "guard":
        assert set(seen.values()) == {1.0}, seen
        [restored] = [e["text"] for e in events if e.get("kind") == "branched"][-1:]
        assert "the recovery's scaled lr ends: lr_scale back to 1" in restored, restored
    else:
        assert rolled[-1].endswith("; the recovery's scaled steps come back with it: "
                                   "lr_scale back to 1 after step 20"), rolled
        # (seen[n]: the value after step n, which step n + 1 trains with)
        assert {step: value for step, value in seen.items() if step < 20} == {
            step: 0.5 for step in range(16, 20)}, seen
        assert {value for step, value in seen.items() if step >= 20} == {1.0}, seen


def test_a_recoverys_scaled_lr_is_not_saved_and_ends_with_a_rewind(run_dir, tmp_path):
    """While a recovery scales the lr, a checkpoint keeps the person's lr_scale; a rewind
    to a checkpoint (lr_scale=0.3 in it) ends the recovery's timer, which would put 1.0
    back at step 20 of the new branch."""
    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    try:
        loop.train_to(3)
        lr.set(0.3)
        run.knobs.knobs["checkpoint"].set("now")
        lr.set(1.0)
        loop.recover_from_a_spike_at_12()
        said = run.knobs.knobs["checkpoint"].set("now")["text"]
        assert ("a recovery scales lr_scale to 0.5 until step 20; the checkpoint keeps "
                "lr_scale=1.0") in said, said
        saved = torch.load(tmp_path / "step-00000010.pt", weights_only=True)
        assert saved["knobs"]["lr_scale"] == 1.0
        run.knobs.knobs["rewind"].set("3")
        assert (run.step, lr.get(), run._lr_back) == (3, 0.3, None)
        seen = {}
        while run.step < 25:
            loop.train_to(run.step + 1)
            seen[run.step] = lr.get()
        assert set(seen.values()) == {0.3}, seen
    finally:
        run.close()


def test_a_recovery_applies_beside_a_persons_recover_at_the_same_boundary(run_dir,
                                                                          tmp_path):
    """A person's ``recover=on`` due at the boundary a recovery is due at does not
    drop the recovery (last-command-wins is for settings): the run goes back, and the
    spike watch judges the new branch's steps again."""
    loop = _Regression(tmp_path, Recovery(keep_every_steps=2))
    run, desk = loop.run, loop.run.agent._desk
    events: list[dict] = []
    run.agent.add_listener(lambda record: events.append(record)
                           if record.get("kind") == "branched" else None)
    try:
        loop.train_to(6)
        run.agent.spikes.waiting_since = 5  # as the watch is when it found a spike at 5
        desk.schedule_recovery(f"{protocol.RECOVERY_ID_PREFIX}5-abcd", "loss spike: test", 8)
        desk.schedule(Pending(8, 0, "recover", "on", "person-1"))
        loop.train_to(7)
        assert (run.step, run.branch) == (7, 1)  # (back to 4 after step 7, then on)
        assert [(e["step"], e["source"]) for e in events] == [(4, "recovery")]
        assert run.knobs.knobs["recover"].get() == "on"
    finally:
        run.close()


def test_a_drop_that_fails_puts_the_state_and_data_position_as_they_were_back(run_dir):
    """``skip_windows`` past the windows trained since the kept state: the recovery
    loads it, then the drop of the windows beyond raises: the load's all or nothing
    puts back the state as it was (the parameters, the step, the data position with no
    drop pending), no branch starts, and the error says why (with several ranks, a
    drop failing on one puts it back on every rank: no rank trains other data)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    run = agent.session(model=model, optimizer=optimizer, name="drop",
                        recover=Recovery(keep_every_steps=2, skip_windows=4))
    events = _events_of(run)
    try:
        run.knobs.knobs["recover"].set("on")
        batches = iter(run.loader([torch.randn(2, 4) for _ in range(20)], epochs=None))
        for _ in range(5):
            model(next(batches)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            run.optimizer_step()

        def drop(micro_batches: int) -> None:
            raise RuntimeError(f"injected: {micro_batches} cannot be dropped")

        run.drop_micro_batches = drop
        params, position = [p.detach().clone() for p in model.parameters()], (
            run.position.state_dict())
        run.recover(5, 5, "loss spike")
        assert run.step == 5 and run.position.dropping == 0
        assert run.position.state_dict()["fetched_total"] == position["fetched_total"]
        for mine, was in zip(model.parameters(), params, strict=True):
            assert torch.equal(mine.detach(), was)
        assert not [e for e in events if e.get("kind") == "branched"]
        [error] = [e for e in events if e["level"] == "error"]
        assert ("loss spike; putting back the state of step 4 failed (RuntimeError: "
                "injected: 3 cannot be dropped)") in error["text"], error["text"]
    finally:
        run.close()


@pytest.mark.parametrize("value", [0.2, 0.5])
def test_a_persons_lr_scale_during_a_recoverys_scaled_steps_is_kept_after_them(
        run_dir, tmp_path, value):
    """A recovery scales lr_scale 1.0 -> 0.5 for 10 steps; a person's lr_scale, a real
    command, applies during them: the person's value holds after them (the recovery's
    timer put its 1.0 back over it, for 0.2 a learning rate five times the one
    commanded), and a checkpoint then keeps it. 0.5, the scaled value, sets nothing
    ("no change") but is the person's all the same."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    events = _events_of(run)
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        reply = send_command(run.agent.info, "lr_scale", value)
        assert reply["ok"], reply
        seen = {}
        while run.step < 25:
            loop.train_to(run.step + 1)
            seen[run.step] = lr.get()
        assert set(seen.values()) == {value}, seen
        values, note = run.chosen_knobs()
        assert values["lr_scale"] == value and note is None, (values, note)
    finally:
        run.close()
    assert not [e for e in events if "back to 1" in e.get("text", "")], events
    assert [e["text"] for e in events if e.get("knob") == "lr_scale"
            and e.get("kind") == "applied"][-1].endswith(
        "; the recovery's scaled lr ends: lr_scale is this value from now on")


@pytest.mark.parametrize("path", ["guard", "out_of_memory"])
def test_a_rollback_of_two_persons_lr_scales_during_a_recovery_brings_its_end_back(
        run_dir, tmp_path, path):
    """A recovery scales lr_scale 1.0 -> 0.5 until step 20; a person's lr_scale=0.2
    (step 15) ends that plan, a second person's lr_scale=0.3 (step 17, the same
    episode) follows; a rollback undoes both (back to 0.5, the value before the
    episode), and the plan's end comes back with it: 1.0 after step 20 (the
    out-of-memory rollback), or at once (the guard's, with the state). Before, the
    second setting dropped what the first had ended: 0.5, the recovery's lowered
    learning rate, for the rest of the run."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        assert send_command(run.agent.info, "lr_scale", 0.2)["ok"]
        loop.train_to(15)
        assert send_command(run.agent.info, "lr_scale", 0.3)["ok"]
        loop.train_to(17)
        assert (lr.get(), run._lr_back) == (0.3, None)
        seen = loop.roll_back_lr_scale_to_half(path, ["lr_scale=0.2", "lr_scale=0.3"])
    finally:
        run.close()
    if path == "guard":
        assert set(seen.values()) == {1.0}, seen
    else:  # (seen[n]: the value after step n, which step n + 1 trains with)
        assert {step: value for step, value in seen.items() if step < 20} == {
            step: 0.5 for step in range(17, 20)}, seen
        assert {value for step, value in seen.items() if step >= 20} == {1.0}, seen


def test_a_rollback_to_a_persons_lr_scale_after_a_recovery_does_not_bring_its_end_back(
        run_dir, tmp_path):
    """A recovery scales lr_scale 1.0 -> 0.5 until step 20; a person's lr_scale=0.5 (no
    change, step 15) ends that plan; a person's lr_scale=0.3 (step 17) starts an
    episode, which the guard rolls back: 0.5, the person's, holds (the plan it ended
    does not come back)."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        assert send_command(run.agent.info, "lr_scale", 0.5)["ok"]
        loop.train_to(15)
        assert send_command(run.agent.info, "lr_scale", 0.3)["ok"]
        loop.train_to(17)
        run.agent._desk.schedule_rollback(Rollback({"lr_scale": 0.5}, ["lr_scale=0.3"],
                                                   "test: the loss rose"), run.step + 1)
        seen = {}
        while run.step < 24:
            loop.train_to(run.step + 1)
            seen[run.step] = lr.get()
    finally:
        run.close()
    assert set(seen.values()) == {0.5}, seen


def test_an_out_of_memory_rollback_after_a_recoverys_planned_end_puts_its_value_back_now(
        run_dir, tmp_path):
    """A recovery scales lr_scale 1.0 -> 0.5 until step 20; a person's lr_scale=0.2
    (step 15) ends that plan; at step 26 an out-of-memory error rolls it back (0.5):
    the plan's end has passed, so 1.0 comes back at once, for the step retried. Before,
    that step trained at 0.5, the recovery's value six steps past its end, and the
    event said the lr would go back "after step 20"."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr = loop.run, loop.run.knobs.knobs["lr_scale"]
    events = _events_of(run)
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        assert send_command(run.agent.info, "lr_scale", 0.2)["ok"]
        loop.train_to(25)
        assert lr.get() == 0.2
        assert run.agent.roll_back_last_change(26, "test: step 26 ran out of memory")
        assert (lr.get(), run._lr_back, run.agent.knob_values["lr_scale"]) == (1.0, None, 1.0)
        loop.train_to(30)
        assert lr.get() == 1.0
    finally:
        run.close()
    rolled = [e["text"] for e in events if e.get("kind") == "rolled_back"]
    assert rolled[-1].endswith("; the recovery's scaled steps ended after step 20: "
                               "lr_scale back to 1 now"), rolled


@pytest.mark.parametrize("queued_first", ["rollback", "recovery"])
def test_a_rollback_and_a_recovery_at_one_boundary_never_bring_the_undone_lr_back(
        run_dir, tmp_path, queued_first):
    """A recovery halves lr_scale until step 20; a person's lr_scale=0.2 (step 15) ends
    that plan; at one boundary the guard's rollback of it and a second recovery fall due,
    queued in either order. The rollback applies first: the second recovery then halves
    1.0 (the value the first would have gone back to) and goes back to 1.0. Before, with
    the recovery first, it halved 0.2, the rollback set 0.5 over it, and at the second
    plan's end the undone 0.2 came back for the rest of the run; and an event said "the
    weights were not restored" right after the recovery had put a state back."""
    from agent.wire.commands import send_command

    loop = _Regression(tmp_path, _LR_HALVED)
    run, lr, desk = loop.run, loop.run.knobs.knobs["lr_scale"], loop.run.agent._desk
    events = _events_of(run)
    try:
        loop.recover_from_a_spike_at_12()
        loop.train_to(13)
        assert send_command(run.agent.info, "lr_scale", 0.2)["ok"]
        loop.train_to(17)
        at = run.step + 1
        queue = {"rollback": lambda: desk.schedule_rollback(
                     Rollback({"lr_scale": 0.5}, ["lr_scale=0.2"], "test: the loss rose"), at),
                 "recovery": lambda: desk.schedule_recovery(
                     f"{protocol.RECOVERY_ID_PREFIX}16-abcd", "loss spike: test", at)}
        queue.pop(queued_first)()
        queue.popitem()[1]()
        loop.train_to(at)
        seen = {}
        while run.step < 40:
            seen[run.step] = lr.get()
            loop.train_to(run.step + 1)
    finally:
        run.close()
    assert 0.2 not in seen.values(), seen
    assert seen[max(seen)] == 1.0, seen
    # the recovery put a state back: the rollback's (dropped by its rewind) is not
    # said to be missing ("the weights were not restored")
    assert not [e for e in events if e.get("kind") == "state_restored"], events
