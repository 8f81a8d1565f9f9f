"""``gpuwatch export RUN --csv/--parquet``: a run's log as two flat tables.

``steps``: one row per optimizer step (a thinned log: per bucket of steps, with its
``steps_in_bucket``), one column per field (``run``, ``rank``, ``branch``, ``t`` unix s,
``seq``, ``step``, then the step fields of :mod:`agent.wire.protocol` the run reported,
with their units in their names), and one ``knobs.<name>`` column per knob with its value
at that step. ``events``: one row per event (``branch``, ``t``, ``step``: the step the
event names, else the last optimizer step completed before it, ``level``, ``kind``,
``knob``, ``value`` as text: a string as it is, else its JSON, and ``text``).

``branch``: the branch of the run a row belongs to (0 until the state is first put back:
a rewind, a rollback that restores the state, a spike recovery; then the number of the
latest ``branched`` event before it, which the event itself has), as ``gpuwatch runs
--all`` numbers them: the steps a branch trains again after its fork are in the table
twice, told apart by it.

Types: integer fields (steps, counts, bytes) are 64-bit integers when every value is
whole, the other numbers 64-bit floats; a knob column is boolean, integer, float (a mix
of integers and floats) or text (any other mix). Missing values are nulls in Parquet and
empty cells in CSV, and the CSV file writes every float with a decimal point, so pandas
reads both files with the same dtypes (``pd.read_csv`` and ``pd.read_parquet``: int64,
or float64 for an integer column with a missing value, as numpy cannot hold it; both
with ``dtype_backend="numpy_nullable"``: Int64, Float64, boolean, string). CSV holds no
types, so a text column whose every cell reads as a number (the events' ``value`` when
every change set a number) or that is empty reads from CSV as numbers: pandas is told
otherwise by ``dtype={"value": "str"}``.

CSV cells are safe to open in a spreadsheet: a text cell that starts with ``=``, ``+``,
``-``, ``@``, a tab or a carriage return is written with a single quote before it (the
OWASP rule against formula injection); numbers are written as they are.

Streamed: the log is read twice (:func:`gpuwatch.history.step_batches`), once for the
columns and their types, once to write them :data:`CHUNK_ROWS` rows at a time, so the
memory does not grow with the run. Both formats are written by pyarrow (its CSV writer
is about ten times pandas').
"""

from __future__ import annotations

import json
import math
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.csv  # type: ignore[import-untyped]
import pyarrow.parquet  # type: ignore[import-untyped]

from agent.wire import protocol
from agent.wire.protocol import MAX_NAME_CHARS, printable
from agent.wire.runlog import BranchTree
from gpuwatch.history import (BUCKET_COUNT, Event, LogFiles, LogReader, StepBatch, event_of,
                              number, output_file, step_batch, step_batches)
from gpuwatch.state import MAX_KNOBS
from gpuwatch.units import knob_text

#: Step fields that hold whole numbers (steps, counts, bytes).
INTEGER_FIELDS = frozenset({"seq", "step", "micro_batches", "samples", "tokens",
                            "skipped_steps_total", "num_ooms", "num_alloc_retries",
                            BUCKET_COUNT})
#: The suffix of fields in bytes, whole numbers too.
BYTES_SUFFIX = "_bytes"
#: The table formats and their file name suffixes.
FORMATS = {"csv": ".csv", "parquet": ".parquet"}
#: Rows written at a time (and held in memory at most).
CHUNK_ROWS = 65_536
#: A knob column's kind -> its Arrow type (any other kind: text).
KNOB_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64()}
#: A CSV text cell a spreadsheet would read as a formula (OWASP: CSV injection).
FORMULA_START = "^([=+\\-@\t\r])"
#: A float that Arrow writes without a decimal point (``1``), read back as an integer.
WHOLE_FLOAT = "^(-?[0-9]+)$"


def _integral(name: str) -> bool:
    return name in INTEGER_FIELDS or name.endswith(BYTES_SUFFIX)


