"""``gpuwatch export RUN --csv/--parquet``: a run's log as two flat tables (pandas).

``steps``: one row per optimizer step, one column per field (``run``, ``rank``, ``t``
unix s, ``seq``, ``step``, then the step fields of :mod:`agent.protocol` the run
reported, with their units in their names), and one ``knobs.<name>`` column per knob
with its value at that step. ``events``: one row per event (``t``, ``step``: the last
optimizer step completed before it, ``level``, ``kind``, ``knob``, ``value`` as text:
a string as it is, else its JSON, and ``text``). Integer fields (steps, counts, bytes)
are nullable integers, knob values keep their type (text, integer, boolean), so a
Parquet file reads back as it was written and a CSV file as pandas parses it.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from agent.protocol import printable
from gpuwatch.history import RunHistory, write_output
from gpuwatch.units import knob_text

#: Step fields that hold whole numbers (steps, counts, bytes).
INTEGER_FIELDS = frozenset({"seq", "step", "micro_batches", "samples", "tokens",
                            "skipped_steps_total", "num_ooms", "num_alloc_retries"})
#: The suffix of fields in bytes, whole numbers too.
BYTES_SUFFIX = "_bytes"
#: The table formats and their file name suffixes.
FORMATS = {"csv": ".csv", "parquet": ".parquet"}


def _integral(name: str) -> bool:
    return name in INTEGER_FIELDS or name.endswith(BYTES_SUFFIX)


def _knob_column(values: list[Any]) -> pd.Series:
    """A knob's values with one type: booleans, integers, or else text."""
    kinds = {type(value) for value in values if value is not None}
    if kinds == {bool}:
        return pd.Series(values, dtype="boolean")
    if kinds == {int}:
        return pd.Series(values, dtype="Int64")
    return pd.Series([None if value is None else knob_text(value) for value in values],
                     dtype="string")


def steps_frame(run: RunHistory) -> pd.DataFrame:
    """The run's steps as one flat table (see the module's documentation)."""
    table = run.steps
    columns: dict[str, Any] = {
        "run": pd.Series([run.run_id] * len(table), dtype="string"),
        "rank": pd.Series([run.log.rank] * len(table), dtype="Int64")}
    for name, values in table.numbers.items():
        if not any(value == value for value in values):
            continue  # a field this run never reported
        column = pd.Series(values, dtype="float64")
        if _integral(name) and all(v != v or v.is_integer() for v in values):
            column = column.round().astype("Int64")  # NaN -> <NA>
        columns[name] = column
    for name, texts in table.texts.items():
        if any(value is not None for value in texts):
            columns[name] = pd.Series(texts, dtype="string")
    for name, knob_values in table.knobs.items():
        columns[f"knobs.{printable(name, 100)}"] = _knob_column(knob_values)
    return pd.DataFrame(columns)


def events_frame(run: RunHistory) -> pd.DataFrame:
    """The run's events as one flat table (see the module's documentation)."""
    events = run.events
    return pd.DataFrame({
        "run": pd.Series([run.run_id] * len(events), dtype="string"),
        "rank": pd.Series([run.log.rank] * len(events), dtype="Int64"),
        "t": pd.Series([math.nan if e.t is None else e.t for e in events],
                       dtype="float64"),
        "step": pd.Series([e.step for e in events], dtype="Int64"),
        "level": pd.Series([e.level for e in events], dtype="string"),
        "kind": pd.Series([e.kind for e in events], dtype="string"),
        "knob": pd.Series([e.knob for e in events], dtype="string"),
        "value": pd.Series([e.value if e.value is None or isinstance(e.value, str)
                            else json.dumps(e.value) for e in events], dtype="string"),
        "text": pd.Series([e.text for e in events], dtype="string"),
    })


def write_tables(run: RunHistory, prefix: Path, table_format: str
                 ) -> list[tuple[Path, int]]:
    """Write ``<prefix>.steps.<ext>`` and ``<prefix>.events.<ext>``; returns each path
    with its rows.

    Args:
        table_format: ``csv`` or ``parquet``.

    Raises:
        ValueError: an unknown format.
        ImportError: Parquet without pyarrow.
        OSError: a file cannot be written.
    """
    if table_format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got "
                         f"{table_format!r}")
    written = []
    for kind, frame in (("steps", steps_frame(run)), ("events", events_frame(run))):
        path = prefix.with_name(f"{prefix.name}.{kind}{FORMATS[table_format]}")
        buffer = io.BytesIO()
        if table_format == "csv":
            frame.to_csv(buffer, index=False)
        else:
            frame.to_parquet(buffer, index=False, engine="pyarrow")
        write_output(path, buffer.getvalue())
        written.append((path, len(frame)))
    return written
