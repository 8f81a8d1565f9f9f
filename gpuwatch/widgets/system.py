"""Host and GPU utilisation from the ~1 Hz ``system`` record."""

from __future__ import annotations

from typing import Any

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_bytes_pair
from gpuwatch.widgets.panel import Panel

_GIB = float(1 << 30)


def _gpu_line(gpu: dict[str, Any]) -> str:
    """One line per GPU, most telling first (lines are cut at the panel's width):
    index, utilisation %, memory used/total GiB, power/limit W, temperature, SM clock."""
    def number(key: str, scale: float = 1.0) -> str:
        value = gpu.get(key)
        return "-" if value is None else f"{value / scale:.0f}"

    power = number("power_w")
    if gpu.get("power_limit_w") is not None:
        power += "/" + number("power_limit_w")
    return (f"{gpu.get('index', '?')} {number('util_pct'):>3}% "
            f"{number('mem_used_bytes', _GIB)}/{number('mem_total_bytes', _GIB)}G "
            f"{power}W {number('temp_c')}°C {number('sm_clock_mhz')}MHz")


def _process_lines(system: dict[str, Any]) -> tuple[str, list[str]]:
    """`` proc 388%`` (the training process's CPU with its child processes': compiler
    and loader workers) and, while they use any, a line ``children 350%`` under it."""
    own, children = system.get("process_cpu_pct"), system.get("children_cpu_pct")
    if not isinstance(own, (int, float)):
        return "", []
    if not isinstance(children, (int, float)) or children < 0.5:
        return f" proc {_percent(own)}", []
    return f" proc {_percent(own + children)}", [f"  children {_percent(children)}"]


def _percent(value: Any) -> str:
    return f"{value:.0f}%" if isinstance(value, (int, float)) else "-"


class SystemPanel(Panel):
    """The host's CPU and memory, then one line per GPU, or why there is no GPU data.

    CPU: the host's (% of all cores) and the training process's (100% = one core)."""

    BORDER_TITLE = "host & GPU"

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._help = self.tooltip = ("CPU: the host, % of all cores; proc: the training "
                                     "process with its child processes (compiler and "
                                     "loader workers: children), 100% = one core busy")

    def show(self, state: RunState) -> None:
        """Redraw from ``state`` (read under the source's lock)."""
        system = state.system
        if system is None:
            self.set_content(Content.styled("no system record yet", "$text-muted"))
            return
        process, children = _process_lines(system)
        lines = [f"CPU {_percent(system.get('cpu_pct'))}{process}", *children,
                 "RAM " + human_bytes_pair(system.get("host_mem_used_bytes"),
                                           system.get("host_mem_total_bytes"))]
        gpus = [gpu for gpu in system.get("gpus") or () if isinstance(gpu, dict)]
        if gpus:
            names = list(dict.fromkeys(str(gpu.get("name", "?")) for gpu in gpus))
            lines.append(f"GPU {', '.join(names)}"
                         + (f" ×{len(gpus)}" if len(names) == 1 and len(gpus) > 1 else ""))
            lines += [_gpu_line(gpu) for gpu in gpus]
        content = Content("\n".join(lines))
        if system.get("gpu_status"):
            status = str(system["gpu_status"])
            room = (self.content_region.height or 5) - len(lines)
            if len(status) > self.text_width * max(room, 1):  # the reason in the tooltip
                self.tooltip = f"{self._help}\n{status}"
                status = status.split(" (")[0]
            content = Content.assemble(content, "\n", (status, "$warning"))
        self.set_content(content)
