"""The one-line run header: run id, name, device, status, step, records missed."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_number
from gpuwatch.widgets.panel import Panel

#: Theme variable that colours each run status.
STATUS_STYLES = {"waiting": "$text-muted", "live": "bold $success",
                 "stalled": "bold $warning", "gone": "bold $error", "ended": "$text-muted"}


class RunHeader(Panel):
    """Who the dashboard watches and whether the run is alive."""

    def show(self, state: RunState, status: str, *, description: str,
             readonly: bool) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            status: the state's status, computed once by the caller.
            description: what the source watches, shown while waiting.
            readonly: whether keys send commands.
        """
        parts: list[str | tuple[str, str]] = [("gpuwatch", "bold $primary"), "  "]
        if status == "waiting":
            parts.append((f"waiting for {description} ...", STATUS_STYLES[status]))
        else:
            parts += [(f"● {status}", STATUS_STYLES[status]), "  ",
                      f"step {human_number(state.step)}", "  "]
            if state.missed or state.malformed:
                parts.append((f"missed {state.missed}" + (
                    f" malformed {state.malformed}" if state.malformed else ""), "$warning"))
            else:
                parts.append("missed 0")
            parts.append(f"  run {state.run_id}")
            for key in ("name", "device"):
                if state.hello.get(key):
                    parts += ["  ", (str(state.hello[key]), "bold" if key == "name" else "")]
        if readonly:
            parts += ["  ", ("read-only", "$warning")]
        self.set_content(Content.assemble(*parts))
