"""The in-run tune: real training with test knobs whose values add a known delay, make the
loss NaN or raise when applied; the search's own parts (ladders, coordinate search,
statistics) on their own; a client killed mid-search; the new knobs cpu_threads and
micro_batch_size."""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import agent
from agent.control.checkpoints import load_checkpoint
from agent.wire import protocol
from agent.wire.knobs import TUNED, TUNED_IF_ALLOWED, Knob, KnobError, KnobSet, KnobSpec
from agent.search.coordinate import CoordinateSearch, ladder
from agent.search.request import TuneRequest
from agent.search.stats import Block, Series, paired_gain, t_quantile
from agent.search.tuner import Tuner, _side
from gpuopt import Trainer
from gpuopt.loader import ReconfigurableLoader
from gpuwatch.client import Subscriber, send_command
from gpuwatch.history import flat_records
from tests.conftest import wait_until
from tests.training import digits_loader, messages, start
from tests.training import model as make_model

#: The test knob ``step_delay``: seconds each micro-batch sleeps at each value. From
#: the start value 0, the search should keep 1 (faster) and revert 2 (slower). Sleeps,
#: which a loaded host does not stretch: the gains stay far beyond its noise.
DELAY_S = {0: 0.02, 1: 0.0, 2: 0.05}


class FakeKnobs:
    """Knobs for a Trainer's run that the tests control: ``step_delay`` (DELAY_S),
    ``poison`` (True: the reported loss is NaN, the gradients stay finite), ``broken``
    (setting it to 1 raises)."""

    def __init__(self, trainer: Trainer) -> None:
        self.delay, self.poison = 0, False
        trainer.fault_injection = lambda _: time.sleep(DELAY_S[self.delay])
        loss_fn = trainer.loss_fn
        trainer.loss_fn = lambda output, target: (
            loss_fn(output, target) + (float("nan") if self.poison else 0.0))

    def bind(self, monitor: agent.Agent, *names: str) -> None:
        specs = {"step_delay": (KnobSpec("step_delay", "int", "test: sleeps per step",
                                         minimum=0, maximum=2, tuning=TUNED),
                                lambda: self.delay, lambda v: setattr(self, "delay", v)),
                 "poison": (KnobSpec("poison", "bool", "test: NaN loss", tuning=TUNED),
                            lambda: self.poison, lambda v: setattr(self, "poison", v)),
                 "broken": (KnobSpec("broken", "int", "test: 1 raises", minimum=0,
                                     maximum=1, tuning=TUNED), lambda: 0, _refuse_one)}
        for name in names:
            spec, get, set_ = specs[name]
            monitor.knobs.add(Knob(spec, get=get, set=set_))
        monitor.refresh_knobs()


def _refuse_one(value: int) -> None:
    if value == 1:
        raise RuntimeError("broken=1 cannot be applied (test)")


def _trainer(**options):
    model = make_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.nn.functional.cross_entropy, digits_loader(), **options)


class Hold:
    """Trainer callback: once :meth:`now` is called, the training thread waits at its
    next optimizer step until :attr:`release` is set (the agent's thread goes on)."""

    def __init__(self):
        self.asked, self.held, self.release = (threading.Event(), threading.Event(),
                                               threading.Event())

    def now(self):
        self.asked.set()
        assert self.held.wait(30)

    def on_optimizer_step(self, trainer, stats):
        if self.asked.is_set() and not self.release.is_set():
            self.held.set()
            assert self.release.wait(30)


@contextlib.contextmanager
def _training(*knob_names, callbacks=()):
    """A Trainer training in a thread with the agent attached and the named test knobs
    bound: yields ``(knobs, monitor, subscriber)`` once a step has been seen."""
    trainer = _trainer(callbacks=list(callbacks))
    knobs = FakeKnobs(trainer)
    monitor = agent.attach(trainer)
    knobs.bind(monitor, *knob_names)
    with Subscriber(monitor.info) as sub:
        thread = start(trainer, max_steps=100_000)
        try:
            messages(sub, lambda m: m["type"] == "step")
            yield knobs, monitor, sub
        finally:
            trainer.stop()
            thread.join(30)


def _steps_after(sub, seen, steps=3):
    """``seen`` and the messages until ``steps`` step records after its last tune record's."""
    last = next(m["body"]["step"] for m in reversed(seen) if m["type"] == protocol.TUNE)
    return seen + messages(sub, lambda m: m["type"] == "step"
                           and m["body"]["step"] > last + steps)


def _tune_to_the_end(sub, info, value, timeout_s=120):
    reply = send_command(info, protocol.TUNE, value)
    assert reply["ok"], reply
    return messages(sub, lambda m: m["type"] == protocol.TUNE
                    and m["body"]["status"] != "running", timeout_s)


def _candidates(seen):
    """The last tune record's candidates by setting: ``{(("knob", value), ...): map}``."""
    return {tuple(c["setting"].items()): c for c in seen[-1]["body"]["candidates"]}


def test_the_search_keeps_the_faster_setting_and_reverts_the_slow_one(run_dir):
    with _training("step_delay") as (knobs, monitor, sub):
        seen = _tune_to_the_end(sub, monitor.info, {"knobs": ["step_delay"]})
        final = next(m["body"] for m in reversed(seen) if m["type"] == protocol.TUNE)
        best = final["best"]["step_delay"]  # its command may apply some steps after the
        seen += messages(sub, lambda m: m["type"] == "step"  # record on a loaded machine
                         and m["body"]["knobs"]["step_delay"] == best)
        seen = _steps_after(sub, seen)
    candidates = _candidates([m for m in seen if m["type"] == protocol.TUNE])
    assert candidates[(("step_delay", 1),)]["state"] == "kept"
    slow = candidates[(("step_delay", 2),)]
    assert slow["state"] == "reverted" and slow["reason"].startswith("slower")
    assert final["best"] == {"step_delay": 1} and final["status"] == "done"
    assert final["text"].startswith("tuned: step_delay=1 (+") and final["gain"] > 0
    assert seen[-1]["body"]["knobs"]["step_delay"] == 1 and knobs.delay == 1
    applied = [(m["body"]["step"], m["body"]["value"]) for m in seen if m["type"] == "event"
               and m["body"].get("kind") == "applied"]
    assert {value for _, value in applied} == {0, 1, 2}  # interleaved: back and forth
    last_step, last_value = applied[-1]
    assert last_value == 1  # the last change the search made: to the best
    after = [m["body"]["knobs"]["step_delay"] for m in seen if m["type"] == "step"
             and m["body"]["step"] >= last_step]
    assert after and set(after) == {1}
    texts = [m["body"]["text"] for m in seen if m["type"] == "event"
             and m["body"].get("kind") in ("tune", "tuned")]
    assert any(t.startswith("tune: step_delay=2 reverted: slower") for t in texts)
    logged = list(flat_records(monitor.info.log_path))  # the run log has the search's
    assert [r["status"] for r in logged if r["type"] == "tune"][-1] == "done"


def test_a_setting_that_makes_the_loss_nan_or_fails_to_apply_is_reverted(run_dir):
    with _training("poison", "broken") as (knobs, monitor, sub):
        seen = _tune_to_the_end(sub, monitor.info, {"knobs": ["poison", "broken"]})
        last = seen[-1]["body"]["step"]
        seen = _steps_after(sub, seen, 5)
    candidates = _candidates([m for m in seen if m["type"] == protocol.TUNE])
    nan = candidates[(("poison", True),)]
    assert nan["state"] == "reverted" and nan["reason"].startswith("loss was nan at step")
    broken = candidates[(("broken", 1),)]
    assert broken["state"] == "reverted"
    assert "applying it failed" in broken["reason"] and "broken=1 cannot" in broken["reason"]
    final = next(m["body"] for m in reversed(seen) if m["type"] == protocol.TUNE)
    assert final["best"] == {"poison": False, "broken": 0}
    assert final["text"].startswith("tuned: no change")
    assert not knobs.poison
    after = [m["body"] for m in seen if m["type"] == "step" and m["body"]["step"] > last]
    assert after and all(math.isfinite(b["loss"]) for b in after)
    # the agent's own guard left the search's changes to the search: no rollback of its own
    assert not [m for m in seen if m["type"] == "event" and m["body"].get("kind") == "rollback"]


