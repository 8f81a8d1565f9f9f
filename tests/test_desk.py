"""The command desk without sockets, and the one ledger both rollback paths read."""

from typing import Any

from agent.wire import protocol
from agent.control.desk import MAX_PENDING_COMMANDS, CommandDesk
from agent.control.guard import ChangeGuard
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINT, LR_SCALE, PRECISION, STOP, Knob,
                              KnobSet, when_applied)
from agent.control.ledger import Change, ChangeLedger
from agent.wire.protocol import EventKind
from agent.search.tune import AutoTune
from gpuwatch.client import reply_text

TOKEN = "secret"


class Run:
    """What the desk sees of a run: knob values in a dict, the events it raises."""

    def __init__(self, ledger: ChangeLedger | None = None, **values: Any) -> None:
        self.values = {"precision": "fp32", "accum_steps": 1, "lr_scale": 1.0, **values}
        self.step = 0
        self.events: list[dict[str, Any]] = []
        self.ledger = ledger or ChangeLedger(guard_steps=20)
        knobs = KnobSet()
        for spec in (PRECISION, ACCUM_STEPS, LR_SCALE):
            knobs.add(Knob(spec, lambda name=spec.name: self.values[name],
                           lambda value, name=spec.name: self.values.__setitem__(name, value)))
        def publish(msg_type, body):
            self.events.append(body)
        self.desk = CommandDesk(
            knobs, token=TOKEN, ledger=self.ledger,
            tune=AutoTune(knobs, 0, publish, lambda: None, 1, lambda where, exc: None),
            publish=publish, event=lambda level, text, **fields: self.events.append(
                {"level": level, "text": text, **fields}),
            step_now=lambda: self.step, ending=lambda: False)

    def command(self, knob: str, value: Any, **extra: Any) -> protocol.Reply:
        return self.desk.answer({"id": extra.pop("id", f"c-{knob}"), "knob": knob,
                                 "value": value, "token": TOKEN, **extra})

    def train(self, steps: int) -> None:
        """Run ``steps`` optimizer steps; pending commands apply at their boundary."""
        for _ in range(steps):
            self.step += 1
            if self.desk.pending:
                self.desk.apply_due(self.step)

    def kinds(self) -> list[str]:
        return [event.get("kind") for event in self.events]


def test_a_command_is_validated_and_a_bad_one_changes_nothing():
    run = Run()
    assert run.desk.answer({"id": 1, "knob": "precision", "value": "bf16",
                            "token": "wrong"}) == {
        "id": 1, "ok": False, "knob": None, "reason": "missing or wrong token"}
    reply = run.command("precision", "fp8")
    assert not reply["ok"] and "fp8" in reply["reason"]
    reply = run.command("accum_steps", 2, apply_step=True)
    assert reply["reason"] == "apply_step must be an integer, got True"
    reply = run.command("accum_steps", 2, apply_step=None)
    assert reply["reason"] == "apply_step must be an integer, got None"
    for bad in (None, True, -1, "0"):  # the branch a step is counted on
        reply = run.command("accum_steps", 2, apply_step=5, branch=bad)
        assert reply["reason"] == f"branch must be an integer >= 0, got {bad!r}", bad
    assert run.desk.answer({"id": [1], "token": TOKEN})["reason"].startswith("id must be")
    check = run.command("accum_steps", "4", dry_run=True)
    assert check == {"id": "c-accum_steps", "ok": True, "dry_run": True,
                     "knob": "accum_steps", "value": 4, "apply_step": 2, "step_time_s": None}
    assert run.desk.pending == [] and run.desk.commands_rejected == 2
    assert run.kinds() == [EventKind.REJECTED]  # one event a second for a flood of them
    run.train(5)
    assert run.values == {"precision": "fp32", "accum_steps": 1, "lr_scale": 1.0}


def test_a_command_applies_at_its_step_and_not_before():
    run = Run()
    run.train(3)
    reply = run.command("accum_steps", 4, apply_step=7)
    assert reply == {"id": "c-accum_steps", "ok": True, "knob": "accum_steps", "value": 4,
                     "apply_step": 7, "step": 3}
    assert run.command("precision", "bf16", apply_step=4)["reason"] == (
        "apply_step 4 has passed on rank 0 (earliest: 5)")
    run.train(2)  # steps 4 and 5: step 6 still trains with the old value
    assert run.values["accum_steps"] == 1
    run.train(1)  # after step 6: the boundary before step 7
    assert run.values["accum_steps"] == 4
    applied = run.events[-1]
    assert applied["kind"] == EventKind.APPLIED and applied["step"] == 7
    assert applied["previous"] == 1
    assert run.ledger.entries == (Change(7, "accum_steps", 4, 1, "c-accum_steps"),)


