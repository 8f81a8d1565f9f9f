"""The run log's writer process (agent.io.logwriter), with real agents and real processes.

The training process SIGKILLed: the log keeps every record it published, even while a
process it forked holds the pipe open. The writer killed,
or unable to write (a file size limit, as a full disk): said once, with its reason, and
training goes on. The writer stopped (SIGSTOP): the I/O thread never blocks, the
backlog stays bounded, what is left out is counted and said. Close: the log is complete
when it returns, whatever signal the writer got before."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading

import psutil
import pytest
import torch

import agent
from agent.io import logwriter
from agent.step.record import StepRecord
from agent.wire import runlog, runs
from gpuwatch import history
from gpuwatch.client import Subscriber
from tests.conftest import wait_until
from tests.test_security import VICTIM, job_env


@pytest.fixture
def started(run_dir):
    """``started(name)``: an agent started now, closed after the test whether it passed or
    failed (a test that failed before its own close left the agent's threads running
    into the tests after it)."""
    made: list[agent.Agent] = []

    def start(name: str) -> agent.Agent:
        made.append(agent.Agent(name=name).start())
        return made[-1]

    yield start
    for monitor in made:
        monitor.close()  # (idempotent: most tests close it themselves)


def _train(monitor: agent.Agent, first: int, count: int) -> int:
    """``count`` optimizer steps from ``first`` (a real loss tensor each); the next step."""
    for step in range(first, first + count):
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=32,
                                          data_wait_s=0.0, loss=torch.tensor(1.0 / step)))
    return first + count


def _envelopes(path) -> list[dict]:
    return [envelope for _, envelope in history.LogReader(history.log_at(path))]


def _seqs(path) -> list[int]:
    return [envelope["seq"] for envelope in _envelopes(path)]


def _children(pid: int) -> dict[str, list[psutil.Process]]:
    """The live child processes of process ``pid``, by command line."""
    found: dict[str, list[psutil.Process]] = {}
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):  # (one that ended meanwhile)
            found.setdefault(" ".join(child.cmdline()), []).append(child)
    return found


def _writer_of(pid: int) -> psutil.Process:
    (writer,) = [child for line, children in _children(pid).items()
                 if "agent.io.logwriter" in line for child in children]
    return writer


def _run_log_errors(monitor: agent.Agent) -> list[str]:
    return [error for error in monitor.errors if "run log failed" in error]


def test_close_waits_until_the_log_and_its_summary_are_complete(started):
    """Right after close the log holds every record published, in order, and the summary
    covers it; SIGINT and SIGTERM (a terminal's or a launcher's, to the whole group) do
    not end the writer before."""
    monitor = started("closed")
    writer = psutil.Process(monitor._io._log.pid)
    assert "agent.io.logwriter" in " ".join(writer.cmdline())
    assert os.path.isfile(monitor.info.log_path)  # made by the agent; the writer: not waited for
    wait_until(lambda: [f.path for f in writer.open_files()] == [monitor.info.log_path],
               "the log open, and no other file (once the writer's start is done)",
               detail=lambda: str(writer.open_files()))
    assert writer.nice() == min(19, psutil.Process().nice() + 10)  # a low priority
    next_step = _train(monitor, 1, 3000)
    writer.send_signal(signal.SIGINT)
    writer.send_signal(signal.SIGTERM)
    _train(monitor, next_step, 1000)
    monitor.close()
    assert not writer.is_running()  # it has written the end and exited
    path = monitor.info.log_path
    envelopes = _envelopes(path)
    assert [e["seq"] for e in envelopes] == list(range(1, monitor._io.seq + 1))
    assert envelopes[0]["type"] == "hello" and envelopes[-1]["type"] == "bye"
    steps = [s for e in envelopes if e["type"] == "steps" for s in e["body"]["columns"]["step"]]
    assert steps == list(range(1, 4001))
    summary = runlog.read_summary(runlog.summary_path(path))
    assert (summary.steps, summary.last_step, summary.ended) == (4000, 4000, "finished")
    assert summary.covered == [0, os.path.getsize(path)]
    assert _run_log_errors(monitor) == []


def test_a_writer_killed_is_said_once_and_training_goes_on(started):
    monitor = started("writer-killed")
    next_step = _train(monitor, 1, 500)
    wait_until(lambda: 500 in [r.get("step") for r in history.flat_records(
        monitor.info.log_path)], "the steps written")
    os.kill(monitor._io._log.pid, signal.SIGKILL)
    wait_until(lambda: _run_log_errors(monitor), "the writer's death said")
    next_step = _train(monitor, next_step, 2000)  # training goes on, unslowed
    monitor.close()
    assert monitor.last_step == next_step - 1 == 2500
    (error,) = _run_log_errors(monitor)
    assert f"exited with status {-signal.SIGKILL}" in error and "without a run log" in error
    seqs = _seqs(monitor.info.log_path)  # what it wrote before reads
    assert seqs and seqs == list(range(1, len(seqs) + 1))


def test_a_writer_that_cannot_write_says_why_and_training_goes_on(started):
    """The log file may not grow (a file size limit on the writer, as a full disk does):
    the writer says why and exits; the agent says so once, with that reason."""
    monitor = started("writer-full")
    path = monitor.info.log_path
    resource.prlimit(monitor._io._log.pid, resource.RLIMIT_FSIZE, (os.path.getsize(path),) * 2)
    step = 1

    def said() -> list[str]:
        nonlocal step
        step = _train(monitor, step, 200)
        return _run_log_errors(monitor)

    (error,) = wait_until(said, "the writer's failure said")
    assert "exited with status 1 (OSError: [Errno 27] File too large)" in error
    step = _train(monitor, step, 500)
    monitor.close()
    assert monitor.last_step == step - 1 and _run_log_errors(monitor) == [error]


def test_a_writer_stopped_never_blocks_the_agent_and_what_is_lost_is_said(started,
                                                                          monkeypatch):
    """SIGSTOP: the pipe fills (one page here), the backlog stays within its bound (64
    KiB here), the I/O thread goes on publishing; records past the bound are counted and
    said, and once the writer runs again the rest reaches the log."""
    monkeypatch.setattr(logwriter, "PIPE_BYTES", 4096)
    monkeypatch.setattr(logwriter, "BACKLOG_BYTES", 64 << 10)
    monitor = started("writer-stopped")
    writer = monitor._io._log
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        step = 1

        def behind() -> bool:
            nonlocal step
            step = _train(monitor, step, 500)
            return any("is behind" in error for error in _run_log_errors(monitor))

        wait_until(behind, "records left out of the log, said", poll_s=0.01)
        assert writer.lost > 0
        assert writer.backlog_bytes <= (64 << 10) + (1 << 20)  # (and a message begun)
        seq = monitor._io.seq
        wait_until(lambda: monitor._io.seq > seq + 2, "the I/O thread publishing on")
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    wait_until(lambda: any("caught up" in error for error in _run_log_errors(monitor)),
               "the writer catching up, said")
    monitor.close()
    seqs = _seqs(monitor.info.log_path)
    assert seqs[0] == 1 and seqs[-1] == monitor._io.seq  # hello to bye
    assert len(seqs) == monitor._io.seq - writer.lost  # the lost ones: the only gaps
    (caught_up,) = [e for e in _run_log_errors(monitor) if "caught up" in e]
    assert f"{writer.lost:,} records were left out" in caught_up


def test_a_message_larger_than_the_backlog_is_lost_and_caught_up_only_when_written(run_dir,
                                                                                monkeypatch):
    """The writer stopped, the pipe full, the backlog empty: a message over the backlog's
    bound is left out; no later wake-up says "caught up" while the pipe takes nothing,
    and the first message the pipe takes once the writer runs again says it."""
    monkeypatch.setattr(logwriter, "PIPE_BYTES", 4096)
    monkeypatch.setattr(logwriter, "BACKLOG_BYTES", 1024)
    said: list[str] = []
    writer = logwriter.LogWriter.start("too-large", lambda what, error: said.append(str(error)))
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        seq = 0

        def message(size: int) -> bytes:
            nonlocal seq
            seq += 1
            return runlog.pack_plain({"v": 1, "type": "event", "seq": seq, "t": 0.0,
                                      "body": {"kind": "note", "text": "x" * size}})

        while writer.lost == 0:  # the pipe fills; then a 2 KiB message cannot wait
            writer.send(message(2048))
        assert writer.backlog_bytes < 2048 and len(said) == 1 and "is behind" in said[0]
        for _ in range(3):
            writer.pump()
        assert len(said) == 1  # nothing written: nothing caught up
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    wait_until(lambda: (writer.pump(), writer.backlog_bytes == 0)[1], "the backlog written")
    writer.send(message(10))  # (the pipe has room once the writer reads)
    wait_until(lambda: (writer.send(message(10)), len(said) == 2)[1], "caught up, said")
    assert f"{writer.lost:,} records were left out" in said[1] and "caught up" in said[1]
    writer.close()


def test_a_training_process_killed_leaves_every_record_it_published_in_the_log(run_dir):
    """A real training job SIGKILLed: its writer sees the pipe end and writes everything
    it was handed, with the summary; every record a subscriber saw is in the log."""
    job = subprocess.Popen([sys.executable, str(VICTIM), "ipc", "1000000"], env=job_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(job.stdout.readline())
        writer = _writer_of(job.pid)
        info = wait_until(lambda: runs.find_run(), "the run file")
        last_seen = 0
        with Subscriber(info) as subscriber:
            while last_seen < 8:  # a few batches of steps, heartbeats, system samples
                message = subscriber.recv(timeout_s=30)
                assert message is not None
                last_seen = max(last_seen, message["seq"])
        job.kill()
        job.wait(30)
        writer.wait(30)  # it saw the pipe's end and wrote it all
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    path = started["log_path"]
    seqs = _seqs(path)
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= last_seen
    summary = runlog.read_summary(runlog.summary_path(path))
    assert summary is not None and summary.covered == [0, os.path.getsize(path)]
    assert summary.records == len(seqs) and summary.ended is None  # no bye: killed


FORKING_JOB = """
import os, sys, time
import torch
from agent.step.core import Agent
from agent.step.record import StepRecord
monitor = Agent(name="forking").start()
for step in range(1, 301):
    monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=32,
                                      data_wait_s=0.0, loss=torch.tensor(1.0 / step)))
