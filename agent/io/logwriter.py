"""The run log's writer, a child process: the training process only hands it bytes.

The I/O thread encodes each message for the wire once (:func:`agent.wire.protocol.encode`)
and hands the same payload to the writer (``python -m agent.io.logwriter``) through a pipe:
its length (u32, little-endian), then its bytes, in one ``write`` a message. The writer
unpacks it and writes the log with :class:`agent.wire.runlog.RunLog`, as the I/O thread did
before (the summary, packing, deflate, frames, parts, thinning): about 1.9 us of CPU a step
at 4,000 steps/s that is no longer GIL time the training thread waits for. A length of 0
is the end: the writer writes what is left, ends the chunk, saves the summary and exits.

Started as the agent's other helpers are (:func:`agent.io.helpers.launch`), with one JSON
line of settings (``name``: the log's file name in :func:`agent.wire.runlog.log_dir`;
``parent``: the training process's id), but not waited for: the agent makes and checks
the log's file itself first (:func:`agent.wire.runlog.create_log`: a private directory,
no link followed, mode 0600), so that a refused log is said at once, and sends its
messages while the writer starts (they wait in the pipe). The writer answers nothing
once it has opened the log, and ``{"error"}`` when it is refused (the same checks, made
again) or cannot be opened; the agent finds it exited and says so. It runs at a low
priority, holds no descriptor of the agent's but its pipe, imports neither torch nor
zmq, and ignores SIGINT, SIGTERM and SIGHUP, which a terminal or a launcher sends the
training process's whole group: it ends when the agent sends the end, when the pipe
closes (the training process gone, even by SIGKILL: it writes everything it was sent
first) or, should a forked process (a DataLoader worker) still hold the pipe open, within
:data:`PARENT_CHECK_S` of its parent's death. A writer that fails (a full disk) says why
in one ``{"error"}`` line on stdout and exits with status 1.

The training process's side (:class:`LogWriter`) never blocks: the pipe is non-blocking;
what does not fit waits in a bounded backlog (:data:`BACKLOG_BYTES`) written at the next
message or wake-up, and past the bound messages are left out of the log, counted and said
(an ``agent_error`` event). A writer that dies is said once, and the run goes on without a
log from there (what was written stays readable); it is not written in the training
process instead: a writer that died of a full disk would fail there too, and the training
process must not take on the cost this module moves out of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any, Callable, TextIO

import msgpack

from agent.io import helpers
from agent.wire.runlog import RunLog, create_log

#: Bytes of messages the training process keeps while the pipe is full (the writer
#: stopped, or behind a slow disk): about 30 s of steps of 16 fields at 4,000 steps/s.
#: Past it, messages are left out of the log, counted and said.
BACKLOG_BYTES = 32 << 20
#: The pipe's capacity asked of Linux (its default: 64 KiB): a second of such steps.
PIPE_BYTES = 1 << 20
#: How long :meth:`LogWriter.close` waits for the writer to write the log's end (s).
CLOSE_S = 5.0
#: The writer checks that its parent lives at least this often (s).
PARENT_CHECK_S = 1.0
#: Bytes the writer reads from the pipe at a time.
_READ_BYTES = 1 << 20
_LENGTH = struct.Struct("<I")
#: The message length that says "the end".
_END = _LENGTH.pack(0)


class LogWriter:
    """The training process's side of the log writer; the I/O thread's alone.

    Made by :meth:`start`. Each :meth:`send` costs one ``write`` system call; nothing
    here blocks but :meth:`close`, which waits at most :data:`CLOSE_S`.

    Args:
        process: the writer, as :func:`agent.io.helpers.start` started it (its stdin: the
            pipe). path: the log it writes.
        report: ``report(where, exc)``: where its death and messages left out are said
            (the agent's ``report_error``: an ``agent_error`` event, once per message).

    Attributes:
        path: the log's first part. pid: the writer's process id. lost: messages left
            out of the log because the backlog was full. backlog_bytes: bytes waiting
            for room in the pipe.
    """

    def __init__(self, process: subprocess.Popen, path: Path,
                 report: Callable[[str, BaseException], None]) -> None:
        assert process.stdin is not None and process.stdout is not None  # both PIPE
        self.path = path
        self.pid = process.pid
        self.lost = 0
        self.backlog_bytes = 0
        self._process: subprocess.Popen | None = process
        self._report = report
        self._fd = process.stdin.fileno()
        self._backlog: deque[memoryview] = deque()
        self._lost_said = 0
        self._written_bytes = 0
        self._read_at_loss = 0  # (what the writer had read at the first loss unsaid)
        os.set_blocking(self._fd, False)
        os.set_blocking(process.stdout.fileno(), False)
        with contextlib.suppress(OSError, AttributeError):  # not Linux, past the quota
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)

    @classmethod
    def start(cls, name: str, report: Callable[[str, BaseException], None]) -> LogWriter:
        """Start the writer of the log ``name`` (a file name) in :func:`agent.wire.runlog.log_dir`.

        Makes the log's first part here (:func:`agent.wire.runlog.create_log`) and starts
        the writer without waiting for it (its start, 0.05 to 0.15 s of CPU, goes on
        beside the training process: what is sent meanwhile waits in its pipe). About
        3 ms, a fork and an exec.

        Raises:
            ValueError: ``name`` is not a file name.
            agent.wire.runs.UnsafeDirectoryError, agent.wire.runlog.UnsafeLogFileError,
                OSError: the directory or the file is refused or cannot be made, or no
                process could be started.
        """
        path = create_log(name)
        process = helpers.launch("agent.io.logwriter", {"name": name, "parent": os.getpid()},
                                 "run log writer")
        return cls(process, path, report)

    def send(self, payload: bytes) -> None:
        """Hand the writer one encoded message (:func:`agent.wire.protocol.encode`'s payload).

        One ``write`` of its length and bytes; never blocks. When the pipe is full it waits
        in the backlog (written by later calls and :meth:`pump`), and past
        :data:`BACKLOG_BYTES` it is left out of the log: counted in :attr:`lost` and said.
        A writer found dead is said once; nothing is sent after."""
        if self._process is None:
            return
        head = _LENGTH.pack(len(payload))
        if self._backlog:
            self._keep(head + payload)
            self._drain()
            return
        try:
            written = os.writev(self._fd, (head, payload))
        except BlockingIOError:  # the pipe is full
            self._keep(head + payload)
            return
        except OSError:  # EPIPE: the writer is gone
            self._gone()
            return
        self._written_bytes += written
        if written < len(head) + len(payload):  # the rest of a message begun is kept,
            rest = memoryview(head + payload)[written:]  # whatever the bound: the stream
            self._backlog.append(rest)  # stays whole
            self.backlog_bytes += len(rest)
        else:  # a whole message sent: past a loss, has the writer caught up?
            self._say_caught_up()

    def _keep(self, data: bytes) -> None:
        if self.backlog_bytes + len(data) > BACKLOG_BYTES:
            self.lost += 1
            if self.lost == self._lost_said + 1:
                self._read_at_loss = self._read_bytes()
                self._report("run log", RuntimeError(
                    f"its writer (pid {self.pid}) is behind (stopped, or a slow disk; "
                    f"its pipe is full and {self.backlog_bytes:,} bytes wait): records are "
                    "left out of the log until it catches up"))
            return
        self._backlog.append(memoryview(data))
        self.backlog_bytes += len(data)

    def pump(self) -> None:
        """Write the backlog as far as the pipe takes it; notice a writer that died.

        Each I/O wake-up calls it: a ``waitpid`` and, with a backlog, a ``write``."""
        if self._process is None:
            return
        if self._process.poll() is not None:
            self._gone()
            return
        self._drain()

    def _drain(self) -> None:
        """Write the backlog's messages until the pipe is full; say what was left out
        once the backlog is written and the writer reads again (:meth:`_say_caught_up`)."""
        while self._backlog:
            data = self._backlog[0]
            try:
                written = os.write(self._fd, data)
            except BlockingIOError:
                return
            except OSError:  # EPIPE: the writer is gone
                self._gone()
                return
            self.backlog_bytes -= written
            self._written_bytes += written
            if written < len(data):
                self._backlog[0] = data[written:]
                return
            self._backlog.popleft()
        self._say_caught_up()

    def _say_caught_up(self) -> None:
        """Past a loss, with the backlog written: say what was lost once the writer has
        read since (a stopped writer's pipe takes a small message into the room its last
        page has left: no sign of a writer caught up)."""
        if self.lost > self._lost_said and self._read_bytes() > self._read_at_loss:
            self._report("run log", RuntimeError(
                f"its writer caught up: {self.lost - self._lost_said:,} records were left "
                "out of the log while it was behind (their seq numbers are missing)"))
            self._lost_said = self.lost

    def _read_bytes(self) -> int:
        """Bytes the writer has read from the pipe: those written less those still in it
        (``FIONREAD``; where it fails, all those written)."""
        unread = array("i", [0])
        with contextlib.suppress(OSError):
            fcntl.ioctl(self._fd, termios.FIONREAD, unread)
        return self._written_bytes - unread[0]

    def _gone(self) -> None:
        """The writer died (killed, a full disk): say so, with its reason, once."""
        process, self._process = self._process, None
        assert process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):  # (a pipe closed: it is
            helpers.wait_exit(process, 1.0)  # exiting, microseconds from its status)
        reason = _reason(process)
        self._close_pipes(process)
        self._report("run log", RuntimeError(
            f"its writer (pid {self.pid}) exited with status {process.returncode}{reason}; "
            f"the run goes on without a run log from here ({self.path} keeps what was "
            "written)"))

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """Send what is left and the end; wait until the writer has written all and the summary.

        At most ``timeout_s`` (s): a writer that has not finished by then finishes alone
        (said once), and what the backlog still holds then is left out (counted, said).
        Idempotent; never raises."""
        process = self._process
        if process is None:
            return
        deadline = time.monotonic() + timeout_s
        self._backlog.append(memoryview(_END))
        self.backlog_bytes += len(_END)
        while self._backlog and self._process is not None:
            self._drain()
            left = deadline - time.monotonic()
            if not self._backlog or left <= 0:
                break
            with contextlib.suppress(OSError, ValueError):
                select.select([], [self._fd], [], left)
        if self._process is None:  # it died meanwhile (said)
            return
        self._process = None
        self.lost += max(0, len(self._backlog) - 1)  # the messages before the end
        self._backlog.clear()
        self.backlog_bytes = 0
        if self.lost > self._lost_said:
            self._report("run log", RuntimeError(
                f"{self.lost - self._lost_said:,} records were left out of the log: its "
                "writer was behind at the end"))
        assert process.stdin is not None  # a PIPE
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            status = helpers.wait_exit(process, deadline - time.monotonic())
        except subprocess.TimeoutExpired:
            self._report("run log", RuntimeError(
                f"its writer (pid {self.pid}) had not written the log's end within "
                f"{timeout_s:.0f} s; it finishes alone"))
        else:
            if status != 0:
                self._report("run log", RuntimeError(
                    f"its writer (pid {self.pid}) exited with status {status} at the end"
                    f"{_reason(process)}"))
        self._close_pipes(process)

    def _close_pipes(self, process: subprocess.Popen) -> None:
        self._backlog.clear()
        self.backlog_bytes = 0
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _reason(process: subprocess.Popen) -> str:
    """What a writer that ended said on its stdout (``{"error"}``), as `` (reason)``, or ""."""
    assert process.stdout is not None  # a PIPE, non-blocking
    with contextlib.suppress(OSError, ValueError):
        answer = json.loads(os.read(process.stdout.fileno(), 1 << 16) or b"{}")
        if isinstance(answer, dict) and isinstance(answer.get("error"), str):
            return f" ({answer['error']})"
    return ""


# --- the writer's process -------------------------------------------------------------

def serve(settings: dict[str, Any], stdin_fd: int, out: TextIO) -> int:
    """Open the log and write what ``stdin_fd`` brings until the end.

    Args:
        settings: ``name``: the log's file name in :func:`agent.wire.runlog.log_dir`;
            ``parent``: the process id of the agent's process.
        stdin_fd: the pipe of length-prefixed messages (see the module's documentation).
        out: where a failure's reason goes, as ``{"error"}`` (nothing else is written).

    Returns:
        The exit status: 0 once the log is closed, 1 when writing failed (said on ``out``).

    Raises:
        ValueError: ``name`` is not a file name, or ``parent`` not a process id.
        agent.wire.runs.UnsafeDirectoryError, agent.wire.runlog.UnsafeLogFileError, OSError:
            the log is refused or cannot be opened (:func:`agent.io.helpers.main` answers so).
    """
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)  # it ends when its parent says so, or dies
    with contextlib.suppress(OSError):
        os.nice(10)
    parent = settings["parent"]
    if not isinstance(parent, int) or isinstance(parent, bool):
        raise ValueError(f"not a process id: {parent!r}")
    log = RunLog(create_log(settings["name"]))
    try:
        try:
            _copy(stdin_fd, log, parent)
        finally:
            log.close()  # what it has, and the summary
    except OSError as exc:  # a full disk, the file gone
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    return 0


def _copy(fd: int, log: RunLog, parent: int) -> None:
    """Write each message the pipe brings to ``log``, and its frames when they are due,
    until the end, the pipe's end or the parent's death.

    Raises:
        OSError: the log cannot be written.
    """
    pending = bytearray()
    while True:
        wait = log.flush_wait_s()
        ready, _, _ = select.select([fd], [], [], PARENT_CHECK_S if wait is None
                                    else min(wait, PARENT_CHECK_S))
        if ready:
            chunk = os.read(fd, _READ_BYTES)
            if not chunk or not _write_messages(pending, chunk, log):
                return
        elif os.getppid() != parent:  # nothing to read and no one to send it
            return
        log.maybe_flush()


def _write_messages(pending: bytearray, chunk: bytes, log: RunLog) -> bool:
    """Append ``chunk`` to ``pending`` and write the whole messages it now holds to
    ``log``; False at the end. A message that is not a msgpack map is skipped (the
    agent encoded it: it never is)."""
    pending += chunk
    at = 0
    more = True
    with memoryview(pending) as view:
        while len(view) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(view, at)
            if size == 0:
                more = False
                break
            if len(view) - at - _LENGTH.size < size:
                break
            start, at = at + _LENGTH.size, at + _LENGTH.size + size
            try:
                message = msgpack.unpackb(view[start:at], raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001 -- msgpack raises several unrelated types
                continue
            if isinstance(message, dict):
                log.write(message)
    del pending[:at]
    return more


if __name__ == "__main__":
    sys.exit(helpers.main(serve))