def test_a_client_killed_mid_search_leaves_the_best_configuration(run_dir):
    with _training("step_delay") as (knobs, monitor, sub):
        client = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", "tune", "--run", monitor.run_id,
             "--knobs", "step_delay"], stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().startswith("tune: searching step_delay")
        seen = messages(sub, lambda m: m["type"] == "event"
                        and m["body"].get("text", "").startswith("tune: trying"))
        client.send_signal(signal.SIGKILL)  # the search goes on in the training process
        client.wait(10)
        seen = _steps_after(sub, seen + messages(
            sub, lambda m: m["type"] == protocol.TUNE and m["body"]["status"] != "running",
            timeout_s=120))
    final = next(m["body"] for m in reversed(seen) if m["type"] == protocol.TUNE)
    assert final["status"] == "done" and final["best"] == {"step_delay": 1}
    assert seen[-1]["body"]["knobs"]["step_delay"] == 1 and knobs.delay == 1


def test_stop_ends_the_search_in_the_best_configuration_so_far(run_dir):
    hold = Hold()
    with _training("step_delay", callbacks=[hold]) as (_, monitor, sub):
        assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
        refused = send_command(monitor.info, protocol.TUNE, {})
        assert not refused["ok"] and "a search is running already" in refused["reason"]
        messages(sub, lambda m: m["type"] == "event"
                 and m["body"].get("text", "").startswith("tune: trying step_delay=1"))
        hold.now()  # the search cannot end on its own while the command line starts
        cli = subprocess.run([sys.executable, "-m", "gpuwatch", "tune", "--run",
                              monitor.run_id, "--stop"], capture_output=True, text=True,
                             timeout=60)
        hold.release.set()
        assert cli.returncode == 0 and "stopping" in cli.stdout, cli.stderr
        seen = _steps_after(sub, messages(sub, lambda m: m["type"] == protocol.TUNE
                                          and m["body"]["status"] != "running"))
    final = next(m["body"] for m in reversed(seen) if m["type"] == protocol.TUNE)
    assert final["status"] == "stopped" and final["text"].endswith("stopped by request")
    assert seen[-1]["body"]["knobs"]["step_delay"] == final["best"]["step_delay"]


def _tune_records(seen):
    return [m for m in seen if m["type"] == protocol.TUNE]


def _event_texts(seen, kind=None):
    return [m["body"]["text"] for m in seen if m["type"] == "event"
            and (kind is None or m["body"].get("kind") == kind)]


def test_a_persons_command_on_a_searched_knob_takes_it_out_of_the_search(run_dir):
    """Measured: a person's accum_steps=3 during a search over it was undone by the
    search's next switch, and the run ended at the search's value. Now the person's
    value stays from the step it applies at to the end, the trial that moved the knob
    ends without a verdict, the search goes on with the other knob, and `gpuwatch set`
    says so."""
    hold = Hold()
    with _training("step_delay", callbacks=[hold]) as (knobs, monitor, sub):
        assert send_command(monitor.info, protocol.TUNE, {
            "knobs": ["step_delay", "cpu_threads"], "budget_steps": 200})["ok"]
        seen = messages(sub, lambda m: m["type"] == "event"
                        and m["body"].get("text", "").startswith("tune: trying step_delay=1"))
        hold.now()  # the trial of step_delay=1 is on: its switches are to come
        cli = subprocess.run([sys.executable, "-m", "gpuwatch", "set", "--run",
                              monitor.run_id, "step_delay=2"], capture_output=True,
                             text=True, timeout=60)
        hold.release.set()
        assert cli.returncode == 0, cli.stderr
        printed = cli.stdout.splitlines()
        assert printed[0].startswith("accepted: step_delay=2 applies at step ")
        person_step = int(printed[0].split()[-1])
        seen += messages(sub, lambda m: m["type"] == protocol.TUNE
                         and m["body"]["status"] != "running", timeout_s=120)
        seen = _steps_after(sub, seen, 10)
        # a command of the search's sent before it knew (here: staged with its id) is
        # refused: it would undo the person's value
        late = send_command(monitor.info, "step_delay", 0,
                            command_id=monitor.tune.tuner.id_prefix + "999999")
        assert not late["ok"] and late["reason"] == (
            f"step_delay=2 set by a person for step {person_step}: the tune search leaves "
            "step_delay to them")
        seen = _steps_after(sub, seen, 3)
    after = [m["body"]["knobs"]["step_delay"] for m in seen if m["type"] == "step"
             and m["body"]["step"] >= person_step]
    assert len(after) > 20 and set(after) == {2} and knobs.delay == 2
    # the search's own commands after the person's: the other knob only
    tried = [m["body"]["knob"] for m in seen if m["type"] == "event"
             and m["body"].get("kind") == "applied" and m["body"]["step"] > person_step]
    assert tried and set(tried) == {"cpu_threads"}
    assert printed[1:] == ["note: the tune search leaves step_delay to you and goes on "
                           "with cpu_threads"]
    final = _tune_records(seen)[-1]["body"]
    assert final["status"] == "done" and set(final["best"]) == {"cpu_threads"}
    assert final["text"].endswith(
        f"; left to a person: step_delay=2 set by a person for step {person_step}")
    trial = _candidates(_tune_records(seen))[(("step_delay", 1),)]
    assert trial["state"] == "reverted" and trial["reason"] == (
        f"not judged: step_delay=2 set by a person for step {person_step}")
    assert (f"tune: step_delay=2 set by a person for step {person_step}: the tune search "
            "leaves step_delay to you and goes on with cpu_threads") in _event_texts(seen)


def test_a_change_during_a_trials_measurement_voids_it_and_it_is_measured_again(run_dir):
    """Measured: a bf16 switch inside a trial's measurement was not re-measured. Now a
    change the search did not make (here a person's max_grad_norm) drops the trial's
    pairs so far, the event says so, and the verdict comes from pairs after it."""
    hold = Hold()
    with _training("step_delay", callbacks=[hold]) as (knobs, monitor, sub):
        assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
        seen = messages(sub, lambda m: m["type"] == "event"  # the trial's first switch
                        and m["body"].get("kind") == "applied" and m["body"]["value"] == 1)
        hold.now()
        reply = send_command(monitor.info, "max_grad_norm", 10.0)
        hold.release.set()
        assert reply["ok"] and "note" not in reply  # not a knob the search explores
        seen += messages(sub, lambda m: m["type"] == "event" and m["body"].get("text", "")
                         .startswith("tune: step_delay=1 kept"), timeout_s=120)
    verdict = next(m["body"] for m in seen if m["type"] == "event"
                   and m["body"]["text"].startswith("tune: step_delay=1 kept"))
    # measured again: at least MIN_PAIRS_FASTER pairs of sub-blocks of more than
    # SUB_BLOCK_STEPS steps each after the change
    from agent.search.stats import MIN_PAIRS_FASTER
    from agent.search.tuner import SUB_BLOCK_STEPS

    assert verdict["step"] - reply["apply_step"] >= MIN_PAIRS_FASTER * 2 * (SUB_BLOCK_STEPS + 1)
    again = [m["body"] for m in seen if m["type"] == "event" and "measuring it again"
             in m["body"]["text"]]
    assert [body["text"] for body in again] == [
        f"tune: max_grad_norm=10.0 applied at step {reply['apply_step']}, during the "
        "measurement of step_delay=1: measuring it again"]
    # the tune record published right after that event (one of the same step may
    # come before it): the trial's measurement so far is gone
    said = next(i for i, m in enumerate(seen) if m["type"] == "event"
                and "measuring it again" in m["body"]["text"])
    after = next(m["body"] for m in seen[said:] if m["type"] == protocol.TUNE)
    trial = next(c for c in after["candidates"] if c["setting"] == {"step_delay": 1})
    assert trial["state"] == "measuring" and trial["per_s"] is None and trial["gain"] is None


