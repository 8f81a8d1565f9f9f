"""Throughput as a labelled sparkline with the run's recent rate.

Tokens/s for token models, else samples/s."""

from __future__ import annotations

import math
from collections.abc import Iterable
from statistics import median

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content

from gpuwatch.sources.whole_run import Past
from gpuwatch.state import StepRecord, recent_steps
from gpuwatch.units import counted, human_rate
from gpuwatch.widgets.panel import Panel, bucket_max, robust_top, sparkline

#: The marker after a sparkline whose scale leaves out a few outliers.
OUTLIER_MARK = "▲"


class ThroughputBar(Horizontal):
    """Tokens per second (runs that report tokens) or samples per second over the kept steps.

    Each column is the median of its steps, from 0 to where the bulk of the values ends: a
    few outlying steps are drawn full and marked, not allowed to flatten the rest. The
    number is the rate over the run's recent steps (:func:`~gpuwatch.state.recent_steps`,
    the window of the step-time chart's title): what they counted over their time, after
    ``10s mean`` where it fits (from 80 columns). With
    the whole run's log, the bar starts from its first step as the charts do."""

    def compose(self) -> ComposeResult:
        yield Panel("throughput", classes="label")
        yield Panel("", classes="spark")
        yield Panel("-", classes="value")

    def show(self, records: Iterable[StepRecord], *, past: Past | None = None) -> None:
        """Redraw from step records (oldest first), after the earlier buckets of ``past``.

        ``past`` is the whole run from its log; its buckets that come before the records are
        drawn first."""
        records = [r for r in records if r.step is not None]
        field, unit = "samples_per_s", "samples/s"
        if records and records[-1].tokens_per_s is not None:
            field, unit = "tokens_per_s", "tokens/s"
        points = [(step, step, rate) for r in records if (step := r.step) is not None
                  and (rate := getattr(r, field)) is not None and math.isfinite(rate)]
        earlier = _past_points(past, field, records[0].step if records else None)
        spark = self.query_one(".spark", Panel)
        width = spark.text_width
        every = [*earlier, *points]
        steps = every[-1][1] - every[0][0] + 1 if every else 0  # the steps drawn
        label = f"{counted(steps, 'step')} " if steps and width >= 30 else ""
        # each column the median of its steps: a few fast steps (batches already
        # prefetched) do not stand for the rest
        wide = max(width - len(label) - 2, 0)
        columns = (by_step(every, wide) if earlier else
                   bucket_max([rate for *_, rate in points], wide, reduce=median))
        top = robust_top(columns)
        mark = f" {OUTLIER_MARK}" if top is not None and any(
            value is not None and value > top for value in columns) else ""
        spark.set_content(Content.assemble(
            (label, "$text-muted"), (sparkline(columns, len(columns), high=top), "$primary"),
            (mark, "$error")))
        recent = recent_steps(records)
        rate = human_rate(recent.rate(field), unit)
        value = self.query_one(".value", Panel)
        label = f"{recent.label} " if recent.records else ""
        value.set_content(Content.assemble(
            (label, "not bold $text-muted") if len(label + rate) <= value.text_width else "",
            rate))


def _past_points(past: Past | None, field: str, before: int | None
                 ) -> list[tuple[int, int, float]]:
    """(first step, last step, mean) of each of ``past``'s buckets of ``field`` that
    ends before step ``before`` (all of them when None)."""
    buckets = past.series.get(field) if past is not None else None
    if buckets is None:
        return []
    return [(int(first), int(last), mean) for first, last, mean in zip(
        buckets.first_steps.tolist(), buckets.last_steps.tolist(), buckets.means.tolist())
            if (before is None or last < before) and math.isfinite(mean)]


def by_step(points: list[tuple[int, int, float]], columns: int) -> list[float | None]:
    """Points (first step, last step, value; oldest first) in at most ``columns`` columns.

    Columns of equal spans of steps, each the median of the values whose middle step it
    holds (None: none): buckets of many steps and single steps on one axis of steps. One
    column a step when the steps fit. Costs O(points)."""
    if columns <= 0 or not points:
        return []
    start, span = points[0][0], points[-1][1] - points[0][0] + 1
    columns = min(columns, span)
    held: list[list[float]] = [[] for _ in range(columns)]
    for first, last, value in points:
        held[min(columns - 1, ((first + last) // 2 - start) * columns // span)].append(value)
    return [median(values) if values else None for values in held]
