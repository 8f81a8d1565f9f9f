"""The replay source: a run log (JSON lines, see :mod:`agent.runlog`) read back into a
RunState, and followed while it grows (``tail -F``), for ``gpuwatch replay FILE``.

Each line is one flattened record, ``{"type", "run", "rank", "seq", "t", **body}``
(:func:`agent.protocol.flatten`); :func:`gpuwatch.history.decode_line`, the one decoder
of run-log lines, turns it back into the envelope that :meth:`RunState.ingest` folds, so
a replay shows the same panels as the live run. A line that is not such a record is
counted as malformed and skipped.

Time: each record is folded at the moment it was written (its ``t``, unix seconds,
taken to the monotonic clock), never later than when it is read. So the run's status
means what it means live: a run log whose last record is a ``bye`` is "ended"; one that
keeps growing (the agent writes a heartbeat a second and flushes every 0.5 s) is "live"
(or "stalled" or "compiling"); one that stopped growing without a ``bye`` (a killed run)
is "gone" once its last record is :data:`~gpuwatch.state.GONE_AFTER_S` old. The backlog
of a long run is folded at once without ever looking live.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from gpuwatch.history import MAX_LINE_BYTES, decode_line
from gpuwatch.sources import Source

#: How often a followed file is checked for new lines (s).
POLL_S = 0.2
#: Lines folded per lock acquisition at most, so the app never waits long.
BATCH = 1000
#: Bytes read from the file at a time, and at most per :meth:`RunLogReader.read` (so
#: that lines of 1 MB are folded a few at a time, never a gigabyte at once).
CHUNK_BYTES = 1 << 20
#: Bytes read at most per :meth:`RunLogReader.read`, however short the lines.
READ_BYTES = 4 << 20


class RunLogReader:
    """Reads a run log's complete lines as envelopes: all of it, then what is appended.

    A line is read only once its newline is there (the agent may be writing it). When
    the path is replaced by a new file (the agent rotates ``run.jsonl`` to
    ``run.jsonl.1`` at 64 MiB) or truncated, reading goes on from the new file's start,
    as ``tail -F`` does. A path that does not exist yet is waited for.

    Args:
        path: the run log.

    Attributes:
        malformed: lines skipped because they were not records (bad JSON, not a map,
            no ``type``, longer than :data:`MAX_LINE_BYTES`).
        at_eof: the last :meth:`read` reached the end of the file.
    """

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = Path(path)
        self.malformed = 0
        self.at_eof = False
        self._file: BinaryIO | None = None
        self._inode: int | None = None
        self._partial = b""
        self._skipping = False  # inside a line over MAX_LINE_BYTES: drop to its newline

    def read(self, max_lines: int = BATCH) -> list[dict[str, Any]]:
        """Envelopes of the next complete lines, at most about ``max_lines`` and
        :data:`READ_BYTES` bytes of them; ``[]`` at the end of the file (see
        :attr:`at_eof`).

        Raises:
            OSError: the file exists but cannot be read (e.g. permissions).
        """
        envelopes: list[dict[str, Any]] = []
        self.at_eof = False
        read = 0
        while len(envelopes) < max_lines and read < READ_BYTES:
            if self._file is None and not self._open():
                self.at_eof = True
                break
            assert self._file is not None
            chunk = self._file.read(CHUNK_BYTES) or b""  # None: a FIFO with nothing yet
            read += len(chunk)
            if not chunk:
                if self._replaced():
                    self._close_file()  # the old file is read to its end; on to the new
                    continue
                self.at_eof = True
                break
            envelopes += self._lines(chunk)
        return envelopes

    def close(self) -> None:
        """Close the file. Idempotent."""
        self._close_file()

    def __enter__(self) -> RunLogReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> bool:
        try:  # a FIFO in its place must not block the reader (NONBLOCK)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        self._file = os.fdopen(fd, "rb")
        self._inode = os.fstat(self._file.fileno()).st_ino
        return True

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._partial = b""  # a line cut by rotation or truncation is not a record
        self._skipping = False

    def _replaced(self) -> bool:
        """At the end of the file: is the path now another file, or was it truncated?"""
        assert self._file is not None
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return False  # between rotation's rename and the new file: wait for it
        return status.st_ino != self._inode or status.st_size < self._file.tell()

    def _lines(self, chunk: bytes) -> list[dict[str, Any]]:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if self._skipping and lines:
            lines.pop(0)  # the rest of the over-long line, already counted
            self._skipping = False
        if len(self._partial) > MAX_LINE_BYTES and not self._skipping:
            self.malformed += 1
            self._skipping = True
        if self._skipping:
            self._partial = b""
        envelopes = []
        for line in lines:
            envelope = self._parse(line)
            if envelope is not None:
                envelopes.append(envelope)
        return envelopes

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip():
            return None  # a blank line is not a record, and not an error
        envelope = decode_line(line)
        if envelope is None:
            self.malformed += 1
        return envelope


class ReplaySource(Source):
    """A run log, folded in a daemon thread and followed while it grows.

    Takes no commands (a replay is read-only).

    Args:
        path: the run log (JSON lines as :class:`agent.runlog.RunLog` writes them).
        follow: keep reading what is appended (default); False stops at the end.
    """

    def __init__(self, path: os.PathLike | str, *, follow: bool = True) -> None:
        super().__init__(None, f"run log {path}", poll_s=POLL_S)
        self.path = Path(path)
        self.follow = follow

    def _run(self) -> None:
        counted = 0  # the reader's malformed lines already added to the state
        waited = False
        with RunLogReader(self.path) as reader:
            while not self._stop.is_set():
                try:
                    envelopes = reader.read()
                except OSError as exc:
                    with self.lock:
                        self.state.log("error", f"cannot read {self.path}: {exc}")
                    return
                if envelopes or reader.malformed != counted:
                    self._fold(envelopes, reader.malformed - counted)
                    counted = reader.malformed
                elif not self.path.exists() and not waited:
                    waited = True
                    with self.lock:
                        self.state.log("warning", f"{self.path} does not exist (yet)")
                if reader.at_eof:
                    if not self.follow:
                        return
                    self._stop.wait(POLL_S)

    def _fold(self, envelopes: list[dict[str, Any]], malformed: int) -> None:
        with self.lock:
            now = time.monotonic()
            offset_s = now - time.time()  # unix time -> monotonic time
            for envelope in envelopes:
                t: Any = envelope.get("t")  # as decoded: its type is checked here
                written = (min(now, t + offset_s) if type(t) in (int, float)
                           and math.isfinite(t) else now)
                self.state.ingest(envelope, written)
            if malformed:
                self.state.malformed += malformed
                self.state.version += 1
