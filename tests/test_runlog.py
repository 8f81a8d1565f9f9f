"""The run log (agent.wire.runlog): what the real agent writes, read back exactly; a log
killed while written, damaged or crafted, read in bounded memory; the summary beside it;
thinning past a disk budget; and events that never crowd steps out."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import msgpack
import pytest
import torch

import agent
from agent.wire import protocol, runlog, runs
from agent.step.record import StepRecord
from agent.wire.runlog import (EXT_FLOATS, FLAG_CHUNK, FLAG_END, LogSummary, RunLog, decode_column,
                               encode_column, frame, summary_path)
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
from tests.conftest import text_of, until
from tests.test_history import gpuwatch
from tests.test_replay import KNOBS, RUN, Writer


def _steps(path):
    return [record for record in history.flat_records(path) if record["type"] == "step"]


# --- what the agent writes ---------------------------------------------------------------

def test_a_real_run_logs_every_step_and_event_exactly(run_dir):
    """A real agent, stepping with a loss and events between the steps: the log holds
    every step once, in order, with the loss the step had and the rates its figures
    make, every event in its place, and a summary beside it that says the same."""
    monitor = agent.Agent(name="columns").start()
    losses = [1.0 / step for step in range(1, 3001)]
    for step, loss in enumerate(losses, start=1):
        monitor.optimizer_step(StepRecord(step=step, micro_batches=2, samples=64,
                                          data_wait_s=0.0, loss=torch.tensor(loss),
                                          tokens=4096 if step % 3 else None))
        if step % 1000 == 0:
            monitor.event("info", f"after step {step}", kind="note")
    monitor.close()
    path = monitor.info.log_path
    assert path.endswith(".runlog") and oct(os.stat(path).st_mode & 0o777) == "0o600"
    records = list(history.flat_records(path))
    assert records[0]["type"] == "hello" and records[-1]["type"] == "bye"
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 3001))
    assert [r["loss"] for r in steps] == [float(torch.tensor(x)) for x in losses]
    assert all(r["samples_per_s"] == 64 / r["step_time_s"] for r in steps[1:])
    assert [r.get("tokens") for r in steps[:4]] == [4096, 4096, None, 4096]
    events = [(i, r["text"]) for i, r in enumerate(records) if r["type"] == "event"
              and r.get("kind") == "note"]
    for index, text in events:  # after its step, before the next
        step = int(text.split()[-1])
        before = [r["step"] for r in records[:index] if r["type"] == "step"]
        assert before[-1] == step
    summary = runlog.read_summary(summary_path(path))
    assert (summary.steps, summary.first_step, summary.last_step) == (3000, 1, 3000)
    assert summary.final_loss == steps[-1]["loss"] and summary.ended == "finished"
    assert summary.covered == [0, os.path.getsize(path)]  # all of it
    assert os.path.getsize(path) < 3000 * 60  # bytes: a batch's columns, compressed


@pytest.mark.parametrize("values", [
    [0.5, -0.0, 0.0, math.nan, math.inf, 1e-300, 2.5],  # floats, bit for bit
    [1, -2, 1 << 62, -(1 << 63), 7],  # integers, as differences
    [3, 3, 3, 3], ["same"] * 3, [None] * 5, [True] * 2,  # one value
    [1, None, 3], ["a", "b"], [{"k": 1}, {"k": 2}], [(1 << 64) - 1, 1],  # as they are
    [True, False], [0.0, 0.0],
])
def test_a_column_reads_back_as_it_was(values):
    n = len(values)
    stored = msgpack.unpackb(msgpack.packb(encode_column(values, n), use_bin_type=True),
                             raw=False, strict_map_key=False)
    back = decode_column(stored, n)
    assert [(type(v), repr(v)) for v in back] == [(type(v), repr(v)) for v in values]
    if any(type(v) is float and v == 0.0 for v in values):  # the sign of zero too
        assert [math.copysign(1, v) for v in back] == [math.copysign(1, v) for v in values]


# --- crash safety and bounds ---------------------------------------------------------------

KILLED_WRITER = """
import sys, time
from agent.wire import protocol
from agent.wire.runlog import RunLog
log = RunLog(sys.argv[1], flush_interval_s=0.0)
step = 0
while True:
    batch = list(range(step + 1, step + 101))
    step += 100
    log.write(protocol.envelope("steps", protocol.steps_body(
        {"step": batch, "loss": [1.0 / s for s in batch]}), run="r", seq=step))
    log.maybe_flush()
    if step == 100_000:
        print("written", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_a_log_that_reads_up_to_its_last_frame(tmp_path):
    """SIGKILL while frames are being written: every whole frame reads, in order, from
    step 1; a frame cut short is skipped and said (truncated), never misread."""
    path = tmp_path / "r.rank0.runlog"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert writer.stdout.readline().strip() == "written"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    log = history.log_at(path)
    reader = history.LogReader(log)
    steps = [step for _, envelope in reader for step in envelope["body"]["columns"]["step"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 100_000
    assert reader.malformed == 0
    with open(path, "ab") as raw:  # and what SIGKILL leaves half way through a write
        raw.write(frame(FLAG_CHUNK, b"\x01" * 5000, 9000, 0)[:3000])
    reader = history.LogReader(history.log_at(path))
    assert sum(1 for _ in reader) == len(steps) // 100 and reader.truncated


def _crafted(path, frames):
    with open(path, "wb") as raw:
        raw.write(runlog.part_header(0))
        for data in frames:
            raw.write(data)
    return history.log_at(path)


def _frame_of(items, *, raw_len=None):
    raw = b"".join(msgpack.packb(item, use_bin_type=True) for item in items)
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    payload = compressor.compress(raw) + compressor.flush()
    return frame(FLAG_CHUNK | FLAG_END, payload, len(raw) if raw_len is None else raw_len,
                 zlib.crc32(raw))


def test_a_crafted_log_cannot_make_a_reader_allocate_without_bound(tmp_path):
    """Every length in a frame is checked before it is used: a frame that says it holds
    4 GiB, a zip bomb (a gigabyte of zeros in a megabyte), a column longer than its
    batch, a batch of a billion rows, msgpack nested 100,000 deep: each skipped and
    counted, and the reader's memory stays within a few frames'."""
    good = {"v": 2, "type": "steps", "run": "r", "rank": 0, "seq": 1, "t": 1.0,
            "body": {"n": 2, "common": {}, "columns": {"step": [1, 2]}}}
    huge = struct.pack("<4sBBHIIII", runlog.FRAME_MAGIC, 1, FLAG_CHUNK, 0, 16,
                       (4 << 30) - 1, 0, 0)
    huge += struct.pack("<I", zlib.crc32(huge)) + b"\0" * 16
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = compressor.compress(b"\0" * (1 << 30)) + compressor.flush()
    bomb_frame = frame(FLAG_CHUNK | FLAG_END, bomb, 1000, 0)
    long_column = {**good, "body": {"n": 2, "common": {}, "columns": {
        "step": msgpack.ExtType(EXT_FLOATS, b"\0" * 8 * 1000)}}}
    billion = {**good, "body": {"n": 10 ** 9, "common": {}, "columns": {}}}
    deep = b"\x91" * 100_000 + b"\xc0"
    compressor = zlib.compressobj(1, zlib.DEFLATED, -15)
    deep_frame = frame(FLAG_CHUNK | FLAG_END, compressor.compress(deep) + compressor.flush(),
                       len(deep), zlib.crc32(deep))
    log = _crafted(tmp_path / "crafted.rank0.runlog", [
        _frame_of([good]), huge, bomb_frame, _frame_of([long_column]),
        _frame_of([billion]), deep_frame, _frame_of([{**good, "seq": 2}])])
    tracemalloc.start()
    reader = history.LogReader(log)
    found = [envelope for _, envelope in reader]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [envelope["seq"] for envelope in found] == [1, 2]
    assert reader.malformed == 5 and not reader.truncated
    assert peak < 64 << 20, peak
    run = history.read_history(log)  # and every tool over it: the same, no error
    assert run.summary.steps == 4 and run.malformed == 5
    exported = gpuwatch("export", str(log.first), "--csv", "-o", str(tmp_path / "t"))
    assert exported.returncode == 0 and "Traceback" not in exported.stderr
    assert "5 damaged records skipped" in exported.stderr
    assert (tmp_path / "t.steps.csv").read_text().count("\n") == 1 + 4


def test_the_summary_beside_the_log_is_what_runs_all_lists(run_dir):
    """``runs --all`` reads the summary the writer keeps (plus the records after it),
    not the log; a log without one is read once and its summary kept."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs)
    path = os.path.join(logs, f"{RUN}.rank0.runlog")
    writer = Writer(path, t0=time.time() - 100)
    writer.hello()
    for step in range(1, 21):
        writer.step(step)
    writer.log.close()
    summary = runlog.read_summary(summary_path(path))
    assert summary.steps == 20 and summary.covered == [0, os.path.getsize(path)]
    summary.steps = 123_456  # (a figure only the summary holds)
    runlog.write_private(summary_path(path), summary.to_json())
    writer = Writer(path, t0=time.time())  # the run goes on: 5 steps after the summary
    for step in range(21, 26):
        writer.step(step)
    writer.log.close()
    [listed] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert listed["steps"] == 123_456 + 5 and listed["last_step"] == 25
    os.unlink(summary_path(path))
    [listed] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert listed["steps"] == 25  # one pass over the log ...
    assert runlog.read_summary(summary_path(path)).steps == 25  # ... kept for next time


def test_best_throughput_is_what_a_batch_sustained_never_one_lucky_step(run_dir):
    """``best/s`` of ``runs --all``: the largest median of a batch's steps (a newcomer's
    run listed 143,699 samples/s for a median of 125,432, the demo 898 for one 35.7 ms
    step), not the fastest single step; a damaged value is passed over; tokens alike."""
    os.makedirs(os.path.join(run_dir, "logs"))
    path = os.path.join(run_dir, "logs", f"{RUN}.rank0.runlog")
    writer = Writer(path, t0=time.time() - 100)
    writer.hello()

    def batch(first, rates, tokens=None):
        rows = {"step": list(range(first, first + len(rates))), "samples_per_s": rates,
                "knobs": [KNOBS] * len(rates)}
        if tokens is not None:
            rows["tokens_per_s"] = tokens
        writer.write("steps", protocol.steps_body(rows))

    batch(1, [100.0] * 8 + [10_000.0, "x"])  # one lucky step, one damaged value
    batch(11, [200.0, 210.0, 190.0, 5.0, 205.0], tokens=[4e4, 1e6, 4.1e4, 3.9e4, 4e4])
    batch(16, [150.0] * 6)
    writer.log.close()
    summary = runlog.read_summary(summary_path(path))
    assert (summary.best_samples_per_s, summary.best_tokens_per_s) == (200.0, 4e4)
    [listed] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert listed["best_samples_per_s"] == 200.0


def test_a_summary_file_that_is_no_summary_is_not_trusted(tmp_path):
    assert LogSummary.from_json(b"[1]") is None
    assert LogSummary.from_json(b'{"steps": -4}') is None
    assert LogSummary.from_json(b'{"covered": [0]}') is None
    assert LogSummary.from_json(b"{" + b" " * runlog.MAX_SUMMARY_BYTES + b"}") is None
    evil = LogSummary.from_json(b'{"name": "\\u001b]0;x\\u0007", "steps": 3}')
    assert evil.name == "␛]0;x␇" and evil.steps == 3
    link = tmp_path / "x.summary"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(LogSummary(steps=9).to_json())
    assert runlog.read_summary(link) is None  # never through a link


# --- a disk budget -------------------------------------------------------------------------

def test_past_its_budget_a_log_thins_old_parts_and_keeps_every_event_and_change(run_dir):
    """A log with a small budget: older parts become buckets of steps (mean, minimum,
    maximum, count) in a child process; no step is lost from the count, every event
    and knob change stays, the figures are the arithmetic of the steps they hold, and
    the tools say so."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs)
    path = os.path.join(logs, f"{RUN}.rank0.runlog")
    log = RunLog(path, budget_bytes=60_000, part_bytes=15_000)  # (the log: ~150 kB)
    seq = 0
    steps = 60_000
    for first in range(1, steps + 1, 500):
        rows = list(range(first, first + 500))
        knobs = {"precision": "bf16" if first > 30_000 else "fp32"}
        seq += 1
        log.write(protocol.envelope("steps", protocol.steps_body(
            {"step": rows, "step_time_s": [0.001 * (1 + step % 7) for step in rows],
             "loss": [1.0 + (step * 7919 % 1000) / 1000 for step in rows]},
            {"knobs": knobs}), run=RUN, seq=seq, t=1e9 + first))
        if first % 5000 == 1:
            seq += 1
            log.write(protocol.envelope("event", {"level": "info", "text": f"at {first}"},
                                        run=RUN, seq=seq, t=1e9 + first))
        log._write_frame(time.monotonic(), final=True)  # a chunk a batch: parts fill
    log.write(protocol.envelope("bye", {"reason": "finished"}, run=RUN, seq=seq + 1))
    log.close()
    assert log._thinner is not None and log._thinner.wait(120) == 0
    [files] = history.find_logs(logs)
    levels = [runlog.thinned_level(part) for part in files.paths]
    assert levels[0] >= runlog.THIN_FACTOR and levels[-1] == 0
    run = history.read_history(files)
    assert run.thinned == max(levels) and run.summary.steps == steps
    assert [event.text for event in run.events] == [f"at {first}" for first in
                                                   range(1, steps + 1, 5000)]
    assert [(c.step, c.value) for c in run.knob_changes] == [(30_001, "bf16")]
    batches = list(history.step_batches(files))
    assert sum(int(batch.weights().sum()) for batch in batches) == steps
    buckets = [batch for batch in batches if batch.counts is not None]
    assert buckets, "no step was thinned"
    batch = buckets[0]
    last, count = int(batch.numbers["step"][0]), int(batch.counts[0])
    held = range(last - count + 1, last + 1)  # the steps the first bucket stands for
    times = [0.001 * (1 + step % 7) for step in held]
    assert batch.numbers["step.min"][0] == held[0]
    assert batch.numbers["step_time_s"][0] == pytest.approx(sum(times) / count)
    assert batch.numbers["step_time_s.min"][0] == min(times)
    assert batch.numbers["step_time_s.max"][0] == max(times)
    listed = gpuwatch("runs", "--all")
    assert listed.returncode == 0 and f"thinned x{max(levels)}" in listed.stdout
    assert "60,000" in listed.stdout or "60.0k" in listed.stdout
    compared = gpuwatch("compare", RUN)
    assert compared.returncode == 0 and "thinned" in compared.stderr


# --- events never starve steps -------------------------------------------------------------

def test_an_event_is_cut_to_a_bounded_size_with_a_note():
    small = {"level": "info", "text": "hello", "kind": "note", "step": 3}
    assert protocol.bounded_event(small) is small  # the usual case: as it is
    huge = protocol.bounded_event({"level": "warning", "text": "x" * (1 << 20),
                                   "value": list(range(100_000)), "knob": "k" * 5000,
                                   **{f"f{i}": i for i in range(100)}})
    assert huge["text"].startswith("x" * 1000)
    assert huge["text"].endswith("… [cut: 1,048,576 characters in all]")
    assert len(huge["text"]) < protocol.MAX_EVENT_TEXT_CHARS + 50
    assert len(huge["knob"]) == protocol.MAX_TEXT_CHARS and len(huge["value"]) <= 1000
    assert len(huge) <= protocol.MAX_EVENT_FIELDS
    assert len(msgpack.packb(huge)) < 64 << 10


@pytest.mark.slow
async def test_large_frequent_events_never_keep_steps_from_the_dashboard(run_dir):
    """Events of 1 MiB, 20 a second, while the run steps: the dashboard shows every
    step, and each event, cut with a note (before, each one larger than a dashboard
    takes made it drop its connection, and it stayed at "no steps yet")."""
    monitor = agent.Agent(name="eventful").start()
    info = runs.find_run(monitor.run_id)
    app = GpuwatchApp(LiveSource(info), readonly=True)
    total = 400
    done = threading.Event()

    def train():
        text = "E" * (1 << 20)
        for step in range(1, total + 1):
            monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                              data_wait_s=0.0))
            if step % 5 == 0:  # every 5 steps of 10 ms: 20 events a second
                monitor.event("info", text, kind="note")
            time.sleep(0.01)
        done.set()

    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.source.state.hello)  # subscribed
            thread = threading.Thread(target=train)
            thread.start()
            await until(pilot, lambda: done.is_set()
                        and app.source.state.steps_total == total, timeout_s=60)
            await until(pilot, lambda: f"step {total} " in text_of(app, "#header"))
            state = app.source.state
            assert state.missed == 0 and state.malformed == 0
            notes = [entry.text for entry in state.events if "EEEE" in entry.text]
            assert notes and all(len(text) <= protocol.MAX_TEXT_CHARS for text in notes)
            thread.join()
    finally:
        monitor.close()
    events = [r["text"] for r in history.flat_records(monitor.info.log_path)
              if r["type"] == "event" and r.get("kind") == "note"]
    assert len(events) == total // 5
    assert all(text.endswith("… [cut: 1,048,576 characters in all]") for text in events)


