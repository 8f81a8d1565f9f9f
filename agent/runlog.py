"""The run log: every record the agent publishes, appended to a file on disk.

One JSON object per line (:func:`agent.protocol.to_json_line`; a ``steps`` batch of the
wire is written as one ``step`` line per optimizer step), so a finished or running run
can be replayed (``gpuwatch replay FILE``), printed (``gpuwatch tail --json FILE``) or
read as a table, the steps alone in one line:
``pandas.read_json(path, lines=True).query("type == 'step'")``. Written only by the agent's
I/O thread, buffered, flushed at most every ``flush_interval_s``; the size is bounded by
rotation (``run.jsonl`` -> ``run.jsonl.1`` -> ...), keeping ``backups`` old files.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Any

import platformdirs

from agent import protocol
from agent.runs import private_dir

#: Environment variable that overrides the run-log directory.
LOG_DIR_ENV = "GPUWATCH_LOG_DIR"


def log_dir() -> Path:
    """The per-user directory of run logs (``$GPUWATCH_LOG_DIR``, else the user data
    directory's ``runs/``), created with mode 0700.

    Checked as :func:`agent.runs.private_dir` checks: a symbolic link, another user's
    directory or one writable by others (a shared ``$GPUWATCH_LOG_DIR`` where another
    user could plant links to your files) is refused.

    Raises:
        agent.runs.UnsafeDirectoryError: the directory is refused (see above).
        OSError: it cannot be created.
    """
    override = os.environ.get(LOG_DIR_ENV)
    path = Path(override) if override else (
        Path(platformdirs.user_data_dir("gpuwatch", appauthor=False)) / "runs")
    return private_dir(path, LOG_DIR_ENV)


class UnsafeLogFileError(PermissionError):
    """The run log's path is a symbolic link, or a file that is not a regular file of
    this user with a single link: it is never written through."""


class RunLog:
    """Append-only JSON-lines file with size-bounded rotation.

    Args:
        path: the log file (created with mode 0600).
        max_bytes: rotate when the file passes this size, in bytes.
        backups: rotated files kept (older ones are deleted).
        flush_interval_s: longest time a record stays in the buffer, in seconds.

    Raises:
        UnsafeLogFileError: ``path`` is a symbolic link, or not a regular file of this
            user with one link (a hard link to another file); nothing is written.
        OSError: the file cannot be created (the agent then runs without a log).
    """

    def __init__(self, path: Path, *, max_bytes: int = 64 << 20, backups: int = 3,
                 flush_interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.flush_interval_s = flush_interval_s
        self._file = self._open()
        self._size = self._file.tell()
        self._last_flush = time.monotonic()
        self._hello_line: bytes | None = None  # the latest hello, to start each new file

    def _open(self):
        """Open (or create, mode 0600) the file for appending, never through a link.

        Raises:
            UnsafeLogFileError: see the class.
            OSError: it cannot be opened.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o600)  # NONBLOCK: a planted FIFO fails
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeLogFileError(f"{self.path} is a symbolic link; the run log "
                                         "is not written through it") from None
            raise
        status = os.fstat(fd)
        if (not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid()
                or status.st_nlink != 1):
            os.close(fd)
            raise UnsafeLogFileError(
                f"{self.path} is not a regular file of this user with a single link; "
                "the run log is not written to it")
        return os.fdopen(fd, "ab", buffering=1 << 16)

    def write(self, message: dict[str, Any]) -> None:
        """Append one envelope (flattened) as a line; a ``steps`` batch as one ``step``
        line a row (:func:`agent.protocol.step_lines`), so the log stays one flat table.
        After a rotation the new file starts with the latest ``hello``, so that every
        file can be replayed alone."""
        if message.get("type") == protocol.STEPS:
            line = protocol.step_lines(message)
        else:
            line = protocol.to_json_line(message)
        if message.get("type") == protocol.HELLO:
            self._hello_line = line
        self._file.write(line)
        self._size += len(line)
        if self._size >= self.max_bytes:
            self._rotate()

    def maybe_flush(self) -> None:
        """Flush if the oldest buffered record is older than ``flush_interval_s``."""
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval_s:
            self._file.flush()
            self._last_flush = now

    def _rotate(self) -> None:
        self._file.close()
        if self.backups:
            for index in range(self.backups - 1, 0, -1):
                older = Path(f"{self.path}.{index}")
                if older.exists():
                    older.replace(f"{self.path}.{index + 1}")
            self.path.replace(f"{self.path}.1")
        else:
            self.path.unlink()
        self._file = self._open()
        self._size = 0
        if self._hello_line is not None:
            self._file.write(self._hello_line)
            self._size = len(self._hello_line)

    def close(self) -> None:
        """Flush and close. Idempotent."""
        if not self._file.closed:
            self._file.close()
