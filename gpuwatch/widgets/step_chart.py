"""A line chart of step-record fields against the optimizer step (textual-plotext)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from textual_plotext import PlotextPlot

from gpuwatch.state import KnobChange, StepRecord
from gpuwatch.units import knob_text


#: Rows below which the legend is left out (it would cover the lines; the title still
#: names each series with its latest value).
_LEGEND_MIN_HEIGHT = 14


class Series(NamedTuple):
    """One line: ``field`` of :class:`StepRecord` times ``scale``, called ``label``."""

    label: str
    field: str
    scale: float = 1.0


#: Step time and data wait in ms, in one chart.
TIMING = (Series("step ms", "step_time_s", 1e3), Series("data wait ms", "data_wait_s", 1e3))
#: The training loss.
LOSS = (Series("loss", "loss"),)

#: Labelled ticks on the step axis.
_X_TICKS = 5
#: With ``clip_spikes``, the y-axis ends at this quantile of the values shown times
#: :data:`_SPIKE_HEADROOM`, so that one stall (a compile, a checkpoint save) does not
#: flatten every other step; spikes are drawn at the top and the title gives the largest.
_SPIKE_QUANTILE = 0.98
_SPIKE_HEADROOM = 1.25
#: Values needed before spikes are clipped (with fewer, every value shows as it is).
_SPIKE_MIN_VALUES = 20
#: Knob changes in view up to which each gets a label (more: their lines alone).
_LABELLED_MARKS = 3
#: plotext colour of the vertical line at a knob change.
_MARK_COLOR = "orange"


class StepChart(PlotextPlot):
    """Lines of step-record fields over the steps kept (records without a finite value
    for a series are left out of that line).

    Args:
        series: the lines to draw.
        clip_spikes: end the y-axis just above the bulk of the values (see
            :data:`_SPIKE_QUANTILE`) instead of at the largest.
    """

    def __init__(self, series: Sequence[Series], *, clip_spikes: bool = False,
                 name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.series = tuple(series)
        self.clip_spikes = clip_spikes

    def show(self, records: Iterable[StepRecord], *, marks: Iterable[KnobChange] = ()
             ) -> None:
        """Redraw from step records (oldest first), with a vertical line at each knob
        change in ``marks`` that falls within their steps (labelled ``knob=value``
        when there are few)."""
        records = [record for record in records if record.step is not None]
        plt = self.plt
        plt.clear_data()
        lines = []
        for series in self.series:
            points = [(record.step, value * series.scale) for record in records
                      if (value := getattr(record, series.field)) is not None
                      and math.isfinite(value)]
            if points:
                lines.append((series, *zip(*points)))
        top = self._top([value for *_, values in lines for value in values])
        legend = len(self.series) > 1 and self.size.height >= _LEGEND_MIN_HEIGHT
        for series, steps, values in lines:
            if top is not None:
                values = [min(value, top) for value in values]
            plt.plot(steps, values, marker="braille",
                     label=series.label if legend else None)
        titles = self._title(lines, top)
        if titles:
            first, last = records[0].step, records[-1].step
            self._mark(marks, first, last, top if top is not None else max(
                (value for *_, values in lines for value in values), default=0.0))
            ticks = sorted({round(first + (last - first) * i / (_X_TICKS - 1))
                            for i in range(_X_TICKS)})
            plt.xticks(ticks, [str(tick) for tick in ticks])
            plt.title(titles)
        else:
            plt.title(f"{' & '.join(s.label for s in self.series)}: no steps yet")
        self.refresh()

    def _mark(self, marks: Iterable[KnobChange], first: int, last: int, top: float
              ) -> None:
        """Vertical lines at the knob changes between steps ``first`` and ``last``; a
        label at the top of each when there are few (``top``: the y-axis' end)."""
        shown = {}  # step -> labels: changes of several knobs at one step share a line
        for mark in marks:
            if first < mark.step <= last:
                shown.setdefault(mark.step, []).append(
                    f"{mark.knob}={knob_text(mark.value)}")
        for step, labels in shown.items():
            self.plt.vline(step, _MARK_COLOR)
            if len(shown) <= _LABELLED_MARKS:  # on the side with room for it
                right = step - first > (last - first) / 2
                label = ", ".join(labels)
                self.plt.text(f"{label} " if right else f" {label}", step, top,
                              color=_MARK_COLOR, alignment="right" if right else "left")

    def _top(self, values: list[float]) -> float | None:
        """Where the y-axis ends when spikes are clipped, or None to show every value
        (no clipping asked, too few values, or none beyond the bulk)."""
        if not self.clip_spikes or len(values) < _SPIKE_MIN_VALUES:
            return None
        ordered = sorted(values)
        top = ordered[int(_SPIKE_QUANTILE * (len(ordered) - 1))] * _SPIKE_HEADROOM
        return top if ordered[-1] > top > 0 else None

    def _title(self, lines: list[tuple[Series, Sequence[int], Sequence[float]]],
               top: float | None) -> str:
        """Each line's latest value (and the largest, when spikes are off scale), as
        much of it as fits the width: plotext leaves out a title that does not fit."""
        if not lines:
            return ""
        latest = [f"{series.label} {values[-1]:.4g}" for series, _, values in lines]
        candidates = []
        if top is not None:
            largest = max(value for *_, values in lines for value in values)
            candidates += [[*latest, f"max {largest:.4g} off scale"],
                           [*latest, f"max {largest:.4g}"]]
        candidates += [latest, [f"{series.label} {values[-1]:.3g}"
                                for series, _, values in lines], latest[:1]]
        fitting = (" | ".join(c) for c in candidates)
        return next((title for title in fitting if len(title) <= self.size.width - 2),
                    latest[0])
