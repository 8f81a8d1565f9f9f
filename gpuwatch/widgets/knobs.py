"""The run's knobs: current values, recent changes and commands not applied yet.

The optimizer's as what the steps use (the effective learning rate, the clipping threshold
and the gradient norm)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from textual.content import Content

from agent.wire.knobs import COMMAND_KINDS, DATA, GROUPS, OTHER, STANDARD_KNOBS
from agent.wire.protocol import printable
from gpuwatch.state import RunState
from gpuwatch.units import human_sig, knob_text
from gpuwatch.widgets.panel import Panel

#: A knob whose value changed within this many seconds is highlighted.
RECENT_CHANGE_S = 10.0
#: Longest settings text (a schema's ``detail``) shown after a knob's value.
MAX_DETAIL_CHARS = 60



def optimizer_texts(state: RunState) -> dict[str, str]:
    """What the optimizer's knobs mean for the steps, from the latest step record.

    ``lr_scale`` as the learning rate the last step used (param group 0) and the scale
    (``0.000300 x0.5``), ``max_grad_norm`` as the threshold (``off`` at 0) and the last
    step's gradient norm (``1 norm 0.830``). Read ``state`` under the lock."""
    texts = {}
    step = state.last_step
    scale = state.knobs.get("lr_scale")
    if "lr_scale" in state.knobs:
        lr = step.get("lr")
        parts = [human_sig(lr)] if isinstance(lr, (int, float)) else []
        if scale != 1 or not parts:
            parts.append(f"x{scale:g}" if isinstance(scale, (int, float)) else f"x{scale}")
        texts["lr_scale"] = " ".join(parts)
    if "max_grad_norm" in state.knobs:
        threshold = state.knobs["max_grad_norm"]
        norm = step.get("grad_norm")
        text = "off" if threshold == 0 else (f"{threshold:g}" if isinstance(
            threshold, (int, float)) else str(threshold))
        if isinstance(norm, (int, float)):
            text += f" norm {human_sig(norm)}"
        texts["max_grad_norm"] = text
    return texts


@dataclass(frozen=True)
class _KnobLine:
    """One knob's line in parts: its label, its value (highlighted after a recent
    change), the settings behind the value (``detail``: recover's policy, shown as far
    as it fits and never at a name's cost) and, while a command is on its way, the
    pending value with and without the step it applies at."""

    label: str
    value: str
    recent: bool = False
    pending: str = ""
    pending_at: str = ""
    detail: str = ""

    def width(self, label_width: int, *, at: bool = True) -> int:
        """Columns it takes with its label padded to ``label_width``."""
        return (max(label_width, len(self.label) + 1) + len(self.value) + len(self.pending)
                + (len(self.pending_at) if at else 0))

    def render(self, label_width: int, width: int) -> Content:
        """The line in ``width`` columns (padded), its label padded to ``label_width``.

        The pending step is left out, then the name cut, before the value is."""
        label = self.label.ljust(label_width) if len(self.label) < label_width \
            else self.label + " "
        at = self.pending_at if self.width(label_width) <= width else ""
        room = width - len(self.value) - len(self.pending) - len(at)
        if len(label) > room > 2:  # cut the name rather than the value
            label = self.label[:room - 2] + "… "
        parts: list[str | tuple[str, str]] = [
            label, (self.value, "bold $success" if self.recent else "bold")]
        detail = _detail_in(self.detail, room - len(label))
        if detail:
            parts.append((detail, "$text-muted"))
        if self.pending:
            parts.append((self.pending + at, "$warning"))
        line = Content.assemble(*parts)
        return line.pad_right(width - line.cell_length) if line.cell_length < width \
            else line


def _detail_in(detail: str, room: int) -> str:
    """`` (every 25 x2, 3 steps > 6 MAD)`` in ``room`` columns: its comma-separated parts
    that fit, ``…`` for the rest; "" where not even the first part fits."""
    if not detail:
        return ""
    parts = detail.split(", ")
    for kept in range(len(parts), 0, -1):
        text = " (" + ", ".join(parts[:kept]) + (")" if kept == len(parts) else ", …)")
        if len(text) <= room:
            return text
    return ""


def _knob_line(state: RunState, name: str, now: float, text: str | None) -> _KnobLine:
    changed_at = state.knob_changed_at.get(name)
    pending = state.pending.get(name)
    value = knob_text(state.knobs.get(name, "?"))
    detail = state.schema.get(name, {}).get("detail")
    return _KnobLine(
        label=(_label(name) or name) if text else name,
        value=text or value,
        # the settings behind the value (recover's policy): on (every 25 x2, ...)
        detail=printable(detail, MAX_DETAIL_CHARS) if isinstance(detail, str) and detail
        and value != "off" and not text else "",
        recent=changed_at is not None and now - changed_at < RECENT_CHANGE_S,
        pending="" if pending is None else f" -> {knob_text(pending.value)}",
        pending_at="" if pending is None or pending.apply_step is None
        else f" (at step {pending.apply_step})")


