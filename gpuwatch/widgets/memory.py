"""Memory of the training process against its device's limit: on CUDA allocated,
reserved and peak reserved (caching allocator) against the GPU's memory; always host
RSS and its peak against the host's memory; and the footprint over the steps."""

from __future__ import annotations

from typing import Any

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_bytes, human_bytes_pair
from gpuwatch.widgets.panel import Panel, sparkline

#: CUDA fields of a step record, with their labels.
CUDA_FIELDS = (("alloc", "mem_allocated_bytes"), ("rsvd", "mem_reserved_bytes"),
               ("peak", "mem_peak_reserved_bytes"))
#: Allocator trouble counters of a step record, when the run reports them.
ALLOCATOR_FIELDS = (("OOMs", "num_ooms"), ("retries", "num_alloc_retries"))


def usage_line(label: str, used: Any, total: Any, width: int, *, label_width: int = 5
               ) -> str:
    """``rsvd  6.0/141.0 GiB (4%)`` when it fits in ``width`` columns, else
    ``rsvd   6.0 GiB   4%`` as tight as it needs; without a total only the amount."""
    if not isinstance(used, (int, float)):
        return f"{label:<{label_width}} -"
    if not isinstance(total, (int, float)) or total <= 0:
        return f"{label:<{label_width}} {human_bytes(used)}"
    percent = f"{used / total:.0%}"
    candidates = (f"{label:<{label_width}} {human_bytes_pair(used, total)} ({percent})",
                  f"{label:<{label_width}}{human_bytes(used):>9} {percent:>4}",
                  f"{label:<{label_width}}{human_bytes(used):>9}{percent:>4}"
                  if len(percent) < 4 else "", f"{label} {human_bytes(used)} {percent}")
    return next((line for line in candidates if line and len(line) <= width),
                candidates[-1])


def device_total_bytes(state: RunState) -> float | None:
    """Memory of the run's GPU (``system.gpus[0].mem_total_bytes``), or None."""
    gpus = (state.system or {}).get("gpus") or ()
    if gpus and isinstance(gpus[0], dict):
        total = gpus[0].get("mem_total_bytes")
        return total if isinstance(total, (int, float)) else None
    return None


class MemoryPanel(Panel):
    """Memory fields of the latest step record against the limits, and a sparkline of
    the footprint per step (peak reserved on CUDA, else host RSS; from 0 to the largest
    shown) so that e.g. turning activation checkpointing on shows as a drop."""

    BORDER_TITLE = "memory"

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.tooltip = ("CUDA: alloc = held by tensors, rsvd = reserved by PyTorch's "
                        "caching allocator, peak = peak reserved as the run reports it "
                        "(since its last reset), as % of the GPU's memory; bars: peak "
                        "reserved per step, from 0 to the largest shown. "
                        "CPU: the training process's RSS and its peak, as % of the "
                        "host's memory; bars: RSS per step.\nc: activation checkpointing "
                        "on/off")

    def show(self, state: RunState) -> None:
        """Redraw from ``state`` (read under the source's lock)."""
        step = state.last_step
        if not step:
            self.set_content(Content.styled("no steps yet", "$text-muted"))
            return
        width = self.text_width
        host_total = (state.system or {}).get("host_mem_total_bytes")
        rss = step.get("host_rss_bytes")
        lines: list[str | Content] = []
        cuda = any(key in step for _, key in CUDA_FIELDS)
        if cuda:
            total = device_total_bytes(state)
            lines += [usage_line(label, step.get(key), total, width)
                      for label, key in CUDA_FIELDS]
            lines.append(_trend([r.mem_peak_reserved_bytes for r in state.steps], width))
            host = f"RSS {human_bytes(rss)}"
            with_peak = f"{host} (peak {human_bytes(state.host_rss_peak_bytes)})"
            lines.append(with_peak if len(with_peak) <= width else host)
        else:
            lines += [usage_line("RSS", rss, host_total, width),
                      usage_line("peak", state.host_rss_peak_bytes, host_total, width),
                      _trend([r.host_rss_bytes for r in state.steps], width),
                      Content.styled("no CUDA (CPU run)", "$text-muted")]
        trouble = [(label, step[key]) for label, key in ALLOCATOR_FIELDS
                   if isinstance(step.get(key), int)]
        if trouble:  # the last line; non-zero counts are in the border too (any size)
            lines.append(Content.styled("  ".join(f"{label} {count}"
                                                  for label, count in trouble),
                                        "bold $error" if any(c for _, c in trouble) else ""))
        self.set_content(Content("\n").join(
            line if isinstance(line, Content) else Content(line) for line in lines))
        subtitle = ", ".join(f"{count} {label}" for label, count in trouble if count)
        if subtitle != (self.border_subtitle or ""):
            self.border_subtitle = subtitle


def _trend(values: list[Any], width: int) -> Content:
    """A labelled sparkline (``per step ▅▆▇``) so that it does not read as a usage bar."""
    label = "per step " if width >= 24 else "steps " if width >= 12 else ""
    return Content.assemble((label, "$text-muted"),
                            (sparkline(values, width - len(label)), "$primary"))
