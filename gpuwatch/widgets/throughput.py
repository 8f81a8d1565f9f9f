"""Throughput as a labelled sparkline with the latest value.

Tokens/s for token models, else samples/s."""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import median

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content

from gpuwatch.state import StepRecord
from gpuwatch.units import human_rate
from gpuwatch.widgets.panel import Panel, bucket_max, robust_top, sparkline

#: The marker after a sparkline whose scale leaves out a few outliers.
OUTLIER_MARK = "▲"


class ThroughputBar(Horizontal):
    """Tokens or samples per second over the kept steps, and the latest value as a number.

    Tokens per second (runs that report tokens) or samples per second; each column the
    median of its steps, from 0 to where the bulk of the values ends: a few outlying steps
    are drawn full and marked, not allowed to flatten the rest."""

    def compose(self) -> ComposeResult:
        yield Panel("throughput", classes="label")
        yield Panel("", classes="spark")
        yield Panel("-", classes="value")

    def show(self, records: Iterable[StepRecord]) -> None:
        """Redraw from step records (oldest first)."""
        records = list(records)
        field, unit = "samples_per_s", "samples/s"
        if records and records[-1].tokens_per_s is not None:
            field, unit = "tokens_per_s", "tokens/s"
        rates = [rate for r in records
                 if (rate := getattr(r, field)) is not None and math.isfinite(rate)]
        spark = self.query_one(".spark", Panel)
        width = spark.text_width
        label = f"{len(rates):,} steps " if rates and width >= 30 else ""
        # each column the median of its steps: a few fast steps (batches already
        # prefetched) do not stand for the rest
        columns = bucket_max(rates, max(width - len(label) - 2, 0), reduce=median)
        top = robust_top(columns)
        mark = f" {OUTLIER_MARK}" if top is not None and any(
            value is not None and value > top for value in columns) else ""
        spark.set_content(Content.assemble(
            (label, "$text-muted"), (sparkline(columns, len(columns), high=top), "$primary"),
            (mark, "$error")))
        self.query_one(".value", Panel).set_content(
            human_rate(rates[-1] if rates else None, unit))