def test_the_measurement_after_a_change_it_did_not_make_has_only_steps_after_it():
    """Arithmetic: x=1 is twice as fast until step 12, then 1.25 times; a change the
    search did not make applies at step 12, in the trial: the verdict is +25% exactly,
    from pairs after it alone (mixed in, the pairs before would make it more)."""
    def person(tuner, step):
        if step == 12:  # a person's precision switch, say: every step slower
            tuner.on_event({"kind": "applied", "id": "a1b2c3", "knob": "precision",
                            "value": "bf16", "previous": "fp32", "step": step,
                            "text": "precision=bf16 applied at step 12"})

    events = []
    tuner = _x_search(lambda x, step: (0.1 if x == 0 else 0.05) if step < 12
                      else (0.2 if x == 0 else 0.16), person, events)
    (candidate,) = tuner.candidates
    assert candidate.state == "kept" and candidate.gain == pytest.approx(0.25)
    assert candidate.block.mean == pytest.approx(0.16 / 32)
    assert ("tune: precision=bf16 applied at step 12, during the measurement of x=1: "
            "measuring it again") in [body.get("text") for body in events]


def test_a_rewind_during_a_trial_drops_its_measurement_and_the_budget_counts_records():
    """Arithmetic: x=1 is twice as fast. In the middle of x=1's sub-block a rewind to
    step 3 (a new branch; the checkpoint's knob values come back: x=0) makes step
    numbers repeat. Before, the search did not see it: it measured x=0 as the candidate
    (a gain under +100%) and, counting its steps by number, spent more records than its
    budget. Now the ``branched`` event drops the trial's pairs so far (an event says
    so), the run goes back to the best configuration (x=0 there already: no command),
    the trial is measured again from there (+100% exactly) and its steps are counted
    as records arrive."""
    value = [0]
    knobs = KnobSet()
    knobs.add(Knob(KnobSpec("x", "int", "", minimum=0, maximum=1, tuning=TUNED),
                   get=lambda: value[0], set=lambda v: None))
    sent, published = [], []
    tuner = Tuner(TuneRequest({"knobs": ["x"], "budget_steps": 200}, knobs), knobs, 1,
                  send=lambda *command: sent.append(command),
                  publish=lambda _, body: published.append(body), cpus=2)
    step = records = 0
    rewound_at = None
    while tuner.status == "running" and records < 1_000:
        step += 1
        for command_id, knob, new in sent:  # each applies at the next step
            previous, value[0] = value[0], new
            tuner.on_event({"kind": "applied", "id": command_id, "knob": knob,
                            "value": new, "previous": previous, "step": step})
        sent.clear()
        trial = tuner._trial
        if (rewound_at is None and step > 20 and trial is not None
                and trial.side == "candidate" and value[0] == 1):
            rewound_at, value[0], step = step, 0, 4  # the next record is step 4 again
            tuner.on_event({"kind": "branched", "level": "info", "branch": 1, "parent": 0,
                            "step": 3, "source": "/ckpt/step-00000003.pt",
                            "cause": "rewind=3", "knobs": {"x": 0},
                            "text": "branch 1 of branch 0 at step 3: /ckpt/step-00000003.pt "
                                    "(rewind=3); x=0"})
        tuner.on_step(step, 0.1 if value[0] == 0 else 0.05, 32, None, 1.0, False)
        records += 1
    assert rewound_at is not None
    (candidate,) = tuner.candidates
    assert candidate.state == "kept" and candidate.gain == pytest.approx(1.0)
    assert tuner.steps == records and tuner.status == "done"
    texts = [body.get("text") for body in published if "kind" in body]
    assert ("tune: branch 1 at step 3 (rewind=3): the steps measured before it are "
            "dropped; measuring x=1 again from x=0") in texts


def test_a_rewind_during_a_real_search_is_told_to_it_and_the_trial_measured_again(run_dir):
    """A real run: a checkpoint before the search, then ``rewind`` to it while the search
    measures step_delay=1. The search hears of the new branch (the checkpoint brings
    step_delay=0 back): its event says the steps before it are dropped, and the trial is
    measured again and kept; its step count is its records, on both branches."""
    with _training("step_delay") as (knobs, monitor, sub):
        assert send_command(monitor.info, "checkpoint", "now")["ok"]
        seen = messages(sub, lambda m: m["type"] == "event" and m["body"]["kind"] == "applied"
                        and m["body"].get("knob") == "checkpoint")
        saved = seen[-1]["body"]["checkpoint_step"]
        assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
        seen += messages(sub, lambda m: m["type"] == "step"
                         and m["body"]["knobs"]["step_delay"] == 1)
        assert send_command(monitor.info, "rewind", str(saved))["ok"]
        seen += messages(sub, lambda m: m["type"] == "event" and m["body"].get(
            "text", "").startswith("tune: step_delay=1 "), timeout_s=120)
    events = [m["body"] for m in seen if m["type"] == "event"]
    [branched] = [e for e in events if e["kind"] == "branched"]
    assert branched["step"] == saved and branched["knobs"]["step_delay"] == 0
    told = [e["text"] for e in events
            if "measured before it" in e.get("text", "")]
    assert told == [f"tune: branch 1 at step {saved} (rewind={saved}): the steps measured "
                    "before it are dropped; measuring step_delay=1 again from step_delay=0"]
    assert events[-1]["text"].startswith("tune: step_delay=1 kept"), events[-1]
    last = [m["body"] for m in seen if m["type"] == protocol.TUNE][-1]
    # the steps of the branch left count too (by number, they would not)
    assert last["steps"] > last["step"] - last["started_step"] + 1, last


def test_nan_from_the_data_during_a_search_blames_no_setting_and_is_warned_of_at_once(
        run_dir):
    """Measured: with the loss NaN from the data, the search reverted a setting it had
    kept "for loss nan (it had been kept)", then others, and ended "nothing was faster";
    the agent's non-finite-loss warning waited for the search's end. Now the search
    goes back to the configuration before the trial, sees the loss stay NaN there, and
    stops: the run itself diverged, what it kept stays; the warning names the first NaN
    step."""
    with _training("step_delay") as (knobs, monitor, sub):
        assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
        seen = messages(sub, lambda m: m["type"] == "event" and m["body"].get("text", "")
                        .startswith("tune: trying step_delay=2"), timeout_s=120)
        assert "tune: step_delay=1 kept" in " ".join(_event_texts(seen))
        knobs.poison = True  # the data goes bad: no knob changes
        seen += messages(sub, lambda m: m["type"] == protocol.TUNE
                         and m["body"]["status"] != "running", timeout_s=120)
        seen = _steps_after(sub, seen, 10)
    final = _tune_records(seen)[-1]["body"]
    assert final["status"] == "stopped" and final["best"] == {"step_delay": 1}
    assert final["text"].startswith("tuned: step_delay=1 (+")
    assert "; the run itself diverged: loss was nan at step " in final["text"]
    assert "back in the configuration before the trial (step_delay=1) the loss was " \
        "still nan at steps " in final["text"]
    candidates = _candidates(_tune_records(seen))
    assert candidates[(("step_delay", 1),)]["state"] == "kept"
    assert candidates[(("step_delay", 2),)]["reason"] == "not judged: the run itself diverged"
    assert not [c for c in candidates.values() if c["reason"].startswith("loss was")]
    first_nan = next(m["body"]["step"] for m in seen if m["type"] == "step"
                     and m["body"]["loss"] is not None and math.isnan(m["body"]["loss"]))
    warnings = [m["body"] for m in seen if m["type"] == "event"
                and m["body"].get("kind") == "warning"
                and m["body"]["text"].startswith("loss was nan")]
    assert [w["step"] for w in warnings] == [first_nan]  # at once, not at the search's end
    assert warnings[0]["text"] == (
        f"loss was nan at step {first_nan}, with no change of a person's to roll back (the "
        "tune search checks whether its trial caused it)")
    tail = [m["body"]["knobs"]["step_delay"] for m in seen if m["type"] == "step"
            and m["body"]["step"] > final["step"] + 3]
    assert tail and set(tail) == {1}  # what it kept stays


