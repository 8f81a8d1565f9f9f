"""The ``v`` screen of a replay on a timeline: the segments around a knob change, side by side.

The segments before and after the change."""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import ScrollableContainer
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from gpuwatch.compare import Column, load_note, table

#: The share of the screen's width the box may take (the stylesheet's ``max-width``),
#: and the columns its border and padding take.
BOX_WIDTH_SHARE, BOX_FRAME_COLUMNS = 0.95, 6


class CompareScreen(ModalScreen[None]):
    """The figures of two or more segments (:func:`gpuwatch.compare.table`); any listed key closes.

    Under them, :func:`gpuwatch.compare.load_note`'s warning where other work on the host
    differed between them.

    In pages of the columns that fit the screen's width (a number is never cut), in a box
    that the arrow keys and page up / down scroll where it is taller than the screen (a
    segment's title wider than a narrow screen scrolls sideways).

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
        with ScrollableContainer(id="compare") as box:
            box.border_title = self.title
            yield Static(self._table(), id="compare-table")
            note = load_note(self.columns)
            if note is not None:
                yield Static(Content.styled(note, "$warning"), id="compare-note")
            yield Static(Content.styled("escape, q or v closes this screen",
                                        "$text-muted"))

    def on_mount(self) -> None:
        """The keys scroll the box."""
        self.query_one("#compare").focus()

    def _table(self) -> str:
        """The table in lines as wide as the box can show."""
        return table(self.columns, int(self.app.size.width * BOX_WIDTH_SHARE)
                     - BOX_FRAME_COLUMNS)

    def on_resize(self, event: events.Resize) -> None:
        """Page the table again for the new width."""
        self.query_one("#compare-table", Static).update(self._table())
