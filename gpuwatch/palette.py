"""The command palette (ctrl+p): the app's key bindings as commands, then the terminal's own.

Every key binding of the app comes first, then the terminal's own commands (theme,
screenshot)."""

from __future__ import annotations

from functools import partial

from textual.actions import parse as parse_action
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider


class BindingCommands(Provider):
    """Offers the app's bindings that act here, by description, then Textual's own commands.

    Each binding by its description; Textual's own are
    :meth:`~textual.app.App.get_system_commands`.

    As the help screen lists them; help shows its key. One provider for both, so that
    the run's commands come first: the palette lists discovered commands in the order
    they arrive, and Textual's own provider would answer first."""

    def _commands(self) -> list[tuple[str, str, str]]:
        app = self.app
        return [(binding.description,
                 f"{binding.tooltip} (key {app.get_key_display(binding)})", binding.action)
                for binding in app.BINDINGS if isinstance(binding, Binding)
                and app.check_action(*parse_action(binding.action)[1:]) is not False]

    async def discover(self) -> Hits:
        for title, help_text, action in self._commands():
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)
        for name, help_text, callback, discover in sorted(
                self.app.get_system_commands(self.screen), key=lambda command: command[0]):
            if discover:
                yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in self._commands():
            score = max(matcher.match(title), matcher.match(help_text))
            if score > 0:
                yield Hit(score, matcher.highlight(title),
                          partial(self.app.run_action, action), text=title, help=help_text)
        for name, help_text, callback, _ in self.app.get_system_commands(self.screen):
            if (score := matcher.match(name)) > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
