"""The run's knobs: current values, recent changes and commands not applied yet; the
optimizer's as what the steps use (the effective learning rate, the clipping threshold
and the gradient norm)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_sig, knob_text
from gpuwatch.widgets.panel import Panel

#: A knob whose value changed within this many seconds is highlighted.
RECENT_CHANGE_S = 10.0


#: Knobs shown under another label, as what the steps use (see :func:`optimizer_texts`).
SHOWN_AS = {"lr_scale": "lr", "max_grad_norm": "clip"}
#: Knobs shown first, in this order (the ones people change most; ``lr`` and ``clip``
#: are aligned as a block of their own); the rest follow in the schema's order.
FIRST = ("precision", "accum_steps", "lr_scale", "max_grad_norm")


def optimizer_texts(state: RunState) -> dict[str, str]:
    """What the optimizer's knobs mean for the steps, from the latest step record:
    ``lr_scale`` as the learning rate the last step used (param group 0) and the scale
    (``0.000300 x0.5``), ``max_grad_norm`` as the threshold (``off`` at 0) and the last
    step's gradient norm (``1 norm 0.830``). Read ``state`` under the lock."""
    texts = {}
    step = state.last_step
    scale = state.knobs.get("lr_scale")
    if "lr_scale" in state.knobs:
        lr = step.get("lr")
        parts = [human_sig(lr)] if isinstance(lr, (int, float)) else []
        if scale != 1 or not parts:
            parts.append(f"x{scale:g}" if isinstance(scale, (int, float)) else f"x{scale}")
        texts["lr_scale"] = " ".join(parts)
    if "max_grad_norm" in state.knobs:
        threshold = state.knobs["max_grad_norm"]
        norm = step.get("grad_norm")
        text = "off" if threshold == 0 else (f"{threshold:g}" if isinstance(
            threshold, (int, float)) else str(threshold))
        if isinstance(norm, (int, float)):
            text += f" norm {human_sig(norm)}"
        texts["max_grad_norm"] = text
    return texts


def knob_lines(state: RunState, names: Sequence[str], now: float, width: int, *,
               texts: dict[str, str] | None = None) -> list[Content]:
    """One line per knob: name, value (highlighted after a recent change) and
    ``-> v (at step N)`` while a command is pending; read ``state`` under the lock.

    Values are aligned in one column, as far right as the longest name needs but no
    further than leaves room for the longest value in ``width`` columns (a longer
    name then takes one space before its value, and is cut if the value would be).

    Args:
        names: the knobs to show, in order. now: monotonic time in s.
        width: the columns of the panel's text.
        texts: a knob's line in another form, by name: labelled as in
            :data:`SHOWN_AS` with this text as its value (see :func:`optimizer_texts`).
    """
    texts = texts or {}
    labels = {name: SHOWN_AS.get(name, name) if name in texts else name for name in names}
    values = {name: texts.get(name) or knob_text(state.knobs.get(name, "?"))
              for name in names}
    column = min(max((len(label) + 1 for label in labels.values()), default=0),
                 width - max((len(value) for value in values.values()), default=0))
    lines = []
    for name in names:
        changed_at = state.knob_changed_at.get(name)
        recent = changed_at is not None and now - changed_at < RECENT_CHANGE_S
        label = labels[name]
        label = label.ljust(column) if len(label) < column else label + " "
        room = width - len(values[name])
        if len(label) > room > 2:  # cut the name rather than the value
            label = labels[name][:room - 2] + "… "
        parts: list[str | tuple[str, str]] = [
            label, (values[name], "bold $success" if recent else "bold")]
        pending = state.pending.get(name)
        if pending is not None:
            at = "" if pending.apply_step is None else f" (at step {pending.apply_step})"
            parts.append((f" -> {knob_text(pending.value)}{at}", "$warning"))
        lines.append(Content.assemble(*parts))
    return lines


class KnobsPanel(Panel):
    """Each knob of the run's schema with its value; ``-> v (at step N)`` while pending;
    ``lr`` (the effective learning rate and ``lr_scale``) and ``clip`` (``max_grad_norm``
    and the gradient norm) for the optimizer's.

    Knobs another panel shows (the loader's, in the data panel) and commands that are not
    settings (``checkpoint``) are left out.
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
                 if name not in shown_elsewhere
                 and state.schema.get(name, {}).get("kind") != "action"]
        if not names:
            self.set_content(Content.styled(
                "no other knobs" if shown_elsewhere and state.schema else
                "no knobs\n(monitor only)" if state.hello else "no knobs yet",
                "$text-muted"))
            return
        names.sort(key=lambda name: FIRST.index(name) if name in FIRST else len(FIRST))
        plain = [name for name in names if name not in SHOWN_AS]
        lines = knob_lines(state, plain, now, self.text_width)
        at = sum(name in FIRST for name in plain)  # after precision and accum_steps
        lines[at:at] = knob_lines(state, [name for name in names if name in SHOWN_AS], now,
                                  self.text_width, texts=optimizer_texts(state))
        room = self.content_region.height
        if room and len(lines) > room:  # say what is cut, and where the rest is
            lines[room - 1:] = [Content.styled(f"+{len(lines) - room + 1} more (? or :)",
                                               "$text-muted")]
        self.set_content(Content("\n").join(lines))
