"""The ``v`` screen of a replay on a timeline: the segments around a knob change, side by side.

The segments before and after the change."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from gpuwatch.compare import Column, table


class CompareScreen(ModalScreen[None]):
    """The figures of two or more segments (:func:`gpuwatch.compare.table`).

    Any listed key closes.

    Args:
        columns: the segments, in order.
        title: what is compared, for the border.
    """

    BINDINGS = [
        Binding("escape,q,v", "dismiss", "close", id="compare.close"),
    ]

    def __init__(self, columns: Sequence[Column], title: str) -> None:
        super().__init__()
        self.columns = list(columns)
        self.title = title

    def compose(self) -> ComposeResult:
        with Vertical(id="compare") as box:
            box.border_title = self.title
            yield Static(table(self.columns), id="compare-table")
            yield Static(Content.styled("escape, q or v closes this screen",
                                        "$text-muted"))
