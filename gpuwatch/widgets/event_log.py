"""The event log: commands sent, replies, the run's own events and warnings."""

from __future__ import annotations

import time

from rich.text import Text
from textual import events
from textual.widgets import RichLog

from agent.protocol import printable
from gpuwatch.state import LogEntry

#: Theme variable that colours each log level (info keeps the widget's colour).
LEVEL_COLORS = {"success": "success", "warning": "warning", "error": "error"}


class EventLog(RichLog):
    """A scrolling log; entries are stamped with the local time the run said them
    (the time they were shown, for the dashboard's own lines)."""

    BORDER_TITLE = "events"

    def __init__(self, *, max_lines: int = 1000, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(max_lines=max_lines, wrap=True, markup=False, name=name, id=id,
                         classes=classes)

    def on_resize(self, event: events.Resize) -> None:
        """Keep the newest line in view when the terminal (and so the log) changes size:
        it is the answer to the last key pressed."""
        self.scroll_end(animate=False, immediate=True)

    def add(self, entry: LogEntry) -> None:
        """Append one entry, coloured by its level, its control characters made visible
        (:func:`agent.protocol.printable`)."""
        variable = LEVEL_COLORS.get(entry.level)
        color = self.app.theme_variables.get(variable, "") if variable else ""
        stamp = time.strftime("%H:%M:%S ", time.localtime(entry.t))  # now when t is None
        self.write(Text.assemble((stamp, "dim"), (printable(entry.text), color)))