def _label(name: str) -> str:
    """The label of a knob shown as what the steps use (:func:`optimizer_texts`):
    :attr:`agent.wire.knobs.KnobSpec.label`; empty for a knob shown by its name."""
    spec = STANDARD_KNOBS.get(name)
    return spec.label if spec is not None else ""


def _label_width(lines: Sequence[_KnobLine], width: int) -> int:
    """Where the values of ``lines`` start: after the longest label, but no further
    than leaves the longest value room in ``width`` columns."""
    return min(max((len(line.label) + 1 for line in lines), default=0),
               width - max((len(line.value) for line in lines), default=0))


def knob_group(name: str, spec: dict[str, Any]) -> str:
    """The group a knob is listed under: its schema's ``group``, else a standard one's.

    Else the standard knob's of that name (a run whose agent sends none), else ``other``."""
    group = spec.get("group")
    if isinstance(group, str) and group:
        return group
    standard = STANDARD_KNOBS.get(name)
    return standard.group if standard is not None else OTHER


def grouped_knobs(state: RunState) -> list[tuple[str, list[str]]]:
    """The run's settings (not its actions, such as ``checkpoint``) by group, in a fixed order.

    The groups in :data:`agent.wire.knobs.GROUPS` order (others after, in the schema's
    order), in each the standard knobs in their declared order (``lr`` and ``clip`` first
    among the optimizer's), the rest in the schema's; read ``state`` under the lock."""
    names = [name for name in (list(state.schema) or list(state.knobs))
             if state.schema.get(name, {}).get("kind") not in COMMAND_KINDS]
    order = {name: index for index, name in enumerate(
        sorted(STANDARD_KNOBS, key=lambda name: not _label(name)))}
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(knob_group(name, state.schema.get(name, {})), []).append(name)
    rank = {group: index for index, group in enumerate(GROUPS)}
    ordered = sorted(groups.items(), key=lambda item: rank.get(item[0], len(GROUPS)))
    return [(group, sorted(members, key=lambda name: order.get(name, len(order))))
            for group, members in ordered]


#: Columns between two columns of knobs, at least.
COLUMN_GAP = 2
#: The knobs panel flows into at most this many columns.
MAX_COLUMNS = 4
#: A column of knobs is never narrower (where not all fit, one goes instead).
MIN_COLUMN_WIDTH = 14


@dataclass(frozen=True)
class KnobGroup:
    """A group's knobs as the knobs panel lists them.

    Attributes:
        heading: its name (and what follows it: the data group's input verdict).
        lines: its knobs' lines. essential: the heading says more than the group's
            name (a verdict): it stays when the other headings give way.
        shorter: shorter headings, longest first, for a column the heading does not
            fit (it is cut only when none does).
    """

    heading: Content
    lines: tuple[_KnobLine, ...]
    essential: bool = False
    shorter: tuple[Content, ...] = ()

    def heading_in(self, width: int) -> Content:
        """The longest of its headings that fits ``width`` columns (else cut)."""
        heading = next((text for text in (self.heading, *self.shorter)
                        if text.cell_length <= width), self.shorter[-1] if self.shorter
                       else self.heading)
        return heading.truncate(width, ellipsis=True)

    def need(self) -> int:
        """The fewest columns its lines take, each name a space before its value.

        Pending values and what follows the heading's name may be cut."""
        return max((len(line.label) + 1 + len(line.value) for line in self.lines),
                   default=self.heading.cell_length)

    def label_width(self, width: int) -> int:
        """Where its values start in a column of ``width``.

        After its longest name, or as far right as leaves its longest value room."""
        return _label_width(self.lines, width)


# a column's line: a group's heading (the group), or one of its knobs (group, line)
_Cell = tuple[KnobGroup, _KnobLine | None]


def _pack(groups: Sequence[KnobGroup], height: int, *, headings: str
          ) -> list[list[_Cell]]:
    """The groups' lines flowed into columns of ``height`` lines, top to bottom then
    left to right, each under its heading if ``headings`` is ``all`` (``essential``:
    only essential headings; ``none``). A group under a heading that does not fit what
    is left of a column starts the next one if it fits a column (one without goes on
    where the last ended); a heading is never a column's last line."""
    columns: list[list[_Cell]] = [[]]
    for group in groups:
        cells: list[_Cell] = [(group, line) for line in group.lines]
        headed = headings == "all" or (headings == "essential" and group.essential)
        if headed:
            cells.insert(0, (group, None))
        room = height - len(columns[-1])
        if headed and len(cells) > room and columns[-1] and (
                len(cells) <= height or room < 2):
            columns.append([])
        for cell in cells:
            column = columns[-1]
            if len(column) >= height or (
                    cell[1] is None and column and len(column) >= height - 1):
                columns.append([])
            columns[-1].append(cell)
    return [column for column in columns if column]


def _need(column: Sequence[_Cell]) -> int:
    """The fewest columns a column of lines takes (see :meth:`KnobGroup.need`; a
    heading its group's name; the ``+N more`` line all of it)."""
    return max(group.need() if line is not None
               else group.heading.cell_length if not (group.lines or group.essential)
               else len(group.heading.plain.split(" ")[0])  # what follows may be cut
               for group, line in column)