def test_a_person_setting_every_searched_knob_ends_the_search():
    value = [0]
    knobs = KnobSet()
    knobs.add(Knob(KnobSpec("x", "int", "", minimum=0, maximum=1, tuning=TUNED),
                   get=lambda: value[0], set=lambda v: None))
    tuner = Tuner(TuneRequest({"knobs": ["x"]}, knobs), knobs, 1,
                  send=lambda *command: None, publish=lambda *_: None, cpus=2)
    assert tuner.person_set("x", 1, 12) == (
        "the tune search leaves x to you and ends (no knob left)")
    assert tuner.status == "stopped" and tuner.best == {}
    assert tuner.text == ("tuned: no change in 0 steps; left to a person: x=1 set by a "
                          "person for step 12; a person set every knob it searched")
    assert tuner.person_set("x", 0, 14) is None  # ended: nothing more to leave


def test_tune_requests_are_checked_and_numerics_need_allowing(run_dir):
    trainer = _trainer()
    monitor = agent.attach(trainer)
    try:
        for value, reason in [
                ({"knobs": ["nope"]}, "tune: this run has no knob 'nope'"),
                ({"knobs": ["precision"]}, "tune: precision changes the training's numerics"),
                ({"budget_steps": 0}, "tune: budget_steps must be an integer from 1"),
                ({"speed": "max"}, "tune: unknown option speed"),
                ("fast", "tune: the value must be a map")]:
            reply = send_command(monitor.info, protocol.TUNE, value)
            assert not reply["ok"] and reply["reason"].startswith(reason), reply
    finally:
        monitor.close()
    request = TuneRequest({"allow": ["precision", "accum_steps"]}, monitor.knobs)
    assert request.knobs == ["cpu_threads", "accum_steps", "precision"]
    assert TuneRequest({}, monitor.knobs).knobs == ["cpu_threads"]


# --- the search's parts, on their own ------------------------------------------------

def test_ladders_are_powers_of_two_within_the_bounds_and_keep_the_current_value():
    def bound(kind, value, **spec):
        return Knob(KnobSpec("num_workers" if kind == "workers" else "x",
                             "int" if kind != "choice" else "choice", "", **spec),
                    get=lambda: value, set=lambda v: None)

    assert ladder(bound("workers", 0, minimum=0, maximum=64), cpus=6) == (
        True, [0, 1, 2, 4, 6])
    assert ladder(bound("workers", 12, minimum=0, maximum=64), cpus=2) == (
        True, [0, 1, 2, 4, 8, 12])
    assert ladder(bound("x", 3, minimum=1, maximum=10), cpus=2) == (True, [1, 2, 3, 4, 8, 10])
    assert ladder(bound("choice", "a", choices=("a", "b")), cpus=2) == (False, ["a", "b"])


def test_coordinate_search_climbs_a_rung_at_a_time_and_makes_a_second_pass():
    search = CoordinateSearch({"threads": (True, [1, 2]), "workers": (True, [0, 1, 2, 4]),
                               "kernels": (False, ["eager", "compile", "triton"])},
                              {"threads": 2, "workers": 0, "kernels": "eager"})
    best = {"threads": 2, "workers": 0, "kernels": "eager"}
    faster = {("threads", 1), ("workers", 1), ("workers", 2), ("kernels", "triton")}
    tried = []
    while (setting := search.next(best)) is not None:  # faster the first time only
        (candidate,) = setting.items()
        tried.append(candidate)
        kept = candidate in faster
        faster.discard(candidate)
        if kept:
            best.update(setting)
        search.result(kept)
    # pass 1: threads down (nothing above 2), workers up while faster, every kernel;
    # pass 2 (pass 1 kept something): each knob again from the new best, configurations
    # measured already left out
    assert tried == [("threads", 1), ("workers", 1), ("workers", 2), ("workers", 4),
                     ("kernels", "compile"), ("kernels", "triton"),
                     ("threads", 2), ("workers", 4), ("workers", 1)]
    assert best == {"threads": 1, "workers": 2, "kernels": "triton"}


def test_a_trade_moves_two_knobs_at_once_where_each_alone_is_slower():
    """On a CPU-bound host a worker more only pays with a compute thread fewer: the search
    tries the trade right after both knobs, and the next pass moves each from there."""
    search = CoordinateSearch({"cpu_threads": (True, [1, 2]), "num_workers": (True, [0, 1, 2]),
                               "pin_memory": (False, [False, True])},
                              {"cpu_threads": 2, "num_workers": 0, "pin_memory": False},
                              trades=(("num_workers", "cpu_threads"),
                                      ("num_workers", "pin_memory")))  # not ordered: none
    best = {"cpu_threads": 2, "num_workers": 0, "pin_memory": False}
    tried = []
    while (setting := search.next(best)) is not None:
        tried.append(setting)
        kept = setting == {"num_workers": 1, "cpu_threads": 1}
        if kept:
            best.update(setting)
        search.result(kept)
    assert tried == [{"cpu_threads": 1}, {"num_workers": 1},
                     {"num_workers": 1, "cpu_threads": 1},  # the trade, once up
                     {"pin_memory": True},
                     # pass 2 from the trade: what is new of each move (threads up is
                     # num_workers=1 alone, workers down cpu_threads=1 alone, the trade
                     # down the start: measured already; no thread below 1)
                     {"num_workers": 2}]
    assert best == {"cpu_threads": 1, "num_workers": 1, "pin_memory": False}


def _x_search(step_time_s, before_step=None, published=None):
    """A search over one knob ``x`` (0 -> 1) fed step records directly, each applied
    command acknowledged at the next step; returns the tuner once it ended.
    ``step_time_s(value, step)`` is a step's time at ``x=value``; ``before_step(tuner,
    step)``, if given, is called before each step record; ``published`` gets the
    bodies the search publishes."""
    value = [0]
    knobs = KnobSet()
    knobs.add(Knob(KnobSpec("x", "int", "", minimum=0, maximum=1, tuning=TUNED),
                   get=lambda: value[0], set=lambda v: None))
    sent = []
    tuner = Tuner(TuneRequest({"knobs": ["x"]}, knobs), knobs, 1,
                  send=lambda *command: sent.append(command),
                  publish=lambda _, body: published is None or published.append(body),
                  cpus=2)
    step = 0
    while tuner.status == "running" and step < 1_000:
        step += 1
        for command_id, knob, new in sent:
            previous, value[0] = value[0], new
            tuner.on_event({"kind": "applied", "id": command_id, "knob": knob,
                            "value": new, "previous": previous, "step": step})
        sent.clear()
        if before_step is not None:
            before_step(tuner, step)
        tuner.on_step(step, step_time_s(value[0], step), 32, None, 1.0, False)
    return tuner


def _search_steps(step_time_s):
    """:func:`_x_search` with ``step_time_s(value)``: ``(steps spent, the candidate's
    reason)``."""
    tuner = _x_search(lambda value, step: step_time_s(value))
    return tuner.steps, tuner.candidates[0].reason


