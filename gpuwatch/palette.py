"""The command palette (ctrl+p): every key binding of the app as a command."""

from __future__ import annotations

from functools import partial

from textual.actions import parse as parse_action
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider


class BindingCommands(Provider):
    """Offers each of the app's bindings that act here, by its description.

    As the help screen lists them; help shows its key."""

    def _commands(self) -> list[tuple[str, str, str]]:
        app = self.app
        return [(binding.description,
                 f"{binding.tooltip} (key {app.get_key_display(binding)})", binding.action)
                for binding in app.BINDINGS if isinstance(binding, Binding)
                and app.check_action(*parse_action(binding.action)[1:]) is not False]

    async def discover(self) -> Hits:
        for title, help_text, action in self._commands():
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in self._commands():
            score = max(matcher.match(title), matcher.match(help_text))
            if score > 0:
                yield Hit(score, matcher.highlight(title),
                          partial(self.app.run_action, action), text=title, help=help_text)