def knob_columns(groups: Sequence[KnobGroup], width: int, height: int) -> list[Content]:
    """The knobs' lines laid out in ``width`` x ``height``, in as few columns as show every knob.

    In as few columns as show every knob under its group's heading; else with only the
    essential headings (the groups still in order); else as many as fit, the last line
    ``+N more (? or :)``."""
    if height < 1 or not groups:
        return []
    for headings in ("all", "essential"):
        columns = _pack(groups, height, headings=headings)
        if not columns:  # no knob, no heading that must stay
            return []
        if len(columns) <= MAX_COLUMNS and sum(map(_need, columns)) + COLUMN_GAP * (
                len(columns) - 1) <= width:
            return _render(columns, width)
    # not all of them fit at their full width: the columns that fit at least
    # MIN_COLUMN_WIDTH (the widest give up columns first: their names are cut before
    # their values), the last line saying how many are not shown
    columns = _pack(groups, height, headings="essential")[:MAX_COLUMNS]
    while len(columns) > 1 and len(columns) * (MIN_COLUMN_WIDTH + COLUMN_GAP) - COLUMN_GAP \
            > width:
        columns.pop()
    left = sum(len(group.lines) for group in groups) - sum(
        line is not None for column in columns for _, line in column)
    if left:  # the last line says how many are not shown (and is one of them)
        left += columns[-1][-1][1] is not None
        columns[-1][-1] = (KnobGroup(Content.styled(f"+{left} more (? or :)",
                                                    "$text-muted"), ()), None)
    cells = [_need(column) for column in columns]
    while sum(cells) + COLUMN_GAP * (len(cells) - 1) > width and max(cells) > 1:
        cells[cells.index(max(cells))] -= 1
    return _render(columns, width, cells)


def _render(columns: list[list[_Cell]], width: int, cells: list[int] | None = None
            ) -> list[Content]:
    """Rows of the columns side by side, in ``cells`` columns each (by default what
    each needs, the width left over shared out between them; one column takes it all);
    each group's values aligned in its column."""
    if cells is None:
        needs = [_need(column) for column in columns]
        spare = max(0, width - sum(needs) - COLUMN_GAP * (len(columns) - 1))
        cells = [need + spare // len(columns) for need in needs]
        cells[-1] = max(0, width - sum(cells[:-1]) - COLUMN_GAP * (len(columns) - 1))
    rows = []
    for row in range(max(len(column) for column in columns)):
        parts: list[Content] = []
        for column, cell in zip(columns, cells):
            if row >= len(column):
                text = Content("")
            else:
                group, line = column[row]
                text = (group.heading_in(cell) if line is None
                        else line.render(group.label_width(cell), cell))
                text = text.truncate(cell, ellipsis=True)
            parts.append(text.pad_right(cell - text.cell_length))
        rows.append(Content(" " * COLUMN_GAP).join(parts).rstrip())
    return rows


class KnobsPanel(Panel):
    """Every setting of the run's schema with its value, under its group, in columns.

    Groups: numerics, kernels & memory, data, optimizer
    (:attr:`agent.wire.knobs.KnobSpec.group`); as many columns as the panel's width needs;
    ``-> v (at step N)`` while pending; ``lr`` (the effective learning rate and
    ``lr_scale``) and ``clip`` (``max_grad_norm`` and the gradient norm) for the
    optimizer's. Commands that are not settings (``checkpoint``) are left out. Where not all
    fit, the last line says how many more (``?``, ``:``).
    """

    BORDER_TITLE = "knobs"

    def show(self, state: RunState, now: float, *, data: Sequence[Content] = ()) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            now: monotonic time in s, to tell recent changes.
            data: what the data group's heading says after its name, longest first
                (the input verdict, when the data panel is folded: see
                :func:`gpuwatch.widgets.data.verdict_texts`).
        """
        groups = grouped_knobs(state)
        if data and DATA not in dict(groups):  # the verdict, for a run without them
            groups.append((DATA, []))
        if not groups:
            self.set_content(Content.styled(
                "no knobs\n(monitor only)" if state.hello else "no knobs yet",
                "$text-muted"))
            return
        texts = optimizer_texts(state)
        blocks = []
        for group, names in groups:
            title = Content.styled(group, "bold $primary")
            headings = [Content.assemble(title, " ", text) for text in data] \
                if group == DATA and data else [title]
            blocks.append(KnobGroup(headings[0], tuple(
                _knob_line(state, name, now, texts.get(name)) for name in names),
                essential=group == DATA and bool(data), shorter=tuple(headings[1:])))
        lines = knob_columns(blocks, self.text_width, self.content_region.height or
                             len(blocks) + sum(len(group.lines) for group in blocks))
        if not any(group.lines for group in blocks):  # the verdict alone
            lines.insert(0, Content.styled("no knobs (monitor only)" if state.hello
                                           else "no knobs yet", "$text-muted"))
        self.set_content(Content("\n").join(lines))