# --- a long run ----------------------------------------------------------------------------

#: The fast loop's pace (steps/s): 0.125 ms a step, faster than a real model's step. (A
#: loop of nothing but records, 80,000 a second, outruns the agent's I/O thread on 2
#: shared CPUs, which then drops records at its queue's bound, as it is meant to.)
FAST_LOOP_STEPS_PER_S = 8000
#: Its record queue: 8 s of steps (the default's 1 s is outlasted by the pauses a
#: machine loaded with other work gives the I/O thread; the records dropped then are
#: the queue's, never the log's).
FAST_LOOP_QUEUE = 1 << 16


@pytest.mark.slow
def test_a_run_of_a_million_steps_keeps_every_step(run_dir, tmp_path):
    """The issue's measure: a fast loop of 1,000,000 optimizer steps (a real agent, a
    loss tensor each step) keeps every step: its export starts at step 1 and has a
    million rows, the log is under 100 MB, and ``runs --all`` counts a million."""
    steps = 1_000_000
    monitor = agent.Agent(name="million", queue_size=FAST_LOOP_QUEUE).start()
    weights = torch.ones(16)
    started = time.monotonic()
    for step in range(1, steps + 1):
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=32,
                                          data_wait_s=0.0, loss=(weights / step).sum()))
        if step % 100 == 0:  # the loop's pace, a sleep every 100 steps
            ahead_s = started + step / FAST_LOOP_STEPS_PER_S - time.monotonic()
            if ahead_s > 0:
                time.sleep(ahead_s)
    elapsed = time.monotonic() - started
    monitor.close(timeout_s=60)
    path = monitor.info.log_path
    size = sum(part.stat().st_size for part in history.log_at(path).paths)
    print(f"{steps:,} steps in {elapsed:.0f} s; log {size / 2**20:.1f} MiB "
          f"({size / steps:.1f} B a step); records dropped {monitor.records_dropped}")
    assert monitor.records_dropped == 0
    assert size < 100 << 20
    [listed] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert listed["steps"] == steps and listed["last_step"] == steps
    exported = gpuwatch("export", monitor.run_id, "--csv", "-o", str(tmp_path / "run"),
                        timeout=600)
    assert exported.returncode == 0, exported.stderr
    with open(tmp_path / "run.steps.csv") as table:
        header = table.readline().split(",")
        first = table.readline().split(",")
        rows = 2 + sum(1 for _ in table)
    assert first[header.index('"step"')] == "1" and rows - 1 == steps


