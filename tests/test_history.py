"""Runs after the fact: run logs written by the real agent.wire.runlog.RunLog (and by the real
demo job), found and read back by gpuwatch.history, listed by ``gpuwatch runs --all``
and replayed on a timeline in the real app."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from agent.wire import protocol, runlog
from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.runlog import RunLog
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.timeline import CHECKPOINT_STEPS, Timeline, TimelineSource
from gpuwatch.state import RunState
from gpuwatch.screens.runs import COLUMNS
from tests.conftest import screen_text, text_of, until, wait_until
from tests.test_end_to_end import Terminal
from tests.test_replay import KNOBS, RUN, LegacyLog, Writer


def gpuwatch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], capture_output=True,
                          text=True, timeout=timeout)


def write_run(path, *, steps=30, changes=(), bye=True, t0=None, events=(),
              name="replayed", system=None, **options):
    """A run log of ``steps`` steps at 0.1 s each, of a run called ``name`` on a 4-CPU
    host; ``changes`` are (step, knob, value) taking effect at that step (with the agent's
    applied event just before it); ``events`` are (step, text) warnings logged after that
    step; ``system(step)``, where given, the system sample (a dict, or None for none)
    logged after each step."""
    writer = Writer(path, t0=time.time() - 3600 if t0 is None else t0, **options)
    writer.write("hello", {"name": name, "device": "cpu", "world_size": 1,
                           "model": {"name": "TinyNet", "params": 1234},
                           "env": {"torch": {"version": "2.13.0+cpu", "num_threads": 2},
                                   "cuda": {"available": False, "devices": []},
                                   "cpu": {"count": 4}},
                           "knobs": [STANDARD_KNOBS[name].to_wire() for name in KNOBS]})
    knobs = {**KNOBS, "precision": "fp32"}
    for step in range(1, steps + 1):
        for at, knob, value in changes:
            if at == step:
                knobs[knob] = value
                writer.write("event", {"level": "info", "kind": "applied", "knob": knob,
                                       "value": value, "step": step,
                                       "text": f"{knob}={value} applied at step {step}"},
                             dt_s=step * 0.1)
        fast = knobs["precision"] == "bf16"
        measured = {"activation_bytes": (11 if fast else 17) << 20} if step % 20 == 1 else {}
        writer.step(step, knobs=dict(knobs), step_time_s=0.05 if fast else 0.1,
                    samples_per_s=640.0 if fast else 320.0, data_wait_s=0.01,
                    host_rss_bytes=(400 if knobs["accum_steps"] > 2 else 500) << 20,
                    **measured)
        writer.write("heartbeat", {"step": step, "ending": False}, dt_s=step * 0.1)
        sample = system(step) if system is not None else None
        if sample is not None:
            writer.write("system", sample, dt_s=step * 0.1)
        for at, text in events:
            if at == step:
                writer.write("event", {"level": "warning", "kind": "warning",
                                       "text": text}, dt_s=step * 0.1)
    if bye:
        writer.write("bye", {"reason": "finished", "steps": steps}, dt_s=steps * 0.1)
    writer.log.close()
    return path


# --- reading --------------------------------------------------------------------------

def _records(log):
    """Every record of a log as the live wire gives them: a step an envelope."""
    return [row for _, envelope in history.LogReader(log) for row in protocol.expand(envelope)]


def _steps(log):
    """The logged step numbers, from the column batches every tool reads."""
    return [step for batch in history.step_batches(log)
            for step in batch.numbers["step"].tolist()]


def test_a_log_of_the_earlier_format_reads_in_order_once_and_folds_without_gaps(run_dir):
    """JSON lines, rotated: read oldest first, each batch's lines back as that batch."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs)
    path = os.path.join(logs, f"{RUN}.rank0.jsonl")
    write_run(path, steps=120, legacy=True, max_bytes=8000, backups=50)
    [log] = history.find_logs(logs)
    assert log.kind == "jsonl" and len(log.paths) > 3
    assert log.paths[-1].name == f"{RUN}.rank0.jsonl" == log.first.name
    assert log.paths[0].name.endswith(f".jsonl.{len(log.paths) - 1}")  # oldest first
    reader = history.LogReader(log)
    records = [envelope for _, envelope in reader]
    assert {r["type"] for r in records} == {"hello", "steps", "heartbeat", "bye"}
    assert all(r["body"]["n"] == 1 for r in records if r["type"] == "steps")  # as written
    assert [r["body"]["step"] for r in _records(log) if r["type"] == "step"] == list(
        range(1, 121))
    assert sum(r["type"] == "hello" for r in records) == 1  # the rotations' copies skipped
    state = RunState()
    for record in records:
        state.ingest(record)
    assert state.missed == 0 and state.malformed == 0 and reader.malformed == 0
    assert state.steps_total == 120

    # the oldest files deleted (as rotation did with few backups): the copy of hello
    # heading the oldest file left is read, without counting the deleted records missed
    for old in log.paths[:2]:
        old.unlink()
    [log] = history.find_logs(logs)
    records = [envelope for _, envelope in history.LogReader(log)]
    assert records[0]["type"] == "hello" and records[0]["seq"] is None
    state = RunState()
    for record in records:
        state.ingest(record)
    assert state.missed == 0 and state.hello["name"] == "replayed"


