"""The base of the text panels: a fixed-size Static that redraws only on real change."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


class Panel(Static):
    """A Static whose size never depends on its text (set in the stylesheet), so an
    update needs no layout pass, and an update to the same text and styles is skipped:
    the dashboard calls ``show()`` several times a second."""

    def set_content(self, content: Content | str) -> None:
        """Show ``content`` unless it is what is shown already."""
        content = Content(content) if isinstance(content, str) else content
        current = self.content
        if isinstance(current, Content) and (current.plain, current.spans) == (
                content.plain, content.spans):
            return
        self.update(content, layout=False)
