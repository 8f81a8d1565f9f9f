"""The ``?`` screen: every key of the dashboard with what it does."""

from __future__ import annotations

from textual.actions import parse as parse_action
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static


class HelpScreen(ModalScreen[None]):
    """Lists the app's bindings that act here (key, description, longer help); any
    listed key closes."""

    BINDINGS = [
        Binding("escape,q,question_mark", "dismiss", "close", id="help.close"),
    ]

    def compose(self) -> ComposeResult:
        app = self.app
        bindings = [b for b in app.BINDINGS if isinstance(b, Binding)  # those that act
                    and app.check_action(*parse_action(b.action)[1:]) is not False]
        bindings.append(Binding(app.COMMAND_PALETTE_BINDING, "command_palette",
                                "commands", tooltip="Command palette: search every command"))
        with Vertical(id="help"):
            with Grid(id="help-keys"):  # a long help wraps inside its own column
                for binding in bindings:
                    yield Static(Content.styled(app.get_key_display(binding),
                                                "bold $accent"), classes="key")
                    yield Static(Content.styled(binding.description, "bold"),
                                 classes="description")
                    yield Static(binding.tooltip, classes="help")
            yield Static(Content.styled("escape, q or ? closes this screen", "$text-muted"))
