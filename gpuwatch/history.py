"""Runs after the fact: the run logs on disk, found and read back.

The one reader of run logs (:mod:`agent.runlog` writes them) for everything that looks
at a run after the fact: ``gpuwatch runs --all``, the timeline, ``report``, ``compare``
and ``export``. The live ``replay`` decodes its lines with :func:`decode_line` too, so a
change of the log's format is made here, in one place.

What it tolerates, never raising for a file's content:

- rotation: ``<run>.rank<r>.jsonl`` with its older ``.1`` ... ``.N`` files, read oldest
  first; the copy of the latest ``hello`` that heads each rotated file is not a second
  hello (see :class:`LogReader`);
- a truncated last line (a killed run), blank lines, lines that are not records
  (counted in :attr:`LogReader.malformed`), lines longer than :data:`MAX_LINE_BYTES`;
- unknown record types and extra fields (ignored), missing fields (None), records of
  other protocol versions (the log holds no version; what is known is read);
- links: a log file or rotated file that is a symbolic link, or not a regular file, is
  never opened (``O_NOFOLLOW``) and is skipped;
- text: every string kept to be shown (a name, an event's text) goes through
  :func:`agent.protocol.printable`, the one sanitizer (no control character reaches a
  terminal or a page) and is cut to a bound.

Units: times are unix seconds (``t``, ``started_at``), durations seconds, memory bytes,
throughput per second, as in the step records (:mod:`agent.protocol`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import statistics
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from agent import protocol
from agent.protocol import MAX_NAME_CHARS, MAX_TEXT_CHARS, printable
from agent.runlog import log_dir
from agent.runs import list_runs
from gpuwatch.state import MAX_KNOBS, KnobChange
from gpuwatch.units import knob_text

#: A line longer than this is malformed (as a frame over the wire limit would be).
MAX_LINE_BYTES = protocol.MAX_MESSAGE_BYTES
#: Bytes read from a file at a time.
CHUNK_BYTES = 1 << 20
#: The envelope's fields in a flattened record; every other field is the body's.
ENVELOPE_KEYS = ("type", "run", "rank", "seq", "t")
#: A run log's file name: ``<run>.rank<r>.jsonl``, rotated ones with ``.<n>`` after it.
LOG_NAME = re.compile(
    r"(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,99})\.rank(?P<rank>[0-9]{1,6})\.jsonl"
    r"(?:\.(?P<backup>[0-9]{1,4}))?")
#: Rotated files looked for beside a log given by path.
MAX_BACKUPS = 1000
#: Numeric columns a step table keeps at most (the known ones, then the first others).
MAX_STEP_COLUMNS = 64
#: Distinct text and knob values a step table keeps, all its columns together (a run
#: has a few); values beyond are kept as None.
MAX_DISTINCT = 1024
#: Events a run's history keeps (its first ones).
MAX_EVENTS = 100_000

#: Step fields with numbers, as :mod:`agent.protocol` documents them (others found in
#: a log are kept too, up to :data:`MAX_STEP_COLUMNS`).
STEP_NUMBERS = (
    "step", "micro_batches", "samples", "step_time_s", "data_wait_s", "data_wait_share",
    "data_wait_share_window", "samples_per_s", "tokens", "tokens_per_s", "loss", "lr",
    "grad_norm", "gpu_step_time_s", "host_rss_bytes", "host_peak_rss_bytes",
    "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_reserved_bytes",
    "activation_bytes", "skipped_steps_total", "num_ooms", "num_alloc_retries")
#: Step fields with text.
STEP_TEXTS = ("input_verdict",)


# --- lines and records ---------------------------------------------------------------

def envelope_from_record(record: Any) -> dict[str, Any] | None:
    """A flattened run-log record back as an envelope
    ``{"v", "type", "run", "rank", "seq", "t", "body"}``; None when ``record`` is not a
    map with a string ``type``.

    The inverse of :func:`agent.protocol.flatten` for what the agent writes (a body key
    named like an envelope key is lost by flattening, and ``v`` is not logged: the
    current :data:`agent.protocol.PROTOCOL_VERSION` is assumed).
    """
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    envelope: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION}
    envelope.update((key, record.get(key)) for key in ENVELOPE_KEYS)
    envelope["body"] = {key: value for key, value in record.items()
                        if key not in ENVELOPE_KEYS}
    return envelope


def decode_line(line: bytes) -> dict[str, Any] | None:
    """One run-log line (without its newline) as an envelope, or None when it is not a
    record: longer than :data:`MAX_LINE_BYTES`, not JSON, not UTF-8, nested beyond what
    the parser takes, not a map, or without a string ``type``.

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
        paths: the files, oldest first (``.N`` ... ``.1``, then the current one).
        size_bytes: their sizes together, in bytes.
        modified_at: when the newest one was last written (unix s).
    """

    run_id: str
    rank: int
    paths: tuple[Path, ...]
    size_bytes: int
    modified_at: float


def _regular_file(path: Path) -> os.stat_result | None:
    """``lstat`` of ``path`` when it is a regular file (not a link), else None."""
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status if stat.S_ISREG(status.st_mode) else None


def _log_files(run_id: str, rank: int, found: dict[int, tuple[Path, os.stat_result]]
               ) -> LogFiles:
    ordered = sorted(found.items(), key=lambda item: -item[0] if item[0] else 1)
    return LogFiles(run_id, rank, tuple(path for _, (path, _) in ordered),
                    sum(status.st_size for _, (_, status) in ordered),
                    max(status.st_mtime for _, (_, status) in ordered))


def find_logs(directory: os.PathLike | str | None = None) -> list[LogFiles]:
    """The run logs in ``directory`` (default :func:`agent.runlog.log_dir`), one per run
    and rank, newest first (by last write). Links and files that are not regular are
    left out; so is a rotated file without the current one's name (its run's newest
    file is then the newest rotated one).

    Raises:
        OSError: the directory cannot be listed.
    """
    directory = Path(directory) if directory is not None else log_dir()
    groups: dict[tuple[str, int], dict[int, tuple[Path, os.stat_result]]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            match = LOG_NAME.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            status = entry.stat(follow_symlinks=False)
            key = (match["run"], int(match["rank"]))
            groups.setdefault(key, {})[int(match["backup"] or 0)] = (
                Path(entry.path), status)
    logs = [_log_files(run_id, rank, found) for (run_id, rank), found in groups.items()]
    logs.sort(key=lambda log: (log.modified_at, -log.rank), reverse=True)
    return logs


def log_at(path: os.PathLike | str) -> LogFiles | None:
    """The run log whose current file is ``path``, with its rotated files beside it
    (``path.1`` ... oldest last); None when ``path`` is not a regular file (missing, a
    link, a directory). Run id and rank come from the name when it is a run log's, else
    the name and 0."""
    path = Path(path)
    status = _regular_file(path)
    if status is None:
        return None
    found = {0: (path, status)}
    for backup in range(1, MAX_BACKUPS + 1):
        older = Path(f"{path}.{backup}")
        older_status = _regular_file(older)
        if older_status is None:
            break
        found[backup] = (older, older_status)
    match = LOG_NAME.fullmatch(path.name)
    run_id, rank = (match["run"], int(match["rank"])) if match else (path.name, 0)
    return _log_files(run_id, rank, found)


def select_logs(selector: str, logs: Sequence[LogFiles]) -> list[LogFiles]:
    """The logs (every rank) of the one run whose id is ``selector`` or starts with it;
    ``[]`` when none or several runs match. Ranks in order."""
    exact = [log for log in logs if log.run_id == selector]
    matches = exact or [log for log in logs if log.run_id.startswith(selector)]
    if len({log.run_id for log in matches}) != 1:
        return []
    return sorted(matches, key=lambda log: log.rank)


# --- reading records ------------------------------------------------------------------

class Position(NamedTuple):
    """Where a record's line starts: the index of its file in :attr:`LogFiles.paths`
    and the byte offset in that file."""

    file: int
    offset: int


def _open_no_follow(path: Path) -> int:
    """A read-only descriptor of ``path``, never through a link and never blocking on a
    FIFO.

    Raises:
        OSError: it cannot be opened, is a link (``ELOOP``) or is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


