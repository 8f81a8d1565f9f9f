"""``gpuwatch export RUN --csv/--parquet``: a run's log as two flat tables.

``steps``: one row per optimizer step (a thinned log: per bucket of steps, with its
``steps_in_bucket``), one column per field (``run``, ``rank``, ``t`` unix s, ``seq``,
``step``, then the step fields of :mod:`agent.wire.protocol` the run reported, with their
units in their names), and one ``knobs.<name>`` column per knob with its value at that
step. ``events``: one row per event (``t``, ``step``: the last optimizer step completed
before it, ``level``, ``kind``, ``knob``, ``value`` as text: a string as it is, else its
JSON, and ``text``). Integer fields (steps, counts, bytes) are nullable integers when
every value is whole, knob values keep their type (text, integer, boolean), so a
Parquet file reads back as it was written and a CSV file as pandas parses it.

Streamed: the log is read twice (:func:`gpuwatch.history.step_batches`), once for the
columns and their types, once to write them :data:`CHUNK_ROWS` rows at a time, so the
memory does not grow with the run. Both formats are written by pyarrow (its CSV writer
is about ten times pandas'); pandas only describes the Parquet file's types.
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
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.csv  # type: ignore[import-untyped]
import pyarrow.parquet  # type: ignore[import-untyped]

from agent.wire import protocol
from agent.wire.protocol import MAX_NAME_CHARS, printable
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


def _integral(name: str) -> bool:
    return name in INTEGER_FIELDS or name.endswith(BYTES_SUFFIX)


@dataclass
class Columns:
    """The columns of a run's steps table and their types, found by one pass over its
    log (:func:`columns_of`).

    Attributes:
        numbers: field -> whether its values are whole numbers (written as integers).
        texts: text fields. knobs: knob -> ``bool``, ``int`` or ``text``.
    """

    numbers: dict[str, bool] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    knobs: dict[str, str] = field(default_factory=dict)

    def frame(self) -> pd.DataFrame:
        """An empty table with these columns and types (what the Parquet file's types
        are taken from)."""
        columns: dict[str, Any] = {"run": pd.Series(dtype="string"),
                                   "rank": pd.Series(dtype="Int64")}
        for name, whole in self.numbers.items():
            columns[name] = pd.Series(dtype="Int64" if whole else "float64")
        for name in self.texts:
            columns[name] = pd.Series(dtype="string")
        for name, kind in self.knobs.items():
            columns[f"knobs.{name}"] = pd.Series(dtype={"bool": "boolean", "int": "Int64"}
                                                 .get(kind, "string"))
        return pd.DataFrame(columns)


def columns_of(log: LogFiles) -> Columns:
    """The steps table's columns: every number field with a value in some row (in the
    order they first come), the text fields, and the knobs with the types of their
    values (a mix of types is text)."""
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
            "bool" if types == {bool} else "int" if types == {int} else "text")
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
    kind_type = {"bool": pa.bool_(), "int": pa.int64()}.get(kind, pa.string())
    return pa.DictionaryArray.from_arrays(
        pa.array(indices), pa.array([value for _, value in dictionary], type=kind_type)
    ).dictionary_decode()


def steps_table(batches: list[StepBatch], columns: Columns, run_id: str, rank: int
                ) -> pa.Table:
    """The rows of ``batches`` as the steps table (see the module's documentation)."""
    n = sum(batch.n for batch in batches)
    arrays: dict[str, pa.Array] = {"run": pa.array([run_id] * n, type=pa.string()),
                                   "rank": pa.array([rank] * n, type=pa.int64())}
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


def events_table(events: list[Event], run_id: str, rank: int) -> pa.Table:
    """``events`` as the events table (see the module's documentation)."""
    return pa.table({
        "run": pa.array([run_id] * len(events), type=pa.string()),
        "rank": pa.array([rank] * len(events), type=pa.int64()),
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


_EVENT_TYPES = pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in (
    ("run", "string"), ("rank", "Int64"), ("t", "float64"), ("step", "Int64"),
    ("level", "string"), ("kind", "string"), ("knob", "string"), ("value", "string"),
    ("text", "string"))})


class _TableWriter:
    """Writes a table a chunk at a time to an open file, as CSV (a header once) or
    Parquet (one row group a chunk), in a thread of its own: pyarrow formats a chunk
    without the GIL while the next one is read (at most two chunks wait)."""

    def __init__(self, handle: BinaryIO, table_format: str, types: pd.DataFrame) -> None:
        self.handle = handle
        self.format = table_format
        self.schema = pa.Schema.from_pandas(types, preserve_index=False)
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
        self._queue.put(table.cast(pa.schema(list(self.schema))))

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
            pyarrow.csv.write_csv(table, self.handle, pyarrow.csv.WriteOptions(
                include_header=not self._started))
        else:
            if self._parquet is None:
                self._parquet = pyarrow.parquet.ParquetWriter(self.handle, self.schema)
            self._parquet.write_table(table.replace_schema_metadata(self.schema.metadata))
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
    """Write ``<prefix>.steps.<ext>`` and ``<prefix>.events.<ext>`` from ``log`` (each
    into a new file, renamed over the old once whole); returns each path with its
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
        steps = _TableWriter(steps_out, table_format, columns.frame())
        events = _TableWriter(events_out, table_format, _EVENT_TYPES)
        batches: list[StepBatch] = []
        rows = 0
        pending: list[Event] = []
        last_step: int | None = None
        reader = LogReader(log, arrays=True)
        for _, envelope in reader:
            kind = envelope["type"]
            if kind == protocol.STEPS:
                batch = step_batch(envelope)
                if batch is None:
                    continue
                batches.append(batch)
                rows += batch.n
                present = batch.numbers["step"][~np.isnan(batch.numbers["step"])]
                last_step = int(present[-1]) if len(present) else last_step
                if rows >= CHUNK_ROWS:
                    steps.write(steps_table(batches, columns, log.run_id, log.rank))
                    batches, rows = [], 0
            elif kind == protocol.EVENT:
                pending.append(event_of(number(envelope.get("t")), last_step,
                                        envelope["body"]))
                if len(pending) >= CHUNK_ROWS:
                    events.write(events_table(pending, log.run_id, log.rank))
                    pending = []
        if batches:
            steps.write(steps_table(batches, columns, log.run_id, log.rank))
        if pending:
            events.write(events_table(pending, log.run_id, log.rank))
        steps.close()
        events.close()
    return [(paths[0], steps.rows), (paths[1], events.rows)], reader