def test_a_candidate_that_cannot_be_shown_faster_is_reverted_without_every_pair():
    flat, flat_reason = _search_steps(lambda x: 0.1)  # x=1 changes nothing
    assert flat_reason == "not worth it: under +5% beyond noise: +0% (+0% to +0%)"
    slower, slower_reason = _search_steps(lambda x: 0.1 * (1 + 0.2 * x))
    assert slower_reason.startswith("slower: -17%")
    faster, faster_reason = _search_steps(lambda x: 0.1 * (1 - 0.2 * x))
    assert faster_reason.startswith("faster: +25%")
    rng = random.Random(1)  # -3% under 20% noise: within the noise, below zero on average
    below, below_reason = _search_steps(
        lambda x: 0.1 * (1 + 0.03 * x) * (1 + 0.2 * rng.gauss(0, 1)))
    assert below_reason.startswith("not faster: slower on average: -1% (-14% to +14%)")
    rng = random.Random(0)  # +2% under 5% noise: twelve pairs would not show it
    futile, futile_reason = _search_steps(
        lambda x: 0.1 * (1 - 0.02 * x) * (1 + 0.05 * rng.gauss(0, 1)))
    assert futile_reason.startswith(
        "not faster beyond noise, nor would 12 pairs show it at this mean: +1% (-3% to +6%)")
    # slower: from MIN_PAIRS_SLOWER pairs; not worth it, and faster: MIN_PAIRS_FASTER;
    # slower on average: MIN_PAIRS_FASTER too, futile from FUTILE_FROM_PAIRS
    assert slower < min(flat, faster) and max(flat, faster) <= below < futile


def test_the_futility_rules_of_a_candidate_between_its_pairs():
    from agent.search.stats import FUTILE_FROM_PAIRS, MAX_PAIRS, could_be_shown_faster
    from agent.search.tuner import _not_faster

    assert _not_faster(2, -0.2, 0.5) is None  # too early for any rule
    assert _not_faster(3, -0.01, 0.5) == "not faster: slower on average"
    assert _not_faster(3, 0.01, 0.04).startswith("not worth it")
    assert _not_faster(FUTILE_FROM_PAIRS - 1, 0.01, 0.3) is None  # wide: measured on
    assert _not_faster(FUTILE_FROM_PAIRS, 0.01, 0.3).startswith("not faster beyond noise, nor")
    assert _not_faster(FUTILE_FROM_PAIRS, 0.3, 0.5) is None  # could still be shown faster
    assert _not_faster(MAX_PAIRS, 0.3, 0.5) == "not faster beyond noise"
    assert could_be_shown_faster(0.0, math.inf, 1)  # no spread yet
    # the interval at MAX_PAIRS from the one at 6 pairs: mean +10%, +25% its upper end
    mean, margin = math.log1p(0.10), math.log1p(0.25) - math.log1p(0.10)
    sd = margin * math.sqrt(6) / t_quantile(0.975, 5)
    assert could_be_shown_faster(0.10, 0.25, 6) == (
        mean > t_quantile(0.975, MAX_PAIRS - 1) * sd / math.sqrt(MAX_PAIRS))


def test_the_next_candidate_is_chosen_once_the_switch_on_its_way_has_applied():
    """``b`` has no effect while ``a`` is 0 (as prefetch_factor without workers): after
    ``a=1`` is reverted, in its sub-block, ``a`` still reads 1 until the way back applies;
    ``b=2`` is judged then, skipped, and never sent (the same wait keeps a kept
    ``num_workers=1`` from making ``prefetch_factor`` look useless before it applies)."""
    values = {"a": 0, "b": 1}
    knobs = KnobSet()
    knobs.add(Knob(KnobSpec("a", "int", "", minimum=0, maximum=1, tuning=TUNED),
                   get=lambda: values["a"], set=lambda v: None))
    knobs.add(Knob(KnobSpec("b", "int", "", minimum=1, maximum=2, tuning=TUNED),
                   get=lambda: values["b"], set=lambda v: None,
                   warn=lambda v: None if values["a"] else "b has no effect while a is 0"))
    sent = []
    tuner = Tuner(TuneRequest({"knobs": ["a", "b"]}, knobs), knobs, 1,
                  send=lambda *command: sent.append(command), publish=lambda *_: None,
                  cpus=2)
    every = []
    step = 0
    while tuner.status == "running" and step < 1_000:
        step += 1
        for command_id, knob, new in sent:  # each applies at the next step
            previous, values[knob] = values[knob], new
            tuner.on_event({"kind": "applied", "id": command_id, "knob": knob,
                            "value": new, "previous": previous, "step": step})
        every += sent
        sent.clear()
        tuner.on_step(step, 0.1, 32, None, 1.0, False)  # not worth it after 3 pairs,
    states = {c.text: (c.state, c.reason)  # in a=1's sub-block: a switch back
              for c in tuner.candidates}
    assert states["a=1"][0] == "reverted"
    assert states["b=2"] == ("skipped", "b has no effect while a is 0")
    assert not [command for command in every if command[1] == "b"]
    assert tuner.status == "done" and values == {"a": 0, "b": 1}


def _trade_search(step_time_s, fails=()):
    """A search over ``cpu_threads`` (from 2) and ``num_workers`` (from 0) on 2 CPUs, fed
    step records directly; each command applies at the next step, except those in
    ``fails`` (``(knob, value)``), which fail there. Returns the tuner and every command
    sent, ``(knob, value)``. ``step_time_s(threads, workers)`` is a step's time."""
    from agent.wire.knobs import CPU_THREADS, NUM_WORKERS

    values = {"cpu_threads": 2, "num_workers": 0}
    knobs = KnobSet()
    for spec in (CPU_THREADS, NUM_WORKERS):
        knobs.add(Knob(spec, get=lambda name=spec.name: values[name], set=lambda v: None))
    sent, every = [], []
    tuner = Tuner(TuneRequest({"knobs": ["cpu_threads", "num_workers"]}, knobs), knobs, 1,
                  send=lambda *command: sent.append(command), publish=lambda *_: None,
                  cpus=2)
    step = 0
    while tuner.status == "running" and step < 2_000:
        step += 1
        for command_id, knob, new in sent:
            every.append((knob, new))
            if (knob, new) in fails:
                tuner.on_event({"kind": "failed", "id": command_id, "knob": knob,
                                "value": new, "step": step, "text": f"{knob}={new} failed"})
                continue
            previous, values[knob] = values[knob], new
            tuner.on_event({"kind": "applied", "id": command_id, "knob": knob,
                            "value": new, "previous": previous, "step": step})
        sent.clear()
        tuner.on_step(step, step_time_s(values["cpu_threads"], values["num_workers"]), 32,
                      None, 1.0, False)
    assert tuner.status == "done"
    return tuner, values, every


def test_the_search_finds_a_trade_of_a_thread_for_a_worker_when_each_alone_is_slower():
    # a worker of its own core: faster only with a compute thread fewer
    times = {(2, 0): 0.10, (1, 0): 0.12, (2, 1): 0.12, (1, 1): 0.07, (1, 2): 0.09,
             (2, 2): 0.15}
    tuner, values, every = _trade_search(lambda threads, workers: times[threads, workers])
    states = {c.text: (c.state, c.reason.split(":")[0]) for c in tuner.candidates}
    assert states == {"cpu_threads=1": ("reverted", "slower"),
                      "num_workers=1": ("reverted", "slower"),
                      "num_workers=1, cpu_threads=1": ("kept", "faster"),
                      "num_workers=2": ("reverted", "slower")}
    assert values == tuner.best == {"cpu_threads": 1, "num_workers": 1}
    assert tuner.text.startswith("tuned: cpu_threads=1, num_workers=1 (+43% samples/s")
    # the trade goes out as its two commands, and back as two
    trade = next(i for i in range(len(every)) if every[i:i + 2] == [
        ("num_workers", 1), ("cpu_threads", 1)])
    assert every[trade:trade + 4] == [("num_workers", 1), ("cpu_threads", 1),
                                      ("num_workers", 0), ("cpu_threads", 2)]


