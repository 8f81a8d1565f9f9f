"""The run log: every record the agent publishes, kept on disk, in order, compactly.

A run log is ``<run>.rank<r>.runlog`` in :func:`log_dir` (mode 0600), and when it grows
past a part's size, ``<run>.rank<r>.runlog.1``, ``.2``, ... (newer parts, higher
numbers; none is ever deleted). Beside it, ``<run>.rank<r>.summary`` holds the run's
figures (:class:`LogSummary`), so that ``gpuwatch runs --all`` reads at most the
records written after it. ``gpuwatch tail --json FILE`` prints a run log as JSON lines
(one object a step); ``gpuwatch.history`` reads it as column batches. A step takes 12
bytes (a loop on the host) to 64 (a token model on a GPU, 16 fields of noisy floats):
10 million steps in 120 to 640 MB.

Format (version 1). Each part is a sequence of *frames*::

    magic b"\\x89GWL", version u8, flags u8, reserved u16, compressed length u32,
    raw length u32, CRC-32 of the compressed bytes u32, CRC-32 of the raw bytes u32,
    CRC-32 of these 24 bytes u32 (little-endian), then the compressed bytes

A part starts with a frame flagged :data:`FLAG_PART`: its bytes are not compressed, a
msgpack map (``part``: its index, ``thinned``: 0, or the steps a bucket of its thinned
steps stands for). Every other frame holds a piece of a *chunk*: one raw deflate stream
(zlib, level 1) that starts at a frame flagged :data:`FLAG_CHUNK`, runs over the frames
written after it (each ends with a sync flush, so its records decode once it is on
disk) and ends once it holds :data:`CHUNK_RAW_BYTES` or :data:`CHUNK_S`. Decompressed,
a frame is whole msgpack items, each an envelope as :func:`agent.wire.protocol.envelope`
makes it; a ``steps`` batch keeps its columns as columns: a column of one value as
:data:`EXT_SAME`, floats as :data:`EXT_FLOATS` and integers as :data:`EXT_INTEGERS`
(little-endian 8-byte values stored byte plane by byte plane, the integers as
differences, so that deflate finds their repeats), any other column as a msgpack list.

Crash safety: a frame is written with one ``write`` once it is complete, at least every
``flush_interval_s``; a writer killed while writing leaves a last frame whose length or
CRC does not match, which readers detect and skip (everything before it reads). (The
agent's writer is a process of its own, :mod:`agent.io.logwriter`: a training process
killed, even with SIGKILL, loses none of the records it handed it.) Bytes that
are no frame (damage) are skipped to the next frame: reading goes on there when no
frame of its chunk was lost (it decompresses to its raw CRC), else at the next chunk. A
reader never trusts a length: frames over :data:`MAX_FRAME_RAW_BYTES` are refused,
decompression stops at the declared size, and a batch has at most
:data:`~agent.wire.protocol.MAX_BATCH_STEPS` rows.

Disk budget: a log never deletes a record. If its parts together pass ``budget_bytes``,
the older parts are *thinned* by a child process (:func:`thin_part`, ``python -m
agent.wire.runlog thin``): each run of :data:`THIN_FACTOR` steps with the same knob values
becomes one row holding their mean, minimum (``<field>.min``), maximum (``<field>.max``)
and count (``steps_in_bucket``); every event, hello, state, tune and bye is kept, and
one heartbeat and system sample in :data:`THIN_FACTOR`. The part's header says so, and
so do the history tools.

Branches: records carry no branch; a ``branched`` event (the branch contract) puts
every record after it on its new branch. :class:`BranchTree` folds them (the summary
keeps it) and :class:`BranchPath` keeps one branch's path (its parent's steps up to the
fork, then its own) from the records read in order, in one pass.

Written by the agent's log writer, a child process of the training process
(:mod:`agent.io.logwriter`), from the messages the agent publishes: a ``steps`` batch costs
one conversion per column (no Python a step), one msgpack pack and its share of a deflate:
1.4 to 2.0 us a step here (the JSON lines of earlier versions: 2.7 to 3.2 us, 536 bytes);
with the unpacking of the wire's bytes and the pipe, the writer spends 2.4 to 3.1 us of
CPU a step at 4,000 steps/s, none of it in the training process.
"""

from __future__ import annotations

import errno
import math
import operator
import os
import stat
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Iterator
from itertools import chain
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import orjson
import platformdirs

from agent.wire import protocol
from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.runs import private_dir

#: Environment variable that overrides the run-log directory.
LOG_DIR_ENV = "GPUWATCH_LOG_DIR"
#: Environment variable that sets the disk budget of one rank's log, in bytes.
LOG_BUDGET_ENV = "GPUWATCH_LOG_BUDGET_BYTES"
#: The run log's suffix, after ``<run>.rank<r>``; later parts add ``.1``, ``.2``, ...
LOG_SUFFIX = ".runlog"
#: The summary's suffix, after ``<run>.rank<r>`` (for logs of either format).
SUMMARY_SUFFIX = ".summary"

FORMAT_VERSION = 1
FRAME_MAGIC = b"\x89GWL"
#: magic, version, flags, reserved, compressed length, raw length, CRC of the compressed
#: bytes, CRC of the raw bytes, CRC of the header before it
FRAME_HEADER = struct.Struct("<4sBBHIIIII")
FLAG_CHUNK = 0x01
FLAG_END = 0x02
FLAG_PART = 0x04
#: msgpack extension codes of the encoded columns of a ``steps`` batch.
EXT_FLOATS = 1
EXT_INTEGERS = 2
EXT_SAME = 3

#: The writer ends a frame once it holds this many raw bytes (or at the flush interval).
FRAME_RAW_BYTES = 256 << 10
#: A record larger than this (packed) is logged as a note saying so (the wire's bound).
MAX_ITEM_BYTES = protocol.MAX_MESSAGE_BYTES
#: Readers refuse a frame that says it holds more than this (raw or compressed).
MAX_FRAME_RAW_BYTES = 4 << 20
#: A chunk (one deflate stream) ends once it holds this many raw bytes (about 2,500
#: steps) or is this old: a damaged frame loses the rest of its chunk at most, and a
#: reader starts again at a chunk (the timeline, a summary's end).
CHUNK_RAW_BYTES = 256 << 10
CHUNK_S = 30.0
#: The summary is saved at a chunk's end at most this often (s), and at the log's end.
SUMMARY_S = 5.0
#: Default disk budget of one rank's log (bytes): about 10 million steps unthinned.
DEFAULT_BUDGET_BYTES = 1 << 30
#: Steps a thinned bucket holds (each time a part is thinned again: times this).
THIN_FACTOR = 16
#: Largest summary file read (bytes).
MAX_SUMMARY_BYTES = 1 << 20
#: zlib level: 1 compresses a step batch at about 60 MB/s here, as small as 6 does.
_LEVEL = 1
#: Types whose equal values are the same value (floats apart from 0.0 and -0.0).
_SCALARS = frozenset({int, float, str, bool, type(None)})
#: Records a thinned part keeps every one of; of the others (heartbeat, system), one
#: in the thinning factor.
KEPT_WHOLE = frozenset({protocol.HELLO, protocol.EVENT, protocol.STATE, protocol.BYE,
                        protocol.TUNE})


def log_dir() -> Path:
    """The per-user directory of run logs, created with mode 0700.

    ``$GPUWATCH_LOG_DIR``, else the user data directory's ``runs/``.

    Checked as :func:`agent.wire.runs.private_dir` checks: a symbolic link, another user's
    directory or one writable by others (a shared ``$GPUWATCH_LOG_DIR`` where another
    user could plant links to your files) is refused.

    Raises:
        agent.wire.runs.UnsafeDirectoryError: the directory is refused (see above).
        OSError: it cannot be created.
    """
    override = os.environ.get(LOG_DIR_ENV)
    path = Path(override) if override else (
        Path(platformdirs.user_data_dir("gpuwatch", appauthor=False)) / "runs")
    return private_dir(path, LOG_DIR_ENV)


