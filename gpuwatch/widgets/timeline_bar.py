"""Where a replay on a timeline is.

The step shown, the run as a bar with its knob changes marked, and the next change."""

from __future__ import annotations

from collections.abc import Sequence

from textual.content import Content

from gpuwatch.sources.timeline import Mark
from gpuwatch.units import human_number
from gpuwatch.widgets.panel import Panel

#: Columns the bar takes at least (else it is left out).
MIN_BAR_COLUMNS = 10


class TimelineBar(Panel):
    """``step 1,234 of 5,000 ━━┃━━━●───┃── next: precision=bf16 at 1,669``.

    The bar is the whole run (``●`` the step shown, ``┃`` a knob change, done part bold)."""

    def show(self, steps: Sequence[int], index: int | None, marks: Sequence[Mark]
             ) -> None:
        """Redraw.

        Args:
            steps: the optimizer step of each step index. index: the index shown (None
                while loading or without steps). marks: the timeline's marks.
        """
        if index is None or not steps:
            self.set_content(Content.styled("timeline: reading the run log ..."
                                            if index is None and not steps else
                                            "timeline: no steps in this run log",
                                            "$text-muted"))
            return
        changes = [mark for mark in marks if mark.kind == "change"]
        head = f"step {human_number(steps[index])} of {human_number(steps[-1])} "
        following = next((mark for mark in changes if mark.index > index), None)
        tail = (f" next: {following.label} at {human_number(steps[following.index])}"
                if following is not None else " no later change")
        columns = self.text_width - len(head) - len(tail)
        if columns < MIN_BAR_COLUMNS:
            tail, columns = "", self.text_width - len(head)
        parts: list[str | tuple[str, str]] = [(head, "bold")]
        if columns >= MIN_BAR_COLUMNS:
            last = max(1, len(steps) - 1)
            cells = ["─"] * columns
            for mark in changes:
                cells[min(columns - 1, mark.index * (columns - 1) // last)] = "┃"
            here = min(columns - 1, index * (columns - 1) // last)
            done = "".join("━" if cell == "─" else cell for cell in cells[:here])
            parts += [(done, "$primary"), ("●", "bold $accent"),
                      ("".join(cells[here + 1:]), "$text-muted")]
        parts.append((tail, "$warning" if following is not None else "$text-muted"))
        self.set_content(Content.assemble(*parts))
