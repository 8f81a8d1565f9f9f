"""The Textual dashboard: one screen of charts and panels for one run, plus its keys."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from textual import events, work
from textual.actions import parse as parse_action
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Input
from textual.worker import Worker, WorkerState, get_current_worker

from agent.wire import protocol
from agent.wire.knobs import (COMMAND_KINDS, DEFAULT_MAX_GRAD_NORM, STANDARD_KNOBS, assignment,
                              refusal)
from agent.wire.runs import find_run
from gpuwatch.client import new_command_id, parse_assignment, reply_text, send_command
from gpuwatch.units import human_number, knob_text
from gpuwatch.palette import BindingCommands
from gpuwatch import history
from gpuwatch.sources import Source
from gpuwatch.sources.live import LiveSource
from gpuwatch.sources.timeline import TimelineSource
from gpuwatch.state import (BUSY_STATUSES, GONE_AFTER_S, QUIET_AFTER_S, STEP_HISTORY,
                            LogEntry, RunState)
from gpuwatch.compare import Column
from gpuwatch.widgets.command_line import CommandLine, SchemaSuggester
from gpuwatch.screens.compare import CompareScreen
from gpuwatch.widgets.data import DataPanel, verdict_texts
from gpuwatch.widgets.event_log import EventLog
from gpuwatch.widgets.header import RunHeader, compile_label
from gpuwatch.screens.help import HelpScreen
from gpuwatch.widgets.key_question import KeyQuestion, Question
from gpuwatch.widgets.key_bar import KeyBar
from gpuwatch.screens.runs import RunsScreen
from gpuwatch.widgets.knobs import KnobsPanel
from gpuwatch.widgets.last_event import LastEvent
from gpuwatch.widgets.memory import MemoryPanel
from gpuwatch.widgets.step_chart import LOSS, TIMING, StepChart
from gpuwatch.widgets.system import SystemPanel
from gpuwatch.widgets.throughput import ThroughputBar
from gpuwatch.widgets.timeline_bar import TimelineBar
from gpuwatch.screens.tune import TuneScreen

#: Seconds between checks for new records; the screen is redrawn only when they changed.
REDRAW_S = 0.2
#: The charts (plotext renders in pure Python, ~10 ms each) are redrawn at most this often
#: (their 600 steps turn over in 0.6 s at 1,000 steps/s: a faster redraw shows no more).
CHART_REDRAW_S = 1.0
#: ... and no more often than keeps their drawing within this share of one core (a big
#: terminal or a slow machine redraws them less often).
CHART_CPU_SHARE = 0.05

#: The footer shows each -/+ pair of keys once, with one description.
_STEP = Binding.Group("step", compact=True)
_CHANGE = Binding.Group("change", compact=True)
_EVENT = Binding.Group("event", compact=True)
#: Steps that shift+left / shift+right move on a timeline.
TIMELINE_LEAP_STEPS = 100
#: Under this many columns the memory and host & GPU panels fold (the stylesheet's
#: ``-cramped``): the knobs and the data panel keep the width.
CRAMPED_BELOW = 80

#: What the event log says when the run's status changes to each of these.
_STATUS_NOTES = {
    "live": ("info", "run is live"),
    "stalled": ("warning", "run is stalled: no optimizer step for several of its step "
                           "times"),
    "paused": ("info", "run is paused after step {step}: P lets it go on"),
    "evaluating": ("info", "run is evaluating after step {step} (evaluate=now): no "
                           "optimizer step until it ends"),
    "saving": ("info", "run is saving a checkpoint after step {step}: no optimizer step "
                       "until it is written"),
    "quiet": ("warning", f"run is quiet: nothing heard for {QUIET_AFTER_S:g} s, but its "
                         "process is alive (a loaded machine?)"),
    "gone": ("error", f"run is gone: nothing heard for {GONE_AFTER_S:g} s"),
}

#: Statuses whose end an event already tells (a compile's end, pause=off's or the
#: command's applied event with its answer): back to live, the log says nothing more.
_QUIET_RETURNS = frozenset({"compiling", "paused", *BUSY_STATUSES.values()})


#: Textual's palette entries left out (see :meth:`GpuwatchApp.get_system_commands`).
_HIDDEN_SYSTEM_COMMANDS = frozenset({"Quit", "Keys", "Maximize", "Minimize"})
#: What Textual's own palette entries start with: the terminal's look, not the run.
SYSTEM_COMMANDS_GROUP = "display: "
#: The actions that send a command (their first parameter is the knob).
_KNOB_ACTIONS = frozenset({"cycle", "step", "toggle", "scale", "clip", "send", "pause"})
#: The actions of the keys that change the run: each asks before it sends (see
#: :meth:`GpuwatchApp.on_key`), unless quick keys are on.
_RUN_ACTIONS = _KNOB_ACTIONS | {"tune"}
#: ``GPUWATCH_QUICK_KEYS=1``: the keys that change the run send at once, without asking
#: (as ``gpuwatch --quick-keys``).
QUICK_KEYS_ENV = "GPUWATCH_QUICK_KEYS"
#: The screens under which the footer's keys that change the run act (closing them).
_KEYS_ACT_UNDER = (HelpScreen, TuneScreen, RunsScreen)
#: The actions that move a replay on a timeline.
_TIMELINE_ACTIONS = frozenset({"move_by", "move_to_mark", "move_to", "compare"})


def _knob_bindings() -> list[Binding]:
    """The standard knobs' keys (:attr:`agent.wire.knobs.KnobSpec.keys`), in their order.

    A knob's keys sit side by side in the footer under its
    :attr:`~agent.wire.knobs.KnobSpec.key_group`."""
    return [Binding(key.key, f"{key.action}({', '.join(map(repr, (spec.name, *key.arguments)))})",
                    key.description, id=f"{spec.name}.{key.id}", show=key.show,
                    tooltip=key.tooltip,
                    group=Binding.Group(spec.key_group, compact=True) if spec.key_group
                    else None)
            for spec in STANDARD_KNOBS.values() for key in spec.keys]


def screen_text(app: App[Any]) -> str:
    """The screen of ``app`` as a person reads it: every cell's character, no styles.

    A modal screen is drawn over the ones below it, as the terminal shows it. Lines
    lose their trailing spaces; the text ends with a newline. For a headless app
    (Textual's ``run_test``): the tests' and ``benchmarks/dashboard_screen.py``'s view."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    lines = console.export_text(styles=False).split("\n")[:height]
    return "\n".join(line.rstrip() for line in lines) + "\n"


class GpuwatchApp(App[None]):
    """The dashboard of one run.

    Args:
        source: where records come from; started on mount, closed on unmount.
        readonly: when True, keys log what they would send and send nothing.
        quick_keys: when True, a key that changes the run sends its command at once;
            when False it asks first (:meth:`on_key`); None: ``$GPUWATCH_QUICK_KEYS``
            (``1``: on).
        notes: ``(level, text)`` lines for the event log at start (e.g. where a demo
            writes its output): ``info``, or ``warning`` (held in view until a key).
    """

    CSS_PATH = "gpuwatch.tcss"
    TITLE = "gpuwatch"
    COMMANDS = {BindingCommands}  # Textual's own commands too, after the run's
    VERTICAL_BREAKPOINTS = [(0, "-tiny"), (24, "-short"), (32, "-tall")]
    HORIZONTAL_BREAKPOINTS = [(0, "-cramped"), (CRAMPED_BELOW, "-narrow"), (100, "-wide"),
                              (120, "-wider")]
    #: First the keys that must stay in view at any width (the footer is cut at the
    #: right), then the knobs' keys.
    BINDINGS = [
        Binding("question_mark", "help", "help", id="help",
                tooltip="Show this list of keys"),
        Binding("q", "quit", "quit", id="quit",
                tooltip="Quit the dashboard (the run goes on; the one `gpuwatch demo` "
                        "opened stops its demo run too)"),
        Binding("colon", "command_line", "cmd", id="command_line",
                priority=True,  # acts as it comes: the keys queued behind it are text
                tooltip="Type a command as `gpuwatch set` takes it: accum_steps=8, "
                        "kernels=compile, checkpoint=now, rewind=120 (back to the "
                        "checkpoint of step 120, or a checkpoint's path, as a new branch; "
                        "no key: only here) (tab completes from the run's knobs; enter "
                        "sends, escape closes)"),
        *_knob_bindings(),
        Binding("T", "tune", "tune", id="tune",
                show=False,  # in help and the palette: the footer is full at 80 columns
                tooltip="Start the in-run search for the fastest safe configuration (the "
                        "run tries its speed settings and keeps what is faster); again: "
                        "stop it, keeping the best"),
        Binding("t", "show_tune", "search", id="tune.show", show=False,
                tooltip="Show the search: each candidate, its throughput, kept or why not"),
        Binding("z", "zoom", "zoom", id="charts.zoom",
                show=False,  # in help and the palette: the footer is full at 80 columns
                tooltip="Charts: the whole run from step 1 (read from the run's log, "
                        f"spikes kept) or its last {STEP_HISTORY} steps"),
        # a replay on a timeline (before the focused widget's keys: the log scrolls too)
        Binding("left", "move_by(-1)", "step-", id="timeline.back", group=_STEP,
                priority=True, tooltip="Timeline: one optimizer step back"),
        Binding("right", "move_by(1)", "step+", id="timeline.forward", group=_STEP,
                priority=True, tooltip="Timeline: one optimizer step forward"),
        Binding("shift+left", f"move_by(-{TIMELINE_LEAP_STEPS})",
                f"-{TIMELINE_LEAP_STEPS}", id="timeline.leap_back", show=False,
                priority=True,
                tooltip=f"Timeline: {TIMELINE_LEAP_STEPS} optimizer steps back"),
        Binding("shift+right", f"move_by({TIMELINE_LEAP_STEPS})",
                f"+{TIMELINE_LEAP_STEPS}", id="timeline.leap_forward", show=False,
                priority=True,
                tooltip=f"Timeline: {TIMELINE_LEAP_STEPS} optimizer steps forward"),
        Binding("left_square_bracket", "move_to_mark('change', -1)", "change-",
                id="timeline.previous_change", group=_CHANGE, priority=True,
                tooltip="Timeline: the previous knob change"),
        Binding("right_square_bracket", "move_to_mark('change', 1)", "change+",
                id="timeline.next_change", group=_CHANGE, priority=True,
                tooltip="Timeline: the next knob change"),
        Binding("comma", "move_to_mark('event', -1)", "event-",
                id="timeline.previous_event", group=_EVENT, priority=True,
                tooltip="Timeline: the previous event the run logged"),
        Binding("full_stop", "move_to_mark('event', 1)", "event+",
                id="timeline.next_event", group=_EVENT, priority=True,
                tooltip="Timeline: the next event the run logged"),
        Binding("home", "move_to('start')", "first", id="timeline.start", priority=True,
                tooltip="Timeline: the first optimizer step"),
        Binding("end", "move_to('end')", "last", id="timeline.end", priority=True,
                tooltip="Timeline: the last optimizer step (the run's end)"),
        Binding("v", "compare", "compare", id="timeline.compare",
                tooltip="Timeline: the segments before and after the knob change at or "
                        "before this step, side by side"),
        Binding("r", "runs", "runs", id="runs", show=False,  # help, palette: room for q
                tooltip="Every run of this user, live and finished: open one here"),
    ]

    def __init__(self, source: Source, *, readonly: bool = False,
                 quick_keys: bool | None = None,
                 notes: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__()
        self.source = source
        self.readonly = readonly
        self.quick_keys = (os.environ.get(QUICK_KEYS_ENV) == "1" if quick_keys is None
                           else quick_keys)
        self._notes = list(notes)
        #: the "waiting for ..." line logged at the start (see :meth:`redraw`)
        self._waiting_line: LogEntry | None = None
        self._drawn: tuple[int, str, Any, int] | None = None
        #: ((state.steps_total, the whole run's rows, zoomed out), monotonic s) at the
        #: charts' last draw
        self._charts_drawn: tuple[Any, float] = (-1, 0.0)
        #: the charts show the whole run (the source's :attr:`~Source.whole`), not only
        #: the steps received (``z``)
        self._whole_run = True
        self._chart_interval_s = CHART_REDRAW_S  # until the next draw (see CHART_CPU_SHARE)
        self._events_shown = 0
        self._state_shown: RunState | None = None  # a timeline replaces the state
        self._log_epoch = 0  # the state's log_epoch drawn: another, the log is drawn afresh
        self._switching = False  # another run replaces this one (widgets recomposed)
        #: the first frame is up (Textual's Ready); an exit asked before it waits for it
        self._up = False
        self._exit_asked = False
        self._knob_names: frozenset[str] = frozenset()
        #: the threshold clipping had before ``g`` turned it off, by knob
        self._clip_restore: dict[str, float] = {}
        #: the command a key asked about, until it is answered
        self._question: Question | None = None
        #: the key whose action runs now (None: the palette or a click ran it)
        self._key: str | None = None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide a knob's keys (footer, help, palette) where no command can go.

        In a replay, and once the run's schema is known, for a knob it does not have. A
        read-only dashboard keeps them: a key then says what it would send. The timeline's
        keys act on a replay on a timeline only."""
        if action in _TIMELINE_ACTIONS:  # before the focused widget's keys, but
            # never a text box's (the command palette's), and listed but not acting on
            # another screen (None: the runs screen's arrows move its columns)
            if not isinstance(self.source, TimelineSource) or isinstance(self.focused, Input):
                return False
            return True if len(self.screen_stack) == 1 else None
        if action == "command_line":  # listed everywhere; acts on the dashboard only
            # (a ``:`` typed in a text box, or on another screen, is that one's)
            return (len(self.screen_stack) == 1
                    and not isinstance(self.focused, Input)) or None
        if action == "tune":
            return self.source.info is not None  # a replay sends nothing
        if action not in _KNOB_ACTIONS:
            return True
        if self.source.info is None:
            return False
        schema = self.source.state.schema  # replaced whole by the source: a safe read
        if not schema:  # a monitor-only run (its hello has no knobs) has no knob keys
            return not self.source.state.hello
        return parameters[0] in schema

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's own palette entries, less those our keys offer or that do nothing useful here.

        Left out: quit (our bindings offer it), and its key list (? is ours) and maximize,
        which do nothing useful here; the rest (theme, screenshot) grouped under
        :data:`SYSTEM_COMMANDS_GROUP`, apart from the run's commands."""
        for command in super().get_system_commands(screen):
            if command.title not in _HIDDEN_SYSTEM_COMMANDS:
                yield command._replace(title=f"{SYSTEM_COMMANDS_GROUP}{command.title}")

    def on_key(self, event: events.Key) -> None:
        """The keys that change the run, before any binding acts on them.

        A key that changes the run asks first (:class:`KeyQuestion`, over the footer):
        the same key again or enter sends, escape cancels, and any other key cancels
        and then does what it does. A key the terminal delivered before the question
        was asked (typed ahead, in the same burst) never answers it: it cancels, and
        asks again if it is the same key. With quick keys on, the command is sent at
        once. A knob's key that :meth:`check_action` hides (a replay, a knob the run
        lacks, no schema yet) is not silent: its action runs and says in the event log
        why nothing is sent. Under a screen whose footer offers these keys (help, search,
        runs: :data:`_KEYS_ACT_UNDER`), a key of theirs that the screen does not bind
        closes it and acts as here (its question then in view); not under another screen
        (a dialog), nor while a text box has the keys (a text box takes keys typed after
        ``:`` however fast they come: it has the focus from the ``:`` on)."""
        for last in self.query(LastEvent):  # none while another run's are composed
            last.key_pressed()
        if isinstance(self.focused, Input):
            return
        if len(self.screen_stack) > 1:
            screen = self.screen
            if (not isinstance(screen, _KEYS_ACT_UNDER) or len(self.screen_stack) > 2
                    or any(event.key in binding.key.split(",")
                           for binding in screen.BINDINGS if isinstance(binding, Binding))
                    or self._run_binding(event.key) is None):
                return
            screen.dismiss()  # (popped at once: the dashboard has the keys again)
        question = self._question
        if question is not None:
            if question.answered_by(event.key, event.time):
                self._show_question(None)
                event.stop()
                event.prevent_default()
                self._command(question.knob, question.value, question.described,
                              ask=False, then=question.then)
                return
            typed_ahead = event.key in ("enter", question.key)
            self._ask(None, why=f": {self.get_key_display(Binding(event.key, ''))} was "
                                "typed ahead of the question" if typed_ahead else "")
            if event.key == "escape":
                event.stop()
                event.prevent_default()
                return
        binding = self._run_binding(event.key)
        if binding is None:
            return
        _, name, parameters = parse_action(binding.action)
        if name in _KNOB_ACTIONS or (name in _RUN_ACTIONS
                                     and self.check_action(name, parameters)):
            event.stop()
            event.prevent_default()  # not the binding as well
            self._key = event.key
            try:
                getattr(self, f"action_{name}")(*parameters)
            finally:
                self._key = None

    def _run_binding(self, key: str) -> Binding | None:
        """The app's binding of ``key`` (Textual's name) if it changes the run."""
        binding = next((b for b in self.BINDINGS if isinstance(b, Binding)
                        and key in b.key.split(",")), None)
        if binding is None or parse_action(binding.action)[1] not in _RUN_ACTIONS:
            return None
        return binding

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        if isinstance(self.source, TimelineSource):
            yield TimelineBar(id="timeline")
        with Horizontal(id="charts"):
            yield StepChart(TIMING, clip_spikes=True, recent=True, id="timing")
            yield StepChart(LOSS, id="loss")
        yield ThroughputBar(id="throughput")
        with Horizontal(id="panels"):
            yield MemoryPanel(id="memory")
            yield SystemPanel(id="system")
            yield DataPanel(id="data")
            yield KnobsPanel(id="knobs")
        yield LastEvent(id="last")
        yield EventLog(id="log")
        yield KeyBar(id="footer")
        yield CommandLine(id="command", placeholder="knob=value (tab completes, escape "
                                                     "closes)",
                          suggester=SchemaSuggester(self._schema_and_knobs))  # over it
        yield KeyQuestion(id="question")  # over it too

    def on_mount(self) -> None:
        self._start_source()
        self.set_interval(REDRAW_S, self.redraw)
        self.redraw()

    def on_ready(self) -> None:
        self._up = True
        if self._exit_asked:
            self.exit()

    def end(self) -> None:
        """Exit as ``q`` does: at once, or once the first frame is up.

        What a signal handler calls (SIGTERM, SIGHUP), any time from the start (an exit
        while the widgets mount tore them down under their own handlers: tracebacks,
        exit 1)."""
        if self._up:
            self.exit()
        else:
            self._exit_asked = True

    def _start_source(self) -> None:
        with self.source.lock:
            for level, note in self._notes:
                self.source.state.log(level, note)
            self.source.state.log("info", f"waiting for {self.source.description} ...")
            self._waiting_line = self.source.state.events[-1]
        self.source.start()

    def on_unmount(self) -> None:
        self.source.close()

    def redraw(self) -> None:
        """Redraw the panels and the charts that have something new, at a bounded cost.

        The panels if a record arrived, the run's status changed or the panels were resized,
        and the charts if steps arrived (at most every :data:`CHART_REDRAW_S`, and within
        :data:`CHART_CPU_SHARE` of a core)."""
        if not self.is_running or self._switching:  # the widgets are being replaced
            return
        wall = time.monotonic()
        size = self.query_one("#panels").size  # sparklines fill the panels' width
        log = self.query_one(EventLog)
        with self.source.lock:
            state = self.source.state
            now = self.source.now()  # the state's clock: a timeline's is its step's
            status = state.status_at(now)
            afresh = False  # the whole log drawn again
            if state is not self._state_shown or state.log_epoch != self._log_epoch:
                # a timeline moved, or the run's events from before the first record
                # received were put first (not counted in events_total: not news)
                if self._state_shown is not None:
                    log.clear()
                afresh = True
                self._log_epoch = state.log_epoch
            if state is not self._state_shown:
                self._state_shown = state
                self._events_shown = state.events_total - min(state.events_total,
                                                              len(state.events))
                self._charts_drawn = (-1, 0.0)
                self._drawn = None
            previous = self._drawn[1] if self._drawn is not None else None
            # (a run found live, or live after a compile that began before this dashboard
            # came, is noted while "waiting for ..." is still the newest line: the folded
            # log at 24 rows would show that under the header's live)
            waited = (status == "live" and bool(state.events)
                      and state.events[-1] is self._waiting_line)
            if ((previous is not None or waited) and previous != status
                    and status in _STATUS_NOTES
                    and not (status == "live" and previous in _QUIET_RETURNS and not waited)):
                level, note = _STATUS_NOTES[status]
                state.log(level, note.format(step=human_number(
                    state.paused_after if status == "paused" else state.step)))
            whole = self.source.whole
            past = whole.past if whole is not None and self._whole_run else None
            drawn = (state.steps_total, past.rows if past is not None else -1,
                     self._whole_run)
            if (drawn != self._charts_drawn[0]
                    and wall - self._charts_drawn[1] >= self._chart_interval_s):
                self._charts_drawn = (drawn, wall)
                cost_s = 0.0  # this draw's, and the last render's (the compositor's)
                for chart in self.query(StepChart):
                    chart.show(state.steps, marks=state.knob_changes, past=past)
                    cost_s += chart.show_s + chart.render_s
                self._chart_interval_s = max(CHART_REDRAW_S, cost_s / CHART_CPU_SHARE)
            knob_names = frozenset(state.schema)
            if isinstance(self.screen, TuneScreen):
                self.screen.show(state)
            drawn_panels = (state.version, status, size, past.rows if past else -1)
            if self._drawn == drawn_panels:
                return
            self._drawn = drawn_panels
            if isinstance(self.source, TimelineSource):
                timeline = self.source.timeline
                self.query_one(TimelineBar).show(
                    timeline.steps if timeline else (), self.source.index,
                    timeline.marks if timeline else ())
            self.query_one(RunHeader).show(state, status, now,
                                           description=self.source.description,
                                           readonly=self.readonly,
                                           replay=isinstance(self.source, TimelineSource))
            self.query_one(ThroughputBar).show(state.steps, past=past)
            self.query_one(MemoryPanel).show(state)
            self.query_one(SystemPanel).show(state)
            data = self.query_one(DataPanel)
            if data.display:
                data.show(state)
            self.query_one(KnobsPanel).show(
                state, now, data=() if data.display else verdict_texts(state))
            new = min(state.events_total - self._events_shown, len(state.events))
            entries = list(state.events)[len(state.events) - new:] if new > 0 else []
            self._events_shown = state.events_total
            drawn_log = list(state.events) if afresh else entries
            self.query_one(LastEvent).show(  # a replay's warnings are not held
                state.events[-1] if state.events else None,
                entries if self.source.info is not None else (), log_shown=log.display,
                progress=compile_label(state, now) if status == "compiling"
                and state.compiling_since is not None else None)
        for entry in drawn_log:
            log.add(entry)
        if knob_names != self._knob_names:  # the keys of knobs the run lacks go away
            self._knob_names = knob_names
            self.refresh_bindings()

    def action_zoom(self) -> None:
        """Charts: between the whole run (from its log, then live) and the steps received last.

        The steps received last: at most :data:`~gpuwatch.state.STEP_HISTORY`."""
        self._whole_run = not self._whole_run
        self._charts_drawn = (-1, 0.0)  # at once
        if not self._whole_run:
            self.note("info", f"charts: the last {STEP_HISTORY} steps")
        elif self.source.whole is None:
            self.note("info", "charts: the whole run received (no run log to read)")
        else:
            self.note("info", "charts: the whole run from step 1")

    def note(self, level: str, text: str) -> None:
        """Add a line to the event log (level: info, success, warning or error)."""
        with self.source.lock:
            self.source.state.log(level, text)
        self.redraw()

    def action_move_by(self, steps: int) -> None:
        """Timeline: move ``steps`` optimizer steps back (negative) or forward."""
        if isinstance(self.source, TimelineSource) and self.source.move_by(steps):
            self.redraw()

    def action_move_to(self, where: str) -> None:
        """Timeline: go to the ``start`` or the ``end`` of the run."""
        index = 0 if where == "start" else 1 << 62  # clamped to the last step
        if isinstance(self.source, TimelineSource) and self.source.move_to(index):
            self.redraw()

    def action_move_to_mark(self, kind: str, direction: int) -> None:
        """Timeline: go to the next or previous knob change or event, or say there is none.

        ``direction`` 1: the next, -1: the previous; ``kind`` change: a knob change, event:
        an event."""
        if not isinstance(self.source, TimelineSource):
            return
        if self.source.move_to_mark(kind, direction) is None:
            what = "knob change" if kind == "change" else "event"
            self.notify(f"no {'later' if direction > 0 else 'earlier'} {what}",
                        severity="warning", timeout=2)
            return
        self.redraw()

    def action_compare(self) -> None:
        """Timeline: open the comparison of the segment shown and the one before it.

        The first two while the first is shown; or say there is no knob change."""
        source = self.source
        if not isinstance(source, TimelineSource) or source.timeline is None \
                or source.index is None:
            return
        segments = source.timeline.history.segments()
        if len(segments) < 2:
            self.notify("no knob change in this run to compare around",
                        severity="warning", timeout=3)
            return
        step = source.timeline.steps[source.index]
        here = next((i for i, s in enumerate(segments) if s.last_step >= step),
                    len(segments) - 1)
        before, after = segments[max(0, here - 1)], segments[max(1, here)]
        self.push_screen(CompareScreen(
            [Column(f"before: {before.label}", before),
             Column(f"after: {after.label}", after)],
            f"compare: {', '.join(after.changed)} at step {after.first_step}"))

    def action_runs(self) -> None:
        """Open the list of every run; the one chosen replaces the run shown."""
        self.push_screen(RunsScreen(), callback=self._open_run)

    async def _open_run(self, summary: history.RunSummary | None) -> None:
        """Show ``summary``'s run instead: a live one live, a finished one on a
        timeline (or say why it cannot be opened)."""
        if summary is None:
            return
        source: Source | None = None
        if summary.live:
            info = find_run(summary.run_id)
            source = LiveSource(info) if info is not None else None
        if source is None:  # its own log (a copy's name may name another run)
            log = (history.log_at(summary.log_path) if summary.log_path is not None
                   else history.find_run_log(summary.run_id))
            source = TimelineSource(log) if log is not None else None
        if source is None:
            self.notify(f"run {summary.run_id} is neither live nor logged any more",
                        severity="warning")
            return
        self._switching = True
        try:
            self.source.close()
            self.source = source
            self._notes = []
            self._state_shown, self._drawn = None, None
            self._charts_drawn, self._events_shown = (-1, 0.0), 0
            self._knob_names = frozenset()
            self._question = None  # its widget goes with the others
            await self.recompose()  # a timeline has its bar, a live run has none
            self.set_focus(None)  # not the removed widget that had it: the keys are ours
        finally:
            self._switching = False
        self._start_source()
        self.refresh_bindings()
        self.redraw()

    def _schema_and_knobs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The run's schema and knob values now (for the command line's completion)."""
        with self.source.lock:
            return dict(self.source.state.schema), dict(self.source.state.knobs)

    def action_command_line(self) -> None:
        """Open the command line (``:``) with the focus, at once, before the keys queued behind it.

        ``:`` is a priority binding, so this runs as the app takes the key from the
        terminal, before it passes on the keys queued behind it; they go to the command line
        however fast they come (``focus()`` would move the focus only after them, and each
        would act as a shortcut). A key's open question is not sent."""
        self._ask(None)
        line = self.query_one(CommandLine)
        line.display = True
        self.screen.set_focus(line)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """The command line's enter: send what was typed as ``gpuwatch set`` sends it.

        The run checks the value; its reply is logged. Or say why it is not a command."""
        if not isinstance(event.input, CommandLine):
            return
        event.stop()
        text = event.value
        event.input.action_close()
        if not text.strip():
            return
        try:
            knob, value = parse_assignment(text)
        except ValueError as exc:
            self.note("error", f"{exc}; nothing sent")
            return
        self._command(knob, value, ask=False)  # typed and entered: asked enough

    def action_help(self) -> None:
        """Open the help screen."""
        self.push_screen(HelpScreen(quick_keys=self.quick_keys))

    def action_show_tune(self) -> None:
        """Open the search's screen."""
        if not isinstance(self.screen, TuneScreen):
            self.push_screen(TuneScreen())

    def action_tune(self) -> None:
        """Start an in-run search with the run's default knobs, or stop the running one.

        The best configuration so far stays; opens the search's screen once sent."""
        with self.source.lock:
            running, hello = self.source.state.tuning, bool(self.source.state.hello)
        if not hello:
            self.note("warning", "no knob schema from the run yet; nothing sent")
            return
        self._command(protocol.TUNE, {"stop": True} if running else {},
                      "tune: stop the search" if running else "tune: start a search",
                      then=self.action_show_tune)

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
        for offset in range(1, len(choices)):  # the values passed over are said
            value = choices[(start + offset) % len(choices)]
            if value == following:
                break
            self.note("info", f"{knob}={value} skipped: {unavailable.get(value, '?')}")
        self._command(knob, following)

    def action_step(self, knob: str, delta: int) -> None:
        """Ask the run for ``knob + delta`` (an integer knob), within the schema's bounds."""
        spec, current = self._knob(knob)
        if spec is None:
            return
        if type(current) is not int:
            self.note("warning", f"{knob} is {current!r}, not an integer; nothing sent")
            return
        self._send_within_bounds(knob, spec, current + delta, f"{knob} is already at")

    def action_scale(self, knob: str, factor: float) -> None:
        """Ask the run for ``knob x factor`` (a float knob), within the schema's bounds."""
        spec, current = self._number(knob)
        if spec is not None:
            self._send_within_bounds(knob, spec, current * factor,
                                     f"{knob} {current:g} x{factor:g} is beyond")

    def action_clip(self, knob: str) -> None:
        """Turn clipping off (``knob=0``), or on again at the threshold it had.

        Else at :data:`DEFAULT_MAX_GRAD_NORM`."""
        spec, current = self._number(knob)
        if spec is None:
            return
        if current:
            self._clip_restore[knob] = current
            self._command(knob, 0.0)
        else:
            self._command(knob, self._clip_restore.get(knob, DEFAULT_MAX_GRAD_NORM))

    def _number(self, knob: str) -> tuple[dict[str, Any] | None, Any]:
        """As :meth:`_knob`, for a number knob: ``(None, None)``, after saying why, when
        its value is not a number."""
        spec, current = self._knob(knob)
        if spec is not None and type(current) not in (int, float):
            self.note("warning", f"{knob} is {current!r}, not a number; nothing sent")
            return None, None
        return spec, current

    def _send_within_bounds(self, knob: str, spec: dict[str, Any], value: Any,
                            beyond: str) -> None:
        """Send ``knob=value`` if the schema's bounds allow it, else say ``<beyond> its
        minimum|maximum <bound>; nothing sent``."""
        low, high = spec.get("min"), spec.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            bound, limit = ("minimum", low) if low is not None and value < low else (
                "maximum", high)
            self.note("warning", f"{beyond} its {bound} {limit:g}; nothing sent")
            return
        self._command(knob, value)

    def action_send(self, knob: str, value: str) -> None:
        """Send ``knob=value``, a command such as ``checkpoint=now``.

        Or say that the run has no such command."""
        with self.source.lock:
            known = knob in self.source.state.schema
            absent = self.source.state.absent.get(knob)
        if not known:
            self.note("warning", (refusal(knob, absent) if absent is not None
                                  else f"this run has no {knob} command") + "; nothing sent")
            return
        self._command(knob, value)

    def action_pause(self, knob: str) -> None:
        """Pause the run at the next boundary with the ``knob`` command, or let a paused one go on.

        ``knob``: ``pause``."""
        with self.source.lock:
            paused = self.source.state.paused_after is not None
        self.action_send(knob, "off" if paused else "on")

    # the app's own "toggle" action (of a boolean knob), in place of DOMNode's coroutine
    # that toggles an attribute: nothing here binds that one
    def action_toggle(self, knob: str) -> None:  # type: ignore[override]
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
            elif name in state.absent:  # the run's own words, as `gpuwatch set` gets
                reason = refusal(name, state.absent[name])
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

    def _command(self, knob: str, value: Any, described: str | None = None, *,
                 ask: bool = True, then: Callable[[], None] | None = None) -> None:
        """Send ``knob=value`` (``described`` for people, by default the assignment; the
        reply is logged when it comes), then call ``then``; or say why not. With
        ``ask`` (and quick keys off) it asks first (see :meth:`on_key`)."""
        described = described or assignment(knob, value)
        if self.source.info is None:
            self.note("warning", f"a replay takes no commands: {described} not sent")
        elif self.readonly:
            self.note("warning", f"read-only: {described} not sent")
        elif self.source.state.ended is not None:
            self.note("warning", f"the run has ended: {described} not sent")
        elif ask and not self.quick_keys:
            what, brief = self._what(knob, value, described)
            self._ask(Question(knob, value, described, what, self._key, time.monotonic(),
                               then, brief))
        else:
            self.note("info", f"sent {described}")
            self._send(knob, value)
            if then is not None:
                then()

    def _what(self, knob: str, value: Any, described: str) -> tuple[str, str]:
        """What sending ``knob=value`` will do, for its question, and a brief form of it.

        ``precision fp32 → bf16 at the next step`` (brief: without ``at the next
        step``); a command: what its key's press does (:meth:`KnobKey.question_of`,
        ``pause=on: hold the training at the next step``, brief: without ``pause=on:``),
        else its help; else ``described``."""
        with self.source.lock:
            state = self.source.state
            spec = state.schema.get(knob) or {}
            known, current = knob in state.knobs, state.knobs.get(knob)
            pending = state.pending.get(knob)  # on its way: the key stepped from it
        if pending is not None:
            current = pending.value
        if spec.get("kind") in COMMAND_KINDS:
            standard = STANDARD_KNOBS.get(knob)
            said = next((key.question_of(value) for key in (standard.keys if standard else ())
                         if key.key == self._key and key.question_of(value)), "")
            text = said or str(spec.get("help", ""))
            return f"{described}: {text}", text
        if known:
            change = f"{knob} {knob_text(current)} → {knob_text(value)}"
            return f"{change} at the next step", change
        return described, described

    def _ask(self, question: Question | None, *, why: str = "") -> None:
        """Show ``question`` over the footer, or close the one open (None); one open
        until now is not sent, and the event log says so (``why``: the reason)."""
        if self._question is not None:
            self.note("info", f"{self._question.described} not sent{why}")
        self._show_question(question)

    def _show_question(self, question: Question | None) -> None:
        """Show ``question`` over the footer (None: nothing)."""
        self._question = question
        key = question.key if question is not None else None
        self.query_one(KeyQuestion).show(
            question, self.get_key_display(Binding(key, "")) if key else None)

    @work(thread=True, group="commands")
    def _send(self, knob: str, value: Any) -> tuple[str, Any, protocol.Reply]:
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
        result = event.worker.result
        assert result is not None  # a "commands" worker returns (knob, value, reply)
        knob, value, reply = result
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
