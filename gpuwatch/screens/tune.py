"""The ``t`` / ``T`` screen: the in-run search, each candidate and why it was kept or reverted."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from agent.wire.knobs import assignment
from gpuwatch.state import RunState
from gpuwatch.units import human_number
from gpuwatch.widgets.panel import safe_content

#: Theme style of each candidate state.
STATE_STYLES = {"kept": "bold $success", "reverted": "$warning", "skipped": "$text-muted",
                "measuring": "bold $accent"}


#: Width of the candidates' setting column (a row fits 66 columns: the screen at 80,
#: its scroll bar included); a longer setting (a trade of two knobs) has a line of its
#: own above its numbers.
SETTING_WIDTH = 22
#: ... on a narrow screen (:func:`tune_text`'s ``narrow``: 60 columns).
NARROW_SETTING_WIDTH = 16


def setting_text(candidate: dict[str, Any]) -> str:
    """A candidate's setting as ``num_workers=1, cpu_threads=1`` (``?`` if it has none)."""
    setting = candidate.get("setting")
    if not isinstance(setting, dict) or not setting:
        return "?"
    return ", ".join(assignment(str(knob), value) for knob, value in setting.items())


def row_width(unit: str) -> int:
    """Columns a candidate's line of figures takes with the 95% half-widths (``unit``/s)."""
    return SETTING_WIDTH + 1 + 15 + 1 + len(unit) + 2 + 1 + 11 + 1 + 5


def gain_text(gain: float, spread: float) -> str:
    """A trial's gain over the best with its 95% half-width, in at most 11 characters.

    ``gain``, ``spread``: 1.0 = 100%. ``+12% ± 37%``; where the half-width is 100% or
    more, ``±>100%`` alone (a noisy trial's "+1301% ± 5081%" said nothing and pushed its
    steps onto a line of their own; its verdict's line gives the figures); a gain past
    999% as ``+>999%`` alone."""
    if abs(spread) >= 0.995:
        return "±>100%"
    if abs(gain) >= 9.995:
        return f"{'+' if gain > 0 else '-'}>999%"
    return f"{gain:+.0%} ± {abs(spread):.0%}"


def candidate_line(candidate: dict[str, Any], unit: str, *, narrow: bool = False) -> Content:
    """One candidate, in two lines: its setting and figures, then its state and reason.

    The first line: setting, throughput with its 95% half-width, gain over the best then
    (with its own) and steps spent; ``narrow`` (a screen narrower than :func:`row_width`):
    without the half-widths, which the verdict's line still gives, and the setting in
    :data:`NARROW_SETTING_WIDTH`. A setting longer than :data:`SETTING_WIDTH` (narrow: its
    own) is on a line of its own above the rest."""
    setting = setting_text(candidate)
    setting_width = NARROW_SETTING_WIDTH if narrow else SETTING_WIDTH
    if len(setting) > setting_width:
        setting = f"{setting}\n{'':<{setting_width}}"
    per_s, spread = candidate.get("per_s"), candidate.get("per_s_spread")
    rate = (f"{human_number(per_s)} ± {human_number(spread)}" if isinstance(per_s, (int, float))
            and isinstance(spread, (int, float)) else "-")
    gain, gain_spread = candidate.get("gain"), candidate.get("gain_spread")
    change = (gain_text(gain, gain_spread) if isinstance(gain, (int, float))
              and isinstance(gain_spread, (int, float)) else "")
    if narrow:
        rate = rate.split(" ± ")[0]
        change = change.split(" ± ")[0]
    steps = candidate.get("steps")
    state = str(candidate.get("state", "?"))
    reason = str(candidate.get("reason") or "")
    rate_width, change_width = (7, 6) if narrow else (15, 11)
    return Content.assemble(  # the verdict on a line of its own: it wraps, never cut
        f"{setting:<{setting_width}} {rate:>{rate_width}} {unit}/s {change:>{change_width}} "
        f"{steps if isinstance(steps, int) else '-':>5}\n    ",
        (state, STATE_STYLES.get(state, "")), f": {reason}" if reason else "")


def tune_text(state: RunState, width: int = 0) -> Content:
    """The whole screen's text from the run's latest ``tune`` record, as it comes.

    ``width``: the columns it is shown in (0: unknown); below :func:`row_width` the
    candidates' figures leave their 95% half-widths out, so that a row does not wrap
    (at 60 columns its header and every row broke in two). The screen makes it safe to
    show (:func:`gpuwatch.widgets.panel.safe_content`)."""
    tune = state.tune
    if tune is None:
        return Content.styled("no search yet: T starts one (the run tries its speed "
                              "settings and keeps what is faster beyond noise)",
                              "$text-muted")
    unit = str(tune.get("unit") or "samples")
    best = tune.get("best") or {}
    gain = tune.get("gain")
    status = str(tune.get("status", "?"))
    candidates = tune.get("candidates") or ()
    narrow = 0 < width < row_width(unit)
    lines = [
        Content.assemble((f"{status}", STATE_STYLES.get("measuring" if status == "running"
                                                        else "kept", "")),
                         f" at step {tune.get('step')}: {tune.get('steps')} of "
                         f"{tune.get('budget_steps')} steps spent; searching "
                         + ", ".join(map(str, tune.get("knobs") or ()))),
        Content.assemble("best: ", (", ".join(assignment(k, v) for k, v in best.items()),
                                    "bold"),
                         f" ({gain:+.0%} {unit}/s over the start)"
                         if isinstance(gain, (int, float)) else ""),
        *([Content.styled(str(tune["text"]), "bold $success")] if tune.get("text")
          else []),  # the result, under the best: seen without scrolling
        Content.styled((f"{'candidate':<{NARROW_SETTING_WIDTH}} "
                        f"{unit + '/s':>{len(unit) + 10}} {'gain':>6} " if narrow else
                        f"{'candidate':<{SETTING_WIDTH}} "
                        f"{unit + '/s ± 95%':>{len(unit) + 18}} {'gain':>11} ")
                       + f"{'steps':>5}\n    verdict", "$text-muted"),
    ]
    lines += [candidate_line(candidate, unit, narrow=narrow) for candidate in candidates]
    return Content("\n").join(lines)


class TuneScreen(ModalScreen[None]):
    """The search's state, redrawn by the app from the run's ``tune`` records.

    ``T`` starts or stops a search (the dashboard's key: this screen closes, and opens again
    once it is sent), escape or ``t`` closes."""

    BINDINGS = [
        Binding("escape,t,q", "dismiss", "close", id="tune.close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="tune"):  # focused: the arrow keys scroll a long list
            yield Static(id="tune-table")
            yield Static(Content.styled("T starts or stops the search (the best so far "
                                        "stays); escape closes", "$text-muted"))

    #: the :attr:`RunState.version` last shown (None: not yet), and the width it was for
    shown_version: int | None = None
    _shown_width = 0

    def show(self, state: RunState) -> None:
        """Redraw from ``state`` (read under the source's lock) if it changed (or the width)."""
        if not self.is_mounted:
            return
        table = self.query_one("#tune-table", Static)
        width = table.content_region.width
        if (state.version, width) != (self.shown_version, self._shown_width):
            self.shown_version, self._shown_width = state.version, width
            table.update(safe_content(tune_text(state, width)))
