"""One contract, tested once, against every integration (``tests/contract/``).

A run (the twin) trains 9 optimizer steps with every live change its framework offers
applied at steps 3 and 4 (``accum_steps``, ``lr_scale``, ``max_grad_norm``, then
``precision=bf16``, ``micro_batch_size`` and ``dropout=0.5``) and ``checkpoint=now``
after step 5. A fresh run resumes from that checkpoint (other initial weights: the
checkpoint's must win) and trains to step 9. It must continue the twin exactly: the
same samples in every window, bit-equal per-step losses, bit-equal final parameters
(fp32 on the CPU; bf16 steps equal to the twin's bf16 steps); the resume event lists
every knob value restored; a knob its framework refuses is refused with the reason.
The same run told ``rewind=5`` after step 7 goes on exactly as that resume (a new
branch); a rollback of the state is a branch too.
"""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.wire.knobs import assignment
from gpuwatch.history import flat_records, log_at, log_summary
from agent.control.recovery import Recovery
from tests.contract import Driver, Recorder, all_drivers, run, run_diverging, run_poisoned

STEPS = 9
CHECKPOINT_AFTER = 5


def _params(driver: Driver) -> object:
    return pytest.param(driver, id=driver.name,
                        marks=[pytest.mark.slow] if driver.slow else [])


DRIVERS = [_params(driver) for driver in all_drivers()]


def _commands(driver: Driver) -> list[tuple[str, object, int]]:
    """The driver's changes: the first three at step 3, the rest at step 4, then the
    checkpoint (saved at the boundary after step 5)."""
    commands = [(knob, value, 3 if index < 3 else 4)
                for index, (knob, value) in enumerate(driver.changes)]
    return commands + [("checkpoint", "now", CHECKPOINT_AFTER + 1)]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_resume_after_live_changes_continues_the_run_exactly(driver, run_dir, tmp_path):
    twin = run(driver, steps=STEPS, commands=_commands(driver), checkpoint_dir=tmp_path)
    for knob, reply in twin.recorder.replies.items():
        assert reply["ok"], (knob, reply)
    applied = {(e["knob"], e["step"]) for e in twin.events("applied")}
    for knob, _, step in _commands(driver):
        assert (knob, step) in applied, (knob, step, twin.events("failed"))
    saved = [e for e in twin.events("applied") if e["knob"] == "checkpoint"]
    assert saved[0]["checkpoint_step"] == CHECKPOINT_AFTER
    path = saved[0]["path"]
    for entry in [Path(path), *Path(path).rglob("*")]:  # owner-only, like the run logs
        assert stat.S_IMODE(entry.lstat().st_mode) == (
            0o700 if entry.is_dir() else 0o600), entry

    resumed = run(driver, steps=STEPS, commands=[], checkpoint_dir=tmp_path / "again",
                  resume_from=path)
    events = resumed.events("resumed")  # (a loop's loader knobs: once run.loader() binds)
    assert {event["step"] for event in events} == {CHECKPOINT_AFTER}, events
    text = "; ".join(event["text"] for event in events)
    want, got = twin.steps(), resumed.steps()
    for knob, _ in driver.changes:  # its value as saved (micro_batch_size moves accum_steps)
        assert assignment(knob, want[CHECKPOINT_AFTER]["knobs"][knob]) in text, text
    assert "not as in the saved run" not in text
    # the resumed run's log names the run it continues (`gpuwatch runs --all` says so)
    origin = twin.records[0]["run"]
    assert [event.get("from_run") for event in events][:1] == [origin]
    summary = log_summary(log_at(resumed.log_path))[0]
    assert (summary.resumed_from, summary.resumed_at) == (origin, CHECKPOINT_AFTER)

    assert sorted(got) == list(range(CHECKPOINT_AFTER + 1, STEPS + 1))
    for step in range(CHECKPOINT_AFTER + 1, STEPS + 1):
        assert resumed.recorder.window(step) == twin.recorder.window(step), step
        assert got[step]["loss"] == want[step]["loss"], step
        assert got[step]["knobs"] == want[step]["knobs"], step
    for mine, theirs in zip(resumed.params, twin.params):
        assert torch.equal(mine, theirs)