def test_a_batch_of_the_earlier_format_reads_back_as_the_batch_it_was(tmp_path):
    """The agent of earlier versions wrote a ``steps`` batch as a line a row, every
    column in every row: read back, the batch is the one sent (constant columns in its
    common fields, where the agent's own ``common`` had them)."""
    body = protocol.steps_body({"step": [1, 2, 3], "loss": [0.5, 0.25, None],
                                "activation_bytes": [None, 7, None]},
                               {"host_rss_bytes": 9, "knobs": {"precision": "fp32"}})
    log = LegacyLog(tmp_path / "r.rank0.jsonl")
    log.write(protocol.envelope("steps", body, run="r", seq=4, t=1.5))
    [(_, envelope)] = history.LogReader(history.log_at(log.path))
    assert envelope["type"] == "steps" and envelope["seq"] == 4 and envelope["t"] == 1.5
    assert protocol.step_bodies(envelope["body"]) == protocol.step_bodies(body)


def test_the_reader_tolerates_truncation_garbage_unknown_types_and_old_records(tmp_path):
    path = tmp_path / f"{RUN}.rank0.jsonl"
    write_run(path, steps=5, bye=False, legacy=True)
    with open(path, "ab") as raw:
        raw.write(b"not json\n[1]\n\n{\"type\": 7}\n" + b'{"type":"x","pad":"'
                  + b"a" * (history.MAX_LINE_BYTES + 10) + b'"}\n')
        # another protocol version's records: a version field, unknown types and
        # fields, missing ones, a NaN as hand-made logs hold, an int beyond 64 bits
        raw.write(b'{"v":0,"type":"step","run":"r","step":6,"step_time_s":0.1}\n'
                  b'{"v":9,"type":"steps_batch","columns":{"step":[7,8]}}\n'
                  b'{"type":"step","step":7,"loss":NaN,"samples":' + b"9" * 30
                  + b',"extra":{"a":[1,2]}}\n')
        raw.write(b'{"type":"step","step":8,"loss":0.5')  # killed mid-line
    log = history.log_at(path)
    run = history.read_history(log)
    assert _steps(log) == [1, 2, 3, 4, 5, 6, 7]
    [last] = [b for b in history.step_batches(log)][-1:]
    assert math.isnan(last.numbers["loss"][-1]) and last.numbers["samples"][-1] > 1e28
    assert run.malformed == 4 and run.truncated and run.bye is None
    summary = history.summarize(run)
    assert summary.steps == 7 and summary.last_step == 7 and summary.ended is None
    assert summary.final_loss == pytest.approx(2.0 / 5)  # the last finite loss


