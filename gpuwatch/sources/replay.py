"""The replay source: a run log read back into a RunState, and followed while it grows.

Followed like ``tail -F``, for ``gpuwatch replay FILE`` and ``gpuwatch tail FILE``.

:class:`RunLogReader` reads either format :mod:`gpuwatch.history` reads: a run log
(:mod:`agent.wire.runlog`: frames, followed from part to part as the writer starts new ones)
or the JSON lines of earlier versions (followed across rotation). Its records are the
envelopes :meth:`RunState.ingest` folds, so a replay shows the same panels as the live
run; what cannot be read is counted as malformed and skipped.

Time: each record is folded at the moment it was written (its ``t``, unix seconds,
taken to the monotonic clock), never later than when it is read. So the run's status
means what it means live: a run log whose last record is a ``bye`` is "ended"; one that
keeps growing (the agent writes a heartbeat a second and a frame at least every 0.5 s)
is "live" (or "stalled" or "compiling"); one that stopped growing without a ``bye`` (a
killed run) is "gone" once its last record is :data:`~gpuwatch.state.GONE_AFTER_S`
old. The backlog of a long run is folded at once without ever looking live.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from agent.wire import protocol, runlog
from gpuwatch.history import MAX_LINE_BYTES, decode_line, on_path
from gpuwatch.sources import Source

#: How often a followed file is checked for new records (s).
POLL_S = 0.2
#: Records returned per :meth:`RunLogReader.read` at most (about: a batch of steps
#: counts once), so the app never waits long.
BATCH = 1000
#: Bytes read from the file at a time, and at most per :meth:`RunLogReader.read` (so
#: that lines of 1 MB are folded a few at a time, never a gigabyte at once).
CHUNK_BYTES = 1 << 20
#: Bytes read at most per :meth:`RunLogReader.read`, however short the records.
READ_BYTES = 4 << 20


class RunLogReader:
    """Reads a run log's complete records as envelopes: all of it, then what is appended.

    A path that does not exist yet is waited for.

    Args:
        path: the run log (its first part, or the current file of JSON lines).
        batches: a ``steps`` batch as one envelope (what :meth:`RunState.ingest` folds
            fastest); by default as one ``step`` envelope a row
            (:func:`agent.wire.protocol.expand`), as ``gpuwatch tail`` prints them.

    Attributes:
        malformed: damaged frames and lines that were not records (bad JSON, not a map,
            no ``type``, longer than :data:`MAX_LINE_BYTES`).
        at_eof: the last :meth:`read` reached the end of what is written.
    """

    def __init__(self, path: os.PathLike | str, *, batches: bool = False) -> None:
        self.path = Path(path)
        self.batches = batches
        self.at_eof = False
        self._reader: _PartFollower | _LineFollower | None = None

    @property
    def malformed(self) -> int:
        """Records skipped because they could not be read (see the class)."""
        return 0 if self._reader is None else self._reader.malformed

    def read(self, max_records: int = BATCH) -> list[dict[str, Any]]:
        """Envelopes of the next complete records, at most about ``max_records`` of them.

        And at most about :data:`READ_BYTES` bytes of them; ``[]`` at the end of what is
        written (see :attr:`at_eof`).

        Raises:
            OSError: the file exists but cannot be read (e.g. permissions).
        """
        if self._reader is None:
            self._reader = self._open()
            if self._reader is None:
                self.at_eof = True
                return []
        envelopes, self.at_eof = self._reader.read(max_records)
        if self.batches:
            return envelopes
        rows: list[dict[str, Any]] = []
        for envelope in envelopes:
            try:
                rows += protocol.expand(envelope)
            except protocol.ProtocolError:
                self._reader.malformed += 1
        return rows

    def _open(self) -> _PartFollower | _LineFollower | None:
        """The follower for the file's format (from its first bytes); None while the
        file is missing or empty."""
        try:  # never through a link; a FIFO never blocks
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            start = os.read(fd, len(runlog.FRAME_MAGIC))
        except OSError:
            start = b""
        finally:
            os.close(fd)
        if not start:
            return None
        if start == runlog.FRAME_MAGIC:
            return _PartFollower(self.path)
        return _LineFollower(self.path)

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._reader is not None:
            self._reader.close()

    def __enter__(self) -> RunLogReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _PartFollower:
    """A run log's parts, read as far as written (:class:`agent.wire.runlog.PartReader`),
    the next part once it exists (the writer finished the one before it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.malformed = 0
        self._index = 0
        self._fd: int | None = None
        self._reader: runlog.PartReader | None = None
        self._counted = 0  # the current part's malformed already in self.malformed

    def read(self, max_records: int) -> tuple[list[dict[str, Any]], bool]:
        envelopes: list[dict[str, Any]] = []
        budget = READ_BYTES  # (decompressed: records of 1 MB are few a read)
        while len(envelopes) < max_records and budget > 0:
            if self._reader is None:
                try:
                    self._fd = runlog.open_no_follow(runlog.part_path(self.path, self._index))
                except FileNotFoundError:
                    return envelopes, True
                self._reader = runlog.PartReader(self._fd, part=self._index)
                self._counted = 0
            counted = self._reader.counted_bytes
            found = self._reader.read(max_bytes=budget)
            budget -= self._reader.counted_bytes - counted
            self.malformed += self._reader.malformed - self._counted
            self._counted = self._reader.malformed
            envelopes += [envelope for _, envelope in found]
            if found:
                continue
            if not runlog.part_path(self.path, self._index + 1).exists():
                return envelopes, True  # the end of what is written
            if self._reader.pending:  # a part cut short, with a part after it
                self.malformed += 1
            self.close()
            self._index += 1
        return envelopes, False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._reader = None, None


class _LineFollower:
    """The JSON lines of earlier versions: complete lines only (the agent may be
    writing one); when the path is replaced by a new file (rotation to ``.1``) or
    truncated, reading goes on from the new file's start, as ``tail -F`` does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.malformed = 0
        self._file: BinaryIO | None = None
        self._inode: int | None = None
        self._partial = b""
        self._skipping = False  # inside a line over MAX_LINE_BYTES: drop to its newline

    def read(self, max_lines: int) -> tuple[list[dict[str, Any]], bool]:
        envelopes: list[dict[str, Any]] = []
        read = 0
        while len(envelopes) < max_lines and read < READ_BYTES:
            if self._file is None and not self._open():
                return envelopes, True
            assert self._file is not None
            chunk = self._file.read(CHUNK_BYTES) or b""  # None: a FIFO with nothing yet
            read += len(chunk)
            if not chunk:
                if self._replaced():
                    self.close()  # the old file is read to its end; on to the new
                    continue
                return envelopes, True
            envelopes += self._lines(chunk)
        return envelopes, False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._partial = b""  # a line cut by rotation or truncation is not a record
        self._skipping = False

    def _open(self) -> bool:
        try:  # never through a link; a FIFO in its place must not block (NONBLOCK)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        self._file = os.fdopen(fd, "rb")
        self._inode = os.fstat(self._file.fileno()).st_ino
        return True

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
            if not line.strip():
                continue  # a blank line is not a record, and not an error
            envelope = decode_line(line)
            if envelope is None:
                self.malformed += 1
            else:
                envelopes.append(envelope)
        return envelopes


class ReplaySource(Source):
    """A run log, folded in a daemon thread and followed while it grows.

    Takes no commands (a replay is read-only).

    Args:
        path: the run log (either format, see :class:`RunLogReader`).
        follow: keep reading what is appended (default); False stops at the end.
        branch: ``(tree, N)``: fold only branch N's path
            (:class:`agent.wire.runlog.BranchPath`; the tree from
            :func:`gpuwatch.history.log_summary`). By default every record is folded,
            and the charts follow the branch taken last (:class:`RunState` goes back
            to each fork).
    """

    def __init__(self, path: os.PathLike | str, *, follow: bool = True,
                 branch: tuple[runlog.BranchTree, int] | None = None) -> None:
        super().__init__(None, f"run log {path}", poll_s=POLL_S)
        self.path = Path(path)
        self.follow = follow
        self._path = None if branch is None else runlog.BranchPath(*branch)

    def _run(self) -> None:
        counted = 0  # the reader's malformed lines already added to the state
        waited = False
        with RunLogReader(self.path, batches=True) as reader:
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
                if (kept := on_path(self._path, envelope, self.state.pass_over)) is None:
                    continue  # another branch's: not lost
                envelope = kept
                t: Any = envelope.get("t")  # as decoded: its type is checked here
                written = (min(now, t + offset_s) if type(t) in (int, float)
                           and math.isfinite(t) else now)
                self.state.ingest(envelope, written)
            if malformed:
                self.state.malformed += malformed
                self.state.version += 1
