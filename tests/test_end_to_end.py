"""End to end: the demo training job in a real subprocess, a real client, real signals."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.demo import held_out_evaluation
from agent.wire import runs
from gpuopt.demo import build_demo
from gpuwatch.client import Subscriber, send_command
from tests.conftest import wait_until
from tests.training import messages


def wait_for_run(process, timeout_s=60):
    """The run file of ``process`` (polled: the file appears from another process)."""
    return wait_until(lambda: next((info for info in runs.list_runs()
                                    if info.pid == process.pid), None),
                      "the demo's run file", timeout_s=timeout_s, alive=[process])


@pytest.fixture
def demo(run_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "agent.demo", "--model", "cnn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_precision_change_shows_at_a_step_boundary_and_sigterm_ends_cleanly(demo):
    info = wait_for_run(demo)
    with Subscriber(info) as sub:
        first = None
        while first is None:
            message = sub.recv(30)
            assert message is not None
            if message["type"] == "step":
                first = message["body"]
        assert first["knobs"]["precision"] == "fp32"
        reply = send_command(info, "precision", "bf16")
        assert reply["ok"], reply
        applied_at = reply["apply_step"]
        applied_event = None
        later_steps = []
        while len(later_steps) < 5:
            message = sub.recv(30)
            assert message is not None
            body = message["body"]
            if message["type"] == "event" and body.get("kind") == "applied":
                applied_event = body
            if message["type"] == "step" and body["step"] >= applied_at:
                assert body["knobs"]["precision"] == "bf16"
                later_steps.append(body["step"])
            elif message["type"] == "step":
                assert body["knobs"]["precision"] == "fp32"
        assert applied_event["text"] == f"precision=bf16 applied at step {applied_at}"
        assert later_steps == list(range(later_steps[0], later_steps[0] + 5))

        demo.send_signal(signal.SIGTERM)
        while True:
            message = sub.recv(30)
            assert message is not None
            if message["type"] == "bye":
                break
    assert demo.wait(30) == 0
    ended = re.search(r"gpuwatch demo: ended at step (\d+) \(stopped by SIGTERM; (\d+) "
                      r"steps trained\)\n", demo.stdout.read())
    assert ended is not None and ended[1] == ended[2]  # (not resumed: every step here)
    assert not os.path.exists(info.path)


def test_the_demos_last_line_says_how_it_ended_and_what_this_job_trained():
    # a newcomer read "stopped after 163 optimizer steps" for a run resumed at step 64
    # that finished its --max-steps: 99 trained by that job
    from agent.demo import ended_line

    assert ended_line(163, 64, None) == ("gpuwatch demo: ended at step 163 (finished; 99 "
                                         "steps trained after the resume at step 64)")
    assert ended_line(1200, 0, "stopped by SIGINT") == (
        "gpuwatch demo: ended at step 1,200 (stopped by SIGINT; 1,200 steps trained)")
    # (one line in an 80-column terminal, up to 999,999 steps: "optimizer steps" made
    # a newcomer's 124-step line wrap its last character)
    assert len(ended_line(999_999, 0, "stopped by SIGINT")) <= 80


@pytest.mark.slow
def test_num_workers_switch_live_through_the_command_path(demo):
    info = wait_for_run(demo)
    with Subscriber(info) as sub:
        message = sub.recv(30)
        assert message is not None
        # (generous timeouts: a demo with loader workers answers late on a busy host)
        assert send_command(info, "num_workers", -1, timeout_s=30)["reason"].startswith(
            "num_workers: -1 is below the minimum 0")
        assert not send_command(info, "prefetch_factor", 0, timeout_s=30)["ok"]
        reply = send_command(info, "num_workers", 2, timeout_s=30)
        assert reply["ok"], reply
        seen_after = []
        while len(seen_after) < 3:
            message = sub.recv(30)
            assert message is not None
            body = message["body"]
            if message["type"] == "step" and body["step"] >= reply["apply_step"]:
                assert body["knobs"]["num_workers"] == 2
                assert body["input_verdict"] in (
                    "input-bound", "partly input-bound", "compute-bound")
                seen_after.append(body["step"])
            elif message["type"] == "step":
                assert body["knobs"]["num_workers"] == 0
    demo.send_signal(signal.SIGTERM)
    assert demo.wait(30) == 0


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_the_demo_evaluates_on_its_held_out_split_drawing_no_random_number(name):
    """The demo's eval_fn equals the loss (and, for the digits, the accuracy) over the
    whole held-out split in one batch, computed by hand; the global generator is left
    as it was (the training after it goes on as without it)."""
    workload = build_demo(name)
    evaluate = held_out_evaluation(workload, 64)
    assert evaluate is not None
    rng = torch.get_rng_state()
    metrics = evaluate()
    assert torch.equal(torch.get_rng_state(), rng) and not workload.model.training
    val = workload.val_dataset
    inputs, targets = (torch.stack(column) for column in zip(*(val[i] for i in range(len(val)))))
    with torch.no_grad():
        output = workload.model(inputs)
    assert metrics["val_loss"] == pytest.approx(float(workload.loss_fn(output, targets)),
                                                rel=1e-5)
    if name == "cnn":
        assert metrics["val_accuracy"] == float((output.argmax(-1) == targets).sum()) / len(val)
    else:
        assert set(metrics) == {"val_loss"}


def test_evaluate_now_in_the_demo_runs_on_its_held_out_split(demo):
    """E / evaluate=now in `gpuwatch demo`: an evaluation event with the held-out loss
    and accuracy, and the training goes on."""
    info = wait_for_run(demo)
    with Subscriber(info) as sub:
        messages(sub, lambda m: m["type"] == "step", timeout_s=60)
        reply = send_command(info, "evaluate", "now", timeout_s=30)
        assert reply["ok"], reply
        seen = messages(sub, lambda m: m["type"] == "step"
                        and m["body"]["step"] >= reply["apply_step"] + 1, timeout_s=60)
    [event] = [m["body"] for m in seen if m["type"] == "event"
               and m["body"].get("kind") == "evaluation"]
    assert event["step"] == reply["apply_step"] - 1
    assert set(event["metrics"]) == {"val_loss", "val_accuracy"}
    assert 0 < event["metrics"]["val_loss"] < 10 and 0 <= event["metrics"]["val_accuracy"] <= 1


@pytest.mark.slow
def test_the_demo_job_ends_with_the_process_that_started_it(run_dir):
    """``gpuwatch demo`` passes its pid: a dashboard killed (or hung up on) must not
    leave its training job running. A stand-in parent that we SIGKILL plays its part."""
    parent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    job = subprocess.Popen(
        [sys.executable, "-m", "agent.demo", "--model", "cnn", "--parent-pid",
         str(parent.pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        info = wait_for_run(job)
        with Subscriber(info) as sub:
            message = sub.recv(30)
            assert message is not None
            parent.kill()
            parent.wait()
            while message["type"] != "bye":
                message = sub.recv(30)
                assert message is not None
        assert message["body"]["reason"] == f"its parent process {parent.pid} ended"
        assert job.wait(30) == 0
        assert "gpuwatch demo: ended at step" in job.stdout.read()
        assert not os.path.exists(info.path)
    finally:
        for process in (parent, job):
            if process.poll() is None:
                process.kill()
                process.wait()


class Terminal:
    """``gpuwatch`` running in a real pseudo-terminal (80x24), its output drained by a
    thread so the app never blocks on a full terminal."""

    def __init__(self, *args):
        import fcntl
        import pty
        import struct
        import termios
        import threading

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch", *args], stdin=slave, stdout=slave,
            stderr=slave, env={**os.environ, "TERM": "xterm-256color"},
            start_new_session=True)
        os.close(slave)
        self.output = bytearray()
        self.hung_up = False
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            self.output += chunk

    def type(self, keys):
        os.write(self.master, keys)

    def hang_up(self):
        """What closing the terminal (an SSH session, a tmux window) does: the pty goes
        (every later write to it fails with EIO) and its process group gets SIGHUP."""
        os.close(self.master)  # (the drain thread's read then fails: it ends)
        self.hung_up = True
        os.killpg(self.process.pid, signal.SIGHUP)

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if not self.hung_up:
            os.close(self.master)


def training_child_of(dashboard, timeout_s=90):
    """The run file of the training job the ``gpuwatch demo`` dashboard started."""
    return wait_until(lambda: next((info for info in runs.list_runs()
                                    if info.pid != dashboard.pid), None),
                      "the demo job's run file", timeout_s=timeout_s, poll_s=0.1,
                      alive=[dashboard])


def gone(pid, timeout_s=30):
    """Whether process ``pid`` has ended within ``timeout_s`` (it is not our child)."""
    import psutil

    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("end", ["q", pytest.param("SIGTERM", marks=pytest.mark.slow),
                                 pytest.param("hangup", marks=pytest.mark.slow),
                                 pytest.param("SIGKILL", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_gpuwatch_demo_in_a_terminal_leaves_nothing_behind(run_dir, end):
    terminal = Terminal("demo", "--model", "cnn")
    try:
        info = training_child_of(terminal.process)
        with Subscriber(info) as sub:
            assert messages(sub, lambda m: m["type"] == "step", timeout_s=60)
        # the dashboard is up (its alternate screen): before it, the job may already
        # train while `gpuwatch demo` is still waiting for its run file, where a signal
        # ends it as 128 + the signal (the job stopped all the same)
        wait_until(lambda: b"\x1b[?1049h" in bytes(terminal.output), "the dashboard",
                   timeout_s=60, detail=lambda: bytes(terminal.output[-400:]).decode(
                       errors="replace"))
        if end == "q":
            terminal.type(b"q")
            assert terminal.process.wait(60) == 0
            # the job's last line, as --no-ui ends, once the dashboard has closed (the
            # drain thread may not have read it yet)
            ended = re.compile(rb"gpuwatch demo: ended at step [0-9,]+ \(dashboard quit;"
                               rb" [0-9,]+ steps trained\)\s*$")
            wait_until(lambda: ended.search(bytes(terminal.output)),
                       "the demo job's last line after the dashboard", timeout_s=30,
                       detail=lambda: bytes(terminal.output[-400:]).decode(errors="replace"))
        elif end == "SIGTERM":  # as `timeout` or a scheduler ends it: as q does
            terminal.process.send_signal(signal.SIGTERM)
            assert terminal.process.wait(60) == 0
        elif end == "hangup":  # its terminal closed: no write can say anything any more
            terminal.hang_up()  # 0 when the dashboard took the SIGHUP, 129 when it came
            assert terminal.process.wait(60) in (0, 128 + signal.SIGHUP)  # on the way out
        else:  # a dashboard killed outright: its job must not train on
            terminal.process.kill()
            terminal.process.wait()
        assert gone(info.pid), "the training job is still running"
        assert not os.path.exists(info.path)
        logs = list(Path(run_dir).glob("demo-*.log"))
        assert logs == [] if end != "SIGKILL" else len(logs) == 1  # kept when not clean
    finally:
        terminal.close()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_gpuwatch_demo_no_ui_ends_its_training_job(run_dir, signum):
    """What ``timeout``, a scheduler or systemd send (SIGTERM), or a closed terminal
    (SIGHUP), to ``gpuwatch demo --no-ui`` alone: the job must end with it, said bye."""
    command = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "demo", "--no-ui", "--model", "cnn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # the signal reaches the command only, not its group
    try:
        info = training_child_of(command)
        with Subscriber(info) as sub:
            assert messages(sub, lambda m: m["type"] == "step", timeout_s=60)
            command.send_signal(signum)
            bye = messages(sub, lambda m: m["type"] == "bye", timeout_s=60)
        assert bye[-1]["body"]["reason"] == f"stopped by {signum.name}"  # as it was sent
        assert command.wait(60) == 128 + signum
        assert gone(info.pid), "the training job is still running"
        assert not os.path.exists(info.path)
        output = command.stdout.read()
        lines = output.rstrip().splitlines()  # the job's last line is the last word of
        ended = max(index for index, line in enumerate(lines)  # the job (the command's
                    if line.startswith("gpuwatch demo: ended at step"))  # notice that
        assert all(line.startswith("gpuwatch demo: stopping the training job")  # it is
                   for line in lines[ended + 1:]), lines[-3:]  # stopping may race it)
        [logged] = [run for run in json.loads(subprocess.run(  # the run log says it too
            [sys.executable, "-m", "gpuwatch", "runs", "--all", "--json"],
            capture_output=True, text=True, check=True).stdout)
                    if run["run_id"] == info.run_id]
        assert logged["ended"] == f"stopped by {signum.name}"
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for left in runs.list_runs():  # (a failed test leaves no job behind either)
            with contextlib.suppress(ProcessLookupError):
                os.kill(left.pid, signal.SIGKILL)
