"""The event log: commands sent, replies, the run's own events and warnings."""

from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual import events
from textual.widgets import RichLog

from agent.wire.protocol import printable
from gpuwatch.state import LogEntry
from gpuwatch.units import local_time

#: Theme variable that colours each log level (info keeps the widget's colour).
LEVEL_COLORS = {"success": "success", "warning": "warning", "error": "error"}


class EventLog(RichLog):
    """A scrolling log of the run's events and the dashboard's answers.

    Entries are stamped with the local time the run said them (the time they were shown, for
    the dashboard's own lines)."""

    BORDER_TITLE = "events"

    def __init__(self, *, max_lines: int = 1000, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        # min_width=1: RichLog renders a line at least 78 cells wide by default, and the
        # cells beyond a narrower log were cut, not wrapped
        super().__init__(max_lines=max_lines, wrap=True, markup=False, min_width=1,
                         name=name, id=id, classes=classes)
        self._entries: deque[Text] = deque(maxlen=max_lines)
        self._wrapped_at = 0

    def on_resize(self, event: events.Resize) -> None:
        """Wrap every entry again at the new width and keep the newest line in view.

        A line keeps the width it was written at; the newest line is the answer to the last
        key pressed."""
        width = self.scrollable_content_region.width
        if width != self._wrapped_at and self._entries:
            self._wrapped_at = width
            super().clear()
            for text in self._entries:
                self.write(text)
        self.scroll_end(animate=False, immediate=True)

    def clear(self) -> EventLog:
        """Remove every entry (a timeline moved: its log is drawn afresh)."""
        self._entries.clear()
        super().clear()
        return self

    def add(self, entry: LogEntry) -> None:
        """Append one entry, coloured by its level, its control characters made visible.

        See :func:`agent.wire.protocol.printable`."""
        variable = LEVEL_COLORS.get(entry.level)
        color = self.app.theme_variables.get(variable, "") if variable else ""
        stamp = local_time(time.time() if entry.t is None else entry.t, "%H:%M:%S") + " "
        text = Text.assemble((stamp, "dim"), (printable(entry.text), color))
        self._entries.append(text)
        self._wrapped_at = self.scrollable_content_region.width
        self.write(text)