#: ``rewind=5`` applies at the boundary after step 7 (sent at step 6: the checkpoint of
#: step 5 exists by then, and the command's check looks for it)
REWIND_AT = 8


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_rewind_goes_on_exactly_as_a_resume_from_the_checkpoint(driver, run_dir, tmp_path):
    """The twin's live changes and ``checkpoint=now`` after step 5, then training on to
    step 7 and ``rewind=5`` (the step: the run's checkpoint directory and names): the
    run goes on from the checkpoint as branch 1 of branch 0 at step 5, its knob values
    back (named in the ``branched`` event, which comes before any step of the new
    branch in the run log), and its steps 6 to 9 equal those of a fresh run resumed
    from that checkpoint: the same samples, bit-equal fp32 losses, the same knob
    values, bit-equal final parameters."""
    recorder = Recorder(later=[(6, "rewind", str(CHECKPOINT_AFTER), REWIND_AT)])
    live = run(driver, steps=STEPS, commands=_commands(driver), checkpoint_dir=tmp_path,
               recorder=recorder)
    reply = recorder.replies["rewind"]
    assert reply["ok"], reply
    [saved] = [e["path"] for e in live.events("applied") if e["knob"] == "checkpoint"]
    [branched] = live.events("branched")
    assert (branched["branch"], branched["parent"], branched["step"]) == (
        1, 0, CHECKPOINT_AFTER), branched
    assert branched["source"] == saved and branched["cause"] == "rewind=5", branched
    at = live.records.index(branched)
    before = [r["step"] for r in live.records[:at] if r["type"] == "step"]
    after = [r for r in live.records[at:] if r["type"] == "step"]
    assert before == list(range(1, REWIND_AT)), before
    assert [r["step"] for r in after] == list(range(CHECKPOINT_AFTER + 1, STEPS + 1))
    [rewound] = [e for e in live.events("applied") if e["knob"] == "rewind"]
    assert rewound["step"] == REWIND_AT and rewound["branch"] == 1, rewound

    if not driver.rollback:  # the loop holds a batch it fetched ahead: the event says so
        assert branched["level"] == "warning" and "fetched ahead" in branched["text"]
        return
    assert branched["level"] == "info", branched
    resumed = run(driver, steps=STEPS, commands=[], checkpoint_dir=tmp_path / "again",
                  resume_from=saved)
    want = resumed.steps()
    for knob, _ in driver.changes:  # the checkpoint's values came back, and are named
        assert assignment(knob, want[CHECKPOINT_AFTER + 1]["knobs"][knob]) in (
            branched["text"]), branched["text"]
    for record in after:
        step = record["step"]
        assert live.recorder.window(step) == resumed.recorder.window(step), step
        assert record["loss"] == want[step]["loss"], step
        assert record["knobs"] == want[step]["knobs"], step
    for mine, theirs in zip(live.params, resumed.params, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].rollback])
def test_a_rollback_puts_the_state_back_where_the_change_applied(driver, run_dir,
                                                                  tmp_path):
    """``precision=bf16`` with ``accum_steps=3`` at step 7 makes the loss NaN (a fault
    injected in the task's loss under bf16), which breaks the weights; the guard rolls
    both changes back, and the training state (model, optimizer, schedule, random
    numbers, data position, accumulation windows) goes back to the boundary after step
    6: steps 7 to 14 then equal a twin's that never made the changes (the same samples,
    losses, knob values and final parameters, bit for bit)."""
    twin = run(driver, steps=14, commands=[], checkpoint_dir=tmp_path)
    diverging = run_diverging(driver, tmp_path, also=(("accum_steps", 3),))
    [restored] = diverging.events("state_restored")
    assert "boundary after step 6" in restored["text"], restored
    [branched] = diverging.events("branched")  # a rollback of the state is a branch
    assert (branched["branch"], branched["parent"], branched["step"],
            branched["source"]) == (1, 0, 6, "rollback"), branched
    assert branched["cause"].startswith("rolled back: loss was nan at step 7"), branched
    assert diverging.records.index(branched) < diverging.records.index(restored)
    want, got = twin.steps(), diverging.steps()
    for step in range(7, 15):
        assert got[step]["loss"] == want[step]["loss"], step
        assert diverging.recorder.window(step) == twin.recorder.window(step), step
        assert got[step]["knobs"] == want[step]["knobs"], step  # fp32, accum_steps 2
    for mine, theirs in zip(diverging.params, twin.params):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].refused])
