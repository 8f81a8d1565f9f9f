"""``gpuwatch report``: a run as one self-contained HTML page.

Plots (matplotlib, rendered off screen, inlined as base64 PNG) of step time and data
wait, throughput (tokens/s when the run reports tokens, else samples/s), loss, memory
and activation memory over the optimizer steps, each knob change a labelled vertical
line; the table of segments between changes (:mod:`gpuwatch.compare`'s figures, one row
per segment); the run's facts and its environment report. No script, no request: the
file opens anywhere, offline. Every text from the log is escaped (and has no control
characters).

Readable from 1000 px wide up: the page is at most 1150 px wide and narrows with the
window, the plots scale with it, a table wider than the page scrolls sideways in its
own box (its cells wrap at spaces first), labels of knob changes closer than a label's
height share one label (``+2 more``), and numbers are never in scientific notation
(thousands separators on the step axis).

Bounded whatever the run's length: a plot draws the run's overview
(:class:`gpuwatch.history.Series`: at most a few thousand buckets, each its mean as
the line and its minimum to maximum as a band, so spikes stay), at most
:data:`MAX_MARKED` knob changes are marked and :data:`MAX_TABLE_ROWS` rows of a table
listed (the page says how many more there are).
"""

from __future__ import annotations

import base64
import html
import io
import os
import time
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # off screen: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import matplotlib.ticker  # noqa: E402

from agent.wire.protocol import printable  # noqa: E402
from gpuwatch.branches import tree_lines  # noqa: E402
from gpuwatch.compare import Column, rows  # noqa: E402
from gpuwatch.history import RunHistory, write_output  # noqa: E402
from gpuwatch.units import (human_age, human_bytes, human_sig, knob_text,  # noqa: E402
                            local_time)

#: Colour of the vertical lines at knob changes (the data lines keep matplotlib's).
MARK_COLOR = "#c2185b"
#: Size of each plot, in inches, and its resolution (dots per inch).
FIGURE_SIZE_IN = (11.0, 3.2)
FIGURE_DPI = 100
#: With spikes (a compile, a checkpoint save), the step-time axis ends at this quantile
#: of the values times :data:`SPIKE_HEADROOM`, as the dashboard's chart does.
SPIKE_QUANTILE = 0.98
SPIKE_HEADROOM = 1.25
#: Nested environment-report entries shown at most.
MAX_ENV_ROWS = 400
#: Knob changes marked in the plots at most (the first ones).
MAX_MARKED = 200
#: Font size of a change's label (points), the least distance between two labels
#: (pixels: a rotated label's height, 8 pt at :data:`FIGURE_DPI`, and a gap) and its
#: longest text (characters; it runs down from the top of the plot).
LABEL_POINTS = 8
LABEL_GAP_PX = LABEL_POINTS / 72 * FIGURE_DPI + 3
LABEL_CHARS = 40
#: Rows of the knob changes' and the segments' tables at most.
MAX_TABLE_ROWS = 1000
_MIB = float(1 << 20)