print(monitor.info.log_path, flush=True)
sys.stdin.readline()  # (once they are logged: the I/O thread is then past its start-up)
if os.fork() == 0:  # a process forked as a DataLoader worker is: it holds the pipe too
    time.sleep(120)
    os._exit(0)
print("forked", flush=True)
time.sleep(120)
"""


def test_a_writer_whose_pipe_a_forked_process_holds_ends_with_its_parent(run_dir):
    """The training process SIGKILLed while a process it forked (a DataLoader worker)
    lives on, holding the pipe open: the writer ends all the same, its parent gone, with
    every step in the log."""
    job = subprocess.Popen([sys.executable, "-c", FORKING_JOB], env=job_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        path = job.stdout.readline().strip()
        wait_until(lambda: 300 in [r.get("step") for r in history.flat_records(path)],
                   "the steps written")
        job.stdin.write("fork\n")
        job.stdin.flush()
        assert job.stdout.readline() == "forked\n"
        writer = _writer_of(job.pid)
        (forked,) = _children(job.pid)[" ".join(job.args)]
        children = [writer, forked]
        job.kill()
        job.wait(30)
        writer.wait(30)
        assert forked.is_running()  # it still holds the pipe: the writer did not wait
    finally:
        for process in children:  # (the forked one, and a writer that failed to end)
            with contextlib.suppress(psutil.Error):
                process.kill()
        if job.poll() is None:
            job.kill()
            job.wait()
    steps = [r["step"] for r in history.flat_records(path) if r["type"] == "step"]
    assert steps == list(range(1, 301))
    summary = runlog.read_summary(runlog.summary_path(path))
    assert summary is not None and summary.steps == 300


DEFAULT_SIGPIPE_JOB = """
import signal, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a script made for `| head` sets it
import torch
from agent.step.core import Agent
from agent.step.record import StepRecord
monitor = Agent(name="sigpipe").start()