def test_a_knob_the_framework_cannot_apply_is_refused_with_the_reason(driver, run_dir,
                                                                        tmp_path):
    refused = {knob: value for knob, value in (("micro_batch_size", 4),
                                               ("accum_steps", 3), ("precision", "bf16"),
                                               ("max_grad_norm", 0.3), ("lr_scale", 0.5))
               if knob in driver.refused}
    result = run(driver, steps=3, commands=[(knob, value, 3)
                                            for knob, value in refused.items()],
                 checkpoint_dir=tmp_path)
    for knob, word in driver.refused.items():
        reply = result.recorder.replies[knob]
        assert not reply["ok"] and word in reply["reason"], reply
    assert not result.events("applied")


@pytest.mark.slow
@pytest.mark.parametrize("driver", DRIVERS)
def test_sigterm_ends_the_run_with_bye(driver, run_dir, tmp_path):
    """SIGTERM (torchrun's and schedulers' stop) in the middle of training: the run log
    ends with ``bye`` naming it, and the process dies of the signal as it would have."""
    process = subprocess.Popen([sys.executable, "-m", "tests.contract", driver.name,
                                str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("step "), process.stderr.read()
        log_path = line.split(maxsplit=2)[2].strip()
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == -signal.SIGTERM, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    last = list(flat_records(log_path))[-1]
    assert last["type"] == "bye" and last["reason"] == "stopped by SIGTERM", last


#: The recovery check: 48 steps of windows of 2, micro-batches 41-46 (steps 21-23)
#: poisoned; states kept every 4 steps, 3 of them.
RECOVERY_STEPS = 48
POISONED = range(41, 47)


@pytest.fixture(scope="module")
def clean_stream(tmp_path_factory):
    """``clean_stream(driver)``: the driver's run of :data:`RECOVERY_STEPS` steps with no
    batch poisoned and no recovery (:func:`run_poisoned`), made once a module and read by
    every test that needs the uninterrupted run (the recovery's twin, the data stream the
    skip checks compare with): one run of 48 steps per driver instead of three (a test
    only reads it)."""
    made: dict[str, object] = {}

    def stream(driver: Driver):
        if driver.name not in made:
            made[driver.name] = run_poisoned(
                driver, tmp_path_factory.mktemp(f"clean-{driver.name}"),
                steps=RECOVERY_STEPS, poisoned=None)
        return made[driver.name]

    return stream


def _final_loss(result) -> float:
    """The mean loss of steps 41-48 (an epoch of the task's data)."""
    steps = result.steps()  # (a step trained again on a new branch: its latest record)
    return sum(steps[step]["loss"] for step in range(41, 49)) / 8


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].rollback])
def test_a_loss_spike_is_recovered_from_past_the_poisoned_batches(driver, run_dir,
                                                                   tmp_path, clean_stream):
    """Three windows of poisoned labels (steps 21-23) wreck the weights and AdamW's
    moments: without recovery the loss of the last epoch stays far above an unpoisoned
    twin's. With ``recover=on`` the spike watch fires at step 23 (the training waits
    there for it), and at the boundary after step 24 the state goes back to the one
    kept after step 20 (a new branch), the data goes on past the 8 micro-batches
    trained since (never trained again), the lr is halved for 4 steps,
    all said in one ``branched`` event; the run reaches step 48 (HF too: it trains
    past its 6 planned epochs of data, 4 windows of them skipped) and the last epoch's
    loss is then within 6% of the twin's (3.5-4.8%: it trained other windows, 4 of them
    at half the lr; HF ended at step 44, 8.6% above, before it trained on: at its
    steps 37-44 it was 2.0% above the twin's)."""
    twin = clean_stream(driver)
    spiked = run_poisoned(driver, tmp_path / "spiked", steps=RECOVERY_STEPS,
                          poisoned=POISONED)
    recovered = run_poisoned(driver, tmp_path / "recovered", steps=RECOVERY_STEPS,
                             poisoned=POISONED, hold_at=23, policy=Recovery(
                                 keep_every_steps=4, keep_states=3, lr_scale=0.5,
                                 lr_steps=4))
    assert spiked.steps()[22]["loss"] > 1000 * twin.steps()[22]["loss"]
    want, unrecovered, got = (_final_loss(r) for r in (twin, spiked, recovered))
    if not driver.clips_gradients:  # (clipping keeps the damage within 2%)
        assert unrecovered > 1.15 * want, (unrecovered, want)
    assert abs(got - want) < 0.06 * want, (got, want, unrecovered)
    assert max(recovered.steps()) == RECOVERY_STEPS
    if driver.name == "hf":
        [plan] = recovered.events("plan")
        assert plan["text"].startswith("4 windows of data skipped by a loss-spike recovery: "
                                       "the run trains beyond its 6 planned epoch(s)"), plan

    [branched] = recovered.events("branched")
    assert (branched["branch"], branched["parent"], branched["step"],
            branched["source"]) == (1, 0, 20, "recovery"), branched
    for said in ("loss spike", "steps 21-23", "restored the state kept after step 20",
                 "skipped the 8 micro-batches (4 windows)", "lr_scale 1 -> 0.5 for 4 steps"):
        assert said in branched["text"], (said, branched["text"])
    [back] = [e for e in recovered.events("applied") if e["knob"] == "lr_scale"]
    assert back["step"] == 25 and back["value"] == 1, back
    steps = recovered.steps()
    assert [steps[step]["knobs"]["lr_scale"] for step in (21, 24, 25)] == [0.5, 0.5, 1]
    # the data never goes back: the recovered run trains the spiked run's stream, its
    # 8 micro-batches after step 20 (the poisoned ones among them) once
    trained = recovered.recorder.trained
    assert trained[:len(spiked.recorder.trained)] == spiked.recorder.trained


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].rollback])
def test_a_recovery_to_a_state_kept_in_the_previous_epoch_goes_on_with_this_epoch(
        driver, run_dir, tmp_path):
    """States kept every 3 steps; micro-batches 33-38 (steps 17-19, epoch 2 of 8-step
    epochs) poisoned: the recovery after step 20 puts back the state kept after step 15,
    in epoch 1. The data goes on where it is, 8 micro-batches into epoch 2: the recovered
    run trains the rest of epoch 2 (micro-batches 40-47), then epoch 3, as the spiked run
    did; epoch 2 trains each sample once. (A run that took the kept epoch and batch
    counts along ended epoch 2 two micro-batches after the recovery: Lightning's did.)"""
    spiked = run_poisoned(driver, tmp_path / "spiked", steps=24, poisoned=range(33, 39))
    recovered = run_poisoned(driver, tmp_path / "recovered", steps=24,
                             poisoned=range(33, 39), hold_at=19,
                             policy=Recovery(keep_every_steps=3, keep_states=3))
    [branched] = recovered.events("branched")
    assert (branched["step"], branched["source"]) == (15, "recovery"), branched
    assert "skipped the 10 micro-batches (5 windows)" in branched["text"], branched["text"]
    trained, before = recovered.recorder.trained, spiked.recorder.trained
    assert len(before) == 48 and trained[:48] == before, (len(trained), len(before))
    epoch_2 = sorted(sample for micro_batch in trained[32:48] for sample in micro_batch)
    assert epoch_2 == sorted(sample for micro_batch in trained[:16]
                             for sample in micro_batch), "epoch 2 is not the data once"