def _marks(axes: Any, run: RunHistory) -> None:
    """A vertical line at each knob change (the first :data:`MAX_MARKED` steps with
    one) and ``knob=value`` beside it; changes closer than :data:`LABEL_GAP_PX` to the
    last label share it (``+N more``: the knob changes' table lists them all)."""
    by_step: dict[int, list[str]] = {}
    for change in run.knob_changes:
        if change.step not in by_step and len(by_step) >= MAX_MARKED:
            break
        by_step.setdefault(change.step, []).append(
            f"{change.knob}={knob_text(change.value)}")
    x0, x1 = axes.get_xlim()
    px_per_step = axes.get_window_extent().width / ((x1 - x0) or 1.0)
    labels: list[tuple[int, list[str], int]] = []  # (step, its changes, more after it)
    for step in sorted(by_step):
        if labels and (step - labels[-1][0]) * px_per_step < LABEL_GAP_PX:
            labels[-1] = (labels[-1][0], labels[-1][1], labels[-1][2] + len(by_step[step]))
        else:
            labels.append((step, by_step[step], 0))
    thin = len(labels) < len(by_step)
    for step in by_step:
        axes.axvline(step, color=MARK_COLOR, linewidth=0.6 if thin else 1.4,
                     linestyle="--")
    for step, label in forks(run):
        axes.axvline(step, color=MARK_COLOR, linewidth=1.4, linestyle="-")
        labels.append((step, [label], 0))
    for step, names, more in labels:
        text = printable(", ".join(names), LABEL_CHARS) + (f" +{more} more" if more else "")
        axes.annotate(text, xy=(step, 1.0), xycoords=("data", "axes fraction"),
                      xytext=(3, -3), textcoords="offset points", rotation=90, va="top",
                      ha="left", fontsize=LABEL_POINTS, color=MARK_COLOR, zorder=5,
                      bbox={"boxstyle": "square,pad=0.1", "facecolor": "white",
                            "edgecolor": "none", "alpha": 0.85})


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figure_of(run: RunHistory, title: str, lines: Sequence[tuple[str, str, float]],
              unit: str, *, clip_spikes: bool = False, points: bool = False) -> Any:
    """One plot (a matplotlib figure) of ``lines`` against the step, with the knob changes.

    ``lines``: (label, step field, scale) each; None when no line has a value. A line is the
    mean of each of the overview's buckets, and when a bucket holds several steps, a band
    from their minimum to their maximum."""
    data = []
    for label, name, scale in lines:
        series = run.overview.get(name)
        if series is not None:
            data.append((label, series.steps, series.means * scale, series.lows * scale,
                         series.highs * scale, series.width > 1 or run.thinned > 0))
    if not data:
        return None
    figure, axes = plt.subplots(figsize=FIGURE_SIZE_IN)
    for label, steps, means, lows, highs, banded in data:
        if points:  # measured every few steps: markers joined
            line, = axes.plot(steps, means, marker="o", markersize=3, linewidth=1,
                              label=label)
        else:
            line, = axes.plot(steps, means, linewidth=1, label=label)
        if banded:
            axes.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.2,
                              linewidth=0)
    if clip_spikes:
        values = sorted(float(value) for *_, highs, _ in data for value in highs)
        top = values[int(SPIKE_QUANTILE * (len(values) - 1))] * SPIKE_HEADROOM
        if values[-1] > top > 0:
            axes.set_ylim(0, top)
            axes.set_title(f"{title} (axis cut at {human_sig(top)} {unit}; "
                           f"largest {human_sig(values[-1])} {unit})", loc="left", fontsize=10)
    if not axes.get_title(loc="left"):
        axes.set_title(title, loc="left", fontsize=10)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(unit)
    axes.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    plain = matplotlib.ticker.ScalarFormatter(useOffset=False)
    plain.set_scientific(False)
    axes.yaxis.set_major_formatter(plain)
    axes.grid(alpha=0.3)
    if len(data) > 1:
        axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0),  # beside: never on
                    fontsize=8)  # a change's label
    _marks(axes, run)
    return figure


def plots(run: RunHistory) -> list[tuple[str, str]]:
    """The report's plots as ``(title, base64 PNG)``, those the run has data for."""
    overview = run.overview
    tokens = overview.get("tokens_per_s") is not None
    memory = [("host RSS", "host_rss_bytes", 1 / _MIB)]
    memory += [(label, name, 1 / _MIB) for label, name in (
        ("CUDA allocated", "mem_allocated_bytes"), ("CUDA reserved", "mem_reserved_bytes"),
        ("CUDA peak reserved", "mem_peak_reserved_bytes")) if overview.get(name) is not None]
    specs = [
        ("Step time and data wait", [("step time", "step_time_s", 1e3),
                                     ("data wait", "data_wait_s", 1e3)], "ms",
         {"clip_spikes": True}),
        ("Throughput", [("tokens/s", "tokens_per_s", 1.0)] if tokens else
         [("samples/s", "samples_per_s", 1.0)], "tokens/s" if tokens else "samples/s", {}),
        ("Loss", [("loss", "loss", 1.0)], "loss", {}),
        ("Memory", memory, "MiB", {}),
        ("Activation memory (saved for backward, one micro-batch)",
         [("activations", "activation_bytes", 1 / _MIB)], "MiB", {"points": True}),
    ]
    result = []
    for title, lines, unit, options in specs:
        figure = figure_of(run, title, lines, unit, **options)
        if figure is not None:
            result.append((title, _png(figure)))
    return result


