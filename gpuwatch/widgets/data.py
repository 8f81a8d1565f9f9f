"""The input pipeline: is the run waiting for data.

The loader's knobs are in the knobs panel, under ``data``."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.widgets.panel import Panel, sparkline

#: Theme style of each verdict of the agent (``input_verdict`` of a step record).
VERDICT_STYLES = {"input-bound": "$error", "partly input-bound": "$warning",
                  "compute-bound": "$success"}
#: Idle CPU (in cores) from which another DataLoader worker has a core to run on.
IDLE_CORES_FOR_A_WORKER = 0.5


def input_advice(state: RunState, width: int) -> Content | None:
    """For a run waiting on its input: idle CPU for more workers, and what the search tries.

    Whether the host has idle CPU for more DataLoader workers (from the latest ``system``
    sample and the CPUs in ``hello``) and what the search (``T``) would try (with no idle
    CPU: a worker for a compute thread, the trade of
    :data:`agent.search.coordinate.TRADES`); the longest wording that fits ``width``
    columns. None when the run is not waiting on its input, or the numbers are not known
    yet."""
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
        wordings: tuple[str, ...] = (f"{idle:.1f} cores idle: T tries {more}",
                                     f"{idle:.1f} cores idle", "idle CPU")
        style = "$success"
    else:
        threads = state.knobs.get("cpu_threads")
        trade = ([f"no idle CPU ({cpu_pct:.0f}%): T tries a worker more for a compute "
                  "thread fewer"] if type(threads) is int and threads > 1 else [])
        wordings = (*trade, (f"no idle CPU ({cpu_pct:.0f}%): a worker competes with "
                             "compute; T measures it"), f"no idle CPU ({cpu_pct:.0f}%)",
                    "no idle CPU")
        style = "$warning"
    return Content.styled(next((w for w in wordings if len(w) <= width), wordings[-1]),
                          style)


def verdict_texts(state: RunState) -> list[Content]:
    """The agent's input verdict in its colour, in wordings from longest to shortest.

    With the share of step time waiting for data over its window, in shorter wordings after
    it (``compute-bound 1%``, ``compute-bound``, ``wait 1%``: the colour still says the
    verdict); none before the first verdict. The knobs panel's ``data`` heading, when the
    data panel is folded."""
    step = state.last_step
    verdict = step.get("input_verdict")
    if not isinstance(verdict, str):
        return []
    style = VERDICT_STYLES.get(verdict, "")
    share = step.get("data_wait_share_window", step.get("data_wait_share"))
    if not isinstance(share, (int, float)):
        return [Content.styled(verdict, style)]
    return [Content.styled(text, style) for text in (
        f"{verdict} {share:.0%}", verdict, f"wait {share:.0%}")]


class DataPanel(Panel):
    """The agent's input verdict and the share of step time spent waiting for data.

    The verdict (input-bound, partly input-bound, compute-bound) in its colour and, when
    waiting on input, whether idle CPU exists for more workers (:func:`input_advice`); the
    share of step time spent waiting for data, over the agent's window and as one bar per
    step (0-100%). The loader's knobs are in the knobs panel. Folded under 100 columns (its
    verdict then heads the knobs panel's ``data`` group)."""

    BORDER_TITLE = "data"

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.tooltip = ("Share of step time the training loop waited for data: the % "
                        "is over the agent's window (20 steps), the basis of the verdict; "
                        "each bar is one step, from 0 to 100%.\n"
                        "w / W: num_workers -/+ 1, m: pin_memory on/off")

    def show(self, state: RunState) -> None:
        """Redraw from ``state`` (read under the source's lock)."""
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
        self.set_content(Content("\n").join(lines))
