"""A line chart of step-record fields against the optimizer step (textual-plotext)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from textual_plotext import PlotextPlot

from gpuwatch.state import StepRecord


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


class StepChart(PlotextPlot):
    """Lines of step-record fields over the steps kept (records without a finite value
    for a series are left out of that line).

    Args:
        series: the lines to draw.
    """

    def __init__(self, series: Sequence[Series], *, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.series = tuple(series)

    def show(self, records: Iterable[StepRecord]) -> None:
        """Redraw from step records (oldest first)."""
        records = [record for record in records if record.step is not None]
        plt = self.plt
        plt.clear_data()
        titles = []
        for series in self.series:
            points = [(record.step, value * series.scale) for record in records
                      if (value := getattr(record, series.field)) is not None
                      and math.isfinite(value)]
            if not points:
                continue
            steps, values = zip(*points)
            titles.append(f"{series.label} {values[-1]:.4g}")
            legend = len(self.series) > 1 and self.size.height >= _LEGEND_MIN_HEIGHT
            plt.plot(steps, values, marker="braille",
                     label=series.label if legend else None)
        if titles:
            first, last = records[0].step, records[-1].step
            ticks = sorted({round(first + (last - first) * i / (_X_TICKS - 1))
                            for i in range(_X_TICKS)})
            plt.xticks(ticks, [str(tick) for tick in ticks])
            plt.title(" | ".join(titles))
        else:
            plt.title(f"{' & '.join(s.label for s in self.series)}: no steps yet")
        self.refresh()