def test_a_run_log_killed_mid_frame_or_damaged_reads_every_whole_frame(tmp_path):
    """A torn last frame (SIGKILL while writing) is skipped and said; a damaged stretch
    in the middle costs the rest of its chunk, and reading goes on at the next one (a
    restarted agent appends a new chunk)."""
    path = tmp_path / f"{RUN}.rank0.runlog"
    write_run(path, steps=10, bye=False)
    whole = path.stat().st_size
    with open(path, "ab") as raw:  # the frame a killed writer left half written
        raw.write(runlog.frame(runlog.FLAG_CHUNK, b"\x00" * 100, 400, 0)[:60])
    run = history.read_history(history.log_at(path))
    assert run.summary.steps == 10 and run.truncated and run.malformed == 0
    with open(path, "r+b") as raw:  # and now a damaged byte in the middle too
        raw.seek(whole // 2)
        byte = raw.read(1)
        raw.seek(whole // 2)
        raw.write(bytes([byte[0] ^ 0xFF]))
    writer = Writer(path, t0=time.time())  # restarted: appends a new chunk
    writer.step(11)
    writer.write("bye", {"reason": "finished", "steps": 11})
    writer.log.close()
    log = history.log_at(path)
    steps = _steps(log)
    run = history.read_history(log)
    assert steps[-1] == 11 and 1 <= len(steps) < 11 and steps == sorted(steps)
    assert run.malformed >= 1 and run.bye == {"reason": "finished", "steps": 11}


def test_links_are_never_followed(tmp_path):
    real = write_run(tmp_path / "elsewhere.runlog", steps=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / f"{RUN}.rank0.runlog").symlink_to(real)
    (logs / "20250101-000000-cafe.rank0.runlog").mkdir()
    assert history.find_logs(logs) == []
    assert history.log_at(logs / f"{RUN}.rank0.runlog") is None
    # a file swapped for a link after it was found is not opened either
    swapped = write_run(logs / "20250101-000000-f00d.rank0.runlog", steps=3)
    [log] = history.find_logs(logs)
    swapped.unlink()
    swapped.symlink_to(real)
    reader = history.LogReader(log)
    assert list(reader) == [] and "20250101-000000-f00d" in reader.unreadable[0]


def test_history_summary_knob_changes_and_segments(tmp_path):
    path = write_run(tmp_path / f"{RUN}.rank0.runlog", steps=60,
                     changes=[(21, "precision", "bf16"), (41, "accum_steps", 4)])
    run = history.read_history(history.log_at(path))
    assert [(c.step, c.knob, c.before, c.value) for c in run.knob_changes] == [
        (21, "precision", "fp32", "bf16"), (41, "accum_steps", 2, 4)]
    summary = history.summarize(run)
    assert (summary.steps, summary.ended, summary.name) == (60, "finished", "replayed")
    # figures the log was written with (write_run: 640 samples/s in bf16), not measured
    assert summary.best_samples_per_s == 640.0 and summary.duration_s > 5


def test_segments_between_changes(tmp_path):
    knobs = {**KNOBS, "precision": "fp32"}
    path = tmp_path / f"{RUN}.rank0.runlog"
    writer = Writer(path, t0=time.time() - 60)
    writer.hello()
    for step in range(1, 41):
        after = step > 20
        writer.step(step, knobs={**knobs, "precision": "bf16" if after else "fp32"},
                    step_time_s=0.05 if after else 0.1, data_wait_s=0.01,
                    samples_per_s=640.0 if after else 320.0, loss=3.0 - step * 0.01,
                    host_rss_bytes=(300 if after else 500) << 20)
    writer.log.close()
    run = history.read_history(history.log_at(path))
    before, after = run.segments()
    assert (before.first_step, before.last_step, before.steps) == (1, 20, 20)
    assert (after.first_step, after.changed, after.knobs["precision"]) == (
        21, ("precision",), "bf16")
    assert before.step_time_s == 0.1 and after.step_time_s == 0.05
    assert after.samples_per_s == 640.0 and after.data_wait_share == pytest.approx(0.2)
    assert before.memory_bytes == 500 << 20 and after.memory_bytes == 300 << 20
    assert after.loss_slope_per_1k == pytest.approx(-10.0)
    assert after.loss_first > after.loss_last
    assert after.label == "steps 21-40 (precision=bf16)"


# --- runs --all -------------------------------------------------------------------------

def _on_a_terminal(*args, columns):
    """``gpuwatch *args``' output on a real terminal (a pty) ``columns`` wide."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "gpuwatch", *args], stdout=follower,
                               stderr=subprocess.PIPE, env=os.environ.copy())
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # (EIO: the process closed the terminal)
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert process.wait(30) == 0, process.stderr.read()
    return out.decode().replace("\r\n", "\n").splitlines()


def test_runs_all_fits_a_narrow_terminal_and_says_what_it_left_out(run_dir):
    """On an 80-column terminal every line fits: the least needed columns are left out
    (said under the table) and a long state wraps at its words under itself; 200 columns
    and a pipe get every column."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=30)
    path = write_run(os.path.join(logs, "20250102-000000-5709.rank0.runlog"), steps=9,
                     run="20250102-000000-5709", bye=False)
    Writer(path, run="20250102-000000-5709").write(
        "bye", {"reason": "stopped by stop=checkpoint after step 9,982", "steps": 9})
    narrow = _on_a_terminal("runs", "--all", columns=80)
    assert max(map(len, narrow)) <= 80, narrow
    shown = narrow[0].replace("FINAL LOSS", "FINAL_LOSS").split()
    assert shown[:2] == ["RUN", "NAME"] and shown[-1] == "STATE"
    note = re.fullmatch(r"\(not shown at 80 columns: (.*): --json\)", narrow[-1])
    left_out = note.group(1).split(", ")
    assert left_out[:2] == ["LOG", "CHANGES"]  # (the first to go)
    assert sorted(shown + left_out) == sorted(["RUN", "NAME", "STARTED", "DURATION", "STEPS",
                                               "FINAL_LOSS", "BEST/S", "CHANGES", "LOG",
                                               "STATE"])
    state_column = narrow[0].index("STATE")
    stopped = next(i for i, line in enumerate(narrow) if "5709" in line)
    state = [narrow[stopped][state_column:]] + [
        line[state_column:] for line in narrow[stopped + 1:stopped + 4]
        if line[:state_column].strip() == ""]
    assert " ".join(state) == "stopped by stop=checkpoint after step 9,982"
    wide = _on_a_terminal("runs", "--all", columns=200)
    assert wide[0].split()[2:4] == ["STARTED", "DURATION"] and "not shown" not in wide[-1]
    assert gpuwatch("runs", "--all").stdout.splitlines()[0].split()[-3:] == [
        "CHANGES", "LOG", "STATE"]  # (a pipe: every column)


def test_runs_all_lists_finished_killed_and_live_runs(run_dir, fake_agent):
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=30,
              changes=[(11, "accum_steps", 4)])
    write_run(os.path.join(logs, "20250102-000000-dead.rank0.jsonl"), steps=7, bye=False,
              legacy=True, run="20250102-000000-dead")  # an earlier version's log, of a killed run
    result = gpuwatch("runs", "--all")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["RUN", "NAME", "STARTED", "DURATION", "STEPS", "FINAL",
                              "LOSS", "BEST/S", "CHANGES", "LOG", "STATE"]
    by_run = {row.split()[0]: row for row in rows}
    assert set(by_run) == {RUN, "20250102-000000-dead", fake_agent.info.run_id}
    finished = by_run[RUN].split()
    assert finished[1] == "replayed" and finished[5:7] == ["30", "0.0667"]
    assert finished[-1] == "finished" and finished[-4] == "1"  # one knob change
    assert by_run["20250102-000000-dead"].endswith("no bye (killed?)")
    assert by_run[fake_agent.info.run_id].endswith("live")
    [listed] = [run for run in json.loads(gpuwatch("runs", "--all", "--json").stdout)
                if run["run_id"] == RUN]
    assert listed["steps"] == 30 and listed["best_samples_per_s"] == 320.0
    assert listed["knob_changes"] == 1 and listed["ended"] == "finished"
    assert listed["log_bytes"] == os.path.getsize(os.path.join(logs, f"{RUN}.rank0.runlog"))
    newest = gpuwatch("runs", "--all", "--last", "1").stdout.splitlines()  # (the live one)
    assert [row.split()[0] for row in newest[1:-1]] == [fake_agent.info.run_id]
    assert newest[-1] == "(2 older runs not shown: --last)"
    assert len(json.loads(gpuwatch("runs", "--all", "--last", "2", "--json").stdout)) == 2
    refused = gpuwatch("runs", "--last", "2")
    assert refused.returncode == 2 and "--last N goes with --all" in refused.stderr


RESUMED = "20250103-000000-c0de"


def _resumed_logs(run_dir, runs=((RESUMED, RUN),)):
    """RUN's log (20 steps), and for each ``(run, origin)`` a log of steps 21-25 of a
    run resumed at step 20 from a checkpoint of ``origin``; the logs' directory."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=20)
    for run, origin in runs:
        writer = Writer(os.path.join(logs, f"{run}.rank0.runlog"), run=run)
        writer.hello()
        writer.write("event", {"level": "info", "kind": "resumed", "step": 20,
                               "from_run": origin, "text": "resumed from ... at step 20"})
        for step in range(21, 26):
            writer.step(step, tokens_per_s=4620.0)
        writer.write("bye", {"reason": "finished", "steps": 5})
        writer.log.close()
    return logs


def test_runs_all_names_the_run_a_resumed_run_continues(run_dir):
    _resumed_logs(run_dir, ((RESUMED, RUN), ("20250104-000000-0bad", "x\x1b[2Jy")))
    for _ in range(2):  # folded from the log, then read from the summary saved beside it
        lines = gpuwatch("runs", "--all").stdout.splitlines()
        row = next(index for index, line in enumerate(lines) if line.startswith(RESUMED))
        assert lines[row + 1] == f"  resumed from {RUN} at step 20"
        assert "  4,620 tok  " in lines[row]  # (a token model's best: tokens/s)
        assert "  resumed from x\u241b[2Jy at step 20" in lines  # (no escape reaches the terminal)
        [listed] = [run for run in json.loads(gpuwatch("runs", "--all", "--json").stdout)
                    if run["run_id"] == RESUMED]
        assert (listed["resumed_from"], listed["resumed_at"]) == (RUN, 20)
    assert sum("resumed from" in line for line in lines) == 2  # the origin: nothing


async def test_the_runs_screen_names_the_run_a_resumed_run_continues(run_dir):
    logs = _resumed_logs(run_dir)
    app = GpuwatchApp(TimelineSource(history.log_at(os.path.join(
        logs, f"{RESUMED}.rank0.runlog"))), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "step" in text_of(app, "#timeline"))
        await pilot.press("r")
        table = app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 2)
        assert table.get_row_at(0)[0] == RESUMED  # (newest first: under the cursor)
        assert table.get_row_at(0)[6] == "4,620 tok"  # (as runs --all: it lost its unit)
        await until(pilot, lambda: str(app.screen.query_one("#runs-branches").content)
                    == f"resumed from {RUN} at step 20")
        await pilot.press("down")
        await until(pilot, lambda: str(app.screen.query_one("#runs-branches").content) == "")


@pytest.mark.slow
def test_a_finished_demo_run_is_listed_and_opens_by_id(run_dir):
    """The real demo job, run to its end; then listed and opened by its id's prefix."""
    demo = subprocess.run([sys.executable, "-m", "gpuwatch", "demo", "--no-ui", "--model",
                           "cnn", "--max-steps", "25"], capture_output=True, text=True,
                          timeout=240)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    [run] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert (run["steps"], run["last_step"], run["ended"]) == (25, 25, "finished")
    assert run["name"] == "demo-cnn" and not run["live"] and run["final_loss"] > 0
    assert gpuwatch("runs").stdout.startswith("no live runs")
    # `gpuwatch RUN` with no live run of that id opens its log on a timeline
    terminal = Terminal(run["run_id"][:17])
    try:
        shows(terminal, b"step 25 of 25")
        terminal.type(b"\x1b[H")  # home: the first step
        shows(terminal, b"step 1 of 25")
        terminal.type(b"q")
        assert terminal.process.wait(30) == 0
    finally:
        terminal.close()


def shows(terminal, text, timeout_s=60):
    """Wait until the terminal has drawn ``text`` (bytes, within one styled span)."""
    wait_until(lambda: text in terminal.output, f"the terminal to show {text!r}",
               timeout_s=timeout_s, alive=[terminal.process],
               detail=lambda: repr(bytes(terminal.output)[-2000:]))


# --- the timeline -----------------------------------------------------------------------

@pytest.mark.parametrize("legacy", [False, True])
def test_timeline_state_at_each_step_is_the_state_folded_to_it(tmp_path, legacy):
    path = write_run(tmp_path / f"{RUN}.rank0.log", steps=CHECKPOINT_STEPS * 2 + 50,
                     changes=[(300, "accum_steps", 4)], events=[(260, "slow loader")],
                     legacy=legacy)
    log = history.log_at(path)
    timeline = Timeline(log, RunState())
    assert len(timeline.steps) == CHECKPOINT_STEPS * 2 + 50
    records = _records(log)
    for index in (0, 1, CHECKPOINT_STEPS - 1, CHECKPOINT_STEPS, 299, 300, 449):
        state, _ = timeline.state_at(index)
        expected = RunState()
        seen = -1
        for record in records:  # every record before the step record after `index`
            if record["type"] == "step":
                seen += 1
                if seen > index:
                    break
            expected.ingest(record, record["t"])
        assert state.step == expected.step == index + 1
        assert state.knobs == expected.knobs and list(state.steps) == list(expected.steps)
        assert [e.text for e in state.events] == [e.text for e in expected.events]
        assert state.knob_changes == expected.knob_changes
    assert timeline.state_at(449)[0].ended is not None  # the end: bye folded
    assert [(m.kind, timeline.steps[m.index]) for m in timeline.marks] == [
        ("event", 260), ("event", 299), ("change", 300)]  # applied is logged before 300


def test_timeline_of_batches_cuts_a_batch_at_the_step_shown(tmp_path):
    """Steps logged in batches (as the agent sends them): the state at a step inside
    a batch has that batch's rows up to it and nothing after; the kept copies of the
    state stay few however long the run (every second one dropped as it grows)."""
    path = tmp_path / f"{RUN}.rank0.runlog"
    log = RunLog(path)
    for seq, first in enumerate(range(1, 5001, 500)):  # 10 batches of 500 steps
        steps = list(range(first, first + 500))
        log.write(protocol.envelope("steps", protocol.steps_body(
            {"step": steps, "step_time_s": [0.01] * 500, "loss": [1 / s for s in steps]},
            {"knobs": {"precision": "fp32"}}), run=RUN, seq=seq, t=1000.0 + seq))
    log.close()
    timeline = Timeline(history.log_at(path), RunState())
    assert len(timeline.steps) == 5000 and timeline.steps[4999] == 5000
    assert timeline.steps.index_of(2500) == 2499
    for index in (0, 499, 500, 1234, 4998):
        state, t = timeline.state_at(index)
        assert state.step == index + 1 and state.steps_total == index + 1
        assert state.steps[-1].loss == 1 / (index + 1) and t == 1000.0 + index // 500


def test_timeline_keeps_few_copies_of_the_state(tmp_path, monkeypatch):
    monkeypatch.setattr("gpuwatch.sources.timeline.MAX_CHECKPOINTS", 4)
    path = write_run(tmp_path / f"{RUN}.rank0.runlog", steps=CHECKPOINT_STEPS * 10)
    timeline = Timeline(history.log_at(path), RunState())
    assert len(timeline._checkpoints) <= 4 + 1
    for index in (0, 777, CHECKPOINT_STEPS * 10 - 2):
        assert timeline.state_at(index)[0].step == index + 1


async def test_timeline_keys_move_every_panel_and_mark_the_changes(tmp_path):
    path = write_run(tmp_path / f"{RUN}.rank0.runlog", steps=80,
                     changes=[(31, "accum_steps", 4), (61, "precision", "bf16")],
                     events=[(50, "loader is slow")])
    app = GpuwatchApp(TimelineSource(history.log_at(path)), readonly=True)

    def shown():
        return (text_of(app, "#header"), text_of(app, "#timeline"),
                " ".join(text_of(app, "#knobs").split()))

    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "● ended" in text_of(app, "#header")
                    and "┃" in text_of(app, "#timeline"))  # drawn at its laid-out width
        header, bar, _ = shown()
        assert "step 80 " in header and bar.startswith("step 80 of 80")
        assert bar.count("┃") == 2 and "no later change" in bar
        await pilot.press("home")
        header, bar, knobs = shown()
        assert "step 1 " in header and "accum_steps 2" in knobs
        assert "● replay" in header and "live" not in header  # a finished run's steps
        assert bar.endswith("next: accum_steps=4 at 31")
        await pilot.press("right", "right")
        assert "step 3 " in text_of(app, "#header")
        await pilot.press("right_square_bracket")
        header, bar, knobs = shown()
        assert "step 31 " in header and "accum_steps 4" in knobs
        assert "accum_steps=4 applied at step 31" in str(app.query_one("#log").lines[-1].text)
        with app.source.lock:
            assert [(c.step, c.knob) for c in app.source.state.knob_changes] == [
                (31, "accum_steps")]
        chart = app.query_one("#loss")
        await until(pilot, lambda: "accum_steps=4" in chart.render().plain)
        await pilot.press("left", "left")  # (after step 30 the run said it applies next)
        header, _, knobs = shown()
        assert "step 29 " in header and "accum_steps 2" in knobs
        await pilot.press("full_stop")  # the applied event, logged after step 30
        assert "step 30 " in text_of(app, "#header")
        await pilot.press("full_stop")
        assert "step 50 " in text_of(app, "#header")
        assert "loader is slow" in str(app.query_one("#log").lines[-1].text)
        await pilot.press("right_square_bracket", "right_square_bracket")  # none after
        assert "step 61 " in text_of(app, "#header")
        assert "precision bf16" in shown()[2]
        await pilot.press("v")  # the segments before and after that change
        compared = str(app.screen.query_one("#compare-table").content).splitlines()
        assert compared[0].split() == ["before:", "steps", "31-60", "(accum_steps=4)",
                                       "after:", "steps", "61-80", "(precision=bf16)",
                                       "ratio"]
        rows = {" ".join(row.split()[:2]): row.split()[2:] for row in compared[1:]}
        assert rows["precision fp32"] == ["bf16"]
        assert rows["step time"] == ["(median)", "100", "ms", "50.0", "ms", "x0.500"]
        assert rows["samples/s (median)"] == ["320", "640", "x2.00"]
        await pilot.press("escape")
        await pilot.press("comma", "comma")
        assert "step 50 " in text_of(app, "#header")
        await pilot.press("end")
        assert "● ended" in text_of(app, "#header") and "step 80 " in text_of(app, "#header")
        await pilot.press("shift+left")
        assert "step 1 " in text_of(app, "#header")  # 100 back, clamped
        await pilot.press("question_mark")
        listed = "\n".join(str(cell.content) for cell in app.screen.query("#help-keys Static"))
        assert all(binding.tooltip in listed for binding in app.BINDINGS
                   if binding.id.startswith("timeline."))
        await pilot.press("escape")
        # the footer offers the timeline's keys and no knob's
        shown_keys = {key for key, active in app.active_bindings.items()
                      if active.binding.show}
        assert shown_keys == {"left", "right", "left_square_bracket", "right_square_bracket",
                              "comma", "full_stop", "home", "end", "v", "question_mark", "colon",
                              "q"}


