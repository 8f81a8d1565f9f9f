"""A line chart of step-record fields against the optimizer step (textual-plotext)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from textual_plotext import PlotextPlot

from gpuwatch.sources.whole_run import Past
from gpuwatch.state import KnobChange, RecentSteps, StepRecord, recent_steps
from gpuwatch.units import counted, human_duration, human_sig, knob_text
from gpuwatch.widgets.panel import OUTLIER_FEW_HEADROOM, robust_top


#: Rows below which the legend is left out (it would cover the lines; the title still
#: names each series with its latest value).
_LEGEND_MIN_HEIGHT = 14


class Series(NamedTuple):
    """One line: ``field`` of :class:`StepRecord` times ``scale``, called ``label``, in ``color``.

    ``short`` is its label where the width is tight; its values in ``unit``, drawn in
    ``color`` (a plotext colour, named in the title when there are several lines)."""

    label: str
    field: str
    scale: float = 1.0
    unit: str = ""
    short: str = ""
    color: str = "cyan"


#: Step time and data wait in ms, in one chart.
TIMING = (Series("step time", "step_time_s", 1e3, "ms", "step", "cyan"),
          Series("data wait", "data_wait_s", 1e3, "ms", "wait", "magenta"))
#: The training loss.
LOSS = (Series("loss", "loss", color="cyan"),)

#: Labelled ticks on the step axis (at most).
_X_TICKS = 5
#: The step axis' unit, before its first label.
_X_UNIT = "step"
#: Labelled ticks on the value axis.
_Y_TICKS = 4
#: The marker of a value beyond the end of the axis (drawn at the end), and its colour.
_OUTLIER_MARKER, _OUTLIER_COLOR = "▲", "red"
#: A chart with a unit (durations) starts its value axis at 0 when its lowest value is
#: under this share of its span.
_FROM_ZERO_BELOW = 0.05
#: The newest values of a line that, when all are beyond its scale, are a sustained
#: change (a slowdown under load), not an outlier: the scale follows them.
_NEWEST_IN_VIEW = 3
#: ... and the newest values whose median beyond the scale is a new level however noisy
#: (bf16 on a CPU: steps of 40 to 110 ms after 33 ms, some back under the old scale).
_NEWEST_LEVEL = 10
#: plotext colour of the vertical line at a knob change.
_MARK_COLOR = "orange"


#: Dots of a braille character across: a chart's columns of pixels are twice its cells.
_DOTS_ACROSS = 2


def thin(steps: Sequence[float], values: Sequence[float], columns: int
         ) -> tuple[Sequence[float], Sequence[float]]:
    """A line of ``steps`` and ``values`` with at most four points per column of ``columns`` cells.

    Braille: two columns of dots each. In each column of dots the lowest and the highest
    value, in the order they came, and nothing else. The line drawn through them spans what
    the full line spans in each column of dots (a spike still shows; a dot or two of a noisy
    line's in-between may go); the chart draws a fraction of the segments (plotext's cost is
    per segment). The first and the last point are kept."""
    pixels = max(1, columns) * _DOTS_ACROSS
    if len(steps) <= 2 * pixels:
        return steps, values
    first, span = steps[0], max(steps[-1] - steps[0], 1)
    kept_steps: list[float] = []
    kept_values: list[float] = []
    start, count = 0, len(steps)
    while start < count:
        bucket = min(pixels - 1, (steps[start] - first) * pixels // span)
        stop = start + 1
        while stop < count and min(pixels - 1, (steps[stop] - first) * pixels // span
                                   ) == bucket:
            stop += 1
        low = min(range(start, stop), key=values.__getitem__)
        high = max(range(start, stop), key=values.__getitem__)
        ends = {index for index in (start, stop - 1) if index in (0, count - 1)}
        for index in sorted({low, high, *ends}):  # the line's ends stay where they are
            kept_steps.append(steps[index])
            kept_values.append(values[index])
        start = stop
    return kept_steps, kept_values


def _past_points(past: Past | None, series: Series, before: float
                 ) -> tuple[list[float], list[float]]:
    """The points of ``series`` from ``past``'s buckets of steps before step
    ``before``: each bucket's minimum at its first step and its maximum at its last
    (one point where they are the same), so that a spike in a bucket still shows."""
    xs: list[float] = []
    ys: list[float] = []
    buckets = past.series.get(series.field) if past is not None else None
    if buckets is None:
        return xs, ys
    for first, last, low, high in zip(buckets.first_steps.tolist(),
                                      buckets.last_steps.tolist(),
                                      (buckets.lows * series.scale).tolist(),
                                      (buckets.highs * series.scale).tolist()):
        if last >= before:
            break
        xs.append(first)
        ys.append(low)
        if (last, high) != (first, low):
            xs.append(last)
            ys.append(high)
    return xs, ys


def _top(lines: Sequence[tuple[Series, Sequence[float], Sequence[float]]]
         ) -> float | None:
    """Where the value axis ends so that no outlier sets the scale: the highest of
    the lines' own ends (each line's :func:`~gpuwatch.widgets.panel.robust_top`, else
    its largest value: a data wait's bulk never cuts the step times), or None when no
    value is beyond it. A line whose :data:`_NEWEST_IN_VIEW` newest values are all
    beyond its end changed for good: its end rises to them (a lone spike among them,
    over :data:`~gpuwatch.widgets.panel.OUTLIER_FEW_HEADROOM` times their least, left
    out), so the newest steps are always in view; so does one whose
    :data:`_NEWEST_LEVEL` newest values have their median beyond it (a noisy new level),
    to the highest of them within that headroom of the median."""
    tops: list[float] = []
    for _, _, values in lines:
        top = robust_top(values) or max(values)
        newest, recent = values[-_NEWEST_IN_VIEW:], values[-_NEWEST_LEVEL:]
        level = statistics.median(recent) if len(recent) == _NEWEST_LEVEL else None
        if len(newest) == _NEWEST_IN_VIEW and min(newest) > top:
            top = max(value for value in newest
                      if value <= min(newest) * OUTLIER_FEW_HEADROOM)
        elif level is not None and level > top:
            top = max(value for value in recent if value <= level * OUTLIER_FEW_HEADROOM)
        tops.append(top)
    highest = max(tops, default=None)
    return highest if highest is not None and any(
        value > highest for _, _, values in lines for value in values) else None


def _human(value: float, unit: str) -> str:
    """A value of a series as a person reads it: durations in ms, s or min (the axis
    stays in ``ms``), other values in :func:`~gpuwatch.units.human_sig` form."""
    if unit == "ms":
        return human_duration(value / 1e3)
    return f"{human_sig(value)} {unit}".rstrip()


class StepChart(PlotextPlot):
    """Lines of step-record fields over the steps kept.

    Records without a finite value for a series are left out of that line.

    Args:
        series: the lines to draw.
        clip_spikes: end the y-axis just above the bulk of the values (see
            :func:`~gpuwatch.widgets.panel.robust_top`) instead of at the largest.
        recent: the title gives each line's mean over the run's recent steps
            (:func:`~gpuwatch.state.recent_steps`, labelled ``10s mean:``), not its
            latest value.
    """

    def __init__(self, series: Sequence[Series], *, clip_spikes: bool = False,
                 recent: bool = False, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.series = tuple(series)
        self.clip_spikes = clip_spikes
        self.recent = recent
        self._shown: tuple[list[StepRecord], list[KnobChange], Past | None] | None = None
        self._shown_size = self.size  # the size :attr:`_shown` was drawn for
        #: seconds the last :meth:`show` and the last render took (CPU of the main thread)
        self.show_s = self.render_s = 0.0

    def render(self) -> Any:
        """plotext's drawing of what :meth:`show` set, timed (:attr:`render_s`).

        Set again first if it was set at another size (its ticks and labels fit a width)."""
        start = time.perf_counter()
        try:
            if self._shown is not None and self._shown_size != self.size:
                self._show(*self._shown)
            return super().render()
        finally:
            self.render_s = time.perf_counter() - start

    def on_resize(self) -> None:
        """Draw what is shown again for the new size (the legend, the labels that fit)."""
        if self._shown is not None:
            records, marks, past = self._shown
            self.show(records, marks=marks, past=past)

    def show(self, records: Iterable[StepRecord], *, marks: Iterable[KnobChange] = (),
             past: Past | None = None) -> None:
        """Redraw from step records (oldest first), after the earlier steps of ``past``.

        The steps of ``past`` that come before them. ``past``: the whole run from its log,
        in buckets, each drawn from its minimum to its maximum. A vertical line at each knob
        change in ``marks`` and ``past`` that falls within the steps drawn (labelled
        ``knob=value`` when there are few). Costs O(records + buckets + marks)."""
        start = time.perf_counter()
        try:
            self._show(records, marks, past)
        finally:
            self.show_s = time.perf_counter() - start

    def _show(self, records: Iterable[StepRecord], marks: Iterable[KnobChange],
              past: Past | None) -> None:
        records = [record for record in records if record.step is not None]
        self._shown = (records, list(marks), past)
        self._shown_size = self.size
        marks = self._shown[1]
        plt = self.plt
        plt.clear_data()
        live_from: float = records[0].step or 0 if records else math.inf
        if past is not None:  # the log's changes before the live ones (a change seen
            # both ways is the same step and knob)
            seen = {(mark.step, mark.knob) for mark in marks}
            marks = [mark for mark in past.knob_changes
                     if mark.step < live_from and (mark.step, mark.knob) not in seen
                     ] + marks
        lines: list[tuple[Series, Sequence[float], Sequence[float]]] = []
        for series in self.series:
            xs, ys = _past_points(past, series, live_from)
            for record in records:
                value = getattr(record, series.field)
                if record.step is not None and value is not None and math.isfinite(value):
                    xs.append(record.step)
                    ys.append(value * series.scale)
            if xs:
                lines.append((series, xs, ys))
        every = [value for *_, values in lines for value in values]
        ends = [step for _, xs, _ in lines for step in (xs[0], xs[-1])]
        first = min([*ends, *(float(record.step or 0) for record in records[:1])], default=0)
        last = max([*ends, *(float(record.step or 0) for record in records[-1:])], default=0)
        top = _top(lines) if self.clip_spikes else None
        outliers = [step for _, steps, values in lines  # (no label covers their marker)
                    for step, value in zip(steps, values) if top is not None and value > top]
        legend_columns = max(len(self._label(series)) for series in self.series) + 4
        legend = (len(self.series) > 1 and self.size.height >= _LEGEND_MIN_HEIGHT
                  and not any((step - first) / max(last - first, 1) * self.size.width
                              <= legend_columns for step in outliers))  # hides no ▲
        for series, steps, values in lines:
            if top is not None:
                beyond = [step for step, value in zip(steps, values) if value > top]
                values = [min(value, top) for value in values]
            steps, values = thin(steps, values, self.size.width)
            plt.plot(steps, values, marker="braille", color=series.color,
                     label=self._label(series) if legend else None)
            if top is not None and beyond:  # outliers: marked at the axis' end
                plt.scatter(beyond, [top] * len(beyond), marker=_OUTLIER_MARKER,
                            color=_OUTLIER_COLOR)
        high = top if top is not None else max(every, default=0.0)
        low = min(every, default=0.0)
        if self.series[0].unit and 0 <= low < (high - low) * _FROM_ZERO_BELOW:
            low = 0.0  # durations near 0 start at 0 (not at 0.0000000605 ms)
        tick_width = self._y_ticks(low, high)
        titles = self._title(lines, top, self.size.width - tick_width - 3, legend=legend,
                             recent=recent_steps(records) if self.recent else None)
        if titles:
            width = self.size.width - tick_width - 3
            unlabelled = self._mark(marks, first, last, high, width, outliers)
            where = f" | {counted(unlabelled, 'more change')} in events"
            if unlabelled and len(titles) + len(where) <= width:
                titles += where  # (else the events panel, or `gpuwatch tail`, has them)
            # room: 3 columns between labels, the first ("step 1", the axis' unit) half
            # under the value labels (plotext centres a label; one that would touch
            # another is left out, which one depending on the hash seed)
            label, first_label = len(f"{last:,.0f}"), len(f"{_X_UNIT} {first:,.0f}")
            count = _X_TICKS
            while count > 2 and width / (count - 1) < max(label + 3,
                                                          (first_label + label) / 2 + 3):
                count -= 1
            ticks: list[float] = sorted({round(first + (last - first) * i / (count - 1))
                                         for i in range(count)})  # ints are floats to plotext
            labels = [f"{tick:,.0f}" for tick in ticks]  # 12,000: steps
            labels[0] = f"{_X_UNIT} {labels[0]}"
            plt.xticks(ticks, labels)
            plt.title(titles)
        else:
            plt.title(f"{' & '.join(self._label(s) for s in self.series)}: no steps yet")
        self.refresh()

    def _mark(self, marks: Iterable[KnobChange], first: float, last: float, top: float,
              width: int, outliers: Sequence[float] = ()) -> int:
        """Vertical lines at the knob changes between steps ``first`` and ``last``; a
        label at the top of each, the newest first, where it fits on the side with more
        room, over no other label and no outlier's marker (``top``: the y-axis' end;
        ``width``: the plot's columns; ``outliers``: the steps of the values beyond
        ``top``). Returns how many lines have no label. Costs O(marks^2)."""
        # step -> labels: changes of several knobs at one step share a line
        shown: dict[int, list[str]] = {}
        for mark in marks:
            if first < mark.step <= last:
                shown.setdefault(mark.step, []).append(
                    f"{mark.knob}={knob_text(mark.value)}")
        taken: list[tuple[float, float]] = [  # columns of the labels and markers drawn
            (at - 1, at + 1) for at in ((step - first) / max(last - first, 1) * width
                                        for step in outliers)]
        unlabelled = 0
        for step, labels in sorted(shown.items(), reverse=True):  # the newest first
            self.plt.vline(step, _MARK_COLOR)
            right = step - first > (last - first) / 2
            label = ", ".join(labels)
            at = (step - first) / max(last - first, 1) * width
            span = (at - len(label) - 1, at) if right else (at, at + len(label) + 1)
            if (0 <= span[0] and span[1] <= width
                    and all(span[1] < start or span[0] > end for start, end in taken)):
                taken.append(span)  # on the side with room for it, over no other label
                self.plt.text(f"{label} " if right else f" {label}", step, top,
                              color=_MARK_COLOR, alignment="right" if right else "left")
            else:
                unlabelled += 1
        return unlabelled

    def _y_ticks(self, low: float, high: float) -> int:
        """Label the value axis in :func:`~gpuwatch.units.human_sig` form with the
        series' unit (durations in ms, s or min; never plotext's scientific notation);
        returns the labels' width in columns."""
        low = min(low, high)
        if high <= low:
            high = low + (abs(low) or 1.0)
        rows = max(self.size.height - 4, 2)  # title, frame and step labels take 4
        count = max(2, min(_Y_TICKS, rows // 2 + 1))  # one row each, with room between
        ticks = [low + (high - low) * i / (count - 1) for i in range(count)]
        labels = [_human(tick, self.series[0].unit) for tick in ticks]  # with its unit
        self.plt.yticks(ticks, labels)
        self.plt.ylim(low, high)
        return max(len(label) for label in labels)

    @staticmethod
    def _label(series: Series, value: float | None = None, *, short: bool = False
               ) -> str:
        """``step time 12.3 ms`` (with a value: the latest, or a mean) or ``step 12.3 ms``;
        without a value the name alone (the legend's: the value axis names the unit,
        which adapts, ``ms`` to ``s`` to ``min``)."""
        name = series.short if short and series.short else series.label
        if value is None:
            return name
        return f"{name} {_human(value, series.unit)}"

    def _title(self, lines: list[tuple[Series, Sequence[float], Sequence[float]]],
               top: float | None, width: int, *, legend: bool = False,
               recent: RecentSteps | None = None) -> str:
        """Each line's name, latest value and unit (with several lines, their colours;
        when outliers are off scale, the largest), as much of it as fits ``width``
        columns: plotext leaves out a title that does not fit. With a ``legend`` the
        colours are left to it. With ``recent``, each line's mean over those steps in
        place of its latest value (``-`` when none has it), after ``10s mean:`` (their
        span), which stays when the rest must be cut."""
        if not lines:
            return ""
        several = len(lines) > 1 and not legend
        shown = [(series, values[-1] if recent is None else
                  recent.mean(series.field, series.scale)) for series, _, values in lines]
        def named(short: bool, colours: bool) -> list[str]:
            return [(self._label(series, value, short=short) if value is not None
                     else f"{self._label(series, short=short)} -")
                    + (f" ({series.color})" if colours else "") for series, value in shown]
        candidates: list[list[str]] = []
        extra = []
        if top is not None:
            largest = max(value for *_, values in lines for value in values)
            largest_text = _human(largest, lines[0][0].unit)
            extra = [f"{_OUTLIER_MARKER} max {largest_text} off scale",
                     f"{_OUTLIER_MARKER} {largest_text}"]
        for tail in extra:  # what ▲ marks before the long names, the names before colours
            for short in (False, True):
                for colours in ((True, False) if several else (False,)):
                    candidates.append([*named(short, colours), tail])
        for short in (False, True):
            for colours in ((True, False) if several else (False,)):
                candidates.append(named(short, colours))
        candidates.append(named(True, False)[:1])
        what = f"{recent.label}: " if recent is not None and recent.records else ""
        fitting = (what + " | ".join(c) for c in candidates)
        return next((title for title in fitting if len(title) <= width),
                    what + named(True, False)[0])