class LogReader:
    """The records of one rank's run log, in order, as envelopes
    (:func:`envelope_from_record`), with where each line starts.

    Iterating reads the files oldest first, a chunk at a time; it never raises for their
    content. A ``hello`` at the head of a file after the first is the copy a rotation
    writes: it is skipped when the records before it were read, and otherwise (the older
    files were deleted) folded with its ``seq`` set to None, so that the records the
    deletion lost are not counted as records missed on the way.

    Args:
        log: the files to read.
        start: where to begin (a :class:`Position` an earlier iteration yielded).

    Attributes:
        malformed: lines that were not records. truncated: the last file ends in a line
        without its newline (a killed run; the line is not read). unreadable: files that
        could not be opened (a link, gone, permissions), with why.
    """

    def __init__(self, log: LogFiles, *, start: Position | None = None) -> None:
        self.log = log
        self.start = start or Position(0, 0)
        self.malformed = 0
        self.truncated = False
        self.unreadable: list[str] = []

    def __iter__(self) -> Iterator[tuple[Position, dict[str, Any]]]:
        last_seq: int | None = None
        for index in range(self.start.file, len(self.log.paths)):
            offset = self.start.offset if index == self.start.file else 0
            # a file read from its start may begin with a rotation's copy of a hello
            head = offset == 0 and (index > self.start.file or self.start.file == 0)
            held: tuple[Position, dict[str, Any]] | None = None
            for position, envelope in self._file_records(index, offset):
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

    def _file_records(self, index: int, offset: int
                      ) -> Iterator[tuple[Position, dict[str, Any]]]:
        path = self.log.paths[index]
        try:
            fd = _open_no_follow(path)
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


