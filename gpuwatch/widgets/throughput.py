"""Throughput (tokens/s for token models, else samples/s) as a sparkline with the
latest value."""

from __future__ import annotations

import math
from collections.abc import Iterable

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Sparkline, Static

from gpuwatch.state import StepRecord
from gpuwatch.units import human_number
from gpuwatch.widgets.panel import Panel


class ThroughputBar(Horizontal):
    """Tokens per second (runs that report tokens) or samples per second over the last
    steps, and the latest value as a number."""

    def compose(self) -> ComposeResult:
        yield Static("throughput", classes="label")
        yield Sparkline([])
        yield Panel("-", classes="value")

    def show(self, records: Iterable[StepRecord]) -> None:
        """Redraw from step records (oldest first)."""
        records = list(records)
        field, unit = "samples_per_s", "samples/s"
        if records and records[-1].tokens_per_s is not None:
            field, unit = "tokens_per_s", "tokens/s"
        rates = [rate for r in records
                 if (rate := getattr(r, field)) is not None and math.isfinite(rate)]
        self.query_one(Sparkline).data = rates
        self.query_one(".value", Panel).set_content(
            f"{human_number(rates[-1], 1 if rates[-1] < 100 else 0)} {unit}"
            if rates else f"- {unit}")
