"""The Textual dashboard: one screen of charts and panels for one run, plus its keys."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer
from textual.worker import Worker, WorkerState, get_current_worker

from agent import protocol
from agent.knobs import assignment
from gpuwatch.client import new_command_id, reply_text, send_command
from gpuwatch.palette import BindingCommands
from gpuwatch.sources import Source
from gpuwatch.state import GONE_AFTER_S, STALLED_AFTER_S
from gpuwatch.widgets.data import DataPanel, loader_knobs
from gpuwatch.widgets.event_log import EventLog
from gpuwatch.widgets.header import RunHeader
from gpuwatch.widgets.help_screen import HelpScreen
from gpuwatch.widgets.knobs import KnobsPanel
from gpuwatch.widgets.memory import MemoryPanel
from gpuwatch.widgets.step_chart import LOSS, TIMING, StepChart
from gpuwatch.widgets.system import SystemPanel
from gpuwatch.widgets.throughput import ThroughputBar
from gpuwatch.widgets.tune import TuneScreen

#: Seconds between checks for new records; the screen is redrawn only when they changed.
REDRAW_S = 0.2
#: The charts (plotext renders in pure Python, ~10 ms each) are redrawn at most this often.
CHART_REDRAW_S = 0.5

#: The footer shows each -/+ pair of keys once, with one description.
_ACCUM = Binding.Group("accum", compact=True)
_WORKERS = Binding.Group("workers", compact=True)
#: Under this many columns the footer is compact (no padding around keys, no ctrl+p).
COMPACT_FOOTER_BELOW = 100

#: What the event log says when the run's status changes to each of these.
_STATUS_NOTES = {
    "live": ("info", "run is live"),
    "stalled": ("warning", f"run is stalled: no optimizer step for {STALLED_AFTER_S:g} s"),
    "gone": ("error", f"run is gone: nothing heard for {GONE_AFTER_S:g} s"),
}


#: The actions that send a command.
_KNOB_ACTIONS = frozenset({"cycle", "step", "toggle"})


class GpuwatchApp(App[None]):
    """The dashboard of one run.

    Args:
        source: where records come from; started on mount, closed on unmount.
        readonly: when True, keys log what they would send and send nothing.
        notes: lines for the event log at start (e.g. where a demo writes its output).
    """

    CSS_PATH = "gpuwatch.tcss"
    TITLE = "gpuwatch"
    COMMANDS = App.COMMANDS | {BindingCommands}
    VERTICAL_BREAKPOINTS = [(0, "-tiny"), (24, "-short"), (32, "-tall")]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    BINDINGS = [
        Binding("p", "cycle('precision')", "precision", id="precision.cycle",
                tooltip="Cycle precision fp32 -> bf16 -> fp16 (the run's choices)"),
        Binding("a", "step('accum_steps', -1)", "accum-", id="accum_steps.decrease",
                tooltip="accum_steps - 1 (micro-batches per optimizer step)", group=_ACCUM),
        Binding("A", "step('accum_steps', 1)", "accum+", id="accum_steps.increase",
                tooltip="accum_steps + 1 (micro-batches per optimizer step)", group=_ACCUM),
        Binding("w", "step('num_workers', -1)", "workers-", id="num_workers.decrease",
                tooltip="num_workers - 1 (DataLoader worker processes)", group=_WORKERS),
        Binding("W", "step('num_workers', 1)", "workers+", id="num_workers.increase",
                tooltip="num_workers + 1 (DataLoader worker processes)", group=_WORKERS),
        Binding("m", "toggle('pin_memory')", "pin", id="pin_memory.toggle",
                tooltip="pin_memory on/off (page-locked host batches, faster copies to "
                        "the GPU)"),
        Binding("k", "cycle('kernels')", "kernels", id="kernels.cycle",
                tooltip="Cycle kernels eager -> compile -> triton (the run's choices)"),
        Binding("c", "toggle('checkpointing')", "ckpt", id="checkpointing.toggle",
                tooltip="Activation checkpointing on/off (less memory, more compute)"),
        Binding("T", "tune", "tune", id="tune",
                tooltip="Start the in-run search for the fastest safe configuration (the "
                        "run tries its speed settings and keeps what is faster); again: "
                        "stop it, keeping the best"),
        Binding("t", "show_tune", "search", id="tune.show", show=False,
                tooltip="Show the search: each candidate, its throughput, kept or why not"),
        Binding("question_mark", "help", "help", id="help",
                tooltip="Show this list of keys"),
        Binding("q", "quit", "quit", id="quit",
                tooltip="Quit the dashboard (a run goes on; a `gpuwatch demo` run stops)"),
    ]

    def __init__(self, source: Source, *, readonly: bool = False,
                 notes: Iterable[str] = ()) -> None:
        super().__init__()
        self.source = source
        self.readonly = readonly
        self._notes = list(notes)
        self._drawn: tuple[int, str, Any] | None = None
        self._charts_drawn = (-1, 0.0)  # (state.steps_total, monotonic s) at the last draw
        self._events_shown = 0
        self._knob_names: frozenset[str] = frozenset()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide a knob's keys (footer, help, palette) where no command can go: in a
        replay, and once the run's schema is known, for a knob it does not have. A
        read-only dashboard keeps them: a key then says what it would send."""
        if action == "tune":
            return self.source.info is not None  # a replay sends nothing
        if action not in _KNOB_ACTIONS:
            return True
        if self.source.info is None:
            return False
        schema = self.source.state.schema  # replaced whole by the source: a safe read
        return not schema or parameters[0] in schema

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Horizontal(id="charts"):
            yield StepChart(TIMING, clip_spikes=True, id="timing")
            yield StepChart(LOSS, id="loss")
        yield ThroughputBar(id="throughput")
        with Horizontal(id="panels"):
            yield MemoryPanel(id="memory")
            yield SystemPanel(id="system")
            yield DataPanel(id="data")
            yield KnobsPanel(id="knobs")
        yield EventLog(id="log")
        yield Footer()

    def on_mount(self) -> None:
        with self.source.lock:
            for note in self._notes:
                self.source.state.log("info", note)
            self.source.state.log("info", f"waiting for {self.source.description} ...")
        self.source.start()
        self.set_interval(REDRAW_S, self.redraw)
        self.redraw()

    def on_resize(self, event: events.Resize) -> None:
        """Under :data:`COMPACT_FOOTER_BELOW` columns the footer is compact and leaves
        out ctrl+p (the help screen lists it), so that every key fits in 80 columns."""
        footer = self.query_one(Footer)
        compact = event.size.width < COMPACT_FOOTER_BELOW
        if footer.show_command_palette == compact:
            footer.compact = compact
            footer.show_command_palette = not compact
            footer.refresh(recompose=True)

    def on_unmount(self) -> None:
        self.source.close()

    def redraw(self) -> None:
        """Redraw the panels if a record arrived, the run's status changed or the panels
        were resized, and the charts if steps arrived (at most every
        :data:`CHART_REDRAW_S`)."""
        if not self.is_running:  # shutting down: the widgets are being removed
            return
        now = time.monotonic()
        size = self.query_one("#panels").size  # sparklines fill the panels' width
        with self.source.lock:
            state = self.source.state
            status = state.status_at(now)
            previous = self._drawn[1] if self._drawn is not None else None
            if (previous is not None and previous != status and status in _STATUS_NOTES
                    and (previous, status) != ("compiling", "live")):
                state.log(*_STATUS_NOTES[status])
            if (state.steps_total != self._charts_drawn[0]
                    and now - self._charts_drawn[1] >= CHART_REDRAW_S):
                self._charts_drawn = (state.steps_total, now)
                for chart in self.query(StepChart):
                    chart.show(state.steps)
            knob_names = frozenset(state.schema)
            if isinstance(self.screen, TuneScreen):
                self.screen.show(state)
            if self._drawn == (state.version, status, size):
                return
            self._drawn = (state.version, status, size)
            self.query_one(RunHeader).show(state, status, now,
                                           description=self.source.description,
                                           readonly=self.readonly)
            self.query_one(ThroughputBar).show(state.steps)
            self.query_one(MemoryPanel).show(state)
            self.query_one(SystemPanel).show(state)
            self.query_one(DataPanel).show(state, now)
            self.query_one(KnobsPanel).show(state, now, shown_elsewhere=loader_knobs(state))
            new = min(state.events_total - self._events_shown, len(state.events))
            entries = list(state.events)[len(state.events) - new:] if new > 0 else []
            self._events_shown = state.events_total
        log = self.query_one(EventLog)
        for entry in entries:
            log.add(entry)
        if knob_names != self._knob_names:  # the keys of knobs the run lacks go away
            self._knob_names = knob_names
            self.refresh_bindings()

    def note(self, level: str, text: str) -> None:
        """Add a line to the event log (level: info, success, warning or error)."""
        with self.source.lock:
            self.source.state.log(level, text)
        self.redraw()

    def action_help(self) -> None:
        """Open the help screen."""
        self.push_screen(HelpScreen())

    def action_show_tune(self) -> None:
        """Open the search's screen."""
        if not isinstance(self.screen, TuneScreen):
            self.push_screen(TuneScreen())

    def action_tune(self) -> None:
        """Start an in-run search with the run's default knobs, or stop the running one
        (the best configuration so far stays); opens the search's screen."""
        with self.source.lock:
            running, hello = self.source.state.tuning, bool(self.source.state.hello)
        if not hello:
            self.note("warning", "no knob schema from the run yet; nothing sent")
            return
        self.action_show_tune()
        self._command(protocol.TUNE, {"stop": True} if running else {},
                      "tune: stop the search" if running else "tune: start a search")

    def action_cycle(self, knob: str) -> None:
        """Ask the run for the next value of a choice knob (its schema's order)."""
        spec, current = self._knob(knob)
        if spec is None:
            return
        choices = list(spec.get("choices") or ())
        if not choices:
            self.note("warning", f"{knob} has no choices in this run's schema; nothing sent")
            return
        unavailable = spec.get("unavailable") or {}
        start = choices.index(current) if current in choices else -1
        following = next((choices[(start + offset) % len(choices)]
                          for offset in range(1, len(choices) + 1)
                          if choices[(start + offset) % len(choices)] not in unavailable),
                         None)
        if following is None or following == current:
            reasons = "; ".join(f"{value}: {why}" for value, why in unavailable.items())
            self.note("warning", f"no other {knob} can run here ({reasons}); nothing sent")
            return
        self._command(knob, following)

    def action_step(self, knob: str, delta: int) -> None:
        """Ask the run for ``knob + delta`` (an integer knob), within the schema's bounds."""
        spec, current = self._knob(knob)
        if spec is None:
            return
        if type(current) is not int:
            self.note("warning", f"{knob} is {current!r}, not an integer; nothing sent")
            return
        value = current + delta
        low, high = spec.get("min"), spec.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            bound = "minimum" if low is not None and value < low else "maximum"
            self.note("warning", f"{knob} is already at its {bound} {current}; nothing sent")
            return
        self._command(knob, value)

    def action_toggle(self, knob: str) -> None:
        """Ask the run to turn a boolean knob the other way."""
        spec, current = self._knob(knob)
        if spec is None:
            return
        if type(current) is not bool:
            self.note("warning", f"{knob} is {current!r}, not a boolean; nothing sent")
            return
        self._command(knob, not current)

    def _knob(self, name: str) -> tuple[dict[str, Any] | None, Any]:
        """The knob's schema and the value a key should step from (the pending one if
        a command is on its way); logs why and returns ``(None, None)`` without it."""
        with self.source.lock:
            state = self.source.state
            if not state.hello:
                reason = "no knob schema from the run yet"
            elif name not in state.schema:
                reason = (f"this run has no knob {name} "
                          f"(it has: {', '.join(state.schema) or 'none'})")
            elif name not in state.knobs:
                reason = f"no current value of {name} from the run yet"
            else:
                pending = state.pending.get(name)
                return state.schema[name], (pending.value if pending is not None
                                            else state.knobs.get(name))
        self.note("warning", f"{reason}; nothing sent")
        return None, None

    def _command(self, knob: str, value: Any, described: str | None = None) -> None:
        """Send ``knob=value`` (``described`` for people, by default the assignment)
        unless read-only or the run has ended."""
        described = described or assignment(knob, value)
        if self.readonly:
            self.note("warning", f"read-only: {described} not sent")
        elif self.source.state.ended is not None:
            self.note("warning", f"the run has ended: {described} not sent")
        else:
            self.note("info", f"sent {described}")
            self._send(knob, value)

    @work(thread=True, group="commands")
    def _send(self, knob: str, value: Any) -> tuple[str, Any, dict[str, Any]]:
        assert self.source.info is not None
        worker = get_current_worker()  # cancelled when the app quits: stop waiting then
        command_id = new_command_id()
        with self.source.lock:  # its rejection is shown once, from the reply
            self.source.state.own_command_ids.add(command_id)
        return knob, value, send_command(self.source.info, knob, value,
                                         cancelled=lambda: worker.is_cancelled,
                                         command_id=command_id)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group != "commands" or event.state != WorkerState.SUCCESS:
            return
        knob, value, reply = event.worker.result
        if knob == protocol.TUNE:  # not a setting: say what the run answered
            self.note("info" if reply.get("ok") else "error",
                      f"tune: {reply['note']}" if reply.get("ok") and reply.get("note")
                      else reply_text(knob, value, reply))
            return
        with self.source.lock:
            if reply.get("ok"):
                self.source.state.note_pending(knob, reply.get("value", value),
                                               reply.get("apply_step"))
        if reply.get("ok") and len(reply.get("ranks") or ()) <= 1:
            return  # the run's own "accepted" event says it, to every dashboard
        if reply.get("ok"):  # several ranks: say that all of them took it
            self.note("info", reply_text(knob, value, reply))
            return
        level = ("warning" if reply.get("answered") is False
                 and not reply.get("ranks_differ") else "error")
        self.note(level, reply_text(knob, value, reply))
