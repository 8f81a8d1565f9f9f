"""The run's knobs: current values, recent changes and commands not applied yet."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.widgets.panel import Panel

#: A knob whose value changed within this many seconds is highlighted.
RECENT_CHANGE_S = 10.0


class KnobsPanel(Panel):
    """Each knob of the run's schema with its value; ``-> v (at step N)`` while pending."""

    BORDER_TITLE = "knobs"

    def show(self, state: RunState, now: float) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            now: monotonic time in s, to tell recent changes.
        """
        names = list(state.schema) or list(state.knobs)
        if not names:
            self.set_content(Content.styled("no knobs yet", "$text-muted"))
            return
        width = max(len(name) for name in names) + 1
        parts: list[str | tuple[str, str]] = []
        for name in names:
            value = state.knobs.get(name, "?")
            changed_at = state.knob_changed_at.get(name)
            recent = changed_at is not None and now - changed_at < RECENT_CHANGE_S
            if parts:
                parts.append("\n")
            parts += [name.ljust(width), (str(value), "bold $success" if recent else "bold")]
            pending = state.pending.get(name)
            if pending is not None:
                at = "" if pending.apply_step is None else f" (at step {pending.apply_step})"
                parts.append((f" -> {pending.value}{at}", "$warning"))
        self.set_content(Content.assemble(*parts))