@pytest.mark.parametrize("driver", [d for d in DRIVERS
                                    if d.values[0].name.startswith("lightning")])
def test_a_recovery_counts_lightnings_windows_from_where_the_data_is(driver, run_dir,
                                                                     tmp_path):
    """``accum_steps=3`` from step 10: epoch 1's windows counted from its batch 2,
    epoch 2's from its batch 0 (16 batches an epoch); states kept every 6 steps;
    micro-batches 33-41 (epoch 2's first 9) poisoned. The recovery after step 18 (epoch
    2's batch 12) puts back the state kept after step 12, in epoch 1: its windows go on
    from where the data is, 12-14 then 15 (the epoch's end), then epoch 3's from its
    batch 0. (Counted from the kept state's batch 2, a window of batches 12-13 alone
    was stepped, its loss divided by 3.)"""
    recovered = run_poisoned(driver, tmp_path, steps=24, poisoned=range(33, 42),
                             hold_at=17, commands=[("accum_steps", 3, 10)],
                             policy=Recovery(keep_every_steps=6, keep_states=3))
    [branched] = recovered.events("branched")
    assert branched["step"] == 12 and "steps 15-17" in branched["text"], branched["text"]
    sizes = [len(recovered.recorder.windows[step]) for step in range(13, 25)]
    assert sizes == [3, 1] + [3, 3, 3, 3, 3, 1] + [3, 3, 3, 3], sizes