def write_output(path: os.PathLike | str, data: bytes) -> None:
    """Write ``data`` to ``path`` (a report, a table), replacing what is there: into a
    new file beside it first, created never through a link, then renamed over it, so a
    reader never sees half a file.

    Raises:
        OSError: the file cannot be written (a missing directory, permissions).
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)  # a stale one (or a link put there) goes first
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


# --- numbers --------------------------------------------------------------------------

def number(value: Any) -> float | None:
    """A log's number as a float: None for a missing, non-numeric (booleans too) or
    non-finite value, or one beyond any float."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def _finite(values: Iterable[float]) -> list[float]:
    return [value for value in values if value == value]  # NaN is not equal to itself


def median(values: Iterable[float]) -> float | None:
    """The median of the finite values, None when there is none."""
    present = _finite(values)
    return statistics.median(present) if present else None


# --- a run's history ------------------------------------------------------------------

class StepTable:
    """One rank's step records as columns: numbers as float arrays (NaN where a record
    lacks the field), texts and knob values as lists (None where missing).

    Attributes:
        numbers: column name -> ``array('d')``: ``t`` (unix s), ``seq``, then the step
            fields (:data:`STEP_NUMBERS` and others found, up to
            :data:`MAX_STEP_COLUMNS`).
        texts: column name -> list of str or None (:data:`STEP_TEXTS`).
        knobs: knob name -> list of the value at each step (None before the knob is
            known).
    """

    def __init__(self) -> None:
        self.numbers: dict[str, array] = {"t": array("d"), "seq": array("d")}
        for name in STEP_NUMBERS:
            self.numbers[name] = array("d")
        self.texts: dict[str, list[str | None]] = {name: [] for name in STEP_TEXTS}
        self.knobs: dict[str, list[Any]] = {}
        self._distinct: dict[Any, Any] = {}  # one object per distinct text or knob value
        self._last_knobs: Any = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, envelope: dict[str, Any]) -> dict[str, Any] | None:
        """Add a ``step`` envelope's record; returns its knobs map when it differs from
        the previous record's (None when the same or absent)."""
        body = envelope["body"]
        nan = math.nan
        values = {"t": number(envelope.get("t")), "seq": number(envelope.get("seq"))}
        for key, value in body.items():
            if key not in self.numbers:
                if (key in self.texts or key == "knobs" or len(self.numbers)
                        >= MAX_STEP_COLUMNS or number(value) is None
                        or not isinstance(key, str) or len(key) > MAX_NAME_CHARS):
                    continue
                self.numbers[key] = array("d", [nan]) * self._length
            values[key] = number(value)
        for name, column in self.numbers.items():
            value = values.get(name)
            column.append(nan if value is None else value)
        for name, texts in self.texts.items():
            value = body.get(name)
            texts.append(self._keep(value) if isinstance(value, str) else None)
        knobs = body.get("knobs")
        changed = None
        if isinstance(knobs, dict) and knobs != self._last_knobs:
            changed = knobs
            self._last_knobs = knobs
            for name in knobs:
                if (isinstance(name, str) and name not in self.knobs
                        and len(self.knobs) < MAX_KNOBS and len(name) <= MAX_NAME_CHARS):
                    self.knobs[name] = [None] * self._length
        current = self._last_knobs if isinstance(self._last_knobs, dict) else {}
        for name, knob_values in self.knobs.items():
            value = current.get(name)
            knob_values.append(self._keep(value) if isinstance(value, (str, int, float, bool))
                               else None)
        self._length += 1
        return changed

    def _keep(self, value: Any) -> Any:
        """``value`` as the one object kept for it (few distinct values, many steps)."""
        key = (type(value), value)
        kept = self._distinct.get(key)
        if kept is None and len(self._distinct) < MAX_DISTINCT:
            if isinstance(value, str):
                value = printable(value, MAX_TEXT_CHARS)
            self._distinct[key] = kept = value
        return kept

    def column(self, name: str) -> array:
        """The numbers of column ``name`` (NaN where missing; all NaN for a column the
        records never had)."""
        found = self.numbers.get(name)
        return found if found is not None else array("d", [math.nan]) * self._length

    def has(self, name: str) -> bool:
        """Whether any record has a finite ``name``."""
        column = self.numbers.get(name)
        return column is not None and any(value == value for value in column)