def create_log(name: str) -> Path:
    """The first part of the log ``name`` (a file name) in :func:`log_dir`, made if missing.

    Created empty (mode 0600) and checked as :class:`RunLog` opens it, never through a
    link. The agent calls it before it starts its writer process, so that a refused log
    is said at once; the writer calls it again (the same checks). About 0.1 ms.

    Raises:
        ValueError: ``name`` is not a file name.
        agent.wire.runs.UnsafeDirectoryError: the directory is refused (:func:`log_dir`).
        UnsafeLogFileError: the file is a link, or not a regular file of this user with a
            single link.
        OSError: the directory or the file cannot be made or opened.
    """
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"not a file name: {name!r}")
    path = log_dir() / name
    os.close(_open_for_append(path))
    return path

def part_path(path: os.PathLike | str, index: int) -> Path:
    """The file of part ``index`` of the log whose first part is ``path``."""
    return Path(path) if index == 0 else Path(f"{os.fspath(path)}.{index}")


def summary_path(path: os.PathLike | str) -> Path:
    """The summary file of the log at ``path``: ``<run>.rank<r>.summary`` beside it.

    For either format."""
    path = Path(path)
    name = path.name
    for suffix in (LOG_SUFFIX, ".jsonl"):
        if suffix in name:
            name = name[:name.index(suffix)]
            break
    return path.with_name(name + SUMMARY_SUFFIX)


class UnsafeLogFileError(PermissionError):
    """The run log's path is a link or not this user's regular file: it is never written through.

    A symbolic link, or a file that is not a regular file of this user with a single
    link."""


def open_no_follow(path: os.PathLike | str) -> int:
    """A read-only descriptor of ``path``, never through a link and never blocking on a FIFO.

    Raises:
        OSError: it cannot be opened, is a link (``ELOOP``) or is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    return fd


def _open_for_append(path: Path) -> int:
    """Open (or create, mode 0600) ``path`` for appending, never through a link.

    Raises:
        UnsafeLogFileError: a link, or not a regular file of this user with one link.
        OSError: it cannot be opened.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)  # NONBLOCK: a planted FIFO fails
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeLogFileError(f"{path} is a symbolic link; the run log is not "
                                     "written through it") from None
        raise
    status = os.fstat(fd)
    if (not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid()
            or status.st_nlink != 1):
        os.close(fd)
        raise UnsafeLogFileError(
            f"{path} is not a regular file of this user with a single link; the run log "
            "is not written to it")
    return fd


def write_private(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Replace ``path`` with ``data`` (bytes, or pieces of it; mode 0600) through a new file.

    A new file beside it, created never through a link, renamed over it (a reader sees the
    old file or the new one).

    Raises:
        OSError: it cannot be written.
    """
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            for piece in [data] if isinstance(data, bytes) else data:
                handle.write(piece)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


# --- frames ---------------------------------------------------------------------------

def frame(flags: int, payload: bytes, raw_len: int, raw_crc: int) -> bytes:
    """One frame: its header, then ``payload``.

    ``raw_len``, ``raw_crc``: the payload's size and CRC-32 decompressed."""
    head = struct.pack("<4sBBHIIII", FRAME_MAGIC, FORMAT_VERSION, flags, 0, len(payload),
                       raw_len, zlib.crc32(payload), raw_crc)
    return head + struct.pack("<I", zlib.crc32(head)) + payload


class FrameWriter:
    """Builds frames out of packed items (:func:`pack_message`): one deflate stream a chunk.

    A sync flush at each frame's end. Not thread-safe; holds the compressed bytes of one
    frame.

    Attributes:
        pending_raw: raw bytes of the items since the last frame. chunk_raw: raw bytes
            of the open chunk. chunk_started: when its first item came (the caller's
            clock).
    """

    def __init__(self) -> None:
        self._compressor: Any = None
        self._out: list[bytes] = []
        self._crc = 0
        self.pending_raw = 0
        self.chunk_raw = 0
        self.chunk_started = 0.0

    def add(self, data: bytes, now: float = 0.0) -> None:
        """Add one packed item (``now``: the time, to age the chunk by)."""
        if self._compressor is None:
            self._compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, -15)
            self.chunk_raw, self.chunk_started = 0, now
        self._out.append(self._compressor.compress(data))
        self._crc = zlib.crc32(data, self._crc)
        self.pending_raw += len(data)
        self.chunk_raw += len(data)

    def frame(self, end_chunk: bool = False) -> bytes:
        """The frame of the items added since the last one (``b""`` when none).

        The chunk ends with it when ``end_chunk`` or once it holds :data:`CHUNK_RAW_BYTES`
        (see :attr:`chunk_open`)."""
        if not self.pending_raw:
            return b""
        ends = end_chunk or self.chunk_raw >= CHUNK_RAW_BYTES
        self._out.append(self._compressor.flush(zlib.Z_FINISH if ends else zlib.Z_SYNC_FLUSH))
        flags = (FLAG_CHUNK if self.chunk_raw == self.pending_raw else 0) | (
            FLAG_END if ends else 0)
        data = frame(flags, b"".join(self._out), self.pending_raw, self._crc)
        self._out, self.pending_raw, self._crc = [], 0, 0
        if ends:
            self._compressor = None
        return data

    @property
    def chunk_open(self) -> bool:
        """Whether a chunk is open (the last frame did not end it)."""
        return self._compressor is not None


def part_header(index: int, thinned: int = 0) -> bytes:
    """The frame a part starts with (see the module's documentation)."""
    body = msgpack.packb({"part": index, "thinned": thinned, "format": FORMAT_VERSION})
    return frame(FLAG_PART, body, len(body), zlib.crc32(body))


def _numpy() -> Any:
    """numpy, imported when a column is first encoded or decoded (``gpuwatch`` starts
    without it)."""
    import numpy

    return numpy


def _pack_value(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True, default=repr)


def encode_column(values: Any, n: int) -> Any:
    """A ``steps`` column as the log stores it (see the module's documentation).

    A list of ``n`` values of one of the types numpy holds exactly becomes an extension; any
    other value is returned as it is. About 10 ns a value (``struct`` and byte slices, not
    numpy: numpy's fixed cost a column was most of a batch of 100 steps)."""
    if type(values) is not list or len(values) != n or not n:
        return values
    first = values[0]
    kind = type(first)
    if (kind in _SCALARS and values[-1] == first and values.count(first) == n
            and not (kind is float and (first == 0.0 or first != first))):
        return msgpack.ExtType(EXT_SAME, _pack_value(first))
    try:
        if kind is float:
            return msgpack.ExtType(EXT_FLOATS, _planes(struct.pack(f"<{n}d", *values)))
        if kind is int:
            struct.pack(f"<{n}q", *values)  # each within int64, as numpy's int64 holds
            deltas = list(map(operator.sub, values, chain((0,), values)))
            try:
                packed = struct.pack(f"<{n}q", *deltas)
            except struct.error:  # deltas past int64 wrap around, as numpy's do
                packed = struct.pack(f"<{n}q", *[(delta + _INT64) % (2 * _INT64) - _INT64
                                                 for delta in deltas])
            return msgpack.ExtType(EXT_INTEGERS, _planes(packed))
    except (struct.error, TypeError, ValueError, OverflowError):
        pass  # a value of another type, or past the format's range: kept as it is
    return values