def test_a_trade_whose_second_part_fails_to_apply_goes_back_whole():
    times = {(2, 0): 0.10, (1, 0): 0.12, (2, 1): 0.12, (1, 1): 0.07}
    tuner, values, every = _trade_search(lambda threads, workers: times[threads, workers],
                                         fails={("cpu_threads", 1)})
    trade = next(c for c in tuner.candidates if len(c.setting) == 2)
    assert trade.state == "reverted"
    assert trade.reason == "applying it failed: cpu_threads=1 failed"
    assert values == tuner.best == {"cpu_threads": 2, "num_workers": 0}
    assert every[-1] == ("num_workers", 0)  # the part that applied went back


def test_student_t_quantiles_and_the_paired_interval_that_load_drift_does_not_fool():
    for df, exact in [(2, 4.303), (5, 2.571), (10, 2.228), (30, 2.042)]:
        assert t_quantile(0.975, df) == pytest.approx(exact, rel=0.01)
    rng = random.Random(1)

    def block(seconds_per_unit):
        return Block(6, seconds_per_unit, (0.05 * seconds_per_unit) ** 2, 6, 6 * seconds_per_unit)

    pairs = []
    for load in (1.0, 3.0, 1.5, 0.8, 2.5):  # the host's load swings 4x between pairs
        pairs.append((block(0.010 * load * (1 + 0.02 * rng.gauss(0, 1))),
                      block(0.008 * load * (1 + 0.02 * rng.gauss(0, 1)))))
    gain, low, high = paired_gain(pairs)
    assert 0 < low < gain < high and gain == pytest.approx(0.25, abs=0.05)
    assert paired_gain(pairs[:1])[1:] == (-math.inf, math.inf)  # one pair: no interval
    same = [(block(0.01 * load), block(0.01 * load * (1 + 0.2 * rng.gauss(0, 1))))
            for load in (1.0, 3.0, 1.5, 0.8)]
    _, low, high = paired_gain(same)
    assert low < 0 < high  # no difference: the interval holds zero
    assert [_side(i) for i in range(8)] == ["best", "candidate", "candidate", "best",
                                            "best", "candidate", "candidate", "best"]
    rate, half = Block(20, 0.008, 0.0008 ** 2, 20, 0.16).rate()
    assert rate == pytest.approx(125) and half == pytest.approx(
        125 * t_quantile(0.975, 19) * 0.1 / math.sqrt(20))


def test_the_warm_up_is_cut_off_and_steady_noise_is_not():
    jitter = random.Random(2)
    series = Series()
    for seconds in [5.0, 0.9, 0.5, 0.3] + [0.1] * 20:
        series.add(seconds * (1 + 0.05 * jitter.random()), 2)
    block = series.block()
    assert block.n == 20 and block.units == 40  # the transient's 4 steps cut
    assert block.rate()[0] == pytest.approx(2 / 0.1025, rel=0.03)
    steady = Series()
    for _ in range(24):
        steady.add(0.1 * (1 + 0.2 * jitter.gauss(0, 1)), 1)
    assert steady.block().n >= 18  # noise is not warm-up: at most a few steps cut


def test_knob_specs_say_what_the_search_may_do():
    from agent.wire.knobs import STANDARD_KNOBS

    tuned = {name for name, spec in STANDARD_KNOBS.items() if spec.tuning == TUNED}
    allowed = {name for name, spec in STANDARD_KNOBS.items()
               if spec.tuning == TUNED_IF_ALLOWED}
    assert tuned == {"num_workers", "pin_memory", "prefetch_factor", "cpu_threads"}
    assert allowed == {"precision", "accum_steps", "micro_batch_size", "kernels",
                       "checkpointing"}
    with pytest.raises(KnobError, match="memory_fraction is not a speed setting"):
        knobs = KnobSet()
        knobs.add(Knob(STANDARD_KNOBS["memory_fraction"], get=lambda: 1.0,
                       set=lambda v: None))
        TuneRequest({"knobs": ["memory_fraction"]}, knobs)


# --- the knobs the search trades -----------------------------------------------------

def test_cpu_threads_applies_at_a_boundary_in_the_training_thread(run_dir):
    seen_threads = []
    trainer = _trainer(callbacks=[type("Threads", (), {
        "on_optimizer_step": lambda self, t, s: seen_threads.append(torch.get_num_threads())})()])
    previous = torch.get_num_threads()
    monitor = agent.attach(trainer)
    # a thread that has run torch code keeps its own count (OpenMP's is per thread), as
    # the agent's I/O thread does: the knob must say the training thread's there too
    # (the search reads it there to go back to the best)
    ran_torch, read = threading.Event(), threading.Event()
    elsewhere = []

    def other_thread():
        elsewhere.append(torch.get_num_threads())
        ran_torch.set()
        read.wait(30)
        elsewhere.append(monitor.knobs.knobs["cpu_threads"].get())

    reader = threading.Thread(target=other_thread)
    reader.start()
    try:
        assert ran_torch.wait(30)
        schema = {k["name"]: k for k in monitor.knobs.schema()}
        assert schema["cpu_threads"]["min"] == 1
        assert schema["cpu_threads"]["max"] == len(os.sched_getaffinity(0))
        other = 2 if previous == 1 else 1  # a change (the tests run on one thread)
        reply = send_command(monitor.info, "cpu_threads", other)
        assert reply["ok"] and reply["apply_step"] == 2
        trainer.fit(max_steps=4)
        assert seen_threads[1:] == [other] * 3
        assert monitor.knobs.values()["cpu_threads"] == other
        read.set()
        reader.join(30)
        # (the other thread's own count is whatever OpenMP gave it: another test of
        # this process may have changed the default; the knob must not follow it)
        assert elsewhere[1] == other
    finally:
        read.set()
        torch.set_num_threads(previous)