def forks(run: RunHistory) -> list[tuple[int, str]]:
    """The forks on the path the report shows, oldest first: the fork step and its title.

    A run with branches: the path of :attr:`RunHistory.branch`; each fork as its step and
    ``b1 from 120 (rewind=120)``."""
    found = []
    for branch_id in run.tree.path(run.branch):
        branch = run.tree.branches[branch_id]
        if branch.parent is not None and branch.fork_step is not None:
            why = printable(branch.cause or branch.source, 40)
            found.append((branch.fork_step, f"b{branch.branch} from {branch.fork_step:,}"
                          + (f" ({why})" if why else "")))
    return found[::-1]


def _facts(run: RunHistory) -> list[tuple[str, str]]:
    hello = run.hello
    model = hello.get("model")
    if not isinstance(model, dict):
        model = {}
    params = model.get("params")
    started = run.started_at
    facts = [
        ("run", run.run_id), ("name", run.name or "-"),
        ("model", printable(model.get("name", "-"), 100) + (
            f" ({params:,} parameters)" if type(params) is int else "")),
        ("device", printable(hello.get("device", "-"), 100)),
        ("ranks", printable(hello.get("world_size", 1), 20)
         + f" (this report: rank {run.log.rank})"),
        ("started", local_time(started or None)),
        ("duration", human_age(run.duration_s) if run.duration_s is not None else "-"),
        ("optimizer steps", f"{run.summary.steps:,}"),
        ("knob changes", f"{run.knob_changes_total:,}"),
        ("end", printable(run.bye.get("reason") or "ended", 200) if run.bye is not None
         else "no bye: the run was killed, or is still going"),
        ("run log", ", ".join(printable(os.fspath(path), 300) for path in run.log.paths)
         + f" ({human_bytes(run.log.size_bytes)})"),
    ]
    if len(run.tree) > 1:
        facts.append(("branch", f"b{run.branch}: its path (its parents' steps up to each "
                      f"fork, then its own), of {len(run.tree):,} branches"))
    if run.thinned:
        facts.append(("thinned", f"the log reached its disk budget: older steps are kept "
                      f"as buckets of {run.thinned:,} (mean, minimum, maximum); every "
                      "event and knob change is kept"))
    if run.malformed or run.truncated or run.unreadable:
        facts.append(("not read", f"{run.malformed:,} damaged records"
                      + ("; the last record was cut (a killed run)" if run.truncated else "")
                      + "".join(f"; {printable(why, 300)}" for why in run.unreadable)))
    return facts


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A nested map as ``(dotted.key, value)`` rows."""
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            found += _flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return found
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        found = []
        for index, item in enumerate(value):
            found += _flatten(item, f"{prefix}[{index}]")
        return found
    shown = ", ".join(map(str, value)) if isinstance(value, list) else (
        "-" if value is None else str(value))
    return [(prefix, shown)]


def _table(cells: Sequence[Sequence[str]], *, header: bool = True,
           css_class: str = "") -> str:
    """A table in a box that scrolls sideways when the table is wider than the page."""
    out = ['<div class="wide">', f'<table class="{css_class}">' if css_class else "<table>"]
    for number, row in enumerate(cells):
        tag = "th" if header and number == 0 else "td"
        out.append("<tr>" + "".join(f"<{tag}>{html.escape(printable(cell, 500))}</{tag}>"
                                    for cell in row) + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1em;
       max-width: 1150px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left;
         vertical-align: top; }
th { background: #f2f2f2; }
div.wide { max-width: 100%; overflow-x: auto; }
table.facts td:first-child, table.env td:first-child { color: #555; white-space: nowrap; }
table.facts td + td, table.env td + td { overflow-wrap: anywhere; }
table.segments td { white-space: nowrap; }
table.segments td:first-child, table.segments th:first-child {
  white-space: normal; min-width: 11em; position: sticky; left: 0; background: #fff; }
table.segments th:first-child { background: #f2f2f2; }
figure { margin: 1em 0; } figure img { width: 100%; max-width: 1100px; height: auto; }
.mark { color: #c2185b; font-weight: bold; }
"""


