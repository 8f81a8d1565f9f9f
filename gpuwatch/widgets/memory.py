"""Memory of the training process: host RSS and, on CUDA, allocated/reserved/peak."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_bytes
from gpuwatch.widgets.panel import Panel

_CUDA_FIELDS = (("allocated", "mem_allocated_bytes"), ("reserved", "mem_reserved_bytes"),
                ("peak rsvd", "mem_peak_reserved_bytes"))


class MemoryPanel(Panel):
    """Memory fields of the latest step record (host RSS; CUDA caching allocator)."""

    BORDER_TITLE = "memory"

    def show(self, state: RunState) -> None:
        """Redraw from ``state`` (read under the source's lock)."""
        step = state.last_step
        if not step:
            self.set_content(Content.styled("no steps yet", "$text-muted"))
            return
        lines = [f"host RSS {human_bytes(step.get('host_rss_bytes')):>10}"]
        if any(key in step for _, key in _CUDA_FIELDS):
            lines += ["CUDA"] + [f"{label:<9}{human_bytes(step.get(key)):>10}"
                                 for label, key in _CUDA_FIELDS]
        else:
            lines.append("no CUDA (CPU run)")
        self.set_content("\n".join(lines))
