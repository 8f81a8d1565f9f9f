"""Replay: a run log written by the real agent.wire.runlog.RunLog, read back by
gpuwatch.sources.replay into the dashboard, and printed by ``gpuwatch tail FILE``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.wire import protocol
from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.runlog import FrameWriter, RunLog, pack_message
from gpuwatch.app import GpuwatchApp
from gpuwatch.history import envelope_from_record
from gpuwatch.sources.replay import ReplaySource, RunLogReader
from tests.conftest import log_texts, text_of, until

RUN = "20250101-000000-beef"
KNOBS = {"precision": "bf16", "accum_steps": 2, "num_workers": 4, "pin_memory": True,
         "prefetch_factor": 2}


class LegacyLog:
    """The JSON-lines run log of earlier versions, as their RunLog wrote it: a line per
    record, a ``steps`` batch as a ``step`` line a row (every column in every row), and
    rotation past ``max_bytes`` (``run.jsonl`` -> ``.1`` -> ..., each new file headed by
    the latest hello), keeping ``backups`` files."""

    def __init__(self, path, *, max_bytes=1 << 40, backups=3):
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self.hello = None

    def write(self, message):
        if message["type"] == "steps":
            names = list(message["body"]["columns"])
            line = b"".join(protocol.to_json_line(
                {**row, "body": {**dict.fromkeys(names), **row["body"]}})
                for row in protocol.expand(message))
        else:
            line = protocol.to_json_line(message)
        if message["type"] == "hello":
            self.hello = line
        with open(self.path, "ab") as handle:
            handle.write(line)
        if self.path.stat().st_size >= self.max_bytes:
            for index in range(self.backups - 1, 0, -1):
                older = Path(f"{self.path}.{index}")
                if older.exists():
                    older.replace(f"{self.path}.{index + 1}")
            self.path.replace(f"{self.path}.1")
            self.path.write_bytes(self.hello or b"")

    def maybe_flush(self):
        pass

    def close(self):
        pass


class Writer:
    """Envelopes as the agent makes them (each step its own ``steps`` batch), appended
    by a real RunLog (a frame each time), or with ``legacy`` in the JSON lines of
    earlier versions (:class:`LegacyLog`)."""

    def __init__(self, path, *, t0=None, legacy=False, run=RUN, **options):
        self.log = (LegacyLog(path, **options) if legacy
                    else RunLog(path, flush_interval_s=0.0, **options))
        self.run = run  # the run id of its records
        self.seq = 0
        self.t0 = t0  # unix time of the first record; now when None
        self.written = []  # the envelopes, as sent

    def write(self, msg_type, body, *, dt_s=0.0):
        self.seq += 1
        t = None if self.t0 is None else self.t0 + dt_s
        message = protocol.envelope(msg_type, body, run=self.run, seq=self.seq, t=t)
        self.log.write(message)
        self.log.maybe_flush()
        self.written.append(message)

    def records(self):
        """What was written, a flat record a step (``gpuwatch tail --json``'s lines)."""
        return [json.loads(protocol.to_json_line(row)) for message in self.written
                for row in protocol.expand(message)]

    def hello(self):
        self.write("hello", {"name": "replayed", "device": "cpu", "knobs": [
            STANDARD_KNOBS[name].to_wire() for name in KNOBS]})

    def step(self, step, **fields):
        row = {"step": step, "step_time_s": 0.1, "data_wait_s": 0.06,
               "data_wait_share": 0.6, "data_wait_share_window": 0.6,
               "input_verdict": "input-bound", "samples_per_s": 320.0,
               "loss": 2.0 / step, "knobs": KNOBS, "host_rss_bytes": 500 << 20, **fields}
        self.write("steps", protocol.steps_body({name: [value] for name, value in row.items()}),
                   dt_s=step * 0.1)


def test_record_round_trip():
    message = protocol.envelope("step", {"step": 3, "loss": 1.5, "knobs": {"a": 1}},
                                run=RUN, rank=2, seq=9, t=123.5)
    record = json.loads(protocol.to_json_line(message))
    assert envelope_from_record(record) == message
    for not_a_record in ([1, 2], "step", {"step": 3}, {"type": 7}, None):
        assert envelope_from_record(not_a_record) is None


async def test_replay_of_a_finished_run_shows_steps_knobs_and_ended(tmp_path):
    path = tmp_path / "run.rank0.runlog"
    writer = Writer(path, t0=time.time() - 3600)  # an hour ago
    writer.hello()
    for step in range(1, 31):
        writer.step(step)
    writer.write("event", {"level": "warning", "text": "loader is slow", "kind": "warning"})
    writer.write("bye", {"reason": "finished", "steps": 30}, dt_s=4.0)
    writer.log.close()
    app = GpuwatchApp(ReplaySource(path), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "● ended" in text_of(app, "#header"))
        header = text_of(app, "#header")
        assert "step 30" in header and "read-only" in header
        assert "missed" not in header  # said only when records were missed
        assert app.source.state.steps_total == 30
        assert "run ended (finished) after 30 steps" in log_texts(app)
        assert "loader is slow" in log_texts(app)
        await until(pilot, lambda: "input-bound" in text_of(app, "#knobs"))
        knobs = text_of(app, "#knobs")  # at 80 columns the verdict heads its data group
        assert "data input-bound 60%" in knobs
        assert "num_workers" in knobs and "pin_memory" in knobs
        assert "precision" in knobs and "bf16" in knobs and "accum_steps" in knobs
        # a replay takes no commands: its footer offers only help, quit and the command line,
        # and the knob keys say why they send nothing
        shown = {key for key, active in app.active_bindings.items() if active.binding.show}
        assert shown == {"q", "question_mark", "colon"}, shown
        lines = len(log_texts(app))
        await pilot.press("p", "W")
        await pilot.pause()
        said = log_texts(app)[lines:]
        assert said == ["a replay takes no commands: precision=fp16 not sent",
                        "a replay takes no commands: num_workers=5 not sent"], said
        assert app.source.state.knobs["precision"] == "bf16"


def _half_record(path, legacy, step):
    """Append a step record in two halves (as a writer caught mid-write would leave
    it); returns the function that appends the second."""
    if legacy:
        data = protocol.to_json_line(protocol.envelope(
            "step", {"step": step}, run=RUN, seq=99, t=time.time()))
    else:  # a frame of a chunk of its own, as a restarted agent's first one
        frames = FrameWriter()
        frames.add(pack_message(protocol.envelope("steps", protocol.steps_body(
            {"step": [step]}), run=RUN, seq=99, t=time.time())))
        data = frames.frame(end_chunk=True)
    with open(path, "ab") as raw:
        raw.write(data[:len(data) // 2])

    def rest():
        with open(path, "ab") as raw:
            raw.write(data[len(data) // 2:])
    return rest


@pytest.mark.parametrize("legacy", [False, True])
async def test_replay_follows_a_growing_file_and_counts_malformed_records(tmp_path, legacy):
    path = tmp_path / "run.log"
    writer = Writer(path, legacy=legacy)
    writer.hello()
    writer.step(1)
    app = GpuwatchApp(ReplaySource(path), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "● live" in text_of(app, "#header")
                    and "step 1 " in text_of(app, "#header"))
        with open(path, "ab") as raw:  # what no agent writes, skipped and counted
            raw.write(b"not json\n[1, 2]\n{\"no\": \"type\"}\n\n")
        for step in (2, 3, 4):
            writer.step(step)
        await until(pilot, lambda: "step 4 " in text_of(app, "#header"))
        malformed = "malformed 3" if legacy else "malformed 1"  # 3 lines, 1 stretch
        assert malformed in text_of(app, "#header")
        writer.log.close()
        rest = _half_record(path, legacy, 5)
        await pilot.pause(0.5)
        assert app.source.state.steps_total == 4  # a record is read once it is whole
        rest()
        await until(pilot, lambda: "step 5 " in text_of(app, "#header"))
        writer = Writer(path, legacy=legacy)  # (the run goes on, a new chunk)
        writer.write("bye", {"reason": "finished", "steps": 5})
        writer.log.close()
        await until(pilot, lambda: "● ended" in text_of(app, "#header"))
        assert malformed in text_of(app, "#header")


async def test_replay_of_a_killed_run_says_gone(tmp_path):
    path = tmp_path / "run.rank0.runlog"
    writer = Writer(path, t0=time.time() - 60)  # stopped writing a minute ago, no bye
    writer.hello()
    writer.step(1)
    writer.log.close()
    app = GpuwatchApp(ReplaySource(path), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "● gone" in text_of(app, "#header"))


def test_reader_follows_the_earlier_format_across_rotation(tmp_path):
    path = tmp_path / "run.jsonl"
    writer = Writer(path, legacy=True, max_bytes=4000, backups=2)
    with RunLogReader(path) as reader:
        writer.hello()
        writer.step(1)
        steps = [m["body"]["step"] for m in reader.read() if m["type"] == "step"]
        assert steps == [1] and reader.at_eof
        for step in range(2, 16):  # rotates once, midway: run.jsonl -> run.jsonl.1
            writer.step(step)
        assert os.path.exists(f"{path}.1") and not os.path.exists(f"{path}.2")
        for _ in range(3):  # the old file's end, then the new file (then nothing)
            steps += [m["body"]["step"] for m in reader.read() if m["type"] == "step"]
    assert steps == list(range(1, 16)) and reader.malformed == 0
    writer.log.close()


def test_reader_follows_a_run_log_from_part_to_part(tmp_path, monkeypatch):
    monkeypatch.setattr("agent.wire.runlog.CHUNK_S", 0.0)  # a chunk a frame
    path = tmp_path / "run.rank0.runlog"
    writer = Writer(path, part_bytes=1, budget_bytes=1 << 40)  # a part a chunk
    with RunLogReader(path, batches=True) as reader:
        writer.hello()
        writer.step(1)
        steps = [m["body"]["columns"]["step"] for m in reader.read() if m["type"] == "steps"]
        assert steps == [[1]] and reader.at_eof
        for step in range(2, 6):
            writer.step(step)
        assert os.path.exists(f"{path}.4")
        steps += [m["body"]["columns"]["step"] for m in reader.read() if m["type"] == "steps"]
    assert steps == [[1], [2], [3], [4], [5]] and reader.malformed == 0
    writer.log.close()


def test_reader_skips_an_overlong_line(tmp_path, monkeypatch):
    monkeypatch.setattr("gpuwatch.sources.replay.MAX_LINE_BYTES", 100)
    monkeypatch.setattr("gpuwatch.sources.replay.CHUNK_BYTES", 64)
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"type":"heartbeat","step":1}\n' + b'{"type":"x","pad":"' + b"a" * 300
                     + b'"}\n{"type":"heartbeat","step":2}\n')
    with RunLogReader(path) as reader:
        messages = reader.read()
    assert [m["body"]["step"] for m in messages] == [1, 2] and reader.malformed == 1


# --- the command line ------------------------------------------------------------------

def gpuwatch(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], capture_output=True,
                          text=True, timeout=timeout)


def _finished_log(path):
    writer = Writer(path)
    writer.hello()
    for step in range(1, 6):
        writer.step(step, loss=float("nan") if step == 5 else 1.0)
    writer.write("bye", {"reason": "finished", "steps": 5})
    writer.log.close()
    return writer


def test_tail_json_file_prints_every_record_and_exits(tmp_path, run_dir):
    path = tmp_path / "run.rank0.runlog"
    writer = _finished_log(path)
    with open(path, "ab") as raw:
        raw.write(b"garbage\n" * 10)
    result = gpuwatch("tail", "--json", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [json.loads(line) for line in lines] == writer.records()
    assert json.loads(lines[-2])["loss"] is None  # a NaN loss: null in JSON
    assert result.stderr == "gpuwatch tail: 1 malformed line skipped\n"
    human = gpuwatch("tail", str(path), "--count", "2")
    assert human.returncode == 0 and human.stdout.splitlines()[0].startswith(
        f"run {RUN} replayed on cpu; knobs: precision")
    assert human.stdout.splitlines()[1].startswith("step 1  100 ms  wait 60.0 ms")


def test_tail_says_a_later_hello_as_the_knobs_it_changed(tmp_path, run_dir):
    # a framework's run binds its knobs after its first hello (a resumed Lightning run:
    # pause, stop, recover, rewind first), and repeats its hello for late subscribers
    path = tmp_path / "run.rank0.runlog"
    writer = Writer(path)
    knobs = [STANDARD_KNOBS[name].to_wire() for name in ("pause", "stop")]
    writer.write("hello", {"name": "replayed", "device": "cpu", "knobs": knobs})
    writer.step(1)
    writer.write("hello", {"name": "replayed", "device": "cpu", "knobs": [
        knobs[0], *(STANDARD_KNOBS[name].to_wire() for name in ("precision", "accum_steps"))]})
    writer.write("hello", {"name": "replayed", "device": "cpu", "knobs": [
        knobs[0], *(STANDARD_KNOBS[name].to_wire() for name in ("precision", "accum_steps"))]})
    writer.step(2)
    writer.log.close()
    result = gpuwatch("tail", str(path))
    lines = result.stdout.splitlines()
    assert lines[0] == f"run {RUN} replayed on cpu; knobs: pause, stop"
    assert lines[2] == f"run {RUN} knobs added: precision, accum_steps; removed: stop"
    assert lines[3].startswith("step 2 ") and len(lines) == 4  # the repeat: not said
    # no bye at its end (a run killed, or going on): said, where a finished log says nothing
    assert result.stderr == ("gpuwatch tail: the log ends without the run's bye: it is still "
                             "going (--follow waits for more), or it was killed before its "
                             "last records were written\n")


def test_tail_follow_file_waits_for_bye(tmp_path, run_dir):
    path = tmp_path / "run.rank0.runlog"
    writer = Writer(path)
    writer.hello()
    writer.step(1)
    with subprocess.Popen([sys.executable, "-m", "gpuwatch", "tail", "--json", "--follow",
                           str(path)], stdout=subprocess.PIPE, text=True) as tail:
        assert json.loads(tail.stdout.readline())["type"] == "hello"
        assert json.loads(tail.stdout.readline())["step"] == 1
        writer.step(2)
        assert json.loads(tail.stdout.readline())["step"] == 2
        writer.write("bye", {"reason": "finished", "steps": 2})
        assert json.loads(tail.stdout.readline())["type"] == "bye"
        assert tail.wait(timeout=10) == 0
    writer.log.close()


def test_replay_needs_a_file(tmp_path, run_dir):
    result = gpuwatch("replay", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 1 and "no such file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [("tail", "--json", "nosuchrun"), ("tail", "--run", "x")])
def test_tail_argument_that_is_no_file_is_a_run_selector(run_dir, args):
    result = gpuwatch(*args)
    assert result.returncode == 1 and "no live run matches" in result.stderr