class Event(NamedTuple):
    """An event of the run: when (unix s), the last optimizer step completed before it
    (None before the first), its level, kind, knob and value (None when absent) and
    text (one line, cut)."""

    t: float | None
    step: int | None
    level: str
    kind: str | None
    knob: str | None
    value: Any
    text: str


@dataclass
class RunHistory:
    """One rank's run log, read whole: what the report, compare, export and the
    timeline's segments are made of.

    Attributes:
        log: the files read. hello: the latest ``hello`` body ({} when none).
        steps: the step records as columns. events: the ``event`` records (the first
            :data:`MAX_EVENTS`). knob_changes: every change of a knob's value between
            consecutive step records. bye: the ``bye`` body, or None (a run that was
            killed, or is still going). first_t, last_t: unix times of the first and
            last record (None without any). records: records read.
        malformed, truncated, unreadable: as :class:`LogReader` counted them.
    """

    log: LogFiles
    hello: dict[str, Any] = field(default_factory=dict)
    steps: StepTable = field(default_factory=StepTable)
    events: list[Event] = field(default_factory=list)
    knob_changes: list[KnobChange] = field(default_factory=list)
    bye: dict[str, Any] | None = None
    first_t: float | None = None
    last_t: float | None = None
    records: int = 0
    malformed: int = 0
    truncated: bool = False
    unreadable: list[str] = field(default_factory=list)

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
        """When the run started (unix s): its hello's ``started_at``, else its first
        record's time."""
        return number(self.hello.get("started_at")) or self.first_t

    @property
    def duration_s(self) -> float | None:
        """From the start to the last record, in s; None without records."""
        start = self.started_at
        if start is None or self.last_t is None:
            return None
        return max(0.0, self.last_t - start)

    def segments(self) -> list[Segment]:
        """The runs of consecutive steps with the same knob values (a new one starts
        at each knob change), with their figures; ``[]`` without steps."""
        return segments(self.steps)


class HistoryBuilder:
    """Folds records, in order, into a :class:`RunHistory` (what :func:`read_history`
    does for a whole log; the timeline adds its own work to the same pass).

    Attributes:
        history: what is folded so far.
    """

    def __init__(self, log: LogFiles) -> None:
        self.history = RunHistory(log)
        self._previous: dict[str, Any] | None = None  # the last step's knobs
        self._last_step: int | None = None

    def add(self, envelope: dict[str, Any]) -> list[KnobChange]:
        """Fold one envelope; returns the knob changes its step record shows."""
        history = self.history
        history.records += 1
        kind, body = envelope["type"], envelope["body"]
        t = number(envelope.get("t"))
        if t is not None:
            history.first_t = t if history.first_t is None else history.first_t
            history.last_t = t
        changes: list[KnobChange] = []
        if kind == protocol.STEP:
            changed = history.steps.append(envelope)
            step = body.get("step")
            self._last_step = step if type(step) is int else self._last_step
            if changed is not None:
                if self._previous is not None and self._last_step is not None:
                    changes = [KnobChange(self._last_step, t, name,
                                          self._previous.get(name), value)
                               for name, value in changed.items()
                               if isinstance(name, str)
                               and self._previous.get(name) != value]
                    history.knob_changes += changes
                self._previous = changed
        elif kind == protocol.HELLO:
            history.hello = body
        elif kind == protocol.EVENT and len(history.events) < MAX_EVENTS:
            history.events.append(_event(t, self._last_step, body))
        elif kind == protocol.BYE:
            history.bye = body
        return changes

    def finish(self, reader: LogReader) -> RunHistory:
        """The history, with what ``reader`` could not read."""
        self.history.malformed, self.history.truncated = reader.malformed, reader.truncated
        self.history.unreadable = reader.unreadable
        return self.history