@dataclass
class Columns:
    """The columns of a run's steps table and their types.

    Found by one pass over its log (:func:`columns_of`).

    Attributes:
        numbers: field -> whether its values are whole numbers (written as integers).
        texts: text fields. knobs: knob -> ``bool``, ``int``, ``float`` or ``text``.
    """

    numbers: dict[str, bool] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    knobs: dict[str, str] = field(default_factory=dict)

    def schema(self) -> pa.Schema:
        """The steps table's Arrow schema.

        No pandas metadata: pandas reads the Parquet file's types as it reads the CSV's."""
        fields = [("run", pa.string()), ("rank", pa.int64()), ("branch", pa.int64())]
        fields += [(name, pa.int64() if whole else pa.float64())
                   for name, whole in self.numbers.items()]
        fields += [(name, pa.string()) for name in self.texts]
        fields += [(f"knobs.{name}", KNOB_TYPES.get(kind, pa.string()))
                   for name, kind in self.knobs.items()]
        return pa.schema(fields)


def columns_of(log: LogFiles) -> Columns:
    """The steps table's columns, from one pass over ``log``.

    Every number field with a value in some row (in the order they first come), the text
    fields, and the knobs with the types of their values (booleans, integers, numbers: a mix
    of integers and floats, else text)."""
    found = Columns()
    whole: dict[str, bool] = {}
    kinds: dict[str, set[type]] = {}
    for batch in step_batches(log):
        for name, values in batch.numbers.items():
            present = values[~np.isnan(values)]
            if not len(present) and name not in whole:
                continue
            is_whole = _integral(name) and bool((present == np.round(present)).all())
            whole[name] = whole.get(name, True) and is_whole
        if BUCKET_COUNT not in whole and batch.counts is not None:
            whole[BUCKET_COUNT] = True
        for name, texts in batch.texts.items():
            if name not in found.texts and any(text is not None for text in texts):
                found.texts.append(name)
        for knobs in _distinct(batch.knobs):
            for name, value in knobs.items():
                if (isinstance(name, str) and len(name) <= MAX_NAME_CHARS
                        and (name in kinds or len(kinds) < MAX_KNOBS)):
                    kinds.setdefault(name, set()).add(type(value))
    found.numbers = whole
    for name, types in kinds.items():
        types.discard(type(None))
        found.knobs[printable(name, MAX_NAME_CHARS)] = (
            "bool" if types == {bool} else "int" if types == {int}
            else "float" if types and types <= {int, float} else "text")
    return found


def _distinct(knobs: list[Any]) -> list[dict[str, Any]]:
    """The knob maps of a batch's rows, each once (rows share one map until a change)."""
    if knobs.count(knobs[0]) == len(knobs):
        return [knobs[0]] if isinstance(knobs[0], dict) else []
    seen: dict[int, dict[str, Any]] = {}
    for values in knobs:
        if isinstance(values, dict) and id(values) not in seen:
            seen[id(values)] = values
    return list(seen.values())


def _numbers(values: np.ndarray, whole: bool) -> pa.Array:
    missing = np.isnan(values)
    if whole:
        return pa.array(np.where(missing, 0, values).astype(np.int64), mask=missing)
    return pa.array(values, mask=missing)


def _knob_value(value: Any, kind: str) -> Any:
    """A knob's value as its column holds it (None when it is not of the column's
    type)."""
    if kind == "bool":
        return value if type(value) is bool else None
    if kind == "int":
        return value if type(value) is int and -(1 << 63) <= value < (1 << 63) else None
    if kind == "float":
        return number(value)  # (None: not finite, or an integer beyond any float)
    return None if value is None else knob_text(value)


def _knob_array(batches: list[StepBatch], name: str, kind: str) -> pa.Array:
    """A knob's column, built from runs of rows with one knob map (rows share a map
    until a change): a lookup a run, then the runs repeated in C."""
    np_runs: list[tuple[Any, int]] = []  # (value, rows), consecutive
    for batch in batches:
        knobs = batch.knobs
        if knobs.count(knobs[0]) == batch.n:
            pieces = [(knobs[0], batch.n)]
        else:
            pieces = []
            for row in knobs:
                if pieces and pieces[-1][0] is row:
                    pieces[-1] = (row, pieces[-1][1] + 1)
                else:
                    pieces.append((row, 1))
        for values, rows in pieces:
            value = _knob_value(values.get(name) if isinstance(values, dict) else None, kind)
            if np_runs and np_runs[-1][0] == value and type(np_runs[-1][0]) is type(value):
                np_runs[-1] = (value, np_runs[-1][1] + rows)
            else:
                np_runs.append((value, rows))
    dictionary: dict[tuple[type, Any], int] = {}
    codes = [dictionary.setdefault((type(value), value), len(dictionary))
             for value, _ in np_runs]
    indices = np.repeat(np.array(codes, dtype=np.int32),
                        np.array([rows for _, rows in np_runs], dtype=np.int64))
    kind_type = KNOB_TYPES.get(kind, pa.string())
    return pa.DictionaryArray.from_arrays(
        pa.array(indices), pa.array([value for _, value in dictionary], type=kind_type)
    ).dictionary_decode()