class Digits(torch.utils.data.Dataset):
    """The first ``n`` digits as a map-style dataset."""

    def __init__(self, n=384):
        x, y = zip(*digits_loader(batch_size=1, n=n))
        self.x, self.y = torch.cat(x), torch.cat(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def test_micro_batch_size_keeps_the_effective_batch_and_every_sample(run_dir):
    """16 x 2 switched to 8 x 4 live: every optimizer step still averages the gradient
    of the same 32 samples, in the same order, as a run that had 8 x 4 from the start;
    a size that cannot keep 32 exactly is refused with the reason."""
    runs_params = []
    for live in (True, False):
        torch.manual_seed(0)
        loader = ReconfigurableLoader(Digits(), 16 if live else 8, shuffle=True, seed=3)
        model = make_model()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.nn.functional.cross_entropy, loader,
                          accum_steps=2 if live else 4)
        if live:
            monitor = agent.attach(trainer)
            for size, reason in [(12, ("the effective batch of 32 samples (16 x "
                                       "accum_steps 2) is not a multiple of 12")),
                                 (64, "more than the effective batch of 32 samples")]:
                refused = send_command(monitor.info, "micro_batch_size", size)
                assert not refused["ok"] and reason in refused["reason"], refused
            assert send_command(monitor.info, "micro_batch_size", 8, apply_step=4)["ok"]
        trainer.fit(max_steps=12)  # one epoch of 384 samples
        assert trainer.accum_steps == 4 and loader.batch_size == 8
        assert loader.position == (0, len(loader), len(loader))  # one epoch, every sample
        assert len(loader) == (6 + 288 // 8 if live else 384 // 8)
        runs_params.append([p.detach().clone() for p in model.parameters()])
    for live, fresh in zip(*runs_params):
        assert torch.allclose(live, fresh, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_end_in_the_same_configuration_at_the_same_step(run_dir):
    """Real torchrun, gloo: rank 0 decides, every change reaches both ranks at one
    step; every step record of both ranks has the same knobs."""
    from tests.jobs import torchrun
    from tests.test_ranks import EXAMPLES, wait_for_ranks

    job = torchrun(str(EXAMPLES / "ddp_attach.py"), "--max-steps", "100000")
    try:
        rank0, rank1 = wait_for_ranks(job, 2)
        cli = subprocess.run([sys.executable, "-m", "gpuwatch", "tune", "--run",
                              rank1.run_id, "--knobs", "cpu_threads,num_workers",
                              "--budget-steps", "150"], capture_output=True, text=True,
                             timeout=600)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.splitlines()[-1].startswith("tuned: ")
        def stepped_on():  # the run logs (every record, unlike a subscriber on a busy
            logs = [_log_records(info) for info in (rank0, rank1)]  # host), as flushed
            # the last change's step: applied, or accepted for a later step (the fan-out
            # schedules a second ahead, which may be past the search's end)
            last = max((event["step"] for log in logs for event in log
                        if event["type"] == "event"
                        and event.get("kind") in ("applied", "accepted")), default=0)
            tuned = any(r.get("kind") == "tuned" for r in logs[0] if r["type"] == "event")
            # the search's end flushed, both ranks 100 steps past its last change
            return tuned and min(max(_step_knobs(log), default=0) for log in logs) >= last + 100

        wait_until(stepped_on, "the ranks to step on", timeout_s=180, poll_s=0.2, alive=[job])
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(60)
    logs = [_log_records(info) for info in (rank0, rank1)]  # as the ranks left them
    applied = [[(e["knob"], e["value"], e["step"]) for e in _applied(log)] for log in logs]
    assert applied[0] and applied[0] == applied[1]  # the same changes at the same steps
    knobs = [_step_knobs(log) for log in logs]
    common = sorted(set(knobs[0]) & set(knobs[1]))
    assert len(common) > 100
    assert all(knobs[0][step] == knobs[1][step] for step in common)


def _log_records(info):
    """The records of a rank's run log so far (a frame being written is left out)."""
    return list(flat_records(info.log_path))


def _applied(records):
    return [r for r in records if r["type"] == "event" and r.get("kind") == "applied"]


def _step_knobs(records):
    return {r["step"]: r["knobs"] for r in records if r["type"] == "step"}


# --- the dashboard ---------------------------------------------------------------------

@pytest.mark.slow
async def test_T_starts_the_search_its_screen_shows_the_candidates_and_T_stops_it(run_dir):
    from gpuwatch.app import GpuwatchApp
    from gpuwatch.sources.live import LiveSource
    from gpuwatch.screens.tune import TuneScreen
    from tests.conftest import log_texts, until

    with _training("step_delay") as (_, monitor, _):
        app = GpuwatchApp(LiveSource(monitor.info))
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.source.state.hello and app.source.state.steps)
            await pilot.press("T", "T")  # asked, then sent
            await until(pilot, lambda: isinstance(app.screen, TuneScreen))

            def shown():
                return str(app.screen.query_one("#tune-table").content)

            # a rung of cpu_threads' ladder other than the training thread's count (1
            # in the tests: OMP_NUM_THREADS) on 2 CPUs
            other = 2 if torch.get_num_threads() == 1 else 1
            await until(pilot, lambda: f"cpu_threads={other}" in shown(), timeout_s=60)
            assert shown().startswith("running at step ")
            assert "searching cpu_threads, step_delay" in shown()
            await pilot.press("T", "T")  # again: stop, keeping the best so far
            await until(pilot, lambda: "tuned: " in shown(), timeout_s=60)
            assert shown().startswith("stopped at step ")
            assert any(text.startswith("tune: stopping") for text in log_texts(app))
            assert any(text.startswith("tuned: ") and text.endswith("stopped by request")
                       for text in log_texts(app))
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, TuneScreen))


def test_the_data_verdict_says_whether_idle_cpu_exists_for_more_workers():
    from gpuwatch.state import RunState
    from gpuwatch.widgets.data import input_advice

    state = RunState()
    state.ingest(protocol.envelope("hello", {"env": {"cpu": {"count": 8, "usable_count": 4}}},
                                   run="r"))
    state.ingest(protocol.envelope("step", {"step": 1, "input_verdict": "input-bound",
                                            "knobs": {"num_workers": 1}}, run="r"))
    assert input_advice(state, 80) is None  # no system sample yet
    state.ingest(protocol.envelope("system", {"cpu_pct": 40.0}, run="r"))
    assert input_advice(state, 80).plain == "2.4 cores idle: T tries num_workers=2"
    assert input_advice(state, 16).plain == "2.4 cores idle"
    state.ingest(protocol.envelope("system", {"cpu_pct": 95.0}, run="r"))
    advice = input_advice(state, 80)
    assert advice.plain == "no idle CPU (95%): a worker competes with compute; T measures it"
    assert input_advice(state, 18).plain == "no idle CPU (95%)"
    state.ingest(protocol.envelope("step", {"step": 2, "input_verdict": "input-bound",
                                            "knobs": {"num_workers": 0, "cpu_threads": 2}},
                                   run="r"))  # a compute thread to trade for a worker
    assert input_advice(state, 80).plain == (
        "no idle CPU (95%): T tries a worker more for a compute thread fewer")
    state.ingest(protocol.envelope("step", {"step": 3, "input_verdict": "compute-bound"},
                                   run="r"))
    assert input_advice(state, 80) is None


def test_cpu_threads_warns_while_the_model_is_compiled_so_the_search_skips_it():
    """torch.compile guards on the thread count: a change recompiles (a stall of tens of
    seconds that the search would measure as the candidate's)."""
    from agent.integrations.adapters import cpu_threads_knob
    from agent.wire.knobs import KERNELS

    mode = {"kernels": "eager"}
    knobs = KnobSet()
    knobs.add(Knob(KERNELS, get=lambda: mode["kernels"],
                   set=lambda value: mode.update(kernels=value)))
    knobs.add(cpu_threads_knob(knobs))
    warn = knobs.knobs["cpu_threads"].warn
    other = 1 if torch.get_num_threads() != 1 else 2
    assert warn(other) is None
    mode["kernels"] = "compile"
    assert "torch.compile guards on the thread count" in warn(other)
    assert warn(torch.get_num_threads()) is None  # no change: nothing recompiles


@pytest.mark.skipif(torch.cuda.is_available(), reason="pin_memory has an effect with CUDA")
def test_pin_memory_warns_either_way_without_cuda_so_the_search_skips_it(run_dir):
    """Without CUDA neither value of pin_memory does anything: a newcomer's search tried
    pin_memory=off on a CPU run for 30 steps and read noise as a -36% verdict. Both
    values warn, so the search skips it with the reason (:meth:`Tuner._skip_reason`)."""
    model = make_model()
    run = agent.session(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        name="pin-skip")
    loader = run.loader(ReconfigurableLoader(torch.utils.data.TensorDataset(
        torch.randn(64, 8), torch.zeros(64)), batch_size=8, pin_memory=True))
    try:
        knob = run.agent.knobs.knobs["pin_memory"]
        reason = "pin_memory has no effect without CUDA (no host-to-device copies)"
        assert knob.warning(True) == knob.warning(False) == reason
    finally:
        del loader
        run.close()


def test_a_noisy_candidates_figures_keep_their_columns():
    """A trial measured on a loaded host (a newcomer's "+1301% ± 5081%") keeps its
    steps in their column: a half-width of 100% or more reads ``±>100%`` alone, a gain
    past 999% ``+>999%``; every line is as wide."""
    from gpuwatch.screens.tune import candidate_line, row_width

    lines = [candidate_line({"setting": {"cpu_threads": 1}, "per_s": 446.0,
                             "per_s_spread": 27.0, "gain": gain, "gain_spread": spread,
                             "steps": 32, "state": "kept", "reason": "x"},
                            "samples").plain.split("\n")[0]
             for gain, spread in ((13.01, 50.81), (-0.36, 1.2), (12.5, 0.4), (-1.0, 0.99))]
    assert {len(line) for line in lines} == {row_width("samples")}
    assert [line.split("samples/s")[1].split() for line in lines] == [
        ["±>100%", "32"], ["±>100%", "32"], ["+>999%", "32"],
        ["-100%", "±", "99%", "32"]]