def read_history(log: LogFiles) -> RunHistory:
    """Read one rank's run log whole (a few us a record).

    Never raises for the files' content; what could not be read is counted in the
    result (``malformed``, ``truncated``, ``unreadable``).
    """
    builder = HistoryBuilder(log)
    reader = LogReader(log)
    for _, envelope in reader:
        builder.add(envelope)
    return builder.finish(reader)


def _event(t: float | None, step: int | None, body: dict[str, Any]) -> Event:
    level = body.get("level")
    kind, knob, value = body.get("kind"), body.get("knob"), body.get("value")
    return Event(t, step, level if level in ("info", "warning", "error") else "info",
                 printable(kind, 100) if isinstance(kind, str) else None,
                 printable(knob, 100) if isinstance(knob, str) else None,
                 printable(value, MAX_TEXT_CHARS) if isinstance(value, str)
                 else value if isinstance(value, (int, float, bool)) else None,
                 printable(body.get("text", ""), MAX_TEXT_CHARS))


# --- segments between knob changes ----------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """Consecutive optimizer steps with the same knob values, and how they went.

    Attributes:
        first_step, last_step: the steps it spans (inclusive). steps: step records in it.
        knobs: the knob values of its steps. changed: the knobs whose value differs from
            the segment before (empty for the first).
        step_time_s: median step time (s). samples_per_s, tokens_per_s: median
            throughput (None without it). data_wait_share: data wait over step time,
            summed over the segment (0..1). memory_bytes: the largest peak reserved
            CUDA memory, or host RSS on a CPU run. activation_bytes: median activation
            memory measured in it. loss_first, loss_last: median loss of its first and
            last fifth. loss_slope_per_1k: least-squares slope of the loss per 1,000
            steps (negative: falling). None where the steps lack the field.
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

    @property
    def label(self) -> str:
        """``steps 1-1668`` and what changed at its start (``precision=bf16``)."""
        changes = ", ".join(f"{name}={printable(knob_text(self.knobs.get(name)), 100)}"
                            for name in self.changed)
        return f"steps {self.first_step}-{self.last_step}" + (
            f" ({changes})" if changes else "")


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    pairs = [(x, y) for x, y in zip(xs, ys) if x == x and y == y]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread


