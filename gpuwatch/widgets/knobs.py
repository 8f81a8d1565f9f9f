"""The run's knobs: current values, recent changes and commands not applied yet."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import knob_text
from gpuwatch.widgets.panel import Panel

#: A knob whose value changed within this many seconds is highlighted.
RECENT_CHANGE_S = 10.0


def knob_lines(state: RunState, names: Sequence[str], now: float, width: int
               ) -> list[Content]:
    """One line per knob: name, value (highlighted after a recent change) and
    ``-> v (at step N)`` while a command is pending; read ``state`` under the lock.

    Values are aligned in one column, as far right as the longest name needs but no
    further than leaves room for the longest value in ``width`` columns (a longer
    name then takes one space before its value, and is cut if the value would be).

    Args:
        names: the knobs to show, in order. now: monotonic time in s.
        width: the columns of the panel's text.
    """
    values = {name: knob_text(state.knobs.get(name, "?")) for name in names}
    column = min(max((len(name) + 1 for name in names), default=0),
                 width - max((len(value) for value in values.values()), default=0))
    lines = []
    for name in names:
        changed_at = state.knob_changed_at.get(name)
        recent = changed_at is not None and now - changed_at < RECENT_CHANGE_S
        label = name.ljust(column) if len(name) < column else name + " "
        room = width - len(values[name])
        if len(label) > room > 2:  # cut the name rather than the value
            label = name[:room - 2] + "… "
        parts: list[str | tuple[str, str]] = [
            label, (values[name], "bold $success" if recent else "bold")]
        pending = state.pending.get(name)
        if pending is not None:
            at = "" if pending.apply_step is None else f" (at step {pending.apply_step})"
            parts.append((f" -> {knob_text(pending.value)}{at}", "$warning"))
        lines.append(Content.assemble(*parts))
    return lines


class KnobsPanel(Panel):
    """Each knob of the run's schema with its value; ``-> v (at step N)`` while pending.

    Knobs another panel shows (the loader's, in the data panel) are left out.
    """

    BORDER_TITLE = "knobs"

    def show(self, state: RunState, now: float, *, shown_elsewhere: Collection[str] = ()
             ) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            now: monotonic time in s, to tell recent changes.
            shown_elsewhere: knob names to leave out.
        """
        names = [name for name in (list(state.schema) or list(state.knobs))
                 if name not in shown_elsewhere]
        if not names:
            self.set_content(Content.styled(
                "no other knobs" if shown_elsewhere and state.schema else "no knobs yet",
                "$text-muted"))
            return
        self.set_content(Content("\n").join(knob_lines(state, names, now,
                                                        self.text_width)))
