"""The agent's helper processes: the tcp gateway, the node relay and the run log's writer.

The tcp gateway is :mod:`agent.io.gateway`, the node relay :mod:`agent.io.relay`, the log
writer :mod:`agent.io.logwriter`. Each is ``python -m <module>`` with the agent's own import
path; it reads one JSON line of settings on stdin, answers one JSON line on stdout (with
``pub_port`` and ``cmd_port``; or ``error``: the log writer answers only that, and only
when it fails, so that the agent need not wait for its start), and ends when its stdin
closes: when the agent closes it, or when the training process dies, however."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

#: How long a helper may take to answer (s): a loaded host can take seconds to start
#: Python.
START_S = 30.0

# What a client can make a run's sockets hold, the same on the training process's ipc
# sockets (agent.io.ioloop) and on a helper's tcp ones (agent.io.gateway, agent.io.relay).
#: Largest message a subscriber may send a PUB socket (a subscription: a topic of a
#: few bytes); a larger one disconnects it (a 100 MB "subscription" is never held).
MAX_SUBSCRIPTION_BYTES = 1024
#: Largest command message (bytes) and command messages queued per client: bound what
#: a flood of large messages can make a process hold.
MAX_COMMAND_BYTES = 64 * 1024
COMMAND_QUEUE = 64
#: A connection that has not completed its handshake (CURVE on tcp) by then is closed:
#: a peer without the run's key holds a file descriptor this long at most (ms).
HANDSHAKE_MS = 2000
#: Telemetry messages queued per subscriber before a PUB socket drops them.
SEND_HIGH_WATER_MARK = 10_000
#: What a helper with sockets answers: the ports it listens on.
PORTS = {"pub_port": int, "cmd_port": int}


def start(module: str, settings: dict[str, Any], what: str
          ) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start ``python -m module`` with ``settings``; returns the process and its answer.

    Blocks until it answers (at most :data:`START_S`) with the fields of :data:`PORTS`.

    Raises:
        OSError: no Python executable, or the helper did not answer with those fields
            (its own error, or none within :data:`START_S`); the process is ended.
    """
    process = launch(module, settings, what)
    assert process.stdout is not None  # a PIPE
    try:
        readable, _, _ = select.select([process.stdout], [], [], START_S)
        line = process.stdout.readline() if readable else b""
    except OSError as exc:
        line = json.dumps({"error": str(exc)}).encode()
    try:
        answer = json.loads(line)
    except ValueError:
        answer = {"error": f"no answer within {START_S:.0f} s"}
    if not isinstance(answer, dict) or "error" in answer or not all(
            isinstance(answer.get(key), kind) for key, kind in PORTS.items()):
        stop(process)
        reason = answer.get("error", answer) if isinstance(answer, dict) else answer
        raise OSError(f"the {what} did not start: {reason}")
    return process, answer


def block_broken_pipe_signal() -> None:
    """Block SIGPIPE in the calling thread: a write to a helper that died fails with EPIPE.

    The agent's I/O thread calls it first: it alone writes to the helpers' pipes. Python
    ignores SIGPIPE, but a training script may set it back to its default (as scripts made
    for ``| head`` do), and then the write to the pipe of a log writer that died (killed,
    out of disk) would kill the training process. Blocked, the signal stays pending in this
    thread (discarded when it ends) and the write raises ``BrokenPipeError``, which the
    callers handle. Threads and processes started from this thread inherit the mask: zmq's
    block every signal anyway, and the helpers are Python, which ignores SIGPIPE."""
    if hasattr(signal, "pthread_sigmask"):  # (not on Windows)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})


def launch(module: str, settings: dict[str, Any], what: str) -> subprocess.Popen:
    """Start ``python -m module`` and write it ``settings``; returns at once.

    Its stdin and stdout are pipes; what it answers is the caller's to read. About 2 ms
    (a fork and an exec): the helper's own start (0.05 to 0.15 s of CPU: Python and its
    imports) goes on beside the caller.

    Raises:
        OSError: no Python executable, or it could not be started.
    """
    if not sys.executable:
        raise OSError(f"no Python executable to start the {what} with")
    home = str(Path(__file__).resolve().parent.parent)  # where `agent` is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        part for part in (home, os.environ.get("PYTHONPATH", "")) if part)}
    process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=env, close_fds=True)
    assert process.stdin is not None  # a PIPE
    try:  # (a pipe holds 64 KiB: the line fits whether the helper reads yet or not)
        process.stdin.write(json.dumps(settings).encode() + b"\n")
        process.stdin.flush()
    except OSError:  # it died before reading its settings: its answer (none) says so
        pass
    return process


def wait_exit(process: subprocess.Popen, timeout_s: float) -> int:
    """Wait at most ``timeout_s`` (s) for ``process`` to exit; returns its exit status.

    Woken by the exit itself (a pidfd, Linux 5.3 and later), where ``Popen.wait`` polls
    at growing intervals of up to 50 ms: a helper that exits 0.1 s from now is seen
    then, not up to 50 ms later.

    Raises:
        subprocess.TimeoutExpired: it is still running after ``timeout_s``.
    """
    if process.poll() is None:
        try:
            pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # not Linux, an old kernel: Popen's polling
            pass
        else:
            try:
                select.select([pidfd], [], [], max(0.0, timeout_s))  # readable at its exit
            finally:
                os.close(pidfd)
            timeout_s = 0.0  # (the exit is reaped at once; a timeout stays one)
    return process.wait(timeout_s)


def stop(process: subprocess.Popen) -> None:
    """Close the helper's stdin (it ends on EOF) and wait for it.

    Kill it if it lingers past 2 s."""
    assert process.stdin is not None and process.stdout is not None  # started with PIPE
    try:
        process.stdin.close()
        wait_exit(process, 2.0)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()
    process.stdout.close()


def main(serve: Callable[[dict[str, Any], int, TextIO], int],
         errors: tuple[type[Exception], ...] = ()) -> int:
    """The helper's side (its ``python -m`` entry); returns the exit status.

    Read one JSON line of settings on stdin and run ``serve(settings, stdin's fd, stdout)``,
    which answers on stdout and returns the exit status once stdin closes; bad settings, a
    failure to open or bind (``OSError``, or one of ``errors``: a socket's) are answered
    with ``{"error"}`` (exit status 1). The line is read a byte at a time (about 1 ms for
    the gateway's 700 bytes): nothing past it is taken from stdin, where the log writer's
    messages follow it at once."""
    answered: tuple[type[Exception], ...] = (ValueError, KeyError, TypeError, OSError, *errors)
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(sys.stdin.fileno(), 1)
        if not byte:  # the agent is gone (json.loads fails on what came: answered)
            break
        line += byte
    try:
        return serve(json.loads(line), sys.stdin.fileno(), sys.stdout)
    except answered as exc:
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        return 1
