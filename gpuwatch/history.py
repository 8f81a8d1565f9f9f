"""Runs after the fact: the run logs on disk, found and read back in bounded memory.

The one reader of run logs for everything that looks at a run after the fact:
``gpuwatch runs --all``, the timeline, ``replay``, ``report``, ``compare`` and
``export``. It reads both formats:

- the run log (:mod:`agent.wire.runlog`, ``<run>.rank<r>.runlog`` and its parts ``.1``,
  ``.2``, ...): frames of compressed records, the steps as column batches;
- the JSON lines of earlier versions (``<run>.rank<r>.jsonl``, rotated ``.1`` ... ``.N``
  older files), one ``step`` line per optimizer step, regrouped here into the batches
  they were written from.

One reader API, three levels:

- :class:`LogReader`: every record in order, as envelopes; the steps as ``steps``
  batches (at most :data:`~agent.wire.protocol.MAX_BATCH_STEPS` rows, the wire's shape), with
  a :class:`Position` to start again from;
- :func:`step_batch`: a batch's rows as numbers, one float64 array a field
  (:class:`StepBatch`), what the tools compute with;
- :func:`read_history` (:class:`RunHistory`): one pass folded into what the report,
  compare and the timeline show, and :func:`run_summaries` the run list, from the
  summary the writer keeps beside each log (:class:`agent.wire.runlog.LogSummary`) and the
  records written after it.

Memory: whatever the log's length, a reader holds one frame (at most
:data:`agent.wire.runlog.MAX_FRAME_RAW_BYTES` of records) or one line (at most
:data:`MAX_LINE_BYTES`); a history holds figures of bounded size: medians from at most
:data:`SAMPLE_VALUES` values a segment, plots of :data:`OVERVIEW_BUCKETS` buckets, the
first :data:`MAX_EVENTS` events and :data:`MAX_CHANGES` knob changes, and
:data:`MAX_SEGMENTS` segments at each end of the run.

What it tolerates, never raising for a file's content: a run killed while writing (a
torn last frame or line), damaged frames and lines that are not records (counted in
``malformed``), unknown record types and fields, records of older agents (missing
fields), numbers that are not numbers (read as missing), files that are symbolic links
or not regular files (never opened, ``O_NOFOLLOW``). Every string kept to be shown goes
through :func:`agent.wire.protocol.printable` and is cut to a bound.

Units: times are unix seconds (``t``, ``started_at``), durations seconds, memory bytes,
throughput per second, as in the step records (:mod:`agent.wire.protocol`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import orjson

from agent.wire import protocol, runlog
from agent.wire.protocol import ENVELOPE_KEYS, MAX_NAME_CHARS, MAX_TEXT_CHARS, printable
from agent.wire.runlog import (BranchPath, BranchTree, LogSummary, log_dir, number,
                               open_no_follow)
from agent.wire.runs import list_runs
from gpuwatch.state import MAX_KNOBS, KnobChange
from gpuwatch.units import human_rate, knob_text

if TYPE_CHECKING:
    import numpy

#: A line longer than this is malformed (as a frame over the wire limit would be).
MAX_LINE_BYTES = protocol.MAX_MESSAGE_BYTES
#: Bytes read from a JSON-lines file at a time.
CHUNK_BYTES = 1 << 20
#: A run log's file name: ``<run>.rank<r>.runlog`` (parts ``.1``, ...) or
#: ``<run>.rank<r>.jsonl`` (rotated ``.1``, ...).
LOG_NAME = re.compile(
    r"(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,99})\.rank(?P<rank>[0-9]{1,6})"
    r"\.(?P<kind>runlog|jsonl)(?:\.(?P<index>[0-9]{1,4}))?")
#: Parts or rotated files looked for beside a log given by path.
MAX_BACKUPS = 1000
#: Numeric fields a step batch keeps at most (the known ones, then the first others).
MAX_STEP_COLUMNS = 64
#: Events a history keeps (its first ones; the others are counted).
MAX_EVENTS = 100_000
#: Knob changes a history keeps (its first ones; the others are counted).
MAX_CHANGES = 10_000
#: Segments a history keeps at each end of the run (the ones between are counted).
MAX_SEGMENTS = 1000
#: Values a segment's medians are taken from at most: every one up to this many, else
#: an evenly spaced sample of them.
SAMPLE_VALUES = 65_536
#: Buckets of a field's overview (:class:`Series`): what a plot of the run draws.
OVERVIEW_BUCKETS = 2048
#: A step number beyond this is not one (a float's exact integers end there).
MAX_STEP = float(1 << 53)
#: A value beyond this is left out of an overview (its sums would overflow).
MAX_PLOTTED = 1e250

#: Step fields with numbers, as :mod:`agent.wire.protocol` documents them (others found in
#: a log are kept too, up to :data:`MAX_STEP_COLUMNS`).
STEP_NUMBERS = (
    "step", "micro_batches", "samples", "step_time_s", "data_wait_s", "data_wait_share",
    "data_wait_share_window", "samples_per_s", "tokens", "tokens_per_s", "loss", "lr",
    "grad_norm", "gpu_step_time_s", "host_rss_bytes", "host_peak_rss_bytes",
    "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_reserved_bytes",
    "activation_bytes", "skipped_steps_total", "num_ooms", "num_alloc_retries")
#: Step fields with text.
STEP_TEXTS = ("input_verdict",)
#: The fields of a history's overview (what the report plots).
OVERVIEW_FIELDS = (
    "step_time_s", "data_wait_s", "samples_per_s", "tokens_per_s", "loss",
    "host_rss_bytes", "mem_allocated_bytes", "mem_reserved_bytes",
    "mem_peak_reserved_bytes", "activation_bytes")
#: Step-batch columns that are not fields of a step: a thinned bucket's count.
BUCKET_COUNT = "steps_in_bucket"


def _np() -> Any:
    """numpy, imported when first needed (``gpuwatch`` starts without it)."""
    import numpy

    return numpy


# --- lines of the older format --------------------------------------------------------

def envelope_from_record(record: Any) -> dict[str, Any] | None:
    """A flattened run-log record back as an envelope; None when it is not one.

    The envelope is ``{"v", "type", "run", "rank", "seq", "t", "body"}``; None when
    ``record`` is not a map with a string ``type``.

    The inverse of :func:`agent.wire.protocol.flatten` for what the agent writes (a body key
    named like an envelope key is lost by flattening, and ``v`` is not logged: the
    current :data:`agent.wire.protocol.PROTOCOL_VERSION` is assumed).
    """
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    envelope: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION}
    envelope.update((key, record.get(key)) for key in ENVELOPE_KEYS)
    envelope["body"] = {key: value for key, value in record.items()
                        if key not in ENVELOPE_KEYS}
    return envelope


def decode_line(line: bytes) -> dict[str, Any] | None:
    """One JSON-lines log line (without its newline) as an envelope, or None for a non-record.

    Not a record: longer than :data:`MAX_LINE_BYTES`, not JSON, not UTF-8, nested beyond
    what the parser takes, not a map, or without a string ``type``.

    Standard JSON goes through orjson (about 2 us for a step line); what orjson refuses
    (``NaN``, integers beyond 64 bits, as a hand-made log may hold) through :mod:`json`.
    """
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return envelope_from_record(record)


# --- finding logs ---------------------------------------------------------------------

@dataclass(frozen=True)
class LogFiles:
    """The files of one rank's run log.

    Attributes:
        run_id: the run id from the file name. rank: the rank from the file name.
        paths: the files in the order their records were written (a run log's parts
            ``<first>``, ``.1``, ``.2``, ...; JSON lines' ``.N`` ... ``.1``, then the
            current one).
        size_bytes: their sizes together, in bytes.
        modified_at: when the newest one was last written (unix s).
        kind: ``runlog`` (:mod:`agent.wire.runlog`) or ``jsonl`` (the earlier format).
    """

    run_id: str
    rank: int
    paths: tuple[Path, ...]
    size_bytes: int
    modified_at: float
    kind: str = "runlog"

    @property
    def first(self) -> Path:
        """The log's own path: the first part of a run log, the current file of JSON lines.

        What a run file names as its ``log_path``."""
        return self.paths[0] if self.kind == "runlog" else self.paths[-1]


def _regular_file(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file (not a link), else None."""
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status if stat.S_ISREG(status.st_mode) else None


