"""The ``?`` screen: every key of the dashboard with what it does."""

from __future__ import annotations

from textual.actions import parse as parse_action
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
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
        keys = [app.get_key_display(binding) for binding in bindings]
        key_width = max(len(key) for key in keys) + 2
        description_width = max(len(binding.description) for binding in bindings) + 2
        parts: list[str | tuple[str, str]] = []
        for key, binding in zip(keys, bindings):
            if parts:
                parts.append("\n")
            parts += [(key.ljust(key_width), "bold $accent"),
                      (binding.description.ljust(description_width), "bold"),
                      binding.tooltip]
        with Vertical(id="help"):
            yield Static(Content.assemble(*parts), id="help-keys")
            yield Static(Content.styled("escape, q or ? closes this screen", "$text-muted"))