def steps_table(batches: list[StepBatch], columns: Columns, run_id: str, rank: int,
                branches: list[int]) -> pa.Table:
    """The rows of ``batches`` as the steps table (see the module's documentation).

    ``branches``: the branch of each batch's rows."""
    n = sum(batch.n for batch in batches)
    arrays: dict[str, pa.Array] = {
        "run": pa.array([run_id] * n, type=pa.string()),
        "rank": pa.array([rank] * n, type=pa.int64()),
        "branch": pa.array(np.repeat(np.array(branches, dtype=np.int64),
                                     [batch.n for batch in batches]), type=pa.int64())}
    for name, whole in columns.numbers.items():
        if name == BUCKET_COUNT:
            values = np.concatenate([batch.weights() for batch in batches])
        else:
            values = np.concatenate([batch.column(name) for batch in batches])
        arrays[name] = _numbers(values, whole)
    for name in columns.texts:
        texts: list[str | None] = []
        for batch in batches:
            texts += batch.texts.get(name) or [None] * batch.n
        arrays[name] = pa.array(texts, type=pa.string())
    for name, kind in columns.knobs.items():
        arrays[f"knobs.{name}"] = _knob_array(batches, name, kind)
    return pa.table(arrays)


def events_table(events: list[Event], run_id: str, rank: int, branches: list[int]
                 ) -> pa.Table:
    """``events`` as the events table (see the module's documentation).

    ``branches``: each event's branch."""
    return pa.table({
        "run": pa.array([run_id] * len(events), type=pa.string()),
        "rank": pa.array([rank] * len(events), type=pa.int64()),
        "branch": pa.array(branches, type=pa.int64()),
        "t": pa.array([math.nan if e.t is None else e.t for e in events], type=pa.float64(),
                      from_pandas=True),
        "step": pa.array([e.step for e in events], type=pa.int64()),
        "level": pa.array([e.level for e in events], type=pa.string()),
        "kind": pa.array([e.kind for e in events], type=pa.string()),
        "knob": pa.array([e.knob for e in events], type=pa.string()),
        "value": pa.array([e.value if e.value is None or isinstance(e.value, str)
                           else json.dumps(e.value) for e in events], type=pa.string()),
        "text": pa.array([e.text for e in events], type=pa.string()),
    })


#: The events table's Arrow schema.
EVENT_SCHEMA = pa.schema([
    ("run", pa.string()), ("rank", pa.int64()), ("branch", pa.int64()), ("t", pa.float64()),
    ("step", pa.int64()),
    ("level", pa.string()), ("kind", pa.string()), ("knob", pa.string()),
    ("value", pa.string()), ("text", pa.string())])


def csv_cells(table: pa.Table) -> pa.Table:
    """``table`` as its CSV file writes it.

    Text cells that start like a formula with a single quote before them, floats as text
    with a decimal point (``1.0``, which Arrow would write as ``1``), the other columns as
    they are. Vectorized (a regular expression per text or float column, in C)."""
    columns = []
    for column in table.columns:
        if pa.types.is_string(column.type):
            column = pc.replace_substring_regex(column, pattern=FORMULA_START,
                                                replacement="'\\1", max_replacements=1)
        elif pa.types.is_floating(column.type):
            column = pc.replace_substring_regex(pc.cast(column, pa.string()),
                                                pattern=WHOLE_FLOAT, replacement="\\1.0")
        columns.append(column)
    return pa.table(columns, names=table.column_names)