def train(first, count):
    for step in range(first, first + count):
        monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=32,
                                          data_wait_s=0.0, loss=torch.tensor(1.0 / step)))
    return first + count

step = train(1, 300)
print(monitor._io._log.pid, flush=True)
sys.stdin.readline()  # the writer is dead now
while not [error for error in monitor.errors if "run log failed" in error]:
    step = train(step, 10)  # a batch written to the dead writer's pipe: EPIPE
step = train(step, 500)
monitor.close()
print(f"trained {step - 1}", flush=True)
"""


@pytest.mark.parametrize("death", ["killed", "disk full"])
def test_a_writer_that_dies_never_kills_a_job_whose_sigpipe_is_the_default(run_dir, death):
    """A script that puts SIGPIPE back to its default (for `| head`) is not killed by the
    write to the pipe of a writer that died (killed, or out of disk): the agent's write
    fails with EPIPE, is said, and training goes on."""
    job = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGPIPE_JOB], env=job_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        writer = psutil.Process(int(job.stdout.readline()))
        if death == "killed":
            writer.kill()
        else:  # the log may not grow: its next frame fails, and the writer exits
            path = runs.find_run().log_path
            resource.prlimit(writer.pid, resource.RLIMIT_FSIZE, (os.path.getsize(path),) * 2)
        writer.wait(30)
        with contextlib.suppress(BrokenPipeError):  # (a job killed meanwhile: said below)
            job.stdin.write("dead\n")
            job.stdin.close()
        out = job.stdout.read()
        job.wait(120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, f"the job ended with {job.returncode} (-13: SIGPIPE)"
    assert out.split()[-2:][0] == "trained" and int(out.split()[-1]) >= 800


def test_an_io_thread_stuck_at_close_is_said_and_left_behind(run_dir, caplog):
    """close() waits its timeout for the I/O thread, not longer; one still stuck then (here
    a listener that blocks on the I/O thread, as a flood in ZeroMQ's poll did) is said:
    the run log may lack its end. Released, the thread ends."""
    stuck, release = threading.Event(), threading.Event()

    def listener(record):  # the events the I/O thread raises are told on it
        if threading.current_thread().name == "gpuwatch-agent":
            stuck.set()
            release.wait(60)

    run = agent.Agent(name="stuck").start()
    try:
        run.add_listener(listener)
        writer = psutil.Process(run._io._log.pid)
        writer.kill()  # the next batch's write fails: an error event, on the I/O thread
        writer.wait(30)
        step = 0
        while not stuck.is_set() and step < 100_000:
            step += 1
            run.optimizer_step(StepRecord(1, 8, 0.0, step=step))
            stuck.wait(0.001)
        assert stuck.is_set()
        with caplog.at_level(logging.WARNING, logger="gpuwatch.agent"):
            run.close(timeout_s=0.5)
        assert "its I/O thread did not end within 0.5 s: the run log may lack" in caplog.text
    finally:
        release.set()
    run._io._thread.join(30)
    assert not run._io._thread.is_alive()