def test_a_command_that_is_not_a_setting_says_after_which_step_it_runs():
    """``stop=now`` sent while step 21 trains runs at the boundary after it: the run ends
    with 21 trained, which "applies at step 22" made people read as one step more."""
    run = Run()
    stopped = []
    run.desk.knobs.add(Knob(STOP, lambda: None, stopped.append))
    run.train(20)
    reply = run.command("stop", "now")
    assert (reply["apply_step"], reply["after_step"]) == (22, 21)
    assert reply_text("stop", "now", reply) == "accepted: stop=now at the boundary after step 21"
    assert run.events[-1]["text"] == "stop=now accepted, at the boundary after step 21"
    run.train(2)
    assert stopped == ["now"]
    setting = run.command("accum_steps", 2)  # a setting: the step that trains with it
    assert "after_step" not in setting
    assert reply_text("accum_steps", 2, setting) == "accepted: accum_steps=2 applies at step 24"
    assert when_applied(1, 0) == "before step 1"


def test_nothing_is_accepted_or_applied_for_steps_a_pending_stop_never_trains():
    """``stop=now`` pending for the boundary after step 21: a setting for that boundary
    or a later one is refused (no step would train with it), a checkpoint there is not;
    one accepted before the stop for its boundary is not applied there, and says so."""
    run = Run()
    stopped, saved = [], []
    run.desk.knobs.add(Knob(STOP, lambda: None, stopped.append))
    run.desk.knobs.add(Knob(CHECKPOINT, lambda: None, saved.append))
    run.train(20)
    early = run.command("accum_steps", 4, id="early")  # for step 22: before the stop
    assert early["ok"] and early["apply_step"] == 22
    assert run.command("stop", "now")["apply_step"] == 22
    refused = run.command("lr_scale", 2.0)
    assert not refused["ok"] and refused["reason"] == (
        "the run stops at the boundary after step 21 (stop=now is pending): no step "
        "trains with it")
    assert not run.command("precision", "bf16", apply_step=30)["ok"]
    assert run.command("checkpoint", "now")["ok"]  # at the stop's own boundary
    run.train(2)
    assert stopped == ["now"] and saved == ["now"]
    assert run.values == {"precision": "fp32", "accum_steps": 1, "lr_scale": 1.0}
    [cancelled] = [e for e in run.events if e.get("kind") == EventKind.CANCELLED]
    assert cancelled["text"] == ("accum_steps=4 not applied: stop=now ends the run at the "
                                 "boundary after step 21, before any step trains with it")
    assert (cancelled["id"], cancelled["step"]) == ("early", 22)
    assert not any(e.get("kind") == EventKind.APPLIED and e.get("knob") == "accum_steps"
                   for e in run.events)


def test_a_setting_to_the_value_it_will_have_says_no_change_in_its_reply():
    run = Run()
    reply = run.command("lr_scale", 1.0)
    assert reply["no_change"] is True
    assert reply_text("lr_scale", 1.0, reply) == ("accepted: lr_scale=1.0 applies at step 2 "
                                                  "(no change)")
    assert "no_change" not in run.command("lr_scale", 0.5)


def test_a_pending_command_is_cancelled_and_a_late_cancel_says_when_it_applied():
    run = Run()
    run.command("precision", "bf16", apply_step=10)
    run.command("accum_steps", 2)
    cancel = run.desk.answer({"id": "c-precision", "cancel": True, "token": TOKEN,
                              "reason": "rank 1 refused it"})
    assert cancel == {"id": "c-precision", "ok": True, "cancel": True, "knob": "precision",
                      "value": "bf16", "apply_step": 10}
    assert run.events[-1]["kind"] == EventKind.CANCELLED
    assert run.events[-1]["text"].endswith("cancelled: rank 1 refused it")
    run.train(12)
    assert run.values["precision"] == "fp32" and run.values["accum_steps"] == 2
    late = run.desk.cancel("c-accum_steps", None)
    assert late["ok"] is False and late["applied_step"] == 2
    assert run.desk.cancel("nobody", None)["reason"] == "no pending command with id 'nobody'"


def test_a_flood_of_valid_commands_is_refused_not_queued():
    run = Run()
    replies = [run.command("accum_steps", 2, id=n) for n in range(MAX_PENDING_COMMANDS + 5)]
    assert all(reply["ok"] for reply in replies[:MAX_PENDING_COMMANDS])
    refused = replies[MAX_PENDING_COMMANDS:]
    assert not any(reply["ok"] for reply in refused)
    assert "already waiting" in refused[0]["reason"]
    assert len(run.desk.pending) == MAX_PENDING_COMMANDS
    assert run.desk.commands_refused == 5
    run.train(2)
    assert run.desk.pending == []  # all due at one boundary: the last one wins
    assert [e["id"] for e in run.events if e["kind"] == EventKind.APPLIED] == [
        MAX_PENDING_COMMANDS - 1]


