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
#: Idle CPU (in cores) from which another DataLoader worker has a core to run on.
IDLE_CORES_FOR_A_WORKER = 0.5


def input_advice(state: RunState, width: int) -> Content | None:
    """For a run waiting on its input: whether the host has idle CPU for more DataLoader
    workers (from the latest ``system`` sample and the CPUs in ``hello``) and what the
    search (``T``) would try; the longest wording that fits ``width`` columns. None
    when the run is not waiting on its input, or the numbers are not known yet."""
    if state.last_step.get("input_verdict") not in ("input-bound", "partly input-bound"):
        return None
    cpu_pct = (state.system or {}).get("cpu_pct")
    cpu = ((state.hello.get("env") or {}).get("cpu") or {})
    cores = cpu.get("usable_count") or cpu.get("count")
    if not isinstance(cpu_pct, (int, float)) or not isinstance(cores, int) or cores < 1:
        return None
    idle = max(0.0, 100.0 - cpu_pct) / 100.0 * cores
    workers = state.knobs.get("num_workers")
    more = f"num_workers={workers + 1}" if type(workers) is int else "more workers"
    if idle >= IDLE_CORES_FOR_A_WORKER:
        wordings = (f"{idle:.1f} cores idle: T tries {more}", f"{idle:.1f} cores idle",
                    "idle CPU")
        style = "$success"
    else:
        wordings = ((f"no idle CPU ({cpu_pct:.0f}%): a worker competes with compute; T "
                     "measures it"), f"no idle CPU ({cpu_pct:.0f}%)", "no idle CPU")
        style = "$warning"
    return Content.styled(next((w for w in wordings if len(w) <= width), wordings[-1]),
                          style)


def loader_knobs(state: RunState) -> list[str]:
    """The loader knobs this run has (its schema's, else the values it reported)."""
    known = state.schema or state.knobs
    return [name for name in LOADER_KNOBS if name in known]


class DataPanel(Panel):
    """The agent's verdict (input-bound, partly input-bound, compute-bound) in its
    colour and, when waiting on input, whether idle CPU exists for more workers
    (:func:`input_advice`); the share of step time spent waiting for data, over the
    agent's window and as one bar per step (0-100%); then ``num_workers``,
    ``pin_memory`` and ``prefetch_factor`` when the run has them."""

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
            advice = input_advice(state, self.text_width)
            if advice is not None:
                lines.append(advice)
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
