"""The footer: the dashboard's keys on one line.

The same keys in the same order at every size and under every screen, folded by priority
where the line is too short."""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

from textual.binding import Binding
from textual.content import Content
from textual.events import Resize
from textual.screen import Screen
from textual.widgets import Static

#: Where there is room left, the command palette's key, at the right.
PALETTE_ITEM = ("^p", "palette")
#: Columns between two keys where every key fits with them (else one).
WIDE_GAP = 2


class KeyItem(NamedTuple):
    """One entry of the footer: ``keys`` (``aA`` for a -/+ pair) and what they do."""

    keys: str
    description: str
    enabled: bool = True


def fold(items: list[KeyItem], width: int) -> tuple[list[KeyItem], int, bool]:
    """Which items fit in ``width`` columns, from the first, never a word cut.

    The bindings' order is their priority. Returns ``(items, gap, palette)``, where ``gap``
    is the columns between two items (:data:`WIDE_GAP` where all of them fit so, else 1) and
    ``palette`` says whether :data:`PALETTE_ITEM` fits as well, at the right."""
    def length(shown: list[KeyItem], gap: int) -> int:
        return sum(len(item.keys) + 1 + len(item.description) for item in shown) + gap * max(
            len(shown) - 1, 0) + 2  # a column of margin at each end

    palette_length = len(PALETTE_ITEM[0]) + 1 + len(PALETTE_ITEM[1]) + WIDE_GAP
    for gap in (WIDE_GAP, 1):
        if length(items, gap) <= width:
            return items, gap, length(items, gap) + palette_length <= width
    shown = list(items)
    while shown and length(shown, 1) > width:
        shown.pop()
    return shown, 1, False


def key_line(items: list[KeyItem], width: int) -> Content:
    """The footer's line for ``width`` columns (see :func:`fold`).

    Keys bold in the accent colour, descriptions plain, keys that do nothing now dimmed."""
    shown, gap, palette = fold(items, width)
    parts: list[Content | tuple[str, str] | str] = [" "]
    for index, item in enumerate(shown):
        if index:
            parts.append(" " * gap)
        parts.append((item.keys, "bold $accent" if item.enabled else "$text-disabled"))
        parts.append((f" {item.description}", "" if item.enabled else "$text-disabled"))
    line = Content.assemble(*parts)
    if palette:
        tail = Content.assemble((PALETTE_ITEM[0], "bold $accent"), f" {PALETTE_ITEM[1]} ")
        line = Content.assemble(line, " " * (width - line.cell_length - tail.cell_length),
                                tail)
    return line


class KeyBar(Static):
    """The footer: the screen's bindings that ``show``, in the app's order.

    Docked at the bottom of the main screen (the other screens open over the rest of it, so
    it stays as it is under them), a -/+ pair (a compact binding group) as one entry (``aA
    accum``). Redrawn when the bindings change (a knob the run lacks hides its keys) and on
    resize, from the new width at once (never a line cut mid-word)."""

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        #: the screen whose bindings it shows (the one it was mounted on)
        self._own_screen: Screen | None = None

    def on_mount(self) -> None:
        self._own_screen = self.screen
        self._own_screen.bindings_updated_signal.subscribe(self, self._bindings_changed)
        self.call_after_refresh(self.draw)

    def on_unmount(self) -> None:
        if self._own_screen is not None:
            self._own_screen.bindings_updated_signal.unsubscribe(self)

    def on_resize(self, event: Resize) -> None:
        self.draw(event.size.width)

    def _bindings_changed(self, screen: Screen) -> None:
        self.draw()

    def items(self) -> list[KeyItem]:
        """The entries, from the bindings of the screen it was mounted on."""
        screen = self._own_screen or self.screen
        shown = [(binding, enabled) for _, binding, enabled, _ in
                 screen.active_bindings.values() if binding.show]
        # in the app's order (its priority), whatever has focus: the same at every size
        order = {binding.id: index for index, binding in enumerate(self.app.BINDINGS)
                 if isinstance(binding, Binding) and binding.id}
        shown.sort(key=lambda pair: order.get(pair[0].id or "", len(order)))
        items = []
        for group, members in groupby(shown, key=lambda pair: pair[0].group):
            pairs = list(members)
            if group is not None and group.compact and len(pairs) > 1:
                items.append(KeyItem("".join(self.app.get_key_display(b) for b, _ in pairs),
                                     group.description, any(e for _, e in pairs)))
            else:
                items += [KeyItem(self.app.get_key_display(b), b.description, e)
                          for b, e in pairs]
        return items

    def draw(self, width: int | None = None) -> None:
        """Lay the line out again for ``width`` columns (default: its own width)."""
        if self.is_mounted:
            self.update(key_line(self.items(), width or self.size.width or self.app.size.width))