def test_a_candidates_verdict_has_a_line_of_its_own_so_it_is_never_cut():
    from gpuwatch.screens.tune import candidate_line

    reason = "not faster beyond noise: +12% (-19% to +55%) (632 ± 97 samples/s over 25 steps)"
    line = candidate_line({"setting": {"num_workers": 2}, "per_s": 632.0,
                           "per_s_spread": 97.0, "gain": 0.12, "gain_spread": 0.37,
                           "steps": 25, "state": "reverted", "reason": reason}, "samples")
    first, second = line.plain.split("\n")
    assert first.split() == ["num_workers=2", "632", "±", "97", "samples/s", "+12%", "±",
                             "37%", "25"]
    assert second == f"    reverted: {reason}"


def test_a_trades_setting_has_a_line_of_its_own_and_every_row_fits_80_columns():
    from gpuwatch.state import RunState
    from gpuwatch.screens.tune import tune_text

    state = RunState()
    state.tune = {"status": "running", "step": 40, "steps": 36, "budget_steps": 600,
                  "unit": "samples", "knobs": ["cpu_threads", "num_workers"],
                  "best": {"cpu_threads": 2, "num_workers": 0}, "gain": 0.0,
                  "candidates": [{"setting": {"cpu_threads": 1}, "state": "reverted",
                                  "reason": "slower", "per_s": 985.0, "per_s_spread": 75.0,
                                  "gain": -0.16, "gain_spread": 0.26, "steps": 30},
                                 {"setting": {"num_workers": 1, "cpu_threads": 1},
                                  "state": "measuring", "per_s": 1894.0,
                                  "per_s_spread": 229.0, "gain": 0.84, "gain_spread": 0.34,
                                  "steps": 32}]}
    lines = tune_text(state).plain.splitlines()
    header = next(line for line in lines if line.startswith("candidate"))
    single = next(line for line in lines if line.startswith("cpu_threads=1 "))
    trade = lines.index("num_workers=1, cpu_threads=1")
    numbers = lines[trade + 1]
    # the numbers line up under the header, in the 66 columns the screen has at 80
    assert len(header) == len(single) == len(numbers) <= 66
    assert numbers.split() == ["1,894", "±", "229", "samples/s", "+84%", "±", "34%", "32"]
    # narrower (60 columns: the header and every row broke in two): no half-widths
    lines = tune_text(state, 50).plain.splitlines()
    header = next(line for line in lines if line.startswith("candidate"))
    single = next(line for line in lines if line.startswith("cpu_threads=1 "))
    numbers = lines[lines.index("num_workers=1, cpu_threads=1") + 1]
    assert len(header) == len(single) == len(numbers) <= 48
    assert header.split() == ["candidate", "samples/s", "gain", "steps"]
    assert numbers.split() == ["1,894", "samples/s", "+84%", "32"]


def test_a_checkpoint_taken_during_a_trial_keeps_the_persons_setting(run_dir):
    """``checkpoint=now`` while the search tries ``step_delay=1``: the checkpoint holds
    the value the trial is measured against (the person's 0), and its event says so; a
    resume from it would otherwise train on in the trial's setting, unannounced."""
    hold = Hold()
    with _training("step_delay", callbacks=[hold]) as (knobs, monitor, sub):
        assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
        messages(sub, lambda m: m["type"] == "step" and m["body"]["knobs"]["step_delay"])
        hold.now()  # in the trial's setting, before it can be judged
        assert knobs.delay != 0
        assert send_command(monitor.info, "checkpoint", "now")["ok"]
        hold.release.set()
        [saved] = [m["body"] for m in messages(
            sub, lambda m: m["type"] == "event" and m["body"].get("kind") == "applied"
            and m["body"].get("knob") == "checkpoint")[-1:]]
    assert saved["knobs"]["step_delay"] == 0, saved
    assert "the search was trying step_delay=" in saved["text"], saved["text"]
    assert "the checkpoint keeps step_delay=0" in saved["text"], saved["text"]
    assert load_checkpoint(saved["path"])["knobs"]["step_delay"] == 0


def test_a_search_cut_short_by_the_runs_end_puts_its_candidate_back():
    """The run ends in the middle of a trial: the candidate is not judged, the knob goes
    back to its best value at once (no boundary comes any more), and the search ends
    ``stopped`` saying why, in an event and in its state."""
    values = {"x": 0}
    knobs = KnobSet()
    knobs.add(Knob(KnobSpec("x", "int", "", minimum=0, maximum=1, tuning=TUNED),
                   get=lambda: values["x"], set=lambda v: values.update(x=v)))
    sent, published = [], []
    tuner = Tuner(TuneRequest({"knobs": ["x"]}, knobs), knobs, 1,
                  send=lambda *command: sent.append(command),
                  publish=lambda *message: published.append(message), cpus=2)
    step = 0
    while not sent:  # the baseline is measured, then the trial of x=1 starts
        step += 1
        tuner.on_step(step, 0.1, 32, None, 1.0, False)
    [(command_id, knob, new)] = sent
    values[knob] = new
    tuner.on_event({"kind": "applied", "id": command_id, "knob": knob, "value": new,
                    "previous": 0, "step": step + 1})
    tuner.on_step(step + 1, 0.1, 32, None, 1.0, False)
    assert tuner.status == "running" and values == {"x": 1}
    tuner.run_ended()
    assert values == {"x": 0} and tuner.status == "stopped"
    assert tuner.text.endswith("; the run ended before the search did; put back x=0")
    events = [body["text"] for kind, body in published if kind == "event"]
    assert events[-2:] == ["tune: x=1 reverted: not judged: the run ended", tuner.text]
    assert published[-1][0] == protocol.TUNE and published[-1][1]["status"] == "stopped"
    tuner.run_ended()  # once
    assert published[-1][1]["status"] == "stopped" and events == [
        body["text"] for kind, body in published if kind == "event"]


def test_a_run_that_ends_during_a_search_ends_it_before_its_bye(run_dir):
    trainer = _trainer()
    FakeKnobs(trainer).bind(monitor := agent.attach(trainer), "step_delay")
    with Subscriber(monitor.info) as sub:
        thread = start(trainer, max_steps=100_000)
        try:
            messages(sub, lambda m: m["type"] == "step")
            assert send_command(monitor.info, protocol.TUNE, {"knobs": ["step_delay"]})["ok"]
            messages(sub, lambda m: m["type"] == protocol.TUNE)
        finally:
            trainer.stop()
            thread.join(30)
        seen = messages(sub, lambda m: m["type"] == "bye")
    final = _tune_records(seen)[-1]["body"]
    assert final["status"] == "stopped"
    assert "the run ended before the search did" in final["text"]
    assert _event_texts(seen, "tuned") == [final["text"]]


def test_a_setting_to_the_value_it_has_does_not_void_a_trials_measurement():
    """Arithmetic: a script sets precision=fp32, what it is, every 10 steps while the
    search runs (the desk sets nothing: "(no change)"). Nothing changed under the trial,
    so it is not measured again: x=1, twice as fast, is kept as without the script
    (each such event voided the trial's pairs: it was never judged, at any budget)."""
    def script(tuner, step):
        if step % 10 == 0:
            tuner.on_event({"kind": "applied", "id": f"s{step}", "knob": "precision",
                            "value": "fp32", "previous": "fp32", "step": step,
                            "text": f"precision=fp32 applied at step {step} (no change)"})

    events = []
    tuner = _x_search(lambda x, step: 0.1 if x == 0 else 0.05, script, events)
    (candidate,) = tuner.candidates
    assert candidate.state == "kept" and candidate.gain == pytest.approx(1.0)
    assert not [body for body in events if "measuring it again" in body.get("text", "")]