@pytest.mark.parametrize("size", [(60, 20), (80, 24)])
async def test_compare_screen_pages_its_columns_rather_than_cut_a_number(tmp_path, size):
    path = write_run(tmp_path / f"{RUN}.rank0.runlog", steps=80,
                     changes=[(31, "accum_steps", 4), (61, "precision", "bf16")],
                     system=lambda step: {"cpu_pct": 100.0 if step <= 60 else 25.0,
                                          "process_cpu_pct": 100.0})  # (another job ended)
    app = GpuwatchApp(TimelineSource(history.log_at(path)), readonly=True)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: "● ended" in text_of(app, "#header"))
        await pilot.press("end", "v")  # the segments before and after step 61's change
        await pilot.pause()
        box = app.screen.query_one("#compare")
        compared = str(app.screen.query_one("#compare-table").content).splitlines()
        titles = [line for line in compared if "steps 31-60 (" in line or "steps 61-80 (" in line]
        assert max(len(line) for line in compared if line not in titles) <= (
            box.content_size.width), compared  # (at 60 columns a title is wider)
        assert "column 1 of 2" in compared  # paged
        rows = [line.split() for line in compared]
        assert ["step", "time", "(median)", "100", "ms"] in rows, compared
        assert ["step", "time", "(median)", "50.0", "ms"] in rows, compared
        assert ["step", "time", "(median)", "x0.500"] in rows, compared  # (a page of its own)
        assert text_of(app.screen, "#compare-note") == (
            "note: other work kept 75% of the host's CPU busy in column 1, 0% in column 2: "
            "the speeds compare that load too")
        assert box.max_scroll_y > 0  # taller than the screen: page down reaches its end
        await pilot.press(*["pagedown"] * 6)
        await until(pilot, lambda: box.scroll_y == box.max_scroll_y)