def test_repeats_of_an_accepted_no_op_in_a_step_make_one_event():
    run = Run()
    run.train(3)
    replies = [run.command("precision", "fp32", id=n) for n in range(20)]  # fp32 already
    assert all(reply["ok"] for reply in replies)
    accepted = [e for e in run.events if e["kind"] == EventKind.ACCEPTED]
    assert [e["text"] for e in accepted] == [
        "precision=fp32 accepted, applies at step 5 (no change)"]
    # a command that changes something always has its event, and so has a no-op after
    # it (the value it keeps is then the pending one's)
    run.command("accum_steps", 4, id="a1")
    run.command("accum_steps", 4, id="a2")
    run.command("accum_steps", 1, id="a3")  # back to the value now: still a change
    texts = [e["text"] for e in run.events if e["kind"] == EventKind.ACCEPTED][1:]
    assert texts == ["accum_steps=4 accepted, applies at step 5",
                     "accum_steps=4 accepted, applies at step 5 (no change)",
                     "accum_steps=1 accepted, applies at step 5"]
    # the next step's first one says how many were left out
    run.train(1)
    run.command("precision", "fp32", id="later")
    assert run.events[-1]["text"] == ("precision=fp32 accepted, applies at step 6 "
                                      "(no change) (19 more before it not shown)")
    run.train(2)
    assert run.values["accum_steps"] == 1  # the last command of the boundary won
    # rejections keep their own limit: one event a second
    for _ in range(10):
        run.command("precision", "fp8")
    assert run.kinds().count(EventKind.REJECTED) == 1


def test_a_setting_to_the_value_it_has_sets_nothing_and_starts_no_episode():
    """A script setting lr_scale every 50 steps to what it already is: no set, no state
    kept for it, nothing in the ledger for a rollback to undo; a real change still is."""

    class Keeper:
        def __init__(self) -> None:
            self.kept: list[int] = []
            self.told: list[str] = []

        def keep_state(self, step: int) -> None:
            self.kept.append(step)

        def setting_applied(self, knob: str, previous: object) -> str:
            self.told.append(knob)  # (a no-op is a person's setting all the same)
            return ""

        def restore_state(self, step: int, reason: str) -> tuple[str, str]:
            raise AssertionError("nothing to restore")

    run = Run()
    run.desk.state_keeper = keeper = Keeper()
    sets = []
    run.desk.knobs.knobs["lr_scale"].set = sets.append
    run.train(3)
    run.command("lr_scale", 1.0)
    run.train(1)
    applied = run.events[-1]
    assert applied["kind"] == EventKind.APPLIED
    assert applied["text"] == "lr_scale=1.0 applied at step 5 (no change)"
    assert sets == [] and keeper.kept == [] and run.ledger.entries == ()
    assert keeper.told == ["lr_scale"]
    run.command("lr_scale", 0.5)
    run.train(1)
    assert sets == [0.5] and keeper.kept == [5]
    assert run.ledger.entries == (Change(6, "lr_scale", 0.5, 1.0, "c-lr_scale"),)
    run.command("lr_scale", 0.7, id=f"{protocol.TUNE_ID_PREFIX}1")  # the search's: not a person's
    run.train(1)
    assert sets == [0.5, 0.7] and keeper.told == ["lr_scale", "lr_scale"]


def test_a_nan_and_an_out_of_memory_error_restore_the_same_last_good_values():
    """One ledger, two readers: the guard (I/O thread, after a NaN loss) and the desk's
    rollback (training thread, after an OOM) undo the same changes to the same values."""

    def changed_run() -> Run:
        run = Run()
        run.command("precision", "bf16", apply_step=10)
        run.command("accum_steps", 4, apply_step=15)
        run.train(16)
        run.command("precision", "fp16", apply_step=18)  # the first previous counts
        run.train(3)
        return run

    last_good = {"precision": "fp32", "accum_steps": 1, "lr_scale": 1.0}
    nan_run = changed_run()
    rollback = ChangeGuard(nan_run.ledger).on_step(20, float("nan"), None)
    assert rollback.reason == ("loss was nan at step 20 after precision=bf16, "
                               "accum_steps=4, precision=fp16")
    nan_run.desk.schedule_rollback(rollback, 22)
    nan_run.train(2)
    assert nan_run.values == last_good
    oom_run = changed_run()
    assert oom_run.desk.roll_back(20, "step 20 ran out of memory")
    assert oom_run.values == last_good
    for run in (nan_run, oom_run):
        assert run.ledger.entries == ()  # rolled back: nothing is left to undo
        assert run.kinds()[-2:] == [EventKind.ROLLED_BACK] * 2
    assert not oom_run.desk.roll_back(21, "step 21 ran out of memory")


def test_the_guard_leaves_the_tuners_changes_to_the_tuner_but_an_oom_undoes_them():
    ledger = ChangeLedger(guard_steps=20)
    ledger.record(Change(10, "lr_scale", 2.0, 1.0, command_id=f"{protocol.TUNE_ID_PREFIX}1"))
    guard = ChangeGuard(ledger)
    assert guard.on_step(11, float("nan"), None) is None
    assert not guard.watching
    assert ledger.last_good(11).values == {"lr_scale": 1.0}
    assert ledger.last_good(31) is None  # more than guard_steps after the change
