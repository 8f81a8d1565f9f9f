"""The newest entry of the event log on one line, and the warnings not read yet.

For a terminal too short for the log itself (the answer to the last key press stays in view
at any size), and the warnings and errors not read yet, whole, at any size."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterable

from textual.content import Content
from textual.timer import Timer

from gpuwatch.state import LogEntry
from gpuwatch.units import fit_paths
from gpuwatch.widgets.event_log import LEVEL_COLORS
from gpuwatch.widgets.panel import Panel

#: A warning or error stays on the line until this many seconds after the first key
#: pressed once it was shown (a key pressed as it came is no sign that it was read).
HOLD_AFTER_KEY_S = 3.0
#: Warnings and errors held at most (the newest; the event log has them all).
MAX_HELD = 2
#: Lines one held entry takes at most (it wraps; a longer one ends in …).
MAX_HELD_LINES = 4
#: The levels that are held.
HELD_LEVELS = frozenset({"warning", "error"})


class LastEvent(Panel):
    """``▸ <text>`` of the newest log entry, coloured by its level.

    The stylesheet shows it where the event log is hidden.

    A warning or error is held: it stays, whole (wrapped), until :data:`HOLD_AFTER_KEY_S`
    after the next key, whatever comes after it, and the line shows it at every size
    (class ``-held``). Until that key the held ones are all the line shows (a short
    terminal's charts keep their rows); from it, the newest entry under them, the
    answer to the key."""

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        #: the warnings and errors shown, each with when it goes (monotonic s; None:
        #: no key pressed since it came)
        self._held: list[tuple[LogEntry, float | None]] = []
        self._newest: LogEntry | None = None
        self._progress: str | None = None
        self._log_shown = False
        self._rows = 1  # lines shown: the layout is redone when they change
        #: the hold's clock (monotonic s); a test replaces it to move the hold's time by hand
        self.now: Callable[[], float] = time.monotonic
        self._wake: Timer | None = None  # the timer for the first hold due (None: none)

    def show(self, newest: LogEntry | None, new: Iterable[LogEntry] = (), *,
             log_shown: bool = False, progress: str | None = None) -> None:
        """Show ``newest``, and hold each warning or error of ``new``.

        ``newest`` None: nothing logged yet; ``new``: the entries logged since the last
        call. ``log_shown``: the event log is in view (it shows the newest entry: this line
        then shows only what it holds). ``progress``: what the run is doing now (a
        compile's progress, longer than the header has room for), shown instead of the
        newest entry."""
        self._held += [(entry, None) for entry in new if entry.level in HELD_LEVELS]
        del self._held[:-MAX_HELD]
        self._newest, self._log_shown, self._progress = newest, log_shown, progress
        self._draw()

    def key_pressed(self) -> None:
        """A key was pressed: what is held goes :data:`HOLD_AFTER_KEY_S` from now."""
        if any(due is None for _, due in self._held):
            until = self.now() + HOLD_AFTER_KEY_S
            self._held = [(entry, until if due is None else due)
                          for entry, due in self._held]
            if self._wake is None:
                self._wake = self.set_timer(HOLD_AFTER_KEY_S, self._hold_due)
            self._draw()  # the newest entry under them: the answer to this key

    def _hold_due(self) -> None:
        """The hold's timer: what is due by :attr:`now` goes, and the timer is set again
        for the next one due (a later key's, or one :attr:`now` says is not due yet)."""
        self._wake = None
        self._draw()
        dues = [due for _, due in self._held if due is not None]
        if dues:
            self._wake = self.set_timer(max(min(dues) - self.now(), 0.0), self._hold_due)

    def on_resize(self) -> None:
        """Wrap what is held again at the new width.

        First shown at a tall terminal's size, the line had none."""
        self._draw()

    def _draw(self) -> None:
        """Show what is held and not yet due, and the newest entry (see the class)."""
        now = self.now()
        self._held = [(entry, due) for entry, due in self._held if due is None or due > now]
        lines = [self._line(entry, wrap=True) for entry, _ in self._held]
        answer = all(due is not None for _, due in self._held)  # a key since they came
        if self._progress is not None and not self._log_shown and answer:
            lines.append(Content.assemble(("▸ ", "$text-muted"),
                                          (self._progress, "$warning")))
        elif self._newest is not None and not self._log_shown and answer and (
                not self._held or self._newest is not self._held[-1][0]):
            lines.append(self._line(self._newest, wrap=False))
        elif not lines:
            lines.append(Content.styled("no events yet", "$text-muted"))
        self.set_class(bool(self._held), "-held")
        content = Content("\n").join(lines)
        rows = len(content.plain.split("\n"))
        self.set_content(content, layout=rows != self._rows)
        self._rows = rows

    def _line(self, entry: LogEntry, *, wrap: bool) -> Content:
        """``▸ text`` in the entry's colour: on one line (its paths shortened from the
        middle, :func:`~gpuwatch.units.fit_paths`; the stylesheet cuts the rest), or
        wrapped to the width in at most :data:`MAX_HELD_LINES` lines."""
        variable = LEVEL_COLORS.get(entry.level)
        style = f"${variable}" if variable else ""
        if not wrap:  # a path keeps its file name (the event log has it whole)
            return Content.assemble(("▸ ", "$text-muted"), (fit_paths(
                " ".join(entry.text.splitlines()), self.text_width - 2), style))
        width = max(self.text_width - 2, 10)
        lines = textwrap.wrap(entry.text, width, max_lines=MAX_HELD_LINES,
                              placeholder=" …") or [""]
        return Content.assemble(("▸ ", "$text-muted"), ("\n  ".join(lines), style))