def test_numbers_that_are_not_numbers_are_read_as_missing_by_every_tool(run_dir, tmp_path):
    """A log whose fields hold text, maps, NaN, 1e308 and integers beyond 64 bits where
    numbers belong (a crafted or damaged log): every tool reads it, such a value as
    missing, and says nothing it cannot; none raises."""
    path = tmp_path / f"{RUN}.rank0.runlog"
    log = RunLog(path)
    odd = ["x", {"a": [1]}, math.nan, math.inf, 1e308, 1 << 70, None, True, [1, 2]]
    for seq, first in enumerate(range(1, 201, 20), start=1):
        rows = list(range(first, first + 20))
        columns = {"step": list(rows), "step_time_s": [0.01] * 20, "loss": [1.0] * 20,
                   "input_verdict": ["compute-bound"] * 20,
                   "knobs": [{"precision": "fp32"}] * 20}
        for row, value in enumerate(odd):
            name = ("step_time_s", "loss", "input_verdict", "knobs")[(seq + row) % 4]
            columns[name][row + 5] = value
        columns["step"][seq % 20] = odd[seq % len(odd)]
        log.write(protocol.envelope("steps", protocol.steps_body(columns), run=RUN,
                                    seq=seq, t=1e9 + seq))
    log.close()
    for command in (("compare", str(path)), ("report", str(path), "-o", str(tmp_path / "r")),
                    ("export", str(path), "--csv", "-o", str(tmp_path / "t")),
                    ("export", str(path), "--parquet", "-o", str(tmp_path / "t"))):
        done = gpuwatch(*command)
        assert "Traceback" not in done.stderr, (command, done.stderr)
    run = history.read_history(history.log_at(path))
    assert run.summary.steps == 200 and run.summary.last_step == 200
    from gpuwatch.sources.timeline import Timeline
    from gpuwatch.state import RunState

    timeline = Timeline(history.log_at(path), RunState())  # (a batch with a bad row is
    assert len(timeline.steps) == 200  # malformed to the dashboard from that row on)
    assert timeline.state_at(100)[0].malformed > 0 and timeline.state_at(199)[0].ended is None


def test_a_knob_value_past_64_bits_never_stops_the_log_from_closing(tmp_path):
    """A knob whose value JSON cannot hold (an integer of 2**70, from a custom knob):
    the log closes without raising (this runs in the training process), its summary
    leaves the knob map out and keeps the counts."""
    path = tmp_path / f"{RUN}.rank0.runlog"
    log = RunLog(path)
    log.write(protocol.envelope("hello", {"name": "big"}, run=RUN, seq=0, t=1e9))
    columns = {"step": [1, 2], "step_time_s": [0.01, 0.01], "loss": [1.0, 0.5],
               "knobs": [{"huge": 1 << 70}] * 2}
    log.write(protocol.envelope("steps", protocol.steps_body(columns), run=RUN, seq=1,
                                t=1e9 + 1))
    log.close()
    summary = runlog.read_summary(runlog.summary_path(path))
    assert summary is not None and summary.knobs is None
    assert (summary.steps, summary.last_step, summary.final_loss) == (2, 2, 0.5)