def figures(table: StepTable, start: int = 0, stop: int | None = None
            ) -> dict[str, float | None]:
    """The figures of :class:`Segment` over the records ``start:stop`` of ``table``:
    ``step_time_s``, ``samples_per_s``, ``tokens_per_s``, ``data_wait_share``,
    ``memory_bytes``, ``activation_bytes``, ``loss_first``, ``loss_last``,
    ``loss_slope_per_1k``."""
    def column(name: str) -> array:
        return table.column(name)[start:stop]

    memory_name = ("mem_peak_reserved_bytes" if table.has("mem_peak_reserved_bytes")
                   else "host_rss_bytes")
    timed = [(s, w) for s, w in zip(column("step_time_s"), column("data_wait_s"))
             if s == s and w == w]
    total_s = sum(s for s, _ in timed)
    memory = _finite(column(memory_name))
    loss = column("loss")
    fifth = max(1, len(loss) // 5)
    slope = _slope(column("step"), loss)
    return {
        "step_time_s": median(column("step_time_s")),
        "samples_per_s": median(column("samples_per_s")),
        "tokens_per_s": median(column("tokens_per_s")),
        "data_wait_share": sum(w for _, w in timed) / total_s if total_s > 0 else None,
        "memory_bytes": max(memory) if memory else None,
        "activation_bytes": median(column("activation_bytes")),
        "loss_first": median(loss[:fifth]), "loss_last": median(loss[-fifth:]),
        "loss_slope_per_1k": None if slope is None else slope * 1000.0,
    }


def segment(table: StepTable, start: int = 0, stop: int | None = None) -> Segment:
    """The records ``start:stop`` of ``table`` as one :class:`Segment` (its knobs:
    those of its first record; ``changed``: those that differ from the record before).

    Raises:
        ValueError: the range holds no record.
    """
    stop = len(table) if stop is None else stop
    if not 0 <= start < stop <= len(table):
        raise ValueError(f"no records in {start}:{stop} of {len(table)}")
    knobs = {name: column[start] for name, column in table.knobs.items()}
    changed = tuple(name for name, column in table.knobs.items()
                    if start and column[start] != column[start - 1])
    present = _finite(table.column("step")[start:stop])
    return Segment(int(present[0]) if present else start,
                   int(present[-1]) if present else stop - 1, stop - start, knobs,
                   changed, **figures(table, start, stop))


def segments(table: StepTable) -> list[Segment]:
    """The segments of a step table, cut where the knob values change (see
    :class:`Segment`)."""
    count = len(table)
    bounds = [0] + [index for index in range(1, count)
                    if any(column[index] != column[index - 1]
                           for column in table.knobs.values())] + [count]
    return [segment(table, start, stop) for start, stop in zip(bounds, bounds[1:])
            if stop > start]


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

    def public(self) -> dict[str, Any]:
        """As a JSON-ready map (``gpuwatch runs --all --json``)."""
        return {name: (list(value) if isinstance(value, tuple) else value)
                for name, value in self.__dict__.items()}


def _last_finite(values: Sequence[float]) -> float | None:
    for value in reversed(values):
        if value == value:
            return value
    return None


def _largest(values: Sequence[float]) -> float | None:
    present = _finite(values)
    return max(present) if present else None


def summarize(history: RunHistory, *, ranks: Sequence[int] = (), live: bool = False,
              log_bytes: int | None = None) -> RunSummary:
    """A run's summary from its (lowest rank's) history.

    Args:
        ranks: every rank with a log (default: the history's). live: a live run file
            names the run. log_bytes: the size of all its logs (default: this one's).
    """
    table = history.steps
    step = _last_finite(table.column("step"))
    ended = None
    if history.bye is not None:
        reason = history.bye.get("reason")
        ended = printable(reason, 100) if isinstance(reason, str) and reason else "ended"
    return RunSummary(
        history.run_id, history.name, tuple(ranks) or (history.log.rank,), live,
        history.started_at, history.duration_s, len(table),
        None if step is None else int(step), _last_finite(table.column("loss")),
        _largest(table.column("samples_per_s")), _largest(table.column("tokens_per_s")),
        len(history.knob_changes), ended,
        history.log.size_bytes if log_bytes is None else log_bytes,
        history.malformed, history.truncated)


def summarize_logs(logs: Sequence[LogFiles], live_run_ids: Iterable[str] = ()
                   ) -> list[RunSummary]:
    """One summary per run of ``logs`` (from :func:`find_logs`), newest first; each read
    from its lowest rank's log."""
    live = set(live_run_ids)
    by_run: dict[str, list[LogFiles]] = {}
    for log in logs:
        by_run.setdefault(log.run_id, []).append(log)
    summaries = []
    for run_id, run_logs in by_run.items():
        run_logs.sort(key=lambda log: log.rank)
        summaries.append(summarize(
            read_history(run_logs[0]), ranks=[log.rank for log in run_logs],
            live=run_id in live, log_bytes=sum(log.size_bytes for log in run_logs)))
    summaries.sort(key=lambda summary: summary.started_at or 0.0, reverse=True)
    return summaries


def find_run_log(selector: str, rank: int | None = None) -> LogFiles | None:
    """The log of the run that ``selector`` names: a run-log file's path, or a run id
    or unique prefix of one among this user's logs; ``rank`` (default: the lowest with
    a log). None when nothing (or several runs) match."""
    if os.sep in selector or selector.endswith(".jsonl"):
        return log_at(selector)
    try:
        logs = select_logs(selector, find_logs())
    except OSError:
        return None
    if rank is not None:
        logs = [log for log in logs if log.rank == rank]
    return logs[0] if logs else None


def all_runs() -> list[RunSummary]:
    """Every run of this user with a run log, and every live run (with or without a
    log), newest first."""
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
