"""Side by side: two runs, or the segments of one run between its knob changes.

In the figures of :class:`gpuwatch.history.Segment` (median step time, throughput, data wait
share, memory, loss trend), as ``gpuwatch compare`` prints them and the dashboard's compare
screen shows them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agent.wire.protocol import printable
from agent.wire.runlog import Branch
from gpuwatch.branches import branch_title
from gpuwatch.history import RunHistory, Segment
from gpuwatch.units import human_bytes, human_ms, human_sig, knob_text

#: The widest line :func:`table` prints by default (characters): a terminal of 120.
WIDTH_CHARS = 120
#: The longest title, knob name and knob value in a cell (characters): with the
#: longest figure label, one column and a ratio fit in :data:`WIDTH_CHARS`.
TITLE_CHARS, NAME_CHARS, VALUE_CHARS = 60, 40, 40
#: :func:`load_note` warns when other work kept at least this share of the host's CPU
#: busy in one column (0..1) ...
BUSY_SHARE = 0.25
#: ... and this much more than in another.
LOAD_GAP = 0.2


@dataclass(frozen=True)
class Column:
    """One side: a title (a run id, or what changed at a segment's start) and its figures."""

    title: str
    segment: Segment

    def public(self) -> dict[str, Any]:
        """As a JSON-ready map (``gpuwatch compare --json``)."""
        return {"title": self.title, **asdict(self.segment),
                "changed": list(self.segment.changed)}


def around_changes(run: RunHistory) -> list[Column]:
    """Every segment of ``run`` in order (the first, then one per knob change).

    ``[]`` when the run has no knob change (nothing to compare)."""
    segments = run.segments()
    if len(segments) < 2:
        return []
    return [Column("start" if not segment.changed else ", ".join(
        f"{name}={knob_text(segment.knobs.get(name))}" for name in segment.changed),
        segment) for segment in segments]


def between_runs(first: RunHistory, second: RunHistory) -> list[Column]:
    """The two runs, each as a whole; ``[]`` when either has no steps.

    Knobs: each as at its first step, then as at its last where it changed
    (``fp32 -> bf16``); a run with branches: the path
    :func:`gpuwatch.history.read_history` read, titled ``RUN@bN``."""
    if first.whole is None or second.whole is None:
        return []
    return [Column(run.run_id + (f"@b{run.branch}" if len(run.tree) > 1 else "")
                   + (f" ({run.name})" if run.name else ""), run.whole)
            for run in (first, second) if run.whole is not None]


def between_branches(branches: Sequence[tuple[Branch, Segment]]) -> list[Column]:
    """A run's branches side by side, each its own steps; ``[]`` for fewer than two.

    Each from its fork on (:func:`gpuwatch.history.branch_segments`), titled by
    :func:`gpuwatch.branches.branch_title`."""
    if len(branches) < 2:
        return []
    return [Column(branch_title(branch), segment) for branch, segment in branches]


def _loss(segment: Segment) -> str:
    if segment.loss_first is None or segment.loss_last is None:
        return "-"
    return f"{human_sig(segment.loss_first)} -> {human_sig(segment.loss_last)}"


def _span(first: Any, last: Any) -> str | None:
    """A knob's value over a segment: ``fp32``, or ``fp32 -> bf16`` where it changed
    within it (a whole run, a branch); None where the segment has no such knob."""
    if first is None and last is None:
        return None
    start = "-" if first is None else printable(knob_text(first), VALUE_CHARS)
    end = "-" if last is None else printable(knob_text(last), VALUE_CHARS)
    return start if start == end else f"{start} -> {end}"


def _ratio(before: float | None, after: float | None) -> str:
    if before is None or after is None or before == 0:
        return ""
    return f"x{human_sig(after / before)}"  # (3 digits: a 24 s step before read x0.00)


def rows(columns: Sequence[Column]) -> list[list[str]]:
    """The comparison as rows of cells: the titles, then each figure and each knob that differs.

    A header row (the titles), then one row per figure and per knob whose value differs
    between the columns (the host's CPU kept busy by other work where the log has system
    samples); with two columns a last cell, ``ratio``, with the second's figure
    over the first's with 3 significant digits (``x0.500``, ``x0.000837``)."""
    segments = [column.segment for column in columns]
    shown = [{name: _span(s.knobs.get(name), s.knobs_last.get(name, s.knobs.get(name)))
              for name in dict.fromkeys([*s.knobs, *s.knobs_last])} for s in segments]
    knobs = [name for name in dict.fromkeys(n for values in shown for n in values)
             if len({values.get(name) for values in shown}) > 1]
    figures: list[tuple[str, Any, Any]] = [
        ("steps", lambda s: f"{s.first_step:,}-{s.last_step:,} ({s.steps:,})", None),
        ("step time (median)", lambda s: human_ms(s.step_time_s), "step_time_s"),
        ("samples/s (median)", lambda s: human_sig(s.samples_per_s),
         "samples_per_s")]
    if any(s.tokens_per_s is not None for s in segments):
        figures.append(("tokens/s (median)", lambda s: human_sig(s.tokens_per_s),
                        "tokens_per_s"))
    figures += [
        ("data wait share", lambda s: "-" if s.data_wait_share is None
         else f"{s.data_wait_share:.1%}", "data_wait_share"),
        ("memory (peak)", lambda s: human_bytes(s.memory_bytes), "memory_bytes"),
        ("activation memory", lambda s: human_bytes(s.activation_bytes),
         "activation_bytes"),
        ("loss (first -> last fifth)", _loss, None),
        ("loss slope / 1k steps", lambda s: "-" if s.loss_slope_per_1k is None
         else f"{s.loss_slope_per_1k:+.3g}", None)]
    if any(s.other_cpu_share is not None for s in segments):
        figures.append(("host CPU, other work", lambda s: "-" if s.other_cpu_share is None
                        else f"{s.other_cpu_share:.0%}", None))
    table = [["", *(printable(column.title, TITLE_CHARS) for column in columns)]]
    if len(columns) == 2:
        table[0].append("ratio")
    for name in knobs:
        table.append([printable(name, NAME_CHARS),
                      *(values.get(name) or "-" for values in shown)]  # (-: no such knob)
                     + ([""] if len(columns) == 2 else []))
    for label, show, field in figures:
        row = [label, *(show(s) for s in segments)]
        if len(columns) == 2:
            row.append(_ratio(getattr(segments[0], field), getattr(segments[1], field))
                       if field else "")
        table.append(row)
    return table


def load_note(columns: Sequence[Column]) -> str | None:
    """A warning when other work on the host moved the columns' speed figures, else None.

    When the busiest column's :attr:`~gpuwatch.history.Segment.other_cpu_share` is at least
    :data:`BUSY_SHARE` and :data:`LOAD_GAP` above the quietest's: a segment can read
    several times faster only because another job on the host ended (a newcomer read a
    x26 "speed-up" of that kind as the knob's)."""
    shares = [(column.segment.other_cpu_share, number) for number, column
              in enumerate(columns, 1) if column.segment.other_cpu_share is not None]
    if len(shares) < 2:
        return None
    (busy, busiest), (quiet, quietest) = max(shares), min(shares)
    if busy < BUSY_SHARE or busy - quiet < LOAD_GAP:
        return None
    return (f"note: other work kept {busy:.0%} of the host's CPU busy in column {busiest}, "
            f"{quiet:.0%} in column {quietest}: the speeds compare that load too")


def table(columns: Sequence[Column], width_chars: int = WIDTH_CHARS) -> str:
    """:func:`rows` as aligned text, one line per row, at most ``width_chars`` characters wide.

    At least 110 are needed for the widest cells. When the columns do not fit side by side,
    in pages of as many columns as fit, each with the labels and under a line that says
    which columns it holds (``columns 6-10 of 20``), the ratio (of two runs) on the page of
    the second run, or on its own where the two do not fit. A cell is never cut: a column
    wider than ``width_chars`` with the labels makes a longer line."""
    cells = rows(columns)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    groups = [[index] for index in range(1, len(columns) + 1)]
    if len(widths) > len(columns) + 1:  # the ratio, with the column before it
        groups[-1].append(len(columns) + 1)
        if widths[0] + sum(2 + widths[index] for index in groups[-1]) > width_chars:
            groups[-1:] = [[index] for index in groups[-1]]  # or on a page of its own
    pages: list[list[int]] = [[]]
    used = widths[0]
    for group in groups:
        wide = sum(2 + widths[index] for index in group)
        if pages[-1] and used + wide > width_chars:
            pages.append([])
            used = widths[0]
        pages[-1] += group
        used += wide
    lines: list[str] = []
    for page in pages:
        if len(pages) > 1:
            shown = [index for index in page if index <= len(columns)]
            lines += [""] if lines else []
            lines.append(f"columns {shown[0]}-{shown[-1]} of {len(columns)}"
                         if len(shown) > 1 else f"column {shown[0]} of {len(columns)}"
                         if shown else "ratio (column 2 over column 1)")
        lines += ["  ".join(row[index].ljust(widths[index]) for index in [0, *page])
                  .rstrip() for row in cells]
    return "\n".join(lines)
