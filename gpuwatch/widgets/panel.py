"""The base of the text panels, and the one-line sparkline they draw with.

A fixed-size Static that redraws only on real change, and the text sparkline (per record, or
per bucket of records)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from textual.content import Content
from textual.widgets import Static

from agent.wire.protocol import printable

#: Block characters of a sparkline, lowest first.
SPARK_BARS = "▁▂▃▄▅▆▇█"
#: Width assumed before the first layout (then the next redraw uses the real one).
DEFAULT_WIDTH = 20
#: Characters of one panel line drawn at most (panels are a few dozen columns wide): a
#: huge string from a run costs no more to draw than one that fits.
MAX_LINE_CHARS = 500


class Panel(Static):
    """A Static whose size never depends on its text, and that skips an update to the same.

    Its size is set in the stylesheet, so an update needs no layout pass, and an update to
    the same text and styles is skipped: the dashboard calls ``show()`` several times a
    second. Every panel's text passes
    :func:`agent.wire.protocol.printable` here (its own line breaks kept), so no string of a
    run or a log reaches the terminal as control sequences."""

    @property
    def text_width(self) -> int:
        """Columns for text inside the border and padding (a default before layout)."""
        return self.content_region.width or DEFAULT_WIDTH

    def set_content(self, content: Content | str, *, layout: bool = False) -> None:
        """Show ``content``, unless it is what is shown already.

        Its control characters are made visible (see :func:`safe_content`). ``layout``: its
        height follows its lines (the layout is redone when it changes)."""
        content = safe_content(content)
        current = self.content
        if isinstance(current, Content) and (current.plain, current.spans) == (
                content.plain, content.spans):
            return
        self.update(content, layout=layout)


def safe_content(content: Content | str) -> Content:
    """``content`` as a terminal may show it.

    Its lines cut to :data:`MAX_LINE_CHARS` and its control characters made visible by
    :func:`agent.wire.protocol.printable` (its own line breaks kept), its styles where they
    were. For every text of a run or a log that a widget shows."""
    content = Content(content) if isinstance(content, str) else content
    plain = content.plain
    if len(plain) > MAX_LINE_CHARS and any(
            len(line) > MAX_LINE_CHARS for line in plain.split("\n")):
        content = Content("\n").join(line[:MAX_LINE_CHARS]
                                      for line in content.split("\n"))
        plain = content.plain
    safe = printable(plain, newlines=True)
    if safe is not plain:  # one character for one: the spans still fit
        content = Content(safe, list(content.spans))
    return content


#: :func:`robust_top` ends a scale at this quantile of the values times
#: :data:`OUTLIER_HEADROOM`, so that a few spikes (a compile, a checkpoint save, a burst
#: of cached batches) do not flatten every other value; needs :data:`OUTLIER_MIN_VALUES`.
OUTLIER_QUANTILE = 0.9
OUTLIER_HEADROOM = 1.5
OUTLIER_MIN_VALUES = 20
#: With fewer values (at least :data:`OUTLIER_FEW_VALUES`: a run's first steps, its
#: compile among them), the scale ends at the median of all but their largest (the lower
#: middle one: a first step that compiled, and a slow second one, do not set the scale
#: of the others) times this.
OUTLIER_FEW_VALUES = 2
OUTLIER_FEW_HEADROOM = 4.0


def robust_top(values: Sequence[float | None]) -> float | None:
    """Where a scale of ``values`` should end so that outliers do not flatten the rest.

    Outliers are drawn at the end and marked. Returns or None when every value fits (too few
    values, or none beyond the bulk)."""
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if len(finite) < OUTLIER_FEW_VALUES:
        return None
    if len(finite) < OUTLIER_MIN_VALUES:  # a compile among a run's first steps
        top = finite[(len(finite) - 2) // 2] * OUTLIER_FEW_HEADROOM
    else:
        top = finite[int(OUTLIER_QUANTILE * (len(finite) - 1))] * OUTLIER_HEADROOM
    return top if finite[-1] > top > 0 else None


def sparkline(values: Sequence[float | None], width: int, *,
              high: float | None = None) -> str:
    """The last ``width`` values as one line of block characters, one per value.

    The newest at the right, scaled from 0 to ``high`` (the largest value shown when None).

    A missing or non-finite value is a space; with fewer values than ``width`` the line
    is shorter (it is not stretched, so one column is always one record).
    """
    shown = list(values)[-width:] if width > 0 else []
    finite = [v for v in shown if v is not None and math.isfinite(v)]
    top = high if high is not None else max(finite, default=0.0)
    top_index = len(SPARK_BARS) - 1
    bars = []
    for value in shown:
        if value is None or not math.isfinite(value):
            bars.append(" ")
        elif top <= 0:
            bars.append(SPARK_BARS[0])
        else:
            index = round(min(max(value / top, 0.0), 1.0) * top_index)
            bars.append(SPARK_BARS[index])
    return "".join(bars)


def bucket_max(values: Sequence[float | None], buckets: int, *,
               reduce: Callable[[list[float]], float] = max) -> list[float | None]:
    """Each bucket's largest value, of ``values`` cut into at most ``buckets`` runs.

    ``values`` (oldest first) cut into at most ``buckets`` consecutive runs of equal length
    (the oldest run takes the remainder), each run's largest value (None when a run has
    none): a long history for a short sparkline, where a peak is not lost. ``reduce``:
    another summary of each run (e.g. :func:`statistics.median`, for a rate whose few fast
    steps should not stand for the rest)."""
    count = len(values)
    if buckets <= 0 or count == 0:
        return []
    if count <= buckets:
        return list(values)
    size = -(-count // buckets)  # ceil: at most `buckets` runs
    first = count - size * (-(-count // size) - 1)
    edges = [0, *range(first, count, size)] if first < count else [0]
    result: list[float | None] = []
    for start, stop in zip(edges, [*edges[1:], count]):
        present = [value for value in values[start:stop]
                   if value is not None and math.isfinite(value)]
        result.append(reduce(present) if present else None)
    return result
