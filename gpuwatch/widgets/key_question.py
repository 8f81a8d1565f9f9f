"""The question a key that changes the run asks before its command is sent.

What it will do and which keys answer, over the footer's row (as the ``:`` command line is)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.content import Content
from textual.widgets import Static

from agent.wire.protocol import printable


@dataclass(frozen=True)
class Question:
    """A command that waits for its answer.

    Attributes:
        knob, value: the command (as :func:`gpuwatch.client.send_command` takes it).
        described: the command for the event log (``precision=bf16``).
        what: what it will do, for the question (``precision fp32 → bf16 at the next
            step``). brief: a shorter what, where that does not fit (``precision fp32 →
            bf16``).
        key: the key that asked (Textual's name): it, or enter, sends; None (asked from
            the command palette or a click): enter alone.
        asked_at: when it was asked, on Textual's clock (``time.monotonic`` s, as a key
            event's ``time``): a key the terminal delivered before it (typed ahead, in
            the same burst as the key that asked) never answers it.
        then: what to do once it is sent (the search's screen opens after ``T``).
    """

    knob: str
    value: Any
    described: str
    what: str
    key: str | None
    asked_at: float
    then: Callable[[], None] | None = None
    brief: str = ""

    def answered_by(self, key: str, delivered_at: float) -> bool:
        """Whether a key (its name, and its event's ``time``) sends the command."""
        return key in ("enter", self.key) and delivered_at >= self.asked_at


class KeyQuestion(Static):
    """``? <what it will do>  p/enter: send  esc: cancel`` while a question is open.

    On one line: where that does not fit, ``p: send  esc: cancel``, then ``p: yes  esc:
    no``, then the same with its brief what (where none fits, the first, wrapped).
    Hidden otherwise; the app decides what answers it (``GpuwatchApp.on_key``)."""

    def show(self, question: Question | None, key_display: str | None) -> None:
        """Show ``question``, or hide (None).

        ``key_display``: its key as the footer shows it."""
        self.display = question is not None
        if question is None:
            return
        width = self.app.size.width - self.styles.gutter.width  # docked: the screen's
        key = key_display or "enter"
        forms = [(f"{key_display}/enter" if key_display else "enter", "send", "cancel"),
                 (key, "send", "cancel"), (key, "yes", "no")]
        shown = [Content.assemble(("? ", "bold $warning"), (printable(what), "bold"),
                                  "  ", (keys, "bold $accent"), f": {send}  ",
                                  ("esc", "bold $accent"), f": {cancel}")
                 for what in (question.what, question.brief or question.what)
                 for keys, send, cancel in forms]
        # the first that fits on one line; none: the whole, wrapped
        self.update(next((content for content in shown if len(content.plain) <= width),
                         shown[0]))
