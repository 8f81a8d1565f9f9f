"""Memory of the training process against its device's limit, activation memory, the footprint.

On CUDA allocated, reserved and peak reserved (caching allocator) against the GPU's memory;
always host RSS and its peak against the host's memory; the activation memory (bytes saved
for backward) and what it was before the last change; and the footprint over the steps."""

from __future__ import annotations

from typing import Any

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import counted, human_bytes, human_bytes_pair
from gpuwatch.widgets.panel import Panel, bucket_max, sparkline

#: CUDA fields of a step record, with their labels.
CUDA_FIELDS = (("alloc", "mem_allocated_bytes"), ("rsvd", "mem_reserved_bytes"),
               ("peak", "mem_peak_reserved_bytes"))
#: Allocator trouble counters of a step record, when the run reports them.
ALLOCATOR_FIELDS = (("OOMs", "num_ooms"), ("retries", "num_alloc_retries"))


def usage_line(label: str, used: Any, total: Any, width: int, *, label_width: int = 5
               ) -> str:
    """``rsvd  6.0/141.0 GiB (4%)`` when it fits in ``width`` columns, else tighter.

    Else ``rsvd   6.0 GiB   4%`` as tight as it needs; without a total only the amount."""
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
    """Memory fields of the latest step record against the limits, and the footprint over the steps.

    The activation memory too, and a sparkline of the footprint over the kept steps (peak
    reserved on CUDA; on a CPU the activation memory, else host RSS; each column the largest
    of its steps, from 0 to the largest shown) so that e.g. turning activation checkpointing
    on shows as a drop."""

    BORDER_TITLE = "memory"

    def __init__(self, *, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.tooltip = ("CUDA: alloc = held by tensors, rsvd = reserved by PyTorch's "
                        "caching allocator, peak = peak reserved as the run reports it "
                        "(since its last reset), as % of the GPU's memory; bars: peak "
                        "reserved over the kept steps (each bar the largest of its "
                        "steps), from 0 to the largest shown. "
                        "CPU: the training process's RSS and its peak, as % of the "
                        "host's memory; bars: activation memory over the kept steps (RSS "
                        "when the run does not measure it).\nactiv = bytes saved for backward "
                        "by one micro-batch (activations; parameters not counted), "
                        "measured every few steps and after each change; 'was' = "
                        "before the last change.\nc: activation checkpointing on/off")

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
            if state.activation_bytes is not None:
                lines.append(activation_line(state, width))
        else:
            lines += [usage_line("RSS", rss, host_total, width),
                      usage_line("peak", state.host_rss_peak_bytes, host_total, width)]
            if state.activation_bytes is None:
                lines.append(_trend([r.host_rss_bytes for r in state.steps], width))
            else:  # the measurements reach further back than the step records
                history = state.activation_history
                first, last = history[0][0], history[-1][0]
                span = last - first + 1 if first is not None and last is not None else None
                lines += [activation_line(state, width),
                          _trend([value for _, value in history], width, steps=span)]
            lines.append(Content.styled("no CUDA (CPU run)", "$text-muted"))
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


def activation_line(state: RunState, width: int, *, label_width: int = 5) -> Content:
    """``activ  2.4 MiB was 17.5 MiB``: the activation memory, and before the last change.

    The measurement before the last change, when there was one and it fits; else
    ``activ  2.4 MiB``; ``activ  - (compile)`` while the run is compiled (it is not measured
    then: a value shown would be stale). Needs ``state.activation_bytes``."""
    label = f"{'activ':<{label_width}}"
    if state.knobs.get("kernels") == "compile":
        text = " - (not measured under compile)" if width >= 37 else " - (compile)"
        return Content.assemble(label, (text, "$text-muted"))
    now = f" {human_bytes(state.activation_bytes)}"
    before = state.activation_before_bytes
    if before is not None:
        was = f" was {human_bytes(before)}"
        if len(label) + len(now) + len(was) <= width:
            return Content.assemble(label, (now, "bold"), (was, "$text-muted"))
    return Content.assemble(label, (now, "bold"))


def _trend(values: list[Any], width: int, *, steps: int | None = None) -> Content:
    """A labelled sparkline of a whole history (``last 600 steps ▅▆▇▁▁``; the largest
    value of each column's values) so that it does not read as a usage bar and a change
    stays in view for minutes, not only for the last few dozen steps. ``steps``: the
    steps the values span (default: one value per step)."""
    steps = len(values) if steps is None else steps
    label = f"last {counted(steps, 'step')} " if width >= 28 else "trend "  # never a bare bar
    columns = bucket_max(values, width - len(label))
    return Content.assemble((label, "$text-muted"), (sparkline(columns, len(columns)),
                                                      "$primary"))