def render(run: RunHistory) -> str:
    """The report of ``run`` as an HTML document (str)."""
    title = f"gpuwatch report: {run.run_id}" + (f" ({run.name})" if run.name else "")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             _table([("", ""), *_facts(run)], header=False, css_class="facts")]
    if run.knob_changes:
        parts.append("<h2>Knob changes</h2>")
        parts.append(_table([("step", "knob", "before", "after"), *(
            (f"{change.step:,}", change.knob, knob_text(change.before),
             knob_text(change.value)) for change in run.knob_changes[:MAX_TABLE_ROWS])]))
        if run.knob_changes_total > MAX_TABLE_ROWS:
            parts.append(f"<p>The first {MAX_TABLE_ROWS:,} of {run.knob_changes_total:,} "
                         "knob changes.</p>")
    tree = tree_lines(run.tree, width_chars=160, max_lines=MAX_TABLE_ROWS)
    if tree:
        parts.append("<h2>Branches</h2>")
        parts.append("<p>Each time the training state was put back (rewind, rollback, "
                     "recovery) the run went on as a new branch; solid lines in the plots "
                     "mark the forks on this report's path.</p>")
        parts.append(f'<pre class="branches">{html.escape(chr(10).join(tree))}</pre>')
    parts.append("<h2>Over the steps</h2>")
    images = plots(run)
    if not images:
        parts.append("<p>No optimizer steps in this run log.</p>")
    if run.knob_changes:
        parts.append('<p>Dashed <span class="mark">vertical lines</span> mark the knob '
                     "changes (the knob and its new value beside each).</p>")
    for caption, image in images:
        parts.append(f'<figure><img alt="{html.escape(caption)}" width="1100" '
                     f'src="data:image/png;base64,{image}"></figure>')
    segments = run.segments()
    if len(segments) > MAX_TABLE_ROWS:
        segments = segments[:MAX_TABLE_ROWS // 2] + segments[-MAX_TABLE_ROWS // 2:]
    if segments:
        parts.append("<h2>Segments between knob changes</h2>")
        left_out = len(run.segments()) - len(segments) + run.segments_omitted
        if left_out:
            parts.append(f"<p>The first and last {len(segments) // 2:,} segments; "
                         f"{left_out:,} between them are left out.</p>")
        columns = [Column(segment.label, segment) for segment in segments]
        transposed = [list(row) for row in zip(*rows(columns))]  # a row per segment
        transposed[0][0] = "segment"
        parts.append(_table(transposed, css_class="segments"))
        parts.append("<p>Medians over each segment's steps (its first steps after a "
                     "change included); data wait share = data wait / step time summed "
                     "over the segment; memory: the largest of the segment; loss: "
                     "median of its first and last fifth, and the least-squares slope."
                     "</p>")
    env = run.hello.get("env")
    parts.append("<h2>Environment</h2>")
    if isinstance(env, dict) and env:
        parts.append(_table([("", ""), *_flatten(env)[:MAX_ENV_ROWS]], header=False,
                            css_class="env"))
    else:
        parts.append("<p>The run log has no environment report.</p>")
    parts.append(f"<p><small>Written by gpuwatch report at "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}.</small></p></body></html>")
    return "\n".join(parts)


def write_report(run: RunHistory, path: os.PathLike | str) -> None:
    """Write the report of ``run`` to ``path`` (see :func:`gpuwatch.history.write_output`).

    Raises:
        OSError: the file cannot be written.
    """
    write_output(path, render(run).encode("utf-8"))
