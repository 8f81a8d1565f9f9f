"""The ``:`` command line: type ``accum_steps=8`` or ``kernels=compile``, with completion.

Completed from the run's knob schema, sent as ``gpuwatch set`` sends it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from textual.binding import Binding
from textual.suggester import Suggester
from textual.widgets import Input

from gpuwatch.units import knob_text


def completions(schema: Mapping[str, Mapping[str, Any]], knobs: Mapping[str, Any]
                ) -> list[str]:
    """What may be typed, from a run's schema: ``knob=``, then ``knob=value`` for each value known.

    ``knob=`` for every knob, then ``knob=value`` for each value a choice, bool or action
    knob takes (choices the run cannot run here left out), and ``knob=<current>`` for a
    number knob."""
    names = [f"{name}=" for name in schema]
    values = []
    for name, spec in schema.items():
        unavailable = spec.get("unavailable") or {}
        if spec.get("kind") == "bool":
            values += [f"{name}=on", f"{name}=off"]
        elif spec.get("choices"):
            values += [f"{name}={choice}" for choice in spec["choices"]
                       if choice not in unavailable]
        elif name in knobs:
            values.append(f"{name}={knob_text(knobs[name])}")
    return names + values


class SchemaSuggester(Suggester):
    """Completes a command from the run's schema as it is now.

    ``source`` gives the schema and the knob values, read under the source's lock by the
    caller."""

    def __init__(self, source: Callable[[], tuple[Mapping[str, Any], Mapping[str, Any]]]
                 ) -> None:
        super().__init__(use_cache=False, case_sensitive=True)
        self._source = source

    async def get_suggestion(self, value: str) -> str | None:
        if not value:
            return None
        schema, knobs = self._source()
        if "=" in value:  # a value: the knob's own choices (the first that fits)
            candidates = [c for c in completions(schema, knobs) if not c.endswith("=")]
        else:
            candidates = [c for c in completions(schema, knobs) if c.endswith("=")]
        return next((c for c in candidates if c.startswith(value) and c != value), None)


class CommandLine(Input):
    """A one-line text box shown by ``:``; enter sends (the app decides), escape closes.

    Tab or right takes the completion shown in grey."""

    BINDINGS = [
        Binding("tab", "cursor_right", "complete", show=False),
        Binding("escape", "close", "close", show=False),
    ]

    def action_close(self) -> None:
        """Hide it unsent."""
        self.value = ""
        self.display = False
        self.app.set_focus(None)
