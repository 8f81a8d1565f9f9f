"""The input pipeline: is the run waiting for data, and the loader's knobs."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.widgets.knobs import knob_lines
from gpuwatch.widgets.panel import Panel, sparkline

#: The loader's knobs, shown here rather than in the knobs panel.
LOADER_KNOBS = ("num_workers", "pin_memory", "prefetch_factor")
#: Theme style of each verdict of the agent (``input_verdict`` of a step record).
VERDICT_STYLES = {"input-bound": "$error", "partly input-bound": "$warning",
                  "compute-bound": "$success"}


def loader_knobs(state: RunState) -> list[str]:
    """The loader knobs this run has (its schema's, else the values it reported)."""
    known = state.schema or state.knobs
    return [name for name in LOADER_KNOBS if name in known]


class DataPanel(Panel):
    """The agent's verdict (input-bound, partly input-bound, compute-bound) in its
    colour; the share of step time spent waiting for data, over the agent's window and
    as one bar per step (0-100%); then ``num_workers``, ``pin_memory`` and
    ``prefetch_factor`` when the run has them."""

    BORDER_TITLE = "data"

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.tooltip = ("Share of step time the training loop waited for data: the % "
                        "is over the agent's window (20 steps), the basis of the verdict; "
                        "each bar is one step, from 0 to 100%.\n"
                        "w / W: num_workers -/+ 1, m: pin_memory on/off")

    def show(self, state: RunState, now: float) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            now: monotonic time in s, to tell recent knob changes.
        """
        step = state.last_step
        verdict = step.get("input_verdict")
        style = VERDICT_STYLES.get(verdict, "") if isinstance(verdict, str) else ""
        shares = [record.data_wait_share for record in state.steps]
        share = step.get("data_wait_share_window", step.get("data_wait_share"))
        lines: list[Content] = []
        if isinstance(verdict, str):
            lines.append(Content.styled(verdict, f"bold {style}".strip()))
        else:
            lines.append(Content.styled("no verdict yet" if step else "no steps yet",
                                        "$text-muted"))
        if step:
            label = "wait " + ("-" if not isinstance(share, (int, float))
                               else f"{share:.0%}") + " "
            bars = sparkline(shares, self.text_width - len(label), high=1.0)
            lines.append(Content.assemble(label, (bars, style)))
        names = loader_knobs(state)
        if names:
            lines += knob_lines(state, names, now, self.text_width)
        elif state.hello:
            lines.append(Content.styled("no loader knobs", "$text-muted"))
        self.set_content(Content("\n").join(lines))
