"""A yes/no question over the dashboard, for a key whose command costs the run something
(``s``: a checkpoint, which the training waits for while it is written)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmScreen(ModalScreen[bool]):
    """Asks ``question`` (with ``detail`` under it); dismissed with True for ``y`` or
    enter, False for ``n``, escape or ``q``."""

    BINDINGS = [
        Binding("y,enter", "dismiss(True)", "yes", id="confirm.yes"),
        Binding("n,escape,q", "dismiss(False)", "no", id="confirm.no"),
    ]

    def __init__(self, question: str, detail: str = "", *, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(Content.styled(self.question, "bold"))
            if self.detail:
                yield Static(Content.styled(self.detail, "$text-muted"))
            yield Static(Content.assemble(("y", "bold $accent"), " / enter: yes   ",
                                          ("n", "bold $accent"), " / escape: no"))