def _epochs(trained: list[tuple[int, ...]]) -> list[set[int]]:
    """The samples of each run of 16 micro-batches (an epoch of the task's data)."""
    return [set().union(*trained[at:at + 16]) for at in range(0, len(trained), 16)]


@pytest.mark.parametrize("skip", [3, 6])
@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].rollback])
def test_a_recovery_skips_skip_windows_counted_from_the_kept_state(driver, skip, run_dir,
                                                                    tmp_path, clean_stream):
    """``skip_windows`` counts from the kept state (step 20, micro-batch 40; 4 windows,
    micro-batches 41-48, trained since when the recovery applies after step 24).

    3: the kept state's data, its first 3 windows (41-46, the poisoned ones) dropped:
    the new branch trains 47-48 again (the clean window of step 24), then whole
    epochs. 6: the data as it is now, 2 more windows (49-52) drawn from the loader and
    dropped: the new branch trains the twin's 53-64 (the epoch made at once from the
    same random numbers), then whole epochs. HF skips within the kept epoch only (it
    makes an epoch's order when it starts it: 6 ends past epoch 3's end), Lightning
    not at all (its epoch loop counts every batch): refused with the reason, not
    recovered."""
    stream = clean_stream(driver)  # (its first 64 micro-batches are compared)
    result = run_poisoned(driver, tmp_path / "skip", steps=34, poisoned=POISONED,
                          hold_at=23, policy=Recovery(keep_every_steps=4, keep_states=3,
                                                      skip_windows=skip))
    trained, twin = result.recorder.trained, stream.recorder.trained
    assert trained[:48] == twin[:48]  # branch 0, to step 24
    refused = driver.skips not in ("any", "epoch") or (driver.skips == "epoch" and skip == 6)
    if refused:
        assert not result.events("branched")
        [warning] = [e for e in result.events("warning") if "not recovered" in e["text"]]
        words = ("only the 0 micro-batches left in epoch 2" if driver.skips == "epoch"
                 else driver.skips)
        for said in (f"skip_windows={skip} needs {2 * skip - 8 if skip > 4 else 6} "
                     "micro-batches drawn and dropped", words):
            assert said in warning["text"], (said, warning["text"])
        return
    [branched] = result.events("branched")
    assert (branched["step"], branched["source"]) == (20, "recovery"), branched
    said = ("skipped 6 micro-batches (3 windows) from it; the 2 after them (1 window) "
            "are trained again" if skip == 3 else "skipped 12 micro-batches (6 windows) "
            "from it: the 8 trained since (4 windows) and 4 more drawn and dropped "
            "(2 windows of 2)")
    assert said in branched["text"], branched["text"]
    after = trained[48:]  # the new branch, from step 21
    if skip == 3:
        assert after[:2] == twin[46:48]
        rest = after[2:]
    else:
        assert after[:12] == twin[52:64]
        rest = after[12:]
    assert len(rest) >= 16 and _epochs(rest)[0] == set(range(128)), rest
    assert sorted(result.steps()) == list(range(1, 35))


@pytest.mark.parametrize("driver", [d for d in DRIVERS if d.values[0].name == "loop"])
def test_a_single_noisy_step_is_not_a_spike(driver, run_dir, tmp_path):
    """One poisoned window (step 21: its loss thousands of times the median) is noise to
    the spike watch (3 steps in a row make a spike): nothing is recovered."""
    noisy = run_poisoned(driver, tmp_path, steps=30, poisoned=range(41, 43),
                         policy=Recovery(keep_every_steps=4))
    assert noisy.steps()[21]["loss"] > 1000 * noisy.steps()[20]["loss"]
    assert not noisy.events("branched") and not noisy.events("warning")
    assert sorted(noisy.steps()) == list(range(1, 31))