def _planes(data: bytes) -> bytes:
    """8-byte little-endian values as their byte planes: every value's first byte, then
    every second byte, ... (what varies little, the sign and exponent, lies together)."""
    return b"".join([data[index::8] for index in range(8)])


_INT64 = 1 << 63


def decode_column(value: Any, n: int, *, arrays: bool = False) -> Any:
    """A stored ``steps`` column back as ``n`` values: a list, or with ``arrays`` a numpy array.

    ``arrays``: floats and integers, stored as such or one for every row, as a numpy array,
    float64 or int64.

    Raises:
        agent.wire.protocol.ProtocolError: not a column of ``n`` values.
    """
    if type(value) is list:
        if len(value) != n:
            raise protocol.ProtocolError(f"a column of {len(value)} values, not {n}")
        return value
    if not isinstance(value, msgpack.ExtType):
        raise protocol.ProtocolError(f"a column must be a list, not {type(value).__name__}")
    code, data = value
    if code == EXT_SAME:
        try:
            same = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise protocol.ProtocolError(f"a column's value: {exc}") from None
        if arrays and type(same) in (int, float) and abs(same) < 1 << 63:
            return _numpy().full(n, same)
        return [same] * n
    if code not in (EXT_FLOATS, EXT_INTEGERS) or len(data) != 8 * n:
        raise protocol.ProtocolError(f"a column of extension {code}, {len(data)} bytes")
    np = _numpy()
    values = np.ascontiguousarray(np.frombuffer(data, "u1").reshape(8, n).T).view(
        "<f8" if code == EXT_FLOATS else "<i8").reshape(n)
    if code == EXT_INTEGERS:
        values = np.cumsum(values, dtype=np.int64)
    values = values.astype(values.dtype.newbyteorder("="), copy=False)
    return values if arrays else values.tolist()


def pack_message(message: dict[str, Any]) -> bytes:
    """An envelope as one msgpack item of the log; a ``steps`` batch with its columns encoded.

    Columns by :func:`encode_column`. Values msgpack cannot hold are stored as their
    ``repr``; a record over :data:`MAX_ITEM_BYTES` as a note of its type and size."""
    body = message.get("body")
    if message.get("type") == protocol.STEPS and isinstance(body, dict):
        n = body.get("n")
        columns = body.get("columns")
        if type(n) is int and isinstance(columns, dict):
            message = {**message, "body": {**body, "columns": {
                name: encode_column(values, n) for name, values in columns.items()}}}
    data = pack_plain(message)
    if len(data) > MAX_ITEM_BYTES:
        data = _pack_value({**{key: message.get(key) for key in
                               ("v", "type", "run", "rank", "seq", "t")},
                            "body": {"note": f"a {printable_type(message)} record of "
                                     f"{len(data):,} bytes, too large for the run log"}})
    return data


