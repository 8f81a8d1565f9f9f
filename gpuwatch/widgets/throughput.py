"""Throughput (samples/s) as a sparkline with the latest value."""

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
    """Samples per second over the last steps, and the latest value as a number."""

    def compose(self) -> ComposeResult:
        yield Static("throughput", classes="label")
        yield Sparkline([])
        yield Panel("-", classes="value")

    def show(self, records: Iterable[StepRecord]) -> None:
        """Redraw from step records (oldest first)."""
        rates = [r.samples_per_s for r in records
                 if r.samples_per_s is not None and math.isfinite(r.samples_per_s)]
        self.query_one(Sparkline).data = rates
        self.query_one(".value", Panel).set_content(
            f"{human_number(rates[-1], 1 if rates[-1] < 100 else 0)} samples/s"
            if rates else "- samples/s")