async def test_runs_screen_opens_a_finished_run_and_a_live_one(run_dir, fake_agent):
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    first = write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=20,
                      t0=time.time() - 7200)
    write_run(os.path.join(logs, "20250102-000000-0002.rank0.runlog"), steps=35,
              run="20250102-000000-0002",
              t0=time.time() - 3600, changes=[(11, "accum_steps", 4)])
    app = GpuwatchApp(TimelineSource(history.log_at(first)), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "step 20 of 20" in text_of(app, "#timeline"))
        await pilot.press("r")
        table = app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 3)
        runs = [table.get_row_at(index)[0] for index in range(3)]
        assert runs == [fake_agent.info.run_id, "20250102-000000-0002", RUN]  # newest first
        assert table.get_row_at(1)[1:3] == ["replayed", "35"]
        assert table.get_row_at(1)[5:8] == ["0.0571", "320", "1"]
        await pilot.press("down", "enter")  # the second: finished, opens on a timeline
        await until(pilot, lambda: "step 35 of 35" in text_of(app, "#timeline"))
        assert "step 35 " in text_of(app, "#header")  # (its records name RUN as run)
        await pilot.press("home")
        assert "step 1 " in text_of(app, "#header")
        await pilot.press("r")
        table = app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 3)
        await pilot.press("enter")  # the live one
        await until(pilot, lambda: "● live" in text_of(app, "#header")
                    and f"run {fake_agent.info.run_id}" in text_of(app, "#header"))
        assert not app.query("#timeline")  # a live run has no timeline bar
        assert "step 1 " not in text_of(app, "#header")


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40)])
async def test_runs_screen_shows_whole_columns_and_each_runs_steps(run_dir, size):
    """At 80 columns the steps show whole, and at any width the table ends after its last
    whole column (``durati`` was cut at 80); the status line names the columns shown, and
    → / ← move those after the run id (which stays) one column, to the last and back;
    the timeline under the screen does not move (its arrows were the app's, and → did
    nothing on the screen)."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    first = write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=1_234,
                      name="demo-transformer")
    app = GpuwatchApp(TimelineSource(history.log_at(first)), readonly=True)
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: "of 1,234" in text_of(app, "#timeline"))
        await pilot.press("r")
        table = app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 1)
        await pilot.pause()

        def shown_columns() -> list[str]:
            screen = screen_text(app)
            heading = next(line for line in screen.splitlines()
                           if re.search(r"│ +run {2,}", line))
            return re.split(r" {2,}", heading.split("│")[1].strip())  # inside the border

        if size[0] >= 80:
            assert re.search(rf"{RUN} +demo-transformer +1,234 ", screen_text(app))
        shown = shown_columns()
        assert shown == list(COLUMNS[:len(shown)]), shown  # whole headings only
        status = text_of(app.screen, "#runs-status")
        if len(shown) == len(COLUMNS):
            assert status == "1 run"
            return
        assert status == (f"1 run; {len(shown)} of {len(COLUMNS)} columns, up to "
                          f"{shown[-1]!r}; → for more")
        moves = 0
        while "→" in text_of(app.screen, "#runs-status"):
            await pilot.press("right")
            await pilot.pause()
            moves += 1
            shown = shown_columns()
            assert shown[0] == "run" and shown[1] == COLUMNS[1 + moves], shown
            assert shown[1:] == list(COLUMNS[1 + moves:1 + moves + len(shown) - 1])
        assert shown[-1] == "state" and moves >= 1
        await pilot.press("right")  # (at the end: nothing)
        await pilot.press("left")
        await pilot.pause()
        assert shown_columns()[1] == COLUMNS[moves]
        status = text_of(app.screen, "#runs-status")
        assert status.startswith(f"1 run; {len(shown_columns())} of {len(COLUMNS)} columns, "
                                 f"run, {COLUMNS[moves]!r} to ")
        assert status.endswith("; ←→ for more")
        assert "step 1,234 of 1,234" in text_of(app, "#timeline")


def test_what_a_log_says_is_bounded_and_printed_without_control_characters(run_dir):
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, f"{RUN}.rank0.runlog")
    writer = Writer(path, t0=time.time() - 60)
    writer.write("hello", {"name": "\x1b[2J\x1b[31mevil\u202e", "device": "cpu"})
    for step in (1, 2):
        writer.step(step, knobs={"precision": "fp32", "k" * 5000: 1},
                    **{"x" * 5000: 1.0})
    writer.write("event", {"level": "warning", "kind": "applied", "knob": "precision",
                           "value": "v" * 100_000, "step": 2, "text": "\x07bell" * 1000})
    writer.write("bye", {"reason": "\x1b]0;title\x07done"})
    writer.log.close()
    run = history.read_history(history.log_at(path))
    assert list(run.segments()[0].knobs) == ["precision"]  # no run has such a knob name
    assert all(len(name) <= 100 for batch in history.step_batches(history.log_at(path))
               for name in batch.numbers)
    [event] = run.events
    assert len(event.value) <= 1000 and len(event.text) <= 1000 and "\x07" not in event.text
    listed = gpuwatch("runs", "--all")
    assert listed.returncode == 0, listed.stderr
    assert "\x1b" not in listed.stdout and "\u202e" not in listed.stdout
    assert "␛[2J␛[31mevil" in listed.stdout and "␛]0;title␇done" in listed.stdout


# --- figures in bounded memory --------------------------------------------------------

def test_a_sample_keeps_every_value_then_an_evenly_spaced_half(tmp_path):
    """Up to its capacity a sample is every value; past it, every second, fourth, ...
    (the rows at multiples of its stride), however the rows come in batches."""
    import numpy as np

    sample = history.Sample(capacity=64)
    rows = np.arange(1000, dtype=float)
    start = 0
    for size in (1, 7, 30, 100, 3, 500, 359):
        sample.add(rows[start:start + size])
        start += size
    assert start == 1000 and sample.rows == 1000
    kept = sample.values()
    assert len(kept) <= 64 and sample.stride == 16
    assert list(kept) == list(range(0, 1000, 16))
    exact = history.Sample(capacity=64)
    exact.add(rows[:64])
    assert list(exact.values()) == list(range(64)) and exact.stride == 1


def test_an_overview_holds_each_buckets_min_max_and_mean(tmp_path):
    """Buckets of consecutive rows, merged in pairs as the run grows: each bucket's
    mean, minimum and maximum are those of the steps it spans (a thinned row counting
    as its steps)."""
    import numpy as np

    overview = history.Overview(fields=("loss",), buckets=8)
    values = [float((step * 37) % 11) for step in range(1, 101)]
    for start in range(0, 100, 25):
        steps = np.arange(start + 1, start + 26, dtype=float)
        overview.add(history.StepBatch(25, None, None, {
            "step": steps, "loss": np.array(values[start:start + 25])}, {}, [None] * 25))
    series = overview.get("loss")
    assert series.width == 16 and len(series.steps) == 7  # 100 rows in buckets of 16
    for index in range(7):
        held = values[index * 16:(index + 1) * 16]
        first, last = index * 16 + 1, min(100, (index + 1) * 16)
        assert series.steps[index] == (first + last) / 2
        assert series.means[index] == pytest.approx(sum(held) / len(held))
        assert (series.lows[index], series.highs[index]) == (min(held), max(held))
    assert overview.get("step_time_s") is None