def pack_plain(value: Any) -> bytes:
    """``value`` as msgpack, whatever it holds: what msgpack cannot hold as its ``repr``.

    Objects msgpack does not know, integers beyond 64 bits, nesting deeper than 64 (the
    log keeps a message the wire cannot send: :mod:`agent.io.logwriter`)."""
    try:
        return _pack_value(value)
    except (OverflowError, ValueError, TypeError):  # an int beyond 64 bits, deep nesting
        return _pack_value(_plain(value))


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` with what msgpack cannot hold as its ``repr``: integers beyond 64 bits,
    nesting deeper than 64."""
    if depth > 64:
        return repr(value)
    if isinstance(value, dict):
        return {key if type(key) is str else repr(key): _plain(item, depth + 1)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    if type(value) is int and not -(1 << 63) <= value < (1 << 64):
        return repr(value)
    return value


def printable_type(message: dict[str, Any]) -> str:
    """A record's type as a note may name it."""
    return protocol.printable(message.get("type"), protocol.MAX_NAME_CHARS)


# --- branches -------------------------------------------------------------------------

#: Branches a tree keeps (the run's first ones): a ``branched`` event past them is
#: counted in :attr:`BranchTree.omitted` and its steps are read as the last kept one's.
MAX_BRANCHES = 1000
#: Knob changes a branch keeps (its first ones; :attr:`Branch.changes` counts them all).
MAX_BRANCH_CHANGES = 8
#: Characters of a branch's ``source`` and ``cause``, and of a change's value, kept.
MAX_BRANCH_TEXT = 200
#: Largest branch id or step number read as one (a float's exact integers end there).
MAX_BRANCH_NUMBER = 1 << 53


def _whole(value: Any) -> int | None:
    """``value`` when it is a whole number from 0 to :data:`MAX_BRANCH_NUMBER`."""
    return value if type(value) is int and 0 <= value <= MAX_BRANCH_NUMBER else None


@dataclass
class Branch:
    """A branch of a run: a segment of its steps, from its fork to its latest step.

    See :class:`BranchTree`.

    Attributes:
        branch: its id (0: where the run started). parent: the branch it left (None
            for branch 0). fork_step: the last step kept from the parent: the branch's
            first step is the next one (None for branch 0, and when neither the event
            nor the parent's steps name one). source: where its state came from (a
            checkpoint's path, "rollback", "recovery"). cause: what asked for it
            (``rewind=120``). Both "" for branch 0, printable, cut.
        first_step, last_step: its own first and latest optimizer step (None before
            one). steps: its own optimizer steps (a thinned bucket counts the steps
            it holds).
        applied: its first :data:`MAX_BRANCH_CHANGES` knob changes (``applied`` and
            ``rolled_back`` events of knobs that are settings, not actions) as
            ``[step or None, knob, value]`` (the value as a number, boolean, None or
            printable text). changes: all of them.
    """

    branch: int
    parent: int | None = None
    fork_step: int | None = None
    source: str = ""
    cause: str = ""
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    applied: list[list[Any]] = field(default_factory=list)
    changes: int = 0

    @classmethod
    def from_public(cls, value: Any) -> Branch | None:
        """A branch from :func:`dataclasses.asdict`'s map of one; None when it is not one.

        The map as a summary file holds it."""
        if not isinstance(value, dict) or _whole(value.get("branch")) is None:
            return None
        branch = cls(value["branch"])
        for name in ("parent", "fork_step", "first_step", "last_step"):
            item = value.get(name)
            if item is not None and _whole(item) is None:
                return None
            setattr(branch, name, item)
        for name in ("steps", "changes"):
            if _whole(value.get(name, 0)) is None:
                return None
            setattr(branch, name, value.get(name, 0))
        for name in ("source", "cause"):
            item = value.get(name, "")
            if not isinstance(item, str):
                return None
            setattr(branch, name, protocol.printable(item, MAX_BRANCH_TEXT))
        applied = value.get("applied", [])
        if not isinstance(applied, list) or len(applied) > MAX_BRANCH_CHANGES:
            return None
        for change in applied:
            if (not isinstance(change, list) or len(change) != 3
                    or (change[0] is not None and _whole(change[0]) is None)
                    or not isinstance(change[1], str)):
                return None
            branch.applied.append([change[0], protocol.printable(change[1], 100),
                                   _change_value(change[2])])
        return branch


def _change_value(value: Any) -> Any:
    """A knob's new value as a branch keeps it: a number, boolean or None as it is,
    anything else as printable text, cut."""
    if value is None or type(value) in (bool, int, float):
        return value if type(value) is not int or abs(value) <= MAX_BRANCH_NUMBER else str(value)
    return protocol.printable(value if isinstance(value, str) else repr(value),
                              MAX_BRANCH_TEXT)


class BranchTree:
    """A run's branches, folded from its records in order.

    Every record belongs to the branch of the latest ``branched`` event before it (branch 0
    before any), as the agent publishes and the log keeps them (the branch contract; records
    carry no branch field).

    A ``branched`` event that does not make sense is read as far as it does, never
    raised for: a ``branch`` id that is not a new whole number gets the next free one;
    a ``parent`` that is not a known branch is the branch the records were on (so
    parents never loop); a ``step`` that is not a whole number is the parent's latest
    step. Memory: at most :data:`MAX_BRANCHES` branches of at most
    :data:`MAX_BRANCH_CHANGES` changes each; a few operations a record.

    Attributes:
        branches: the branches by id, in the order they began (0 first).
        current: the branch the latest record belongs to (the one trained now, in a
            live run's log). omitted: ``branched`` events past :data:`MAX_BRANCHES`.
    """

    def __init__(self) -> None:
        self.branches: dict[int, Branch] = {0: Branch(0)}
        self.current = 0
        self.omitted = 0

    def __len__(self) -> int:
        return len(self.branches)

    def branched(self, body: dict[str, Any]) -> Branch | None:
        """Fold a ``branched`` event's body: the new branch, now the current one.

        None past :data:`MAX_BRANCHES` (counted in :attr:`omitted`)."""
        if len(self.branches) >= MAX_BRANCHES:
            self.omitted += 1
            return None
        wanted = _whole(body.get("branch"))
        branch_id = wanted if wanted and wanted not in self.branches else max(
            self.branches) + 1
        parent = body.get("parent")
        if type(parent) is not int or parent not in self.branches:
            parent = self.current
        fork = _whole(body.get("step"))
        if fork is None:
            fork = self.branches[parent].last_step
        source, cause = body.get("source"), body.get("cause")
        branch = Branch(branch_id, parent, fork,
                        protocol.printable(source, MAX_BRANCH_TEXT)
                        if isinstance(source, str) else "",
                        protocol.printable(cause, MAX_BRANCH_TEXT)
                        if isinstance(cause, str) else "")
        self.branches[branch_id] = branch
        self.current = branch_id
        return branch

    def applied(self, body: dict[str, Any]) -> None:
        """Fold an ``applied`` or ``rolled_back`` event's body: a change on the current branch.

        Not a command's: ``pause=on``, ``rewind=120`` set no value."""
        knob = body.get("knob")
        spec = STANDARD_KNOBS.get(knob) if isinstance(knob, str) else None
        if spec is not None and spec.command:
            return
        branch = self.branches[self.current]
        branch.changes += 1
        if len(branch.applied) < MAX_BRANCH_CHANGES and isinstance(knob, str):
            branch.applied.append([_whole(body.get("step")), protocol.printable(knob, 100),
                                   _change_value(body.get("value"))])

    def stepped(self, steps: int, first: Any, last: Any) -> None:
        """Fold ``steps`` optimizer steps of the current branch, numbered ``first`` to ``last``.

        ``first`` and ``last`` are ignored unless whole numbers."""
        branch = self.branches[self.current]
        branch.steps += steps
        if branch.first_step is None:
            branch.first_step = _whole(first)
        if _whole(last) is not None:
            branch.last_step = last

    def path(self, branch: int) -> dict[int, float]:
        """The branches whose steps make ``branch``'s path, each with the last step the path takes.

        The path: the steps a run on it trained through (its ancestors' up to each fork,
        then its own); each branch's last step the path takes (``math.inf``: all of its
        own). ``{}`` for an unknown branch."""
        limits: dict[int, float] = {}
        limit = math.inf
        at: int | None = branch
        while at is not None and at in self.branches and at not in limits:
            limits[at] = limit
            node = self.branches[at]
            if node.parent is not None:
                limit = min(limit, -1 if node.fork_step is None else node.fork_step)
            at = node.parent
        return limits

    def children(self) -> dict[int | None, list[Branch]]:
        """The branches by parent, each list in the order they began."""
        found: dict[int | None, list[Branch]] = {}
        for branch in self.branches.values():
            found.setdefault(branch.parent, []).append(branch)
        return found

    def public(self) -> dict[str, Any]:
        """The tree as JSON-ready values (what a summary file keeps)."""
        return {"branches": [asdict(branch) for branch in self.branches.values()],
                "current": self.current, "omitted": self.omitted}

    @classmethod
    def from_public(cls, value: Any) -> BranchTree | None:
        """A tree from :meth:`public`'s values; None when they are not one.

        Not one: no branch 0, a parent before its child, a current branch that is not one,
        too many."""
        if not isinstance(value, dict) or not isinstance(value.get("branches"), list):
            return None
        listed = value["branches"]
        if not listed or len(listed) > MAX_BRANCHES:
            return None
        tree = cls()
        tree.branches = {}
        for item in listed:
            branch = Branch.from_public(item)
            if (branch is None or branch.branch in tree.branches
                    or (branch.parent is None) != (branch.branch == 0)
                    or (branch.parent is not None and branch.parent not in tree.branches)):
                return None
            tree.branches[branch.branch] = branch
        current, omitted = value.get("current"), _whole(value.get("omitted"))
        if 0 not in tree.branches or current not in tree.branches or omitted is None:
            return None
        tree.current, tree.omitted = current, omitted
        return tree


def steps_on_path(message: dict[str, Any], limit: float) -> dict[str, Any] | None:
    """A decoded ``steps`` envelope cut to the rows whose step is at most ``limit``.

    ``limit``: :meth:`BranchTree.path`'s. The same envelope when all are, None when none is.
    A row without a step number is kept only when ``limit`` is ``math.inf``. Columns of
    lists or numpy arrays; a new body, the envelope given is not changed.

    Raises:
        KeyError, TypeError: not a decoded ``steps`` batch (:func:`decode_steps`).
    """
    if limit == math.inf:
        return message
    body = message["body"]
    steps = body["columns"].get("step")
    if steps is None:
        step = body.get("common", {}).get("step")
        return message if _whole(step) is not None and step <= limit else None
    if hasattr(steps, "tolist"):
        steps = steps.tolist()
    rows = [row for row, step in enumerate(steps) if _whole(step) is not None
            and step <= limit]
    if len(rows) == body["n"]:
        return message
    if not rows:
        return None
    columns = {}
    for name, values in body["columns"].items():
        if hasattr(values, "tolist"):
            columns[name] = values[_numpy().asarray(rows)]
        else:
            columns[name] = [values[row] for row in rows]
    return {**message, "body": {**body, "n": len(rows), "columns": columns}}


class BranchPath:
    """One branch's path through a run log's records (:meth:`BranchTree.path`).

    Feed every record in order to :meth:`keep`, which says what of it is on the path.

    Args:
        tree: the log's branches (a first pass over it, or its summary's).
        branch: the branch whose path is kept (default: the tree's current one, the
            branch taken last).

    What a path keeps: its branches' step rows up to each fork (:func:`steps_on_path`);
    their other records (events, state, system samples) from before a step past the
    fork; the ``branched`` events of its forks; every ``hello`` and ``bye``. Memory: a
    :class:`LogSummary` folded on the way (its tree: the same ids as ``tree``'s).
    """

    def __init__(self, tree: BranchTree, branch: int | None = None) -> None:
        self.branch = tree.current if branch is None else branch
        self.limits = tree.path(self.branch)
        self.summary = LogSummary()

    def keep(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """What of ``message`` (an envelope, a ``steps`` batch decoded) is on the path.

        It, its rows on the path, or None."""
        kind = message.get("type")
        self.summary.add(message)
        if kind in (protocol.HELLO, protocol.BYE):
            return message
        tree = self.summary.tree
        limit = self.limits.get(tree.current)
        if limit is None:
            return None
        if kind == protocol.STEPS:
            try:
                return steps_on_path(message, limit)
            except (KeyError, TypeError, AttributeError, IndexError):
                return None
        last = tree.branches[tree.current].last_step
        return message if last is None or last <= limit else None


# --- the summary ----------------------------------------------------------------------

def number(value: Any) -> float | None:
    """A logged number as a finite float; None for anything else.

    None for a missing, non-numeric (booleans too) or non-finite value, or an integer beyond
    any float."""
    if type(value) is float:
        return value if value - value == 0.0 else None
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def _sustained(values: list[Any]) -> float | None:
    """The median of the finite numbers of ``values`` (a batch's throughputs: what its
    steps sustained, never one lucky step's); None without any."""
    present = sorted(value for value in map(number, values) if value is not None)
    return present[len(present) // 2] if present else None


@dataclass
class LogSummary:
    """A run log in figures, folded record by record (:meth:`add`).

    What ``gpuwatch runs --all`` lists. Folded by the writer as it writes (saved beside the
    log, :func:`summary_path`), and by readers for a log without one (an older one, or a run
    killed before it wrote one).

    Attributes:
        run, rank: the run id and rank of its records. name: the hello's name.
        started_at: the hello's ``started_at`` (unix s). first_t, last_t: the first
            and last record's time (unix s). records: records folded.
        steps: optimizer steps (a thinned bucket counts the steps it holds).
        first_step, last_step: the first and latest optimizer step.
        final_loss: the last finite loss. best_samples_per_s, best_tokens_per_s: the
            best throughput the run sustained: the largest median of a batch's steps
            (what one wake-up of the agent published: about half a second of steps, one
            step where steps are slower), or of a thinned part, the largest bucket mean.
            Never one lucky step's: a newcomer's run listed 143,699 samples/s for a run
            whose median step did 125,432. knob_changes: changes of a knob's value
            between consecutive steps. events: ``event`` records.
        ended: the ``bye``'s reason ("ended" without one), None without a bye.
        knobs: the latest step's knob values (to count changes on from).
        covered: where the fold stopped: ``[part or file, byte offset]``, where a reader
            can go on (a chunk's start; a line's for the older format).
        malformed, truncated: what a reader that made this summary could not read
            (damaged frames or lines; a torn end): the writer's own has none.
        tree: the run's branches (:class:`BranchTree`; one, branch 0, until the state
            is put back).
        resumed_from, resumed_at: the run the checkpoint it resumed from was saved by,
            and the step it resumed at (its first ``resumed`` event's; None when it
            started afresh, or its checkpoint did not say which run saved it).
    """

    run: str | None = None
    rank: int | None = None
    name: str | None = None
    started_at: float | None = None
    first_t: float | None = None
    last_t: float | None = None
    records: int = 0
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    final_loss: float | None = None
    best_samples_per_s: float | None = None
    best_tokens_per_s: float | None = None
    knob_changes: int = 0
    events: int = 0
    ended: str | None = None
    knobs: dict[str, Any] | None = None
    covered: list[int] | None = None
    malformed: int = 0
    truncated: bool = False
    tree: BranchTree = field(default_factory=BranchTree)
    resumed_from: str | None = None
    resumed_at: int | None = None

    def add(self, message: dict[str, Any]) -> None:
        """Fold one envelope: a ``steps`` batch, or an older log's ``step``.

        A ``steps`` batch with list columns, as the wire has it. A few operations per batch
        in C; never raises for a body's content."""
        self.records += 1
        kind = message.get("type")
        t = number(message.get("t"))
        if t is not None:
            if self.first_t is None:
                self.first_t = t
            self.last_t = t
        if self.run is None and isinstance(message.get("run"), str):
            self.run = protocol.printable(message["run"], protocol.MAX_NAME_CHARS)
            rank = message.get("rank")
            self.rank = rank if type(rank) is int else None
        body = message.get("body")
        if not isinstance(body, dict):
            return
        if kind == protocol.STEPS:
            try:
                self._add_steps(body)
            except (TypeError, ValueError, AttributeError, KeyError, IndexError):
                pass  # a malformed batch: its readers count it
        elif kind == protocol.STEP:
            self._add_steps({"n": 1, "common": {}, "columns": {
                name: [value] for name, value in body.items()}})
        elif kind == protocol.HELLO:
            name, started = body.get("name"), number(body.get("started_at"))
            if isinstance(name, str):
                self.name = protocol.printable(name, protocol.MAX_NAME_CHARS)
            if started is not None and self.started_at is None:
                self.started_at = started
            self.ended = None  # a hello after a bye: the run id restarted
        elif kind == protocol.EVENT:
            self.events += 1
            event = body.get("kind")
            if event == protocol.EventKind.BRANCHED:
                self.tree.branched(body)
            elif event in protocol.EventKind.CHANGED:
                self.tree.applied(body)
            elif (event == protocol.EventKind.RESUMED and self.resumed_from is None
                  and isinstance(body.get("from_run"), str)):
                self.resumed_from = protocol.printable(body["from_run"],
                                                       protocol.MAX_NAME_CHARS)
                step = body.get("step")
                self.resumed_at = step if type(step) is int and step >= 0 else None
        elif kind == protocol.BYE:
            reason = body.get("reason")
            self.ended = (protocol.printable(reason, protocol.MAX_NAME_CHARS)
                          if isinstance(reason, str) and reason else "ended")

    def _add_steps(self, body: dict[str, Any]) -> None:
        n, columns, common = body["n"], body["columns"], body.get("common") or {}
        if type(n) is not int or n <= 0 or not isinstance(columns, dict):
            return

        def column(name: str) -> list[Any]:
            values: Any = columns.get(name)
            if hasattr(values, "tolist") and len(values) == n:  # a numpy column
                values = values.tolist()
            if type(values) is list and len(values) == n:
                return values
            return [common.get(name)] * (1 if name not in columns else n)

        counts = column("steps_in_bucket") if "steps_in_bucket" in columns else None
        steps_in = (n if counts is None
                    else sum(count for count in counts if type(count) is int))
        self.steps += steps_in
        steps = column("step")
        first = steps[0] if "step.min" not in columns else column("step.min")[0]
        self.tree.stepped(steps_in, first, steps[-1])
        if type(first) is int and self.first_step is None:
            self.first_step = first
        if type(steps[-1]) is int:
            self.last_step = steps[-1]
        for loss in reversed(column("loss")):
            loss = number(loss)
            if loss is not None:
                self.final_loss = loss
                break
        for name in ("samples_per_s", "tokens_per_s"):
            top = _sustained(column(name))  # (a thinned part's: its buckets' means)
            attribute = f"best_{name}"
            best = getattr(self, attribute)
            if top is not None and (best is None or top > best):
                setattr(self, attribute, top)
        knobs = column("knobs")
        if knobs.count(knobs[0]) == len(knobs):
            knobs = knobs[:1]  # one map for the batch: only its first row can change
        for values in knobs:
            if not isinstance(values, dict) or values == self.knobs:
                continue
            if self.knobs is not None:
                self.knob_changes += sum(1 for name, value in values.items()
                                         if isinstance(name, str)
                                         and self.knobs.get(name) != value)
            self.knobs = values

    def to_json(self) -> bytes:
        """The summary as a JSON document (what the summary file holds); never raises.

        Knob maps too large, or holding what JSON cannot (an integer past 64 bits), are left
        out (a reader then counts changes from the next step's map)."""
        values = {spec.name: getattr(self, spec.name) for spec in fields(self)}
        values["tree"] = self.tree.public()
        try:
            data = orjson.dumps(values, default=repr, option=orjson.OPT_NON_STR_KEYS)
        except orjson.JSONEncodeError:
            data = b""
        if not data or len(data) > MAX_SUMMARY_BYTES:  # huge or odd knob maps: not kept
            data = orjson.dumps({**values, "knobs": None}, default=repr)
        return data

    @classmethod
    def from_json(cls, data: bytes) -> LogSummary | None:
        """A summary from :meth:`to_json`'s document; None when it is not one.

        Not one: wrong field types, unknown format, too large."""
        if len(data) > MAX_SUMMARY_BYTES:
            return None
        try:
            values = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(values, dict):
            return None
        summary = cls()
        for spec in fields(cls):
            value = values.get(spec.name, getattr(summary, spec.name))
            default = getattr(summary, spec.name)
            if spec.name in ("run", "name", "ended", "resumed_from"):
                ok = value is None or isinstance(value, str)
                value = value if value is None else protocol.printable(
                    value, protocol.MAX_NAME_CHARS)
            elif spec.name in ("started_at", "first_t", "last_t", "final_loss",
                               "best_samples_per_s", "best_tokens_per_s"):
                ok = value is None or type(value) in (int, float)
                value = float(value) if ok and value is not None else value
            elif spec.name == "knobs":
                ok = value is None or isinstance(value, dict)
            elif spec.name == "truncated":
                ok = type(value) is bool
            elif spec.name == "tree":
                value = (BranchTree() if value is default
                         else BranchTree.from_public(value))
                ok = value is not None
            elif spec.name == "covered":
                ok = value is None or (type(value) is list and len(value) == 2 and all(
                    type(part) is int and part >= 0 for part in value))
            else:  # counts and steps
                ok = (value is None and default is None) or (
                    type(value) is int and (default is None or value >= 0))
            if not ok:
                return None
            setattr(summary, spec.name, value)
        return summary


def read_summary(path: os.PathLike | str) -> LogSummary | None:
    """The summary file at ``path``; None when missing or not a summary.

    Never read through a link, and at most :data:`MAX_SUMMARY_BYTES` of it."""
    try:
        fd = open_no_follow(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(MAX_SUMMARY_BYTES + 1)
        except OSError:
            return None
    return LogSummary.from_json(data)


# --- the writer -----------------------------------------------------------------------

def _budget_from_env() -> int:
    value = os.environ.get(LOG_BUDGET_ENV, "")
    try:
        budget = int(value)
    except ValueError:
        return DEFAULT_BUDGET_BYTES
    return budget if budget > 0 else DEFAULT_BUDGET_BYTES


class RunLog:
    """The writer of one rank's run log (see the module's documentation); one thread only.

    The agent's log writer process runs it (:mod:`agent.io.logwriter`); tests write logs
    with it directly.

    Args:
        path: the log's first part (created with mode 0600; a log already there, e.g.
            the same run id restarted, is appended to).
        flush_interval_s: longest time a record waits in memory before its frame is
            written (what a run killed with SIGKILL loses at most), in seconds.
        budget_bytes: the disk budget of all its parts (default
            ``$GPUWATCH_LOG_BUDGET_BYTES``, else :data:`DEFAULT_BUDGET_BYTES`); past it,
            older parts are thinned, never deleted.
        part_bytes: a new part starts once one passes this size (default: an eighth of
            the budget, between 1 MiB and 256 MiB).

    Attributes:
        summary: the log's figures so far (saved beside it when a chunk ends, at most
            every :data:`SUMMARY_S`, when a part ends and at :meth:`close`).

    Raises:
        UnsafeLogFileError: ``path`` is a symbolic link, or not a regular file of this
            user with one link (a hard link to another file); nothing is written.
        OSError: the file cannot be created (the agent then runs without a log).
    """

    def __init__(self, path: os.PathLike | str, *, flush_interval_s: float = 0.5,
                 budget_bytes: int | None = None, part_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.flush_interval_s = flush_interval_s
        self.budget_bytes = budget_bytes if budget_bytes is not None else _budget_from_env()
        self.part_bytes = part_bytes if part_bytes is not None else min(
            256 << 20, max(1 << 20, self.budget_bytes // 8))
        self.summary = LogSummary()
        self._part = 0
        while part_path(self.path, self._part + 1).exists():  # a log appended to
            self._part += 1
        self._fd = _open_for_append(part_path(self.path, self._part))
        self._size = os.fstat(self._fd).st_size
        self._summarized = True  # the summary covers all of the log
        if self._size:
            known = read_summary(summary_path(self.path))
            if known is not None and known.covered == [self._part, self._size]:
                self.summary = known
            else:  # what came before is not in our figures: readers rebuild them
                self._summarized = False
                summary_path(self.path).unlink(missing_ok=True)
        else:
            self._write(part_header(self._part))
        self._frames = FrameWriter()
        self._first_pending = 0.0
        self._thinner: subprocess.Popen | None = None
        self._summary_saved = 0.0
        self.closed = False

    def write(self, message: dict[str, Any]) -> None:
        """Append one envelope (a ``steps`` batch as columns); it reaches the disk with its frame.

        Within ``flush_interval_s`` (:meth:`maybe_flush`), or at once when the frame is
        full.

        Raises:
            OSError: the disk is full, the file went away (the log is then dropped).
        """
        self.summary.add(message)
        data = pack_message(message)
        now = time.monotonic()
        frames = self._frames
        if not frames.pending_raw:
            self._first_pending = now
        frames.add(data, now)
        if frames.pending_raw >= FRAME_RAW_BYTES:
            self._write_frame(now)

    def flush_wait_s(self) -> float | None:
        """Seconds until :meth:`maybe_flush` writes the frame being built; None when none is."""
        if not self._frames.pending_raw:
            return None
        return max(0.0, self._first_pending + self.flush_interval_s - time.monotonic())

    def maybe_flush(self) -> None:
        """Write the frame being built if its oldest record is ``flush_interval_s`` old.

        Its writer calls it each time it wakes up (:meth:`flush_wait_s`: when that is due)."""
        if self._frames.pending_raw:
            now = time.monotonic()
            if now - self._first_pending >= self.flush_interval_s:
                self._write_frame(now)

    def _write_frame(self, now: float, final: bool = False) -> None:
        """Write the records built so far as one frame; when that ends the chunk (full,
        :data:`CHUNK_S` old, or ``final``), save the summary, start a new part past
        ``part_bytes`` and thin old parts past the budget."""
        frames = self._frames
        self._write(frames.frame(final or now - frames.chunk_started >= CHUNK_S))
        if not frames.chunk_open:
            self._chunk_ended()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._size += len(data)

    def _chunk_ended(self) -> None:
        now = time.monotonic()
        if now - self._summary_saved >= SUMMARY_S:
            self._summary_saved = now
            self.save_summary()
        if self._size >= self.part_bytes:
            os.close(self._fd)
            self._part += 1
            self._fd = _open_for_append(part_path(self.path, self._part))
            self._size = os.fstat(self._fd).st_size
            self._write(part_header(self._part))
            self.save_summary()
            self._thin_past_budget()

    def save_summary(self) -> None:
        """Save :attr:`summary` beside the log (covering it up to here).

        Unless the log held records of an earlier writer."""
        if self._summarized:
            self.summary.covered = [self._part, self._size]
            write_private(summary_path(self.path), self.summary.to_json())

    def _thin_past_budget(self) -> None:
        """Past the budget, start a child process that thins the older parts, the least
        thinned first, until the log would be within three quarters of it (one process
        at a time: none while the last one still runs). Its work (reading and rewriting
        parts of up to 256 MiB) is never the training process's."""
        if self._thinner is not None and self._thinner.poll() is None:
            return
        self._thinner = None
        parts = []
        for index in range(self._part):  # the closed parts
            try:
                size = os.lstat(part_path(self.path, index)).st_size
            except OSError:
                continue
            parts.append((thinned_level(part_path(self.path, index)), index, size))
        total = sum(size for *_, size in parts) + self._size
        if total <= self.budget_bytes:
            return
        chosen = []
        for level, index, size in sorted(parts):  # the least thinned, oldest first
            if total <= self.budget_bytes * 3 // 4:
                break
            chosen.append(os.fspath(part_path(self.path, index)))
            total -= size - size // THIN_FACTOR
        if chosen and sys.executable:
            home = str(Path(__file__).resolve().parent.parent)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                part for part in (home, os.environ.get("PYTHONPATH", "")) if part)}
            try:
                self._thinner = subprocess.Popen(
                    [sys.executable, "-m", "agent.wire.runlog", "thin", *chosen], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, close_fds=True)
            except OSError:
                pass  # no process to be had now: the next part tries again

    def close(self) -> None:
        """Write what is left, end the chunk, save the summary and close.

        Idempotent; a thinning process still running goes on alone."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._frames.pending_raw:
                self._write_frame(time.monotonic(), final=True)
            self.save_summary()
        finally:
            os.close(self._fd)


# --- the reader -----------------------------------------------------------------------

class Position(tuple):
    """Where a reader can start again: ``(part, chunk offset, item)``.

    The part's index, the byte offset of the frame that starts the chunk, and the items of
    the chunk before it."""

    __slots__ = ()

    def __new__(cls, part: int, offset: int, item: int = 0) -> Position:
        return tuple.__new__(cls, (part, offset, item))

    @property
    def part(self) -> int:
        return self[0]

    @property
    def offset(self) -> int:
        return self[1]

    @property
    def item(self) -> int:
        return self[2]


def _envelope(item: Any) -> dict[str, Any] | None:
    """A stored item as an envelope, or None when it is not one (not a map, no string
    ``type``, a body that is not a map)."""
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        return None
    body = item.get("body")
    if body is None:
        item["body"] = {}
    elif not isinstance(body, dict):
        return None
    return item


def decode_steps(message: dict[str, Any], *, arrays: bool = False) -> dict[str, Any]:
    """A stored ``steps`` item's body with its columns decoded (:func:`decode_column`), in place.

    Returns the message.

    Raises:
        agent.wire.protocol.ProtocolError: not a batch of at most
            :data:`~agent.wire.protocol.MAX_BATCH_STEPS` rows.
    """
    body = message["body"]
    n, columns, common = body.get("n"), body.get("columns"), body.get("common", {})
    if (type(n) is not int or not 0 <= n <= protocol.MAX_BATCH_STEPS
            or not isinstance(columns, dict) or not isinstance(common, dict)):
        raise protocol.ProtocolError("a steps body needs n, columns and common")
    body["columns"] = {name: decode_column(value, n, arrays=arrays)
                       for name, value in columns.items()}
    body.setdefault("common", common)
    return message


class PartReader:
    """The records of one part file, read as far as it is complete.

    Call :meth:`read` again to get what was appended since (a log being written).

    Never raises for the file's content: a damaged frame is counted in
    :attr:`malformed` and reading goes on at the next chunk; a frame not complete at
    the end of the file is left for the next call (in a finished log: the torn frame
    of a killed run, :attr:`pending` bytes).

    Args:
        fd: the part's descriptor (read with ``pread``; the caller closes it).
        part: the part's index (for the positions given out).
        start: where to begin (a :class:`Position` in this part; default its start).
        arrays: ``steps`` columns of numbers as numpy arrays, not lists.

    Attributes:
        malformed: damaged stretches, frames or items that could not be read.
        pending: bytes after the last complete frame. thinned: the part header's
            ``thinned`` (0: every step as logged). counted_bytes: the frames read so far,
            each at its larger size, compressed or not (what bounds :meth:`read`).
    """

    def __init__(self, fd: int, *, part: int = 0, start: tuple[int, int, int] | None = None,
                 arrays: bool = False) -> None:
        self.fd = fd
        self.part = part
        self.arrays = arrays
        self.malformed = 0
        self.pending = 0
        self.thinned = 0
        self.counted_bytes = 0
        self.offset = start[1] if start else 0
        self._skip = start[2] if start else 0
        self._decompressor: Any = None
        self._chunk = -1  # the offset of the frame that started the current chunk
        self._item = 0  # items of the chunk read so far
        self._lost = False  # a chunk's frames after damage, up to the next chunk
        self._garbage = False  # in bytes that are no frame (counted once)

    def read(self, max_bytes: int = 16 << 20) -> list[tuple[Position, dict[str, Any]]]:
        """The records of the complete frames after the last call, with their positions.

        At most about ``max_bytes`` of frames, each counted at its larger size,
        compressed or not (a crafted frame may decompress to a thousand times its size;
        a frame is at most :data:`MAX_FRAME_RAW_BYTES` either way).

        Raises:
            OSError: the file cannot be read.
        """
        found: list[tuple[Position, dict[str, Any]]] = []
        read = 0
        while read < max_bytes:
            head = os.pread(self.fd, FRAME_HEADER.size, self.offset)
            if len(head) < FRAME_HEADER.size:
                self.pending = len(head)
                break
            magic, version, flags, _, comp_len, raw_len, crc, raw_crc, head_crc = \
                FRAME_HEADER.unpack(head)
            if (magic != FRAME_MAGIC or zlib.crc32(head[:-4]) != head_crc
                    or version != FORMAT_VERSION or comp_len > MAX_FRAME_RAW_BYTES
                    or raw_len > MAX_FRAME_RAW_BYTES):
                if not self._resync():
                    break
                continue
            payload = os.pread(self.fd, comp_len, self.offset + FRAME_HEADER.size)
            if len(payload) < comp_len:
                self.pending = FRAME_HEADER.size + len(payload)
                break
            if zlib.crc32(payload) != crc:
                if not self._resync():
                    break
                continue
            start, self._garbage, self.pending = self.offset, False, 0
            self.offset += FRAME_HEADER.size + comp_len
            read += max(FRAME_HEADER.size + comp_len, raw_len)
            self.counted_bytes += max(FRAME_HEADER.size + comp_len, raw_len)
            found += self._frame(start, flags, payload, raw_len, raw_crc)
        return found

    def _resync(self) -> bool:
        """After bytes that are no frame: count them (once) and move to the next
        frame; False when none follows yet (the offset then stays where one could still
        begin). The chunk's stream goes on if no frame of it was lost (its next frame
        then decompresses to its raw CRC), else from the next chunk."""
        if not self._garbage:
            self.malformed += 1
            self._garbage = True
        block_size = 1 << 20
        position = self.offset + 1
        while True:
            block = os.pread(self.fd, block_size, position)
            at = block.find(FRAME_MAGIC)
            while at != -1:
                head = block[at:at + FRAME_HEADER.size]
                if len(head) < FRAME_HEADER.size:
                    break  # cut by the block's end: read again from it
                if zlib.crc32(head[:-4]) == FRAME_HEADER.unpack(head)[-1]:
                    self.offset = position + at
                    return True
                at = block.find(FRAME_MAGIC, at + 1)
            if len(block) < block_size:  # the end: maybe a frame comes later
                self.offset = position + (at if at != -1 else max(
                    0, len(block) - len(FRAME_MAGIC) + 1))
                self.pending = len(block) - (self.offset - position)
                return False
            position += at if at != -1 else len(block) - len(FRAME_MAGIC) + 1

    def _frame(self, start: int, flags: int, payload: bytes, raw_len: int, raw_crc: int
               ) -> list[tuple[Position, dict[str, Any]]]:
        if flags & FLAG_PART:
            try:
                thinned = msgpack.unpackb(payload, raw=False, strict_map_key=False).get(
                    "thinned", 0)
                self.thinned = thinned if type(thinned) is int and thinned >= 0 else 0
            except Exception:  # msgpack raises several unrelated types
                self.malformed += 1
            return []
        if flags & FLAG_CHUNK:
            self._decompressor = zlib.decompressobj(-15)
            self._chunk, self._item, self._lost = start, 0, False
        elif self._decompressor is None:
            if not self._lost:
                self.malformed += 1  # a chunk's later frame without its start
                self._lost = True
            return []
        try:
            raw = self._decompressor.decompress(payload, raw_len)
            if (len(raw) != raw_len or self._decompressor.unconsumed_tail
                    or zlib.crc32(raw) != raw_crc):  # (a frame of its chunk was lost)
                raise zlib.error(f"{len(raw)} bytes, not the {raw_len} written")
        except zlib.error:
            self.malformed += 1
            self._decompressor, self._lost = None, True
            return []
        if flags & FLAG_END:
            self._decompressor = None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                    max_buffer_size=max(raw_len, 1))
        unpacker.feed(raw)
        found = []
        try:
            for item in unpacker:
                index = self._item
                self._item += 1
                if self._skip:
                    self._skip -= 1
                    continue
                envelope = _envelope(item)
                if envelope is not None and envelope["type"] == protocol.STEPS:
                    try:
                        decode_steps(envelope, arrays=self.arrays)
                    except protocol.ProtocolError:
                        envelope = None
                if envelope is None:
                    self.malformed += 1
                    continue
                found.append((Position(self.part, self._chunk, index), envelope))
        except Exception:  # msgpack raises several unrelated types; the rest is lost
            self.malformed += 1
        return found


def read_part(path: os.PathLike | str, *, part: int = 0, arrays: bool = False
              ) -> Iterator[tuple[Position, dict[str, Any]]]:
    """Every record of a finished part file, in order (see :class:`PartReader`).

    Raises:
        OSError: it cannot be opened (a link, not a regular file) or read.
    """
    fd = open_no_follow(path)
    try:
        reader = PartReader(fd, part=part, arrays=arrays)
        while True:
            found = reader.read()
            if not found and (reader.pending or reader.offset >= os.fstat(fd).st_size):
                return
            yield from found
    finally:
        os.close(fd)


def thinned_level(path: os.PathLike | str) -> int:
    """A part's ``thinned`` (0 when it is not thinned or cannot be read)."""
    try:
        fd = open_no_follow(path)
    except OSError:
        return 0
    try:
        reader = PartReader(fd)
        reader.read(max_bytes=1)
        return reader.thinned
    except OSError:
        return 0
    finally:
        os.close(fd)


# --- thinning -------------------------------------------------------------------------

class _Buckets:
    """Step rows folded into buckets of at most ``factor`` rows with the same knob
    values (rows that are buckets already fold by their counts), emitted as ``steps``
    batches of at most :data:`~agent.wire.protocol.MAX_BATCH_STEPS` buckets."""

    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.rows: list[dict[str, Any]] = []  # the finished buckets, as rows
        self._open: dict[str, Any] | None = None
        self._stats: dict[str, list[float]] = {}  # name -> [sum, count, min, max]
        self._head: dict[str, Any] = {}

    def add(self, message: dict[str, Any]) -> None:
        self._head = {key: message.get(key) for key in ("v", "run", "rank", "seq", "t")}
        for row in protocol.step_bodies(message["body"]):
            count = row.pop("steps_in_bucket", 1)
            count = count if type(count) is int and count > 0 else 1
            if self._open is not None and (row.get("knobs") != self._open.get("knobs")
                                           or self._open["steps_in_bucket"] + count
                                           > self.factor):
                self._close()
            if self._open is None:
                self._open = {"steps_in_bucket": 0}
                self._stats = {}
            opened = self._open
            opened["steps_in_bucket"] += count
            for name, value in row.items():
                if name.endswith((".min", ".max")):
                    continue
                mean = number(value)
                if mean is None:
                    opened[name] = value  # text, maps, None: the latest
                    continue
                low = number(row.get(f"{name}.min"))
                high = number(row.get(f"{name}.max"))
                stats = self._stats.setdefault(name, [0.0, 0, math.inf, -math.inf])
                stats[0] += mean * count
                stats[1] += count
                stats[2] = min(stats[2], mean if low is None else low)
                stats[3] = max(stats[3], mean if high is None else high)
                if name == "step":
                    opened["step"] = value

    def _close(self) -> None:
        opened, self._open = self._open, None
        if opened is None:
            return
        for name, (total, count, low, high) in self._stats.items():
            if name == "step":
                opened["step.min"] = int(low)
                continue
            opened[name] = total / count
            opened[f"{name}.min"] = low
            opened[f"{name}.max"] = high
        self.rows.append(opened)

    def batches(self, final: bool) -> list[dict[str, Any]]:
        """The finished buckets as ``steps`` envelopes (``final``: the open one too)."""
        if final:
            self._close()
        rows, self.rows = self.rows, []
        messages = []
        for start in range(0, len(rows), protocol.MAX_BATCH_STEPS):
            part = rows[start:start + protocol.MAX_BATCH_STEPS]
            names = list(dict.fromkeys(name for row in part for name in row))
            columns = {name: [row.get(name) for row in part] for name in names}
            body = {**protocol.steps_body(columns), "thinned": self.factor}
            messages.append({**self._head, "type": protocol.STEPS, "body": body})
        return messages


def thin_part(path: os.PathLike | str, factor: int = THIN_FACTOR) -> None:
    """Rewrite a finished part of a run log thinned (see the module's documentation).

    Into a new file beside it, then renamed over it (a reader reading it goes on reading the
    old one). A part thinned already is thinned again, ``factor`` times coarser.

    Raises:
        OSError: it cannot be read or written (a link is never followed).
    """
    write_private(Path(path), _thinned_frames(Path(path), factor))


def _thinned_frames(path: Path, factor: int) -> Iterator[bytes]:
    level = max(1, thinned_level(path)) * factor
    suffix = path.name.rsplit(".", 1)[-1]
    yield part_header(int(suffix) if suffix.isdigit() else 0, level)
    buckets = _Buckets(level)
    seen: dict[str, int] = {}
    frames = FrameWriter()
    for _, message in read_part(path):
        kind = message["type"]
        if kind == protocol.STEPS:
            buckets.add(message)
            batches = buckets.batches(False)
        else:
            seen[kind] = seen.get(kind, 0) + 1
            kept = kind in KEPT_WHOLE or (seen[kind] - 1) % factor == 0
            batches = [*buckets.batches(True), message] if kept else []  # in order
        for batch in batches:
            frames.add(pack_message(batch))
            if frames.pending_raw >= FRAME_RAW_BYTES:
                yield frames.frame()
    for batch in buckets.batches(True):
        frames.add(pack_message(batch))
    yield frames.frame(end_chunk=True)


def main(argv: list[str]) -> int:
    """``python -m agent.wire.runlog thin PART...``: thin each part; return the exit status.

    The writer's child process, run at a low priority."""
    if len(argv) < 2 or argv[0] != "thin":
        print("usage: python -m agent.wire.runlog thin PART...", file=sys.stderr)
        return 2
    try:
        os.nice(10)
    except OSError:
        pass
    status = 0
    for path in argv[1:]:
        try:
            thin_part(path)
        except OSError as exc:
            print(f"cannot thin {path}: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
