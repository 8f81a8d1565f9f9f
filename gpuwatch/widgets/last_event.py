"""One line with the newest entry of the event log, for a terminal too short for the
log itself: the answer to the last key press stays in view at any size."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import LogEntry
from gpuwatch.widgets.event_log import LEVEL_COLORS
from gpuwatch.widgets.panel import Panel


class LastEvent(Panel):
    """``▸ <text>`` of the newest log entry, coloured by its level (the stylesheet shows
    it only where the event log is hidden)."""

    def show(self, entry: LogEntry | None) -> None:
        """Show ``entry`` (None: nothing logged yet)."""
        if entry is None:
            self.set_content(Content.styled("no events yet", "$text-muted"))
            return
        variable = LEVEL_COLORS.get(entry.level)
        self.set_content(Content.assemble(("▸ ", "$text-muted"),
                                          (entry.text, f"${variable}" if variable else "")))