class _TableWriter:
    """Writes a table a chunk at a time to an open file, as CSV (a header once) or
    Parquet (one row group a chunk), in a thread of its own: pyarrow formats a chunk
    without the GIL while the next one is read (at most two chunks wait)."""

    def __init__(self, handle: BinaryIO, table_format: str, schema: pa.Schema) -> None:
        self.handle = handle
        self.format = table_format
        self.schema = schema
        self.rows = 0
        self._parquet: Any = None
        self._started = False
        self._queue: queue.Queue[pa.Table | None] = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpuwatch-export",
                                        daemon=True)
        self._thread.start()

    def write(self, table: pa.Table) -> None:
        """Queue a chunk (waits while two are queued).

        Raises:
            OSError: writing an earlier chunk failed.
        """
        self._check()
        self.rows += table.num_rows
        self._queue.put(table.cast(self.schema))

    def _run(self) -> None:
        while (table := self._queue.get()) is not None:
            if self._error is not None:
                continue  # (drain: the error is raised in the caller's thread)
            try:
                self._write(table)
            except BaseException as exc:
                self._error = exc

    def _write(self, table: pa.Table) -> None:
        if self.format == "csv":
            pyarrow.csv.write_csv(csv_cells(table), self.handle, pyarrow.csv.WriteOptions(
                include_header=not self._started))
        else:
            if self._parquet is None:
                self._parquet = pyarrow.parquet.ParquetWriter(self.handle, self.schema)
            self._parquet.write_table(table)
        self._started = True

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Write what is queued and end the file.

        Raises:
            OSError: writing failed.
        """
        self._queue.put(None)
        self._thread.join()
        self._check()
        if not self._started:
            self._write(self.schema.empty_table())
        if self._parquet is not None:
            self._parquet.close()


def write_tables(log: LogFiles, prefix: Path, table_format: str
                 ) -> tuple[list[tuple[Path, int]], LogReader]:
    """Write ``<prefix>.steps.<ext>`` and ``<prefix>.events.<ext>`` from ``log``.

    Each goes into a new file, renamed over the old once whole; returns each path with its
    rows, and the reader of the log (what it could not read: ``malformed``, ...).

    Args:
        table_format: ``csv`` or ``parquet``.

    Raises:
        ValueError: an unknown format.
        OSError: a file cannot be written.
    """
    if table_format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got "
                         f"{table_format!r}")
    columns = columns_of(log)
    paths = [prefix.with_name(f"{prefix.name}.{kind}{FORMATS[table_format]}")
             for kind in ("steps", "events")]
    with output_file(paths[0]) as steps_out, output_file(paths[1]) as events_out:
        steps = _TableWriter(steps_out, table_format, columns.schema())
        events = _TableWriter(events_out, table_format, EVENT_SCHEMA)
        batches: list[StepBatch] = []
        batch_branches: list[int] = []
        rows = 0
        pending: list[Event] = []
        event_branches: list[int] = []
        last_step: int | None = None
        tree = BranchTree()  # (numbered as every other tool numbers the branches)
        reader = LogReader(log, arrays=True)
        for _, envelope in reader:
            kind = envelope["type"]
            if kind == protocol.STEPS:
                batch = step_batch(envelope)
                if batch is None:
                    continue
                batches.append(batch)
                batch_branches.append(tree.current)
                rows += batch.n
                present = batch.numbers["step"][~np.isnan(batch.numbers["step"])]
                last_step = int(present[-1]) if len(present) else last_step
                if rows >= CHUNK_ROWS:
                    steps.write(steps_table(batches, columns, log.run_id, log.rank,
                                            batch_branches))
                    batches, batch_branches, rows = [], [], 0
            elif kind == protocol.EVENT:
                body = envelope["body"]
                if body.get("kind") == protocol.EventKind.BRANCHED:
                    tree.branched(body)
                pending.append(event_of(number(envelope.get("t")), last_step, body))
                event_branches.append(tree.current)
                if len(pending) >= CHUNK_ROWS:
                    events.write(events_table(pending, log.run_id, log.rank, event_branches))
                    pending, event_branches = [], []
        if batches:
            steps.write(steps_table(batches, columns, log.run_id, log.rank, batch_branches))
        if pending:
            events.write(events_table(pending, log.run_id, log.rank, event_branches))
        steps.close()
        events.close()
    return [(paths[0], steps.rows), (paths[1], events.rows)], reader