def _log_files(run_id: str, rank: int, found: dict[int, tuple[Path, os.stat_result]]
               ) -> LogFiles:
    # the format from the first bytes (a name is no proof): a run log's parts count up,
    # rotated JSON lines count back in time
    kind = "runlog" if _starts_with(found[min(found)][0], runlog.FRAME_MAGIC) else "jsonl"
    order = sorted(found) if kind == "runlog" else sorted(
        found, key=lambda index: -index if index else 1)
    return LogFiles(run_id, rank, tuple(found[index][0] for index in order),
                    sum(status.st_size for _, status in found.values()),
                    max(status.st_mtime for _, status in found.values()), kind)


def find_logs(directory: os.PathLike | str | None = None) -> list[LogFiles]:
    """The run logs in ``directory``, one per run and rank (and format), newest first.

    ``directory`` defaults to :func:`agent.wire.runlog.log_dir`; newest by last write. Links
    and files that are not regular are left out.

    Raises:
        OSError: the directory cannot be listed.
    """
    directory = Path(directory) if directory is not None else log_dir()
    groups: dict[tuple[str, int, str], dict[int, tuple[Path, os.stat_result]]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            match = LOG_NAME.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            status = entry.stat(follow_symlinks=False)
            key = (match["run"], int(match["rank"]), match["kind"])
            groups.setdefault(key, {})[int(match["index"] or 0)] = (Path(entry.path), status)
    logs = [_log_files(run_id, rank, found) for (run_id, rank, _), found in groups.items()]
    logs.sort(key=lambda log: (log.modified_at, -log.rank), reverse=True)
    return logs


def log_at(path: os.PathLike | str) -> LogFiles | None:
    """The run log whose first part (or, JSON lines, current file) is ``path``, with its files.

    The files beside it come with it; None when ``path`` is not a regular file (missing, a
    link, a directory). Run id and rank come from the name when it is a run log's, else the
    name and 0; the format from its first bytes."""
    path = Path(path)
    status = _regular_file(path)
    if status is None:
        return None
    found = {0: (path, status)}
    for index in range(1, MAX_BACKUPS + 1):
        other = Path(f"{path}.{index}")
        other_status = _regular_file(other)
        if other_status is None:
            break
        found[index] = (other, other_status)
    match = LOG_NAME.fullmatch(path.name)
    run_id, rank = (match["run"], int(match["rank"])) if match else (path.name, 0)
    return _log_files(run_id, rank, found)


def _starts_with(path: Path, prefix: bytes) -> bool:
    try:
        fd = open_no_follow(path)
    except OSError:
        return False
    try:
        return os.pread(fd, len(prefix), 0) == prefix
    except OSError:
        return False
    finally:
        os.close(fd)


def select_logs(selector: str, logs: Sequence[LogFiles]) -> list[LogFiles]:
    """The logs (every rank) of the one run whose id is ``selector`` or starts with it.

    ``[]`` when none or several runs match. Ranks in order."""
    exact = [log for log in logs if log.run_id == selector]
    matches = exact or [log for log in logs if log.run_id.startswith(selector)]
    if len({log.run_id for log in matches}) != 1:
        return []
    return sorted(matches, key=lambda log: (log.rank, log.kind != "runlog"))


def find_run_log(selector: str, rank: int | None = None) -> LogFiles | None:
    """The log of the run that ``selector`` names, at ``rank``; None when none or several match.

    ``selector``: a run log's path, or a run id or unique prefix of one among this user's
    logs; ``rank`` defaults to the lowest with a log. None when nothing (or several runs)
    match."""
    if os.sep in selector or selector.endswith((".jsonl", runlog.LOG_SUFFIX)):
        return log_at(selector)
    try:
        logs = select_logs(selector, find_logs())
    except OSError:
        return None
    if rank is not None:
        logs = [log for log in logs if log.rank == rank]
    return logs[0] if logs else None


# --- reading records ------------------------------------------------------------------

class Position(NamedTuple):
    """Where a reader can start again: a file, a byte offset in it and the records to skip.

    The index of a file in :attr:`LogFiles.paths`, a byte offset in it (a run log's: where a
    chunk starts; JSON lines': where a line starts) and the records to skip from there."""

    file: int
    offset: int
    item: int = 0


class LogReader:
    """The records of one rank's run log, in order, as envelopes, with where to start again.

    Where to start again from each: a run log's records as stored, the older format's lines
    regrouped (every ``step`` line of one ``steps`` batch, the ones with its ``seq``, back
    into that batch). A ``steps`` batch's columns are lists, or with ``arrays`` the numbers
    of a run log as numpy arrays.

    Iterating never raises for the files' content. Older format: a ``hello`` at the
    head of a file after the first is the copy a rotation writes, skipped when the
    records before it were read, else (older files deleted) kept with its ``seq`` None
    so that the records deleted are not counted as missed on the way.

    Args:
        log: the files to read.
        start: where to begin (a :class:`Position` an earlier iteration yielded).
        arrays: see above.

    Attributes:
        malformed: damaged frames and lines that were not records. truncated: the log
            ends in an incomplete frame or line (a run killed while writing; it is not
            read). unreadable: files that could not be opened or read (a link, gone,
            permissions), with why. thinned: the largest bucket of thinned steps met
            (0: every step as logged).
    """

    def __init__(self, log: LogFiles, *, start: Position | None = None,
                 arrays: bool = False) -> None:
        self.log = log
        self.start = start or Position(0, 0)
        self.arrays = arrays
        self.malformed = 0
        self.truncated = False
        self.unreadable: list[str] = []
        self.thinned = 0

    def __iter__(self) -> Iterator[tuple[Position, dict[str, Any]]]:
        if self.log.kind == "runlog":
            return self._parts()
        return _regrouped(self._lines())

    # the run log's parts

    def _parts(self) -> Iterator[tuple[Position, dict[str, Any]]]:
        paths = self.log.paths
        for index in range(self.start.file, len(paths)):
            try:
                fd = open_no_follow(paths[index])
            except OSError as exc:
                self.unreadable.append(f"{paths[index]}: {exc.strerror or exc}")
                continue
            try:
                start = self.start if index == self.start.file and self.start.offset else None
                reader = runlog.PartReader(fd, part=index, start=start, arrays=self.arrays)
                while True:
                    found = reader.read(max_bytes=1)  # a frame at a time
                    for position, envelope in found:
                        yield Position(*position), envelope
                    if not found and (reader.pending or reader.offset >= os.fstat(fd).st_size):
                        break
            except OSError as exc:
                self.unreadable.append(f"{paths[index]}: {exc.strerror or exc}")
                continue
            finally:
                os.close(fd)
            self.malformed += reader.malformed
            self.thinned = max(self.thinned, reader.thinned)
            if reader.pending:
                if index == len(paths) - 1:
                    self.truncated = True
                else:
                    self.malformed += 1  # a part cut short, with parts after it

    # the older format's lines

    def _lines(self) -> Iterator[tuple[Position, dict[str, Any]]]:
        last_seq: int | None = None
        for index in range(self.start.file, len(self.log.paths)):
            offset = self.start.offset if index == self.start.file else 0
            # a file read from its start may begin with a rotation's copy of a hello
            head = offset == 0 and (index > self.start.file or self.start.file == 0)
            held: tuple[Position, dict[str, Any]] | None = None
            for position, envelope in self._file_lines(index, offset):
                if head and envelope["type"] == protocol.HELLO:
                    held, head = (position, envelope), False
                    continue
                head = False
                if held is not None:
                    yield from self._head_hello(held, last_seq, envelope.get("seq"))
                    held = None
                if type(envelope.get("seq")) is int:
                    last_seq = envelope["seq"]
                yield position, envelope
            if held is not None:
                yield from self._head_hello(held, last_seq, None)

    @staticmethod
    def _head_hello(held: tuple[Position, dict[str, Any]], last_seq: int | None,
                    next_seq: Any) -> Iterator[tuple[Position, dict[str, Any]]]:
        """The hello that heads a file: nothing when it repeats one already read;
        without its ``seq`` when the record after it does not follow it (a copy whose
        original was deleted with an older file)."""
        hello = held[1]
        seq = hello.get("seq")
        if type(seq) is int and last_seq is not None and seq <= last_seq:
            return
        if type(seq) is not int or next_seq != seq + 1:
            hello["seq"] = None
        yield held

    def _file_lines(self, index: int, offset: int
                    ) -> Iterator[tuple[Position, dict[str, Any]]]:
        path = self.log.paths[index]
        try:
            fd = open_no_follow(path)
        except OSError as exc:
            self.unreadable.append(f"{path}: {exc.strerror or exc}")
            return
        with os.fdopen(fd, "rb", buffering=0) as handle:
            handle.seek(offset)
            partial = b""
            line_start = offset
            skipping = False  # inside a line longer than MAX_LINE_BYTES
            while True:
                try:
                    chunk = handle.read(CHUNK_BYTES) or b""
                except OSError as exc:
                    self.unreadable.append(f"{path}: {exc.strerror or exc}")
                    return
                if not chunk:
                    break
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                for line in lines:
                    start, line_start = line_start, line_start + len(line) + 1
                    if skipping:
                        skipping = False
                        continue
                    if not line.strip():
                        continue
                    envelope = decode_line(line)
                    if envelope is None:
                        self.malformed += 1
                    else:
                        yield Position(index, start), envelope
                if len(partial) > MAX_LINE_BYTES:
                    if not skipping:
                        self.malformed += 1
                        skipping = True
                    line_start += len(partial)
                    partial = b""
            if index == len(self.log.paths) - 1:
                self.truncated = bool(partial.strip()) and not skipping


def _regrouped(records: Iterable[tuple[Position, dict[str, Any]]]
               ) -> Iterator[tuple[Position, dict[str, Any]]]:
    """Older-format records with the ``step`` lines of one batch (consecutive, with
    the same ``run``, ``rank``, ``seq`` and ``t``) back as one ``steps`` batch: each
    field a column (None where a line lacks it), a field with one value in every row
    among the batch's ``common`` ones."""
    rows: list[dict[str, Any]] = []
    head: tuple[Any, ...] = ()
    first: Position | None = None
    for position, envelope in records:
        if envelope["type"] == protocol.STEP:
            key = tuple(envelope.get(name) for name in ("run", "rank", "seq", "t"))
            if rows and (key != head or len(rows) >= protocol.MAX_BATCH_STEPS):
                yield _batch(first, head, rows)  # type: ignore[arg-type]
                rows = []
            if not rows:
                head, first = key, position
            rows.append(envelope["body"])
            continue
        if rows:
            yield _batch(first, head, rows)  # type: ignore[arg-type]
            rows = []
        yield position, envelope
    if rows:
        yield _batch(first, head, rows)  # type: ignore[arg-type]


def _batch(position: Position, head: tuple[Any, ...], rows: list[dict[str, Any]]
           ) -> tuple[Position, dict[str, Any]]:
    n = len(rows)
    names = dict.fromkeys(name for row in rows for name in row)
    columns, common = {}, {}
    for name in names:
        values = [row.get(name) for row in rows]
        first = values[0]
        if type(first) in (int, float, str, bool, type(None)) and (
                values.count(first) == n and set(map(type, values)) == {type(first)}):
            common[name] = first
        else:
            columns[name] = values
    if "step" not in columns:  # the batch's one column every reader looks for
        columns["step"] = [common.pop("step", None)] * n
    run, rank, seq, t = head
    return position, {"v": protocol.PROTOCOL_VERSION, "type": protocol.STEPS, "run": run,
                      "rank": rank, "seq": seq, "t": t,
                      "body": {"n": n, "columns": columns, "common": common}}


def flat_records(path: os.PathLike | str) -> Iterator[dict[str, Any]]:
    """Every record of the run log at ``path`` as one flat map, as ``gpuwatch tail --json`` has it.

    See :func:`agent.wire.protocol.flatten`; a step a record:
    ``pandas.DataFrame(flat_records(path)).query("type == 'step'")`` is the log's steps as a
    table (in memory: for short runs; :func:`step_batches` for long ones).

    Raises:
        FileNotFoundError: ``path`` is not a regular file (missing, a link).
    """
    log = log_at(path)
    if log is None:
        raise FileNotFoundError(f"no run log at {path}")
    for _, envelope in LogReader(log):
        for record in protocol.expand(envelope):
            yield protocol.flatten(record)


# --- the steps as numbers -------------------------------------------------------------

@dataclass
class StepBatch:
    """The rows of a ``steps`` batch as numbers: what every tool computes with.

    Attributes:
        n: rows. t, seq: the batch's time (unix s) and sequence number (None when the
            log lacks them).
        numbers: field -> float64 array of ``n`` (NaN where a row lacks the field or
            has no finite number in it): ``step`` (an optimizer step number, NaN past
            2**53) and every numeric field found (:data:`STEP_NUMBERS` first), at most
            :data:`MAX_STEP_COLUMNS`; a thinned bucket's ``<field>.min`` and
            ``<field>.max`` too.
        texts: field -> ``n`` strings or None (:data:`STEP_TEXTS`).
        knobs: each row's knob values (the same map for rows that share it; None where
            unknown).
        counts: the steps each row stands for (int64 array; a thinned bucket's
            ``steps_in_bucket``), None when one each.
    """

    n: int
    t: float | None
    seq: int | None
    numbers: dict[str, numpy.ndarray]
    texts: dict[str, list[str | None]]
    knobs: list[Any]
    counts: numpy.ndarray | None = None

    def column(self, name: str) -> numpy.ndarray:
        """The numbers of field ``name`` (all NaN when the batch lacks it)."""
        found = self.numbers.get(name)
        return found if found is not None else _np().full(self.n, math.nan)

    def weights(self) -> numpy.ndarray:
        """The steps each row stands for, as floats (ones unless thinned)."""
        np = _np()
        return np.ones(self.n) if self.counts is None else self.counts.astype(np.float64)


_NUMBER_TYPES = frozenset({int, float, type(None)})


def _numbers(values: Any, n: int) -> numpy.ndarray:
    """A column (list or numpy array) of ``n`` values as float64, NaN where not a
    finite number (booleans, text, maps, None, inf, integers beyond a float)."""
    np = _np()
    if isinstance(values, np.ndarray):
        array = values.astype(np.float64)
    elif set(map(type, values)) <= _NUMBER_TYPES:
        try:
            array = np.array(values, dtype=np.float64)
        except OverflowError:
            array = np.array([math.nan if (v := number(value)) is None else v
                              for value in values])
    else:
        array = np.array([math.nan if (v := number(value)) is None else v
                          for value in values])
    if not np.isfinite(array).all():
        array[~np.isfinite(array)] = math.nan
    return array


def step_batch(envelope: dict[str, Any]) -> StepBatch | None:
    """A ``steps`` envelope (as :class:`LogReader` gives it) as numbers.

    None when its body is not a batch."""
    np = _np()
    body = envelope.get("body") or {}
    n, columns, common = body.get("n"), body.get("columns"), body.get("common") or {}
    if (type(n) is not int or not 0 < n <= protocol.MAX_BATCH_STEPS
            or not isinstance(columns, dict) or not isinstance(common, dict)):
        return None
    for values in columns.values():
        if not hasattr(values, "__len__") or len(values) != n:
            return None
    numbers: dict[str, Any] = {}
    texts: dict[str, list[str | None]] = {}
    knobs: list[Any] = [None] * n
    counts = None
    t, seq = number(envelope.get("t")), envelope.get("seq")
    numbers["t"] = np.full(n, math.nan if t is None else t)
    numbers["seq"] = np.full(n, seq if type(seq) is int and abs(seq) < MAX_STEP
                             else math.nan, dtype=np.float64)
    names = [name for name in dict.fromkeys([*STEP_NUMBERS, *columns, *common])
             if name in columns or name in common]
    for name in names:
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or name in ENVELOPE_KEYS:
            continue
        if name not in columns:  # one value for every row
            value = common[name]
            if name == "knobs":
                knobs = [value] * n
            elif name in STEP_TEXTS:
                texts[name] = [_text(value)] * n
            elif name != BUCKET_COUNT and len(numbers) < MAX_STEP_COLUMNS + 2 and (
                    (found := number(value)) is not None or name in STEP_NUMBERS):
                numbers[name] = np.full(n, math.nan if found is None else found)
            continue
        values = columns[name]
        if name == "knobs":
            knobs = list(values)
        elif name in STEP_TEXTS:
            if values.count(values[0]) == n:
                texts[name] = [_text(values[0])] * n
            else:
                shown: dict[str, str | None] = {}  # each distinct text made printable once
                texts[name] = [(shown[value] if value in shown
                                else shown.setdefault(value, _text(value)))
                               if type(value) is str else None for value in values]
        elif name == BUCKET_COUNT:
            counts = np.maximum(np.nan_to_num(_numbers(values, n), nan=1.0), 1.0).astype(
                np.int64)
        elif len(numbers) < MAX_STEP_COLUMNS + 2:
            array = _numbers(values, n)
            if name == "step":
                array[np.abs(array) > MAX_STEP] = math.nan
            elif np.isnan(array).all() and name not in STEP_NUMBERS:
                continue
            numbers[name] = array
    if "step" not in numbers:
        numbers["step"] = np.full(n, math.nan)
    return StepBatch(n, t, seq if type(seq) is int else None, numbers, texts, knobs, counts)


def _text(value: Any) -> str | None:
    return printable(value, MAX_TEXT_CHARS) if isinstance(value, str) else None


def step_batches(log: LogFiles) -> Iterator[StepBatch]:
    """Every step of ``log`` as :class:`StepBatch` es, in order, one batch in memory at a time."""
    for _, envelope in LogReader(log, arrays=True):
        if envelope["type"] == protocol.STEPS:
            batch = step_batch(envelope)
            if batch is not None:
                yield batch


# --- bounded statistics ---------------------------------------------------------------

class Sample:
    """The values of a field over consecutive rows, kept evenly spaced in at most ``capacity``.

    Every one up to ``capacity``, then every second one, every fourth, ... (at most
    ``capacity`` values; medians and fifths are read from them)."""

    def __init__(self, capacity: int = SAMPLE_VALUES) -> None:
        self.capacity = capacity
        self.stride = 1
        self.rows = 0  # rows seen
        self._values = _np().empty(16)
        self._kept = 0

    def add(self, values: numpy.ndarray) -> None:
        """Add the next rows' values (NaN where missing)."""
        np = _np()
        start = (-self.rows) % self.stride  # the first of these rows that is kept
        first = self.rows + start  # its index among all rows
        kept = values[start::self.stride]
        self.rows += len(values)
        while self._kept + len(kept) > self.capacity:  # every second one, twice as sparse
            self._values[:(self._kept + 1) // 2] = self._values[:self._kept:2].copy()
            self._kept = (self._kept + 1) // 2
            odd = (first // self.stride) % 2  # rows at odd multiples of the stride go
            kept = kept[odd::2]
            first += self.stride * odd
            self.stride *= 2
        if self._kept + len(kept) > len(self._values):
            grown = np.empty(max(len(self._values) * 2, self._kept + len(kept)))
            grown[:self._kept] = self._values[:self._kept]
            self._values = grown
        self._values[self._kept:self._kept + len(kept)] = kept
        self._kept += len(kept)

    def values(self) -> numpy.ndarray:
        """The values kept, in row order (NaN included)."""
        return self._values[:self._kept]


def _median(values: numpy.ndarray) -> float | None:
    np = _np()
    present = values[~np.isnan(values)]
    return float(np.median(present)) if len(present) else None


class Overview:
    """Fields over the optimizer steps in at most ``buckets`` buckets of consecutive rows.

    Each bucket has the steps it spans and the minimum, maximum and mean of each field's
    values (a thinned row counts as the steps it holds, with its own minimum and maximum): a
    plot of any length of run, spikes kept. Twice as many rows a bucket each time the
    buckets are full. Every field in one array, so a batch costs a few numpy operations
    whatever the number of fields.

    Args:
        fields: the step fields it follows. buckets: at most this many (even).
    """

    def __init__(self, fields: Sequence[str] = OVERVIEW_FIELDS,
                 buckets: int = OVERVIEW_BUCKETS) -> None:
        np = _np()
        self.fields = tuple(fields)
        self.buckets = buckets
        self.width = 1  # rows a bucket
        self.rows = 0
        shape = (len(self.fields), buckets)
        self._sum, self._count = np.zeros(shape), np.zeros(shape)
        self._min, self._max = np.full(shape, math.inf), np.full(shape, -math.inf)
        self._first, self._last = np.full(shape, math.inf), np.full(shape, -math.inf)

    def add(self, batch: StepBatch) -> None:
        """Add a batch's rows."""
        np = _np()
        n = batch.n
        while (self.rows + n - 1) // self.width >= self.buckets:
            self._halve()
        ids = (self.rows + np.arange(n)) // self.width
        self.rows += n
        starts = np.flatnonzero(np.diff(ids, prepend=-1))
        at = ids[starts]
        values = np.vstack([batch.column(name) for name in self.fields])
        values[np.abs(values) > MAX_PLOTTED] = math.nan  # (a damaged log's 1e308s)
        present = ~np.isnan(values)
        thinned = batch.counts is not None
        lows = np.vstack([batch.numbers.get(f"{name}.min", values[row])
                          for row, name in enumerate(self.fields)]) if thinned else values
        highs = np.vstack([batch.numbers.get(f"{name}.max", values[row])
                           for row, name in enumerate(self.fields)]) if thinned else values
        weights = batch.weights()
        cut = self._sum[:, at]
        self._sum[:, at] = cut + np.add.reduceat(np.where(present, values * weights, 0.0),
                                                 starts, axis=1)
        self._count[:, at] += np.add.reduceat(np.where(present, weights, 0.0), starts,
                                              axis=1)
        self._min[:, at] = np.minimum(self._min[:, at], np.minimum.reduceat(
            np.where(present, lows, math.inf), starts, axis=1))
        self._max[:, at] = np.maximum(self._max[:, at], np.maximum.reduceat(
            np.where(present, highs, -math.inf), starts, axis=1))
        steps = batch.numbers["step"]
        known = present & ~np.isnan(steps)
        self._first[:, at] = np.minimum(self._first[:, at], np.minimum.reduceat(
            np.where(known, steps, math.inf), starts, axis=1))
        self._last[:, at] = np.maximum(self._last[:, at], np.maximum.reduceat(
            np.where(known, steps, -math.inf), starts, axis=1))

    def _halve(self) -> None:
        np = _np()
        half = self.buckets // 2
        for name, merge, empty in (("_sum", np.add, 0.0), ("_count", np.add, 0.0),
                                   ("_min", np.minimum, math.inf),
                                   ("_max", np.maximum, -math.inf),
                                   ("_first", np.minimum, math.inf),
                                   ("_last", np.maximum, -math.inf)):
            array = getattr(self, name)
            array[:, :half] = merge(array[:, 0::2], array[:, 1::2])
            array[:, half:] = empty
        self.width *= 2

    def cut(self, step: int) -> None:
        """Drop the buckets that begin after optimizer step ``step`` (the run went back there).

        A new branch: the rows added next go on from the last bucket kept. The bucket that
        holds ``step`` keeps its figures of the rows after it (at most one bucket's width of
        them), its last step set to ``step``."""
        np = _np()
        firsts = self._first.min(axis=0)
        kept = np.flatnonzero(firsts <= step)
        used = np.flatnonzero(np.isfinite(firsts))
        if not len(used) or (len(kept) and kept[-1] == used[-1]
                             and self._last[:, kept[-1]].max() <= step):
            return  # nothing after the step
        end = int(kept[-1]) + 1 if len(kept) else 0
        for name, empty in (("_sum", 0.0), ("_count", 0.0), ("_min", math.inf),
                            ("_max", -math.inf), ("_first", math.inf),
                            ("_last", -math.inf)):
            getattr(self, name)[:, end:] = empty
        if end:
            self._last[:, end - 1] = np.minimum(self._last[:, end - 1], step)
        self.rows = end * self.width

    def get(self, name: str) -> Series | None:
        """Field ``name``'s buckets; None when not followed or without a value."""
        if name not in self.fields:
            return None
        row = self.fields.index(name)
        if not (self._count[row] > 0).any():
            return None
        used = (self._count[row] > 0) & _np().isfinite(self._first[row])
        first, last = self._first[row][used], self._last[row][used]
        return Series((first + last) / 2, self._sum[row][used] / self._count[row][used],
                      self._min[row][used], self._max[row][used], self.width, first, last)


class Series(NamedTuple):
    """A field's buckets (:meth:`Overview.get`): steps, mean, minimum, maximum and rows of each.

    Each bucket's step (the middle of the steps it spans), mean, minimum and maximum, the
    rows a bucket holds, and the first and last step each bucket spans."""

    steps: numpy.ndarray
    means: numpy.ndarray
    lows: numpy.ndarray
    highs: numpy.ndarray
    width: int
    first_steps: numpy.ndarray
    last_steps: numpy.ndarray


# --- a run's history ------------------------------------------------------------------

class Event(NamedTuple):
    """An event of the run: when, its step, level, kind, knob, value and text.

    When (unix s), its step (the one it names, else the last optimizer step completed before
    it; None before the first), its level, kind, knob and value (None when absent) and text
    (one line, cut)."""

    t: float | None
    step: int | None
    level: str
    kind: str | None
    knob: str | None
    value: Any
    text: str


def event_of(t: float | None, step: int | None, body: dict[str, Any]) -> Event:
    """An ``event`` body as an :class:`Event` (text made printable and cut).

    Its step is the one the body names (a whole number from 0 to :data:`MAX_STEP`), else
    ``step`` (the last optimizer step completed before it)."""
    level = body.get("level")
    kind, knob, value = body.get("kind"), body.get("knob"), body.get("value")
    named = body.get("step")
    if type(named) is int and 0 <= named <= MAX_STEP:
        step = named
    return Event(t, step, level if level in ("info", "warning", "error") else "info",
                 printable(kind, 100) if isinstance(kind, str) else None,
                 printable(knob, 100) if isinstance(knob, str) else None,
                 printable(value, MAX_TEXT_CHARS) if isinstance(value, str)
                 else value if isinstance(value, (int, float, bool)) else None,
                 printable(body.get("text", ""), MAX_TEXT_CHARS))


@dataclass(frozen=True)
class Segment:
    """Consecutive optimizer steps with the same knob values, and how they went.

    Attributes:
        first_step, last_step: the steps it spans (inclusive). steps: optimizer steps
            in it. knobs: the knob values of its steps. changed: the knobs whose value
            differs from the segment before (empty for the first).
        step_time_s: median step time (s). samples_per_s, tokens_per_s: median
            throughput (None without it). data_wait_share: data wait over step time,
            summed over the segment (0..1). memory_bytes: the largest peak reserved
            CUDA memory of its steps, or their host RSS where they report none (a CPU
            run). activation_bytes: median activation
            memory measured in it. loss_first, loss_last: median loss of its first and
            last fifth. loss_slope_per_1k: least-squares slope of the loss per 1,000
            steps (negative: falling). None where the steps lack the field. Medians
            over more than :data:`SAMPLE_VALUES` steps are of an evenly spaced sample.
        knobs_last: the knob values of its last step: those of :attr:`knobs` but in a
            segment that spans knob changes (a whole run, a branch).
        other_cpu_share: the share of the host's CPU (0..1 of all its cores) that
            processes other than the run's own kept busy, the mean of the run's system
            samples (1 Hz) taken while it ran (:func:`other_cpu_share`); None without
            them. A segment faster than another only because other work went away shows
            here.
    """

    first_step: int
    last_step: int
    steps: int
    knobs: dict[str, Any]
    changed: tuple[str, ...]
    step_time_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    data_wait_share: float | None
    memory_bytes: float | None
    activation_bytes: float | None
    loss_first: float | None
    loss_last: float | None
    loss_slope_per_1k: float | None
    knobs_last: dict[str, Any] = field(default_factory=dict)
    other_cpu_share: float | None = None

    @property
    def label(self) -> str:
        """``steps 1-1668`` and what changed at its start (``precision=bf16``)."""
        changes = ", ".join(f"{name}={printable(knob_text(self.knobs.get(name)), 100)}"
                            for name in self.changed)
        return f"steps {self.first_step}-{self.last_step}" + (
            f" ({changes})" if changes else "")


#: The fields a segment takes medians (and fifths) of.
_SAMPLED = ("step_time_s", "samples_per_s", "tokens_per_s", "activation_bytes", "loss")


#: A segment's rows are folded once this many wait (fewer stay slices of their batches
#: until its figures are asked for): the many short segments of a run whose knobs change
#: every few steps cost no numpy work unless they are among the segments kept.
FOLD_ROWS = 64


class SegmentFold:
    """The figures of a :class:`Segment`, folded from its rows a batch slice at a time.

    Memory: at most :data:`SAMPLE_VALUES` values of each of 5 fields, and the slices of
    fewer than :data:`FOLD_ROWS` rows not folded yet.

    Args:
        knobs: the knob values of its steps. changed: the knobs that changed at its
            start.

    Attributes:
        rows: the step rows added.
    """

    def __init__(self, knobs: dict[str, Any], changed: tuple[str, ...]) -> None:
        self.knobs = knobs
        self.changed = changed
        #: the knob values of the last row added (a segment spanning changes)
        self.knobs_last = knobs
        self.rows = 0
        self._first_step: float | None = None
        self._last_step: float | None = None
        self._steps = 0
        self._pending: list[tuple[StepBatch, int, int]] = []
        self._pending_rows = 0
        self._last_map: Any = None  # (the batch's map knobs_last was made from)
        self._samples: dict[str, Sample] = {}  # made when the first rows are folded
        self._wait_s = self._time_s = 0.0
        self._peak_reserved = -math.inf
        self._rss = -math.inf
        self._slope = [0.0] * 5  # n, sum x, sum y, sum xx, sum xy (x from first step)
        self._other_cpu = [0.0, 0]  # sum, count of other_cpu_share samples

    def add_system(self, share: float) -> None:
        """Add one system sample's :func:`other_cpu_share` (0..1) taken while it ran."""
        self._other_cpu[0] += share
        self._other_cpu[1] += 1

    def add(self, batch: StepBatch, start: int, stop: int) -> None:
        """Add rows ``start:stop`` of ``batch`` (folded once :data:`FOLD_ROWS` wait)."""
        last = batch.knobs[stop - 1] if stop > start else None
        if isinstance(last, dict) and last is not self._last_map:
            self._last_map = last
            self.knobs_last = _known(last)
        self._pending.append((batch, start, stop))
        self._pending_rows += stop - start
        self.rows += stop - start
        if self._pending_rows >= FOLD_ROWS:
            self._fold_pending()

    @property
    def short(self) -> bool:
        """Whether nothing is folded yet (fewer than :data:`FOLD_ROWS` rows)."""
        return self._pending_rows == self.rows

    def _fold_pending(self) -> None:
        for batch, start, stop in self._pending:
            self._fold(batch, start, stop)
        self._pending, self._pending_rows = [], 0

    def _fold(self, batch: StepBatch, start: int, stop: int) -> None:
        with _np().errstate(over="ignore", invalid="ignore"):  # (1e308s: inf, then None)
            self._fold_rows(batch, start, stop)

    def _fold_rows(self, batch: StepBatch, start: int, stop: int) -> None:
        np = _np()
        rows = slice(start, stop)
        if not self._samples:
            self._samples = {name: Sample() for name in _SAMPLED}
        steps = batch.numbers["step"][rows]
        present = steps[~np.isnan(steps)]
        if len(present):
            low = batch.numbers["step.min"][rows] if "step.min" in batch.numbers else steps
            first = float(np.nanmin(low)) if not np.isnan(low).all() else float(present[0])
            if self._first_step is None:
                self._first_step = first
            self._last_step = float(present[-1])
        weights = batch.weights()[rows]
        self._steps += int(weights.sum())
        for name, sample in self._samples.items():
            sample.add(batch.column(name)[rows])
        times, waits = batch.column("step_time_s")[rows], batch.column("data_wait_s")[rows]
        timed = ~np.isnan(times) & ~np.isnan(waits)
        self._time_s += float((times[timed] * weights[timed]).sum())
        self._wait_s += float((waits[timed] * weights[timed]).sum())
        for attribute, name in (("_peak_reserved", "mem_peak_reserved_bytes"),
                                ("_rss", "host_rss_bytes")):
            values = batch.numbers.get(f"{name}.max", batch.numbers.get(name))
            if values is not None and not np.isnan(values[rows]).all():
                setattr(self, attribute, max(getattr(self, attribute),
                                             float(np.nanmax(values[rows]))))
        loss = batch.column("loss")[rows]
        pairs = ~np.isnan(steps) & ~np.isnan(loss)
        if pairs.any():
            x = steps[pairs] - (self._first_step or 0.0)
            y = loss[pairs]
            sums = self._slope
            sums[0] += len(x)
            sums[1] += float(x.sum())
            sums[2] += float(y.sum())
            sums[3] += float((x * x).sum())
            sums[4] += float((x * y).sum())

    def segment(self) -> Segment | None:
        """Its figures (the rows still waiting folded first); None without a step number."""
        self._fold_pending()
        if self._first_step is None or self._last_step is None:
            return None
        medians = {name: _median(sample.values()) for name, sample in self._samples.items()
                   if name != "loss"}
        loss = self._samples["loss"].values()  # (made: there was a step number)
        fifth = max(1, len(loss) // 5)
        n, sx, sy, sxx, sxy = self._slope
        spread = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / spread if n >= 2 and spread > 0 else None
        if slope is not None and not math.isfinite(slope):
            slope = None  # (numbers too large to square: a damaged log)
        memory = self._peak_reserved if self._peak_reserved > -math.inf else self._rss
        return Segment(
            int(self._first_step), int(self._last_step), self._steps, self.knobs,
            self.changed, medians["step_time_s"], medians["samples_per_s"],
            medians["tokens_per_s"], self._wait_s / self._time_s if self._time_s > 0 else None,
            memory if memory > -math.inf else None, medians["activation_bytes"],
            _median(loss[:fifth]), _median(loss[-fifth:]),
            None if slope is None else slope * 1000.0, self.knobs_last,
            self._other_cpu[0] / self._other_cpu[1] if self._other_cpu[1] else None)


@dataclass
class RunHistory:
    """One rank's run log, folded in one pass into figures of bounded size.

    What the report, compare and the timeline show.

    Attributes:
        log: the files read. hello: the latest ``hello`` body ({} when none).
        bye: the ``bye`` body, or None (a run that was killed, or is still going).
        summary: the run in figures (:class:`agent.wire.runlog.LogSummary`; ``steps`` counts
            optimizer steps, a thinned bucket's included).
        events: the first :data:`MAX_EVENTS` events. knob_changes: the first
            :data:`MAX_CHANGES` changes of a knob's value between consecutive steps.
        overview: the run's fields in buckets (:class:`Overview` of
            :data:`OVERVIEW_FIELDS`).
        whole: the whole run as one segment (None without steps, or when not asked
            for and the run has several).
        rows: step rows read (fewer than ``summary.steps`` when thinned).
        segments_omitted: segments between the first and last :data:`MAX_SEGMENTS`.
        malformed, truncated, unreadable, thinned: as :class:`LogReader` counted them.
        tree: the run's branches (the whole log's). branch: the branch whose path the
            figures are of (:class:`agent.wire.runlog.BranchPath`: its ancestors' steps
            up to each fork, then its own); the whole log when the run has one branch.
    """

    log: LogFiles
    hello: dict[str, Any] = field(default_factory=dict)
    bye: dict[str, Any] | None = None
    summary: LogSummary = field(default_factory=LogSummary)
    events: list[Event] = field(default_factory=list)
    knob_changes: list[KnobChange] = field(default_factory=list)
    overview: Overview = field(default_factory=Overview)
    whole: Segment | None = None
    rows: int = 0
    segments_omitted: int = 0
    malformed: int = 0
    truncated: bool = False
    unreadable: list[str] = field(default_factory=list)
    thinned: int = 0
    tree: BranchTree = field(default_factory=BranchTree)
    branch: int = 0
    _segments: list[Segment] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        """The run's id (from the file name)."""
        return self.log.run_id

    @property
    def name(self) -> str:
        """The run's name from its hello (the script or model), "" without one."""
        name = self.hello.get("name")
        return printable(name, 100) if isinstance(name, str) else ""

    @property
    def started_at(self) -> float | None:
        """When the run started (unix s): hello's ``started_at``, else the first record's time."""
        return number(self.hello.get("started_at")) or self.summary.first_t

    @property
    def first_t(self) -> float | None:
        """The first record's time (unix s)."""
        return self.summary.first_t

    @property
    def last_t(self) -> float | None:
        """The last record's time (unix s)."""
        return self.summary.last_t

    @property
    def duration_s(self) -> float | None:
        """From the start to the last record, in s; None without records."""
        start = self.started_at
        if start is None or self.last_t is None:
            return None
        return max(0.0, self.last_t - start)

    @property
    def knob_changes_total(self) -> int:
        """Every knob change of the run (also those past :data:`MAX_CHANGES`)."""
        return self.summary.knob_changes

    @property
    def events_total(self) -> int:
        """Every event of the run (also those past :data:`MAX_EVENTS`)."""
        return self.summary.events

    def segments(self) -> list[Segment]:
        """The runs of consecutive steps with the same knob values (a new one at each knob change).

        The first and last :data:`MAX_SEGMENTS` of them (:attr:`segments_omitted` between);
        ``[]`` without steps."""
        return list(self._segments)


class HistoryBuilder:
    """Folds records, in order, into a :class:`RunHistory`.

    What :func:`read_history` does for a whole log; the timeline adds its own work to the
    same pass.

    Args:
        log: the log's files (named in the history).
        overview: fill :attr:`RunHistory.overview` (what a report plots).
        whole: take the whole run's figures apart from its segments' (what comparing
            two runs needs; a run of one segment has them anyway).

    Attributes:
        history: what is folded so far (segments and the whole run once finished).
    """

    def __init__(self, log: LogFiles, *, overview: bool = True, whole: bool = True) -> None:
        self.history = RunHistory(log)
        self._overview = overview
        self._whole_wanted = whole
        self._knobs: Any = None  # the last step's knob values
        self._last_step: int | None = None
        self._fold: SegmentFold | None = None
        self._whole: SegmentFold | None = None
        self._cpus: int | None = None  # the host's CPU count (the hello's)
        self._head: list[Segment] = []  # the first segments' figures
        self._tail: deque[Segment | SegmentFold] = deque(maxlen=MAX_SEGMENTS)

    def add(self, envelope: dict[str, Any]) -> list[KnobChange]:
        """Fold one envelope (a ``steps`` batch, list or array columns); return its knob changes.

        The knob changes its steps show, the first :data:`MAX_CHANGES` of the run's (the
        others are counted in the summary)."""
        history = self.history
        history.summary.add(envelope)
        kind, body = envelope["type"], envelope["body"]
        if kind == protocol.STEPS:
            batch = step_batch(envelope)
            if batch is None:
                history.malformed += 1
                return []
            return self.add_batch(batch)
        t = number(envelope.get("t"))
        if kind == protocol.HELLO:
            history.hello = body
            self._cpus = host_cpu_count(body)
        elif kind == protocol.SYSTEM:
            share = other_cpu_share(body, self._cpus)
            if share is not None:
                for fold in (self._fold, self._whole):
                    if fold is not None:
                        fold.add_system(share)
        elif kind == protocol.EVENT:
            if len(history.events) < MAX_EVENTS:
                history.events.append(event_of(t, self._last_step, body))
            if body.get("kind") == protocol.EventKind.BRANCHED:
                self._branched()
        elif kind == protocol.BYE:
            history.bye = body
        return []

    def add_batch(self, batch: StepBatch) -> list[KnobChange]:
        """Fold a batch of steps; the knob changes it shows."""
        np = _np()
        history = self.history
        history.rows += batch.n
        steps = batch.numbers["step"]
        if self._overview:
            history.overview.add(batch)
        changes: list[KnobChange] = []
        cuts: list[tuple[int, dict[str, Any]]] = []  # rows where a new segment starts
        knobs = batch.knobs
        for row in range(1) if knobs.count(knobs[0]) == batch.n else range(batch.n):
            values = knobs[row]
            if not isinstance(values, dict) or values is self._knobs or values == self._knobs:
                continue
            if self._knobs is not None:
                cuts.append((row, values))
                step = steps[row]
                room = MAX_CHANGES - len(history.knob_changes)
                if room > 0 and not np.isnan(step):  # (past the first ones: counted only)
                    changed = [
                        KnobChange(int(step), batch.t, name, self._knobs.get(name), value)
                        for name, value in values.items()
                        if isinstance(name, str) and self._knobs.get(name) != value]
                    history.knob_changes += changed[:room]
                    changes += changed
            elif self._fold is not None:  # the first knob values, after steps without
                self._fold.knobs = _known(values)
            self._knobs = values
        if self._fold is None:
            self._open_segment(self._knobs)
        start = 0
        for row, values in cuts:
            if row > start:
                self._fold.add(batch, start, row)  # type: ignore[union-attr]
            self._open_segment(values)
            start = row
        self._fold.add(batch, start, batch.n)  # type: ignore[union-attr]
        if self._whole is not None:
            self._whole.add(batch, 0, batch.n)
        present = steps[~np.isnan(steps)]
        if len(present):
            self._last_step = int(present[-1])
        return changes

    def _branched(self) -> None:
        """The run went back to the fork step of the branch just begun: its overview and
        knob changes follow the new branch (no change nor bucket after the fork is
        kept). In a log read along one branch's path, nothing is after it already."""
        tree = self.history.summary.tree
        fork = tree.branches[tree.current].fork_step
        if fork is None:
            return
        self.history.overview.cut(fork)
        changes = self.history.knob_changes
        while changes and changes[-1].step > fork:
            changes.pop()
        self._last_step = fork

    def _open_segment(self, knobs: Any) -> None:
        known = _known(knobs)
        previous = self._fold
        changed = () if previous is None else tuple(
            name for name, value in known.items() if previous.knobs.get(name) != value)
        if previous is not None:
            self._close(previous)
        self._fold = SegmentFold(known, changed)
        if self._whole is None and self._whole_wanted:
            self._whole = SegmentFold(known, ())

    def _close(self, fold: SegmentFold) -> None:
        """Keep a finished segment: among the first :data:`MAX_SEGMENTS` (its figures
        now), else among the last (those pushed out counted): a long one's figures now
        (its samples freed), a short one's only if it is still among them at the end."""
        if len(self._head) < MAX_SEGMENTS:
            segment = fold.segment()
            if segment is not None:
                self._head.append(segment)
            return
        if len(self._tail) == self._tail.maxlen:
            self.history.segments_omitted += 1
        self._tail.append(fold if fold.short else fold.segment() or fold)

    def finish(self, reader: LogReader) -> RunHistory:
        """The history, its segments computed, with what ``reader`` could not read."""
        history = self.history
        if self._fold is not None:
            self._close(self._fold)
            self._fold = None
        tail = [kept.segment() if isinstance(kept, SegmentFold) else kept
                for kept in self._tail]
        history._segments = self._head + [segment for segment in tail if segment is not None]
        if self._whole is not None:
            history.whole = self._whole.segment()
        elif len(history._segments) == 1 and not history.segments_omitted:
            history.whole = history._segments[0]
        history.malformed += reader.malformed
        history.truncated, history.unreadable = reader.truncated, reader.unreadable
        history.thinned = reader.thinned
        return history


def host_cpu_count(hello: Any) -> int | None:
    """The CPU count of a run's host, as its ``hello`` reports it (``env.cpu.count``).

    None where it does not say (an older agent, a damaged record)."""
    env = hello.get("env") if isinstance(hello, dict) else None
    cpu = env.get("cpu") if isinstance(env, dict) else None
    count = cpu.get("count") if isinstance(cpu, dict) else None
    return count if type(count) is int and 0 < count <= 1 << 20 else None


def other_cpu_share(system: Any, cpus: int | None) -> float | None:
    """The share of the host's CPU that processes other than the run's own kept busy.

    By one ``system`` record, 0..1 of all the host's ``cpus`` cores: the host's busy
    share (``cpu_pct``, % of all cores) less the training process's and its children's
    (``process_cpu_pct``, ``children_cpu_pct``: 100 = one core), clamped to 0..1 (the
    three are read over slightly different intervals). None where ``cpus`` or the host's
    or process's figure is missing or not a number."""
    if cpus is None or not isinstance(system, dict):
        return None
    host, own = number(system.get("cpu_pct")), number(system.get("process_cpu_pct"))
    if host is None or own is None:
        return None
    children = number(system.get("children_cpu_pct")) or 0.0
    return min(1.0, max(0.0, host / 100.0 - (own + children) / 100.0 / cpus))


def _known(knobs: Any) -> dict[str, Any]:
    """Knob values as a segment keeps them: at most :data:`MAX_KNOBS`, with names of at
    most :data:`MAX_NAME_CHARS` characters."""
    if not isinstance(knobs, dict):
        return {}
    return {name: value for name, value in list(knobs.items())[:MAX_KNOBS]
            if isinstance(name, str) and len(name) <= MAX_NAME_CHARS}


def on_path(path: BranchPath | None, envelope: dict[str, Any],
            passed_over: Callable[[dict[str, Any]], None] | None = None
            ) -> dict[str, Any] | None:
    """What of ``envelope`` is on ``path`` (:meth:`BranchPath.keep`), all of it without one.

    None where it is another branch's; ``passed_over`` is then given it (a dashboard's
    :meth:`gpuwatch.state.RunState.pass_over`: a record left out on purpose is no gap)."""
    if path is None:
        return envelope
    kept = path.keep(envelope)
    if kept is None and passed_over is not None:
        passed_over(envelope)
    return kept


def read_history(log: LogFiles, *, overview: bool = True, whole: bool = True,
                 branch: int | None = None) -> RunHistory:
    """Read one rank's run log in one pass, of one branch's path when the run has several.

    Bounded memory; a few seconds for a million steps here. ``branch``'s path, by default
    the branch taken last (the tree from :func:`log_summary`: the summary beside the log and
    what was written after it). ``overview``, ``whole``: as :class:`HistoryBuilder` takes
    them (what a tool does not show, it need not compute).

    Never raises for the files' content; what could not be read is counted in the
    result (``malformed``, ``truncated``, ``unreadable``).

    Raises:
        ValueError: the run has no branch ``branch``.
    """
    tree = log_summary(log)[0].tree
    if branch is not None and branch not in tree.branches:
        raise ValueError(f"run {log.run_id} has no branch {branch} (its branches: "
                         + ", ".join(f"b{known}" for known in list(tree.branches)[:20])
                         + ("..." if len(tree) > 20 else "") + ")")
    builder = HistoryBuilder(log, overview=overview, whole=whole)
    reader = LogReader(log, arrays=True)
    path = BranchPath(tree, branch) if len(tree) > 1 else None
    for _, envelope in reader:
        if (kept := on_path(path, envelope)) is not None:
            builder.add(kept)
    run = builder.finish(reader)
    run.tree = tree if path is None else path.summary.tree
    run.branch = tree.current if path is None else path.branch
    return run


#: Branches :func:`branch_segments` folds at most (the latest ones).
MAX_COMPARED_BRANCHES = 12


def branch_segments(log: LogFiles, tree: BranchTree
                    ) -> list[tuple[runlog.Branch, Segment]]:
    """Each branch's own steps (from its fork on, not its parent's) as one :class:`Segment`.

    Knobs: those of its first step, and of its last (:attr:`Segment.knobs_last`); in one
    pass: the latest :data:`MAX_COMPARED_BRANCHES`
    branches of ``tree`` (:func:`log_summary`'s), those with steps. What ``compare RUN``
    shows of a run with branches. Memory: one :class:`SegmentFold` a branch. Never raises
    for the files' content."""
    chosen = list(tree.branches)[-MAX_COMPARED_BRANCHES:]
    folds: dict[int, SegmentFold] = {}
    fold = LogSummary()  # which branch each record is on
    cpus = None
    for _, envelope in LogReader(log, arrays=True):
        fold.add(envelope)
        branch = fold.tree.current
        if envelope["type"] == protocol.HELLO:
            cpus = host_cpu_count(envelope["body"])
        elif envelope["type"] == protocol.SYSTEM and branch in folds:
            share = other_cpu_share(envelope["body"], cpus)
            if share is not None:
                folds[branch].add_system(share)
        if envelope["type"] != protocol.STEPS or branch not in chosen:
            continue
        batch = step_batch(envelope)
        if batch is None or not batch.n:
            continue
        if branch not in folds:
            folds[branch] = SegmentFold(_known(batch.knobs[0]), ())
        folds[branch].add(batch, 0, batch.n)
    found = []
    for branch, segment_fold in folds.items():
        segment = segment_fold.segment()
        if segment is not None and branch in tree.branches:
            found.append((tree.branches[branch], segment))
    return found


# --- output files ---------------------------------------------------------------------

@contextmanager
def output_file(path: os.PathLike | str) -> Iterator[BinaryIO]:
    """A file to write ``path`` (a report, a table) through, renamed over it on success.

    A new file beside it, created never through a link, renamed over ``path`` when the block
    ends without an error (a reader never sees half a file), removed otherwise.

    Raises:
        OSError: it cannot be written (a missing directory, permissions).
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)  # a stale one (or a link put there) goes first
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_output(path: os.PathLike | str, data: bytes) -> None:
    """Write ``data`` to ``path`` through :func:`output_file`.

    Raises:
        OSError: the file cannot be written (a missing directory, permissions).
    """
    with output_file(path) as handle:
        handle.write(data)


# --- summaries ------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSummary:
    """One line of ``gpuwatch runs --all``: a run (its lowest rank's log) in figures.

    Attributes:
        run_id, name: identity. ranks: the ranks with a log here. live: a live run file
            names it. started_at: unix s (None when unknown). duration_s: start to the
            last record, s. steps: optimizer steps logged. last_step: the latest one.
            final_loss: the last finite loss. best_samples_per_s, best_tokens_per_s:
            the largest throughput of a step (None without). knob_changes: changes of
            knob values. ended: the ``bye`` reason, or None (killed, or still going).
            log_bytes: all its files' sizes, every rank. malformed, truncated: as read.
            thinned: the steps a bucket of its thinned steps stands for (0: none
            thinned: every step kept as logged). log_path: its lowest rank's log (the
            first file), None for a live run without one; run_id is what its records
            say (a copied log's file name may name another). resumed_from, resumed_at:
            the run whose checkpoint it resumed from, and the step it resumed at (None:
            it started afresh, or the checkpoint did not name its run).
    """

    run_id: str
    name: str
    ranks: tuple[int, ...]
    live: bool
    started_at: float | None
    duration_s: float | None
    steps: int
    last_step: int | None
    final_loss: float | None
    best_samples_per_s: float | None
    best_tokens_per_s: float | None
    knob_changes: int
    ended: str | None
    log_bytes: int
    malformed: int
    truncated: bool
    thinned: int = 0
    tree: BranchTree = field(default_factory=BranchTree)
    log_path: str | None = None
    resumed_from: str | None = None
    resumed_at: int | None = None

    def best_rate_text(self) -> str:
        """The best throughput as a person reads it: ``4,620 tok`` (tokens/s) or ``1,788``.

        Tokens/s where the run counted tokens, else samples/s; ``-`` without either."""
        if self.best_tokens_per_s:
            return human_rate(self.best_tokens_per_s) + " tok"
        return human_rate(self.best_samples_per_s)

    def resumed_text(self) -> str:
        """``resumed from RUN at step N`` for a run resumed from a checkpoint, else ""."""
        if self.resumed_from is None:
            return ""
        at = "" if self.resumed_at is None else f" at step {self.resumed_at:,}"
        return f"resumed from {printable(self.resumed_from, 100)}{at}"

    def public(self) -> dict[str, Any]:
        """As a JSON-ready map (``gpuwatch runs --all --json``).

        ``tree``: the run's branches, :meth:`agent.wire.runlog.BranchTree.public`."""
        return {name: (list(value) if isinstance(value, tuple) else value.public()
                       if isinstance(value, BranchTree) else value)
                for name, value in self.__dict__.items()}


def _summary_of(run_id: str, summary: LogSummary, *, ranks: Sequence[int], live: bool,
                log_bytes: int, malformed: int, truncated: bool, thinned: int,
                log_path: str | None = None) -> RunSummary:
    started = summary.started_at or summary.first_t
    duration = (None if started is None or summary.last_t is None
                else max(0.0, summary.last_t - started))
    return RunSummary(
        run_id, printable(summary.name or "", 100), tuple(ranks), live, started, duration,
        summary.steps, summary.last_step, summary.final_loss, summary.best_samples_per_s,
        summary.best_tokens_per_s, summary.knob_changes,
        None if summary.ended is None else printable(summary.ended, 100), log_bytes,
        malformed, truncated, thinned, summary.tree, log_path, summary.resumed_from,
        summary.resumed_at)


def summarize(history: RunHistory, *, ranks: Sequence[int] = (), live: bool = False,
              log_bytes: int | None = None) -> RunSummary:
    """A run's summary from its (lowest rank's) history.

    Args:
        ranks: every rank with a log (default: the history's). live: a live run file
            names the run. log_bytes: the size of all its logs (default: this one's).
    """
    return dataclasses.replace(_summary_of(
        history.run_id, history.summary, ranks=tuple(ranks) or (history.log.rank,),
        live=live, log_bytes=history.log.size_bytes if log_bytes is None else log_bytes,
        malformed=history.malformed, truncated=history.truncated, thinned=history.thinned),
        tree=history.tree)  # (the whole log's: its summary may be of one path)


def log_summary(log: LogFiles, *, live: bool = False) -> tuple[LogSummary, LogReader]:
    """A log's :class:`~agent.wire.runlog.LogSummary`, with the reader of what was read.

    The one saved beside it, with the records written after what it covers folded on (those
    of the last :data:`agent.wire.runlog.SUMMARY_S` to :data:`agent.wire.runlog.CHUNK_S` of
    the run); without one (an older log, a run killed before its first chunk ended), one
    pass over the log, saved beside it for the next time unless the run is live. Returns it
    with the reader of what was read (whose ``malformed``, ``truncated`` and ``thinned`` say
    what it met). Never raises for the files' content.
    """
    path = runlog.summary_path(log.first)
    saved = runlog.read_summary(path)
    start = _resume_at(log, saved)
    summary = saved if saved is not None and start is not None else LogSummary()
    reader = LogReader(log, start=start)
    for _, envelope in reader:
        summary.add(envelope)
    if start is None:
        summary.malformed, summary.truncated = reader.malformed, reader.truncated
        if not live:  # kept for the next time
            last = len(log.paths) - 1
            summary.covered = [last, _size(log.paths[last])]
            try:
                runlog.write_private(path, summary.to_json())
            except OSError:
                pass  # a directory we cannot write to: read again next time
    else:
        summary.malformed += reader.malformed
        summary.truncated = summary.truncated or reader.truncated
    return summary, reader


def _resume_at(log: LogFiles, summary: LogSummary | None) -> Position | None:
    """Where the records after what ``summary`` covers start in ``log``; None when it
    covers nothing known (then the whole log is read)."""
    if summary is None or summary.covered is None:
        return None
    file, offset = summary.covered
    if file >= len(log.paths) or offset > _size(log.paths[file]):
        return None
    if log.kind == "jsonl" and (file, offset) != (len(log.paths) - 1,
                                                 _size(log.paths[-1])):
        return None  # rotated since: the offsets moved
    return Position(file, offset)


def _size(path: Path) -> int:
    status = _regular_file(path)
    return -1 if status is None else status.st_size


def part_thinning(log: LogFiles) -> int:
    """The coarsest thinning of a run log's parts (their headers; 0: none)."""
    if log.kind != "runlog":
        return 0
    return max(runlog.thinned_level(path) for path in log.paths)


def summarize_logs(logs: Sequence[LogFiles], live_run_ids: Iterable[str] = ()
                   ) -> list[RunSummary]:
    """One summary per run of ``logs`` (from :func:`find_logs`), newest first, with its path.

    Each from its lowest rank's log (:func:`log_summary`: its saved summary and the records
    after it), under the run id its records say (a copied log's name may say another)."""
    live = set(live_run_ids)
    by_run: dict[str, list[LogFiles]] = {}
    for log in logs:
        by_run.setdefault(log.run_id, []).append(log)
    summaries = []
    for run_id, run_logs in by_run.items():
        run_logs.sort(key=lambda log: (log.rank, log.kind != "runlog"))
        first = run_logs[0]
        summary, reader = log_summary(first, live=run_id in live)
        summaries.append(_summary_of(
            summary.run or run_id, summary, ranks=sorted({log.rank for log in run_logs}),
            live=run_id in live, log_bytes=sum(log.size_bytes for log in run_logs),
            malformed=summary.malformed, truncated=summary.truncated,
            thinned=max(reader.thinned, part_thinning(first)), log_path=str(first.first)))
    summaries.sort(key=lambda summary: summary.started_at or 0.0, reverse=True)
    return summaries


def all_runs() -> list[RunSummary]:
    """Every run of this user with a run log, and every live run (with or without a log).

    Newest first."""
    live = list_runs()
    try:
        logs = find_logs()
    except OSError:
        logs = []
    summaries = summarize_logs(logs, {info.run_id for info in live})
    logged = {summary.run_id for summary in summaries}
    seen: set[str] = set()
    for info in live:  # live runs that write no log (or not here)
        if info.run_id in logged or info.run_id in seen:
            continue
        seen.add(info.run_id)
        summaries.append(RunSummary(
            info.run_id, printable(info.name, 100), (info.rank,), True, info.started_at,
            max(0.0, time.time() - info.started_at), 0, None, None, None, None, 0, None,
            0, 0, False))
    summaries.sort(key=lambda summary: summary.started_at or 0.0, reverse=True)
    return summaries
