"""The dashboard's model of one run: decoded envelopes folded into bounded buffers.

Pure Python (no textual, no zmq), so it is fast and tested on its own. A source (the live
socket, a replay file) feeds every received frame or envelope to :class:`RunState` under
the source's lock; the app reads the state under the same lock and redraws when
:attr:`RunState.version` moved or :attr:`RunState.status` changed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, NamedTuple

from agent import protocol

#: Step records kept for the charts (about 10 minutes at one step a second).
STEP_HISTORY = 600
#: Activation-memory measurements kept (one every ~20 steps: thousands of steps).
ACTIVATION_HISTORY = 200
#: Agent events kept for the event log.
EVENT_HISTORY = 200
#: No message for this long (s): the run is "gone".
GONE_AFTER_S = 3.0
#: Messages but no optimizer step for this long (s): the run is "stalled".
STALLED_AFTER_S = 5.0


class StepRecord(NamedTuple):
    """One optimizer step as the charts and sparklines need it (times in s, shares in
    0..1, throughput in samples/s, memory in bytes; None where the record lacks it)."""

    step: int | None
    step_time_s: float | None
    data_wait_s: float | None
    data_wait_share: float | None
    samples_per_s: float | None
    loss: float | None
    mem_peak_reserved_bytes: float | None = None
    host_rss_bytes: float | None = None
    #: bytes saved for backward by a micro-batch, as last measured (the run measures
    #: every few steps; carried forward in between)
    activation_bytes: float | None = None
    #: tokens per second, for token models that report tokens
    tokens_per_s: float | None = None


class RankPace(NamedTuple):
    """How one rank of a run of several is doing: its latest optimizer step, its step
    time smoothed over about :data:`RANK_PACE_STEPS` steps (s), and when it was last
    heard (monotonic s)."""

    step: int | None
    step_time_s: float | None
    heard_at: float


#: Steps the per-rank step time is smoothed over (an exponential moving average).
RANK_PACE_STEPS = 20
#: Latest steps whose knob values are kept per rank, to compare ranks at one step.
RANK_KNOB_STEPS = 8


class LogEntry(NamedTuple):
    """A line for the event log: ``level`` is info, warning or error; ``t`` is when the
    run said it (unix time, s), None for the dashboard's own lines."""

    level: str
    text: str
    t: float | None = None


class Pending(NamedTuple):
    """A command the agent accepted but has not applied yet."""

    value: Any
    apply_step: int | None


class SeqGaps:
    """Counts records lost between sender and receiver from each sender's ``seq``.

    Gaps are counted per ``(run, rank)``. A ``seq`` that goes backwards (the sender
    restarted) starts the count afresh instead of counting a gap.
    """

    def __init__(self) -> None:
        self.missed = 0
        """Records lost so far (sum of all gaps)."""
        self._last: dict[tuple[Any, Any], int] = {}

    def observe(self, message: dict[str, Any]) -> None:
        """Account for one envelope; envelopes without an integer ``seq`` are skipped."""
        seq = message.get("seq")
        if type(seq) is not int:
            return
        key = (message.get("run"), message.get("rank"))
        last = self._last.get(key)
        if last is not None and seq > last + 1:
            self.missed += seq - last - 1
        self._last[key] = seq


_MISSING = object()


def _max(*values: float | None) -> float | None:
    """The largest of the values that are not None; None if all are."""
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _number(value: Any) -> float | None:
    """A wire number as float; None for missing or non-numeric values (bool included)."""
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:  # beyond any float (e.g. 10**400 in a hand-made log)
            return None
    return None


#: Event kinds that settle a pending command (it was applied, or it failed).
_SETTLING_KINDS = frozenset({"applied", "failed", "rolled_back", "cancelled"})
#: Event kinds that end a "compiling" phase (besides the first step record after it).
_COMPILE_END_KINDS = frozenset({"compiled", "failed"})


class RunState:
    """Everything the dashboard knows about one run, in bounded memory.

    Attributes (read them under the source's lock):
        run_id: from the first envelope. hello: the latest ``hello`` body.
        schema: knob schema by name (wire maps: ``name``, ``kind``, ``choices``, ``min``,
            ``max``, ``help``). knobs: current knob values by name.
        knob_changed_at: monotonic time (s) a knob's value last changed.
        pending: accepted commands not applied yet, by knob name.
        steps: the last :data:`STEP_HISTORY` step records; steps_total counts all ever.
        last_step: the latest ``step`` body (memory, data-wait verdict). step: the last
            completed optimizer step.
        host_rss_peak_bytes: the largest host RSS of the training process seen, or the
            run's own peak (``host_peak_rss_bytes``, ``ru_maxrss``) when larger; None
            until a step record has one.
        activation_bytes: the latest ``activation_bytes`` a step record carried (bytes
            saved for backward by a micro-batch), or None. activation_before_bytes:
            the measurement before the latest change of more than 5% (e.g. before
            checkpointing was turned on), or None. activation_history: the last
            :data:`ACTIVATION_HISTORY` measurements as ``(step, bytes)``.
        compiling_since: monotonic time (s) of a ``compiling`` event whose end (a
            ``compiled`` or ``failed`` event, or the step it applied at) has not come.
        agent_records_dropped, agent_errors: the agent's own counts from its latest
            heartbeat (records its queue dropped; internal errors, training goes on).
        system: the latest ``system`` body, or None. ended: the ``bye`` body, or None
            (cleared if the same run id speaks again: it was restarted).
        tune: the latest ``tune`` body (the in-run search: status, best, candidates),
            or None before any search.
        events: the last :data:`EVENT_HISTORY` log entries; events_total counts all ever.
        records: envelopes ingested. missed: records lost (sequence gaps).
        message_t: the ``t`` (unix time, s) of the latest envelope, None if it had none.
        primary_rank: the rank whose records fill the charts, panels and log (the first
            rank heard, unless given). ranks: :class:`RankPace` of every rank heard; the
            other ranks' records update only that, and their warnings and errors go to
            the log with the rank named.
        malformed: frames or bodies that could not be read (dropped, never raised).
        version: bumped on every change; compare it to know whether to redraw.
    """

    def __init__(self, primary_rank: int | None = None) -> None:
        self.primary_rank = primary_rank
        self.ranks: dict[int, RankPace] = {}
        #: knob values of each rank's latest few steps: {rank: {step: knobs}}
        self._rank_knobs: dict[int, dict[int, dict[str, Any]]] = {}
        self.run_id: str | None = None
        self.hello: dict[str, Any] = {}
        self.schema: dict[str, dict[str, Any]] = {}
        #: ids of the commands this dashboard sent (bounded by the person's key presses)
        self.own_command_ids: set[str] = set()
        self.knobs: dict[str, Any] = {}
        self.knob_changed_at: dict[str, float] = {}
        self.pending: dict[str, Pending] = {}
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.steps_total = 0
        self.last_step: dict[str, Any] = {}
        self.step: int | None = None
        self.host_rss_peak_bytes: float | None = None
        self.activation_bytes: float | None = None
        self.activation_before_bytes: float | None = None
        self.activation_history: deque[tuple[int | None, float]] = deque(
            maxlen=ACTIVATION_HISTORY)
        self.compiling_since: float | None = None
        self._compiling_until_step: int | None = None
        self.agent_records_dropped = 0
        self.agent_errors = 0
        self.system: dict[str, Any] | None = None
        self.tune: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None
        self.events: deque[LogEntry] = deque(maxlen=EVENT_HISTORY)
        self.events_total = 0
        self.records = 0
        self.malformed = 0
        self.version = 0
        self.first_seen_at: float | None = None
        self.last_seen_at: float | None = None
        self.last_step_at: float | None = None
        self.message_t: float | None = None
        self._gaps = SeqGaps()
        self._fold: dict[str, Callable[[dict[str, Any], float], None]] = {
            protocol.HELLO: self._fold_hello,
            protocol.STEP: self._fold_step,
            protocol.SYSTEM: self._fold_system,
            protocol.STATE: self._fold_state,
            protocol.EVENT: self._fold_event,
            protocol.HEARTBEAT: self._fold_heartbeat,
            protocol.BYE: self._fold_bye,
            protocol.TUNE: self._fold_tune,
        }

    @property
    def missed(self) -> int:
        """Records lost between the run and this dashboard (sequence gaps)."""
        return self._gaps.missed

    def ingest_frames(self, frames: list[bytes], now: float | None = None) -> None:
        """Decode a received multipart message and fold it; count it if malformed.

        Args:
            frames: ``[topic, payload]`` as received. now: receive time, monotonic s.
        """
        try:
            message = protocol.decode_frames(frames)
        except protocol.ProtocolError:
            self.malformed += 1
            self.version += 1
            return
        self.ingest(message, now)

    def ingest(self, message: dict[str, Any], now: float | None = None) -> None:
        """Fold one decoded envelope.

        Unknown types and extra fields are ignored; a body whose fields have the wrong
        types is counted in :attr:`malformed` and otherwise ignored, never raised.

        Args:
            message: an envelope as :func:`agent.protocol.decode` returns it.
            now: receive time, monotonic s (``time.monotonic()`` when omitted).
        """
        if now is None:
            now = time.monotonic()
        self.records += 1
        self.version += 1
        rank = message.get("rank")
        if type(rank) is int:
            if self.primary_rank is None:
                self.primary_rank = rank
            if rank != self.primary_rank:
                self._gaps.observe(message)
                self._fold_other_rank(rank, message, now)
                return
        self.last_seen_at = now
        t = message.get("t")
        self.message_t = t if type(t) is float or type(t) is int else None
        if self.first_seen_at is None:
            self.first_seen_at = now
            self.run_id = message.get("run")
        self._gaps.observe(message)
        msg_type = message.get("type")
        if self.ended is not None and msg_type != protocol.BYE:
            self.ended = None  # the same run id speaks after bye: restarted by its agent
            self.first_seen_at, self.last_step_at = now, None  # stalled counts afresh
            self.log("info", "run restarted (records after its bye)", self.message_t)
        fold = self._fold.get(msg_type)  # type: ignore[arg-type]
        if fold is None:
            return
        try:
            fold(message.get("body") or {}, now)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.malformed += 1

    def _fold_other_rank(self, rank: int, message: dict[str, Any], now: float) -> None:
        body = message.get("body")
        if not isinstance(body, dict):
            self.malformed += 1
            return
        msg_type = message.get("type")
        if msg_type == protocol.STEP:
            self._note_pace(rank, body, now)
        elif msg_type == protocol.EVENT and body.get("level") in ("warning", "error"):
            t = message.get("t")
            self.log(body["level"], f"rank {rank}: {body.get('text', '')}",
                     t if type(t) is float or type(t) is int else None)
        elif rank in self.ranks:  # heard: a heartbeat, hello, ...
            self.ranks[rank] = self.ranks[rank]._replace(heard_at=now)

    def _note_pace(self, rank: int, body: dict[str, Any], now: float) -> None:
        step = body.get("step")
        step_time = _number(body.get("step_time_s"))
        previous = self.ranks.get(rank)
        smoothed = previous.step_time_s if previous is not None else None
        if step_time is not None and step_time >= 0:
            smoothed = step_time if smoothed is None else (
                smoothed + (step_time - smoothed) / RANK_PACE_STEPS)
        self.ranks[rank] = RankPace(step if type(step) is int else None, smoothed, now)
        knobs = body.get("knobs")
        if type(step) is int and isinstance(knobs, dict):
            recent = self._rank_knobs.setdefault(rank, {})
            recent[step] = knobs
            for old in sorted(recent)[:-RANK_KNOB_STEPS]:
                del recent[old]

    def knobs_differ(self) -> tuple[int, int, str, Any, Any] | None:
        """A knob whose value at one optimizer step differs between the shown rank and
        another: ``(rank, step, knob, shown rank's value, that rank's value)``, or None.
        Commands apply at one step on every rank; this catches what went wrong anyway."""
        shown = self._rank_knobs.get(self.primary_rank) if self.primary_rank is not None \
            else None
        if not shown:
            return None
        for rank, recent in self._rank_knobs.items():
            if rank == self.primary_rank:
                continue
            for step in sorted(set(shown) & set(recent), reverse=True):
                for knob, value in shown[step].items():
                    other = recent[step].get(knob, value)
                    if other != value:
                        return rank, step, knob, value, other
        return None

    def slowest_rank(self, now: float) -> tuple[int, float] | None:
        """With two or more ranks heard within :data:`GONE_AFTER_S`: the rank with the
        longest smoothed step time and how much longer it is than the fastest's (0.08:
        8%); else None. Under data parallelism every rank waits for the slowest at each
        gradient all-reduce, so a straggler sets the pace of all."""
        paces = [(pace.step_time_s, rank) for rank, pace in self.ranks.items()
                 if pace.step_time_s and now - pace.heard_at <= GONE_AFTER_S]
        if len(paces) < 2:
            return None
        slowest, fastest = max(paces), min(paces)
        return slowest[1], slowest[0] / fastest[0] - 1.0

    def status_at(self, now: float) -> str:
        """The run's status at monotonic time ``now`` (s); see :attr:`status`."""
        if self.ended is not None:
            return "ended"
        if self.last_seen_at is None or self.first_seen_at is None:
            return "waiting"
        if now - self.last_seen_at > GONE_AFTER_S:
            return "gone"
        if self.compiling_since is not None:
            return "compiling"
        if now - (self.last_step_at or self.first_seen_at) > STALLED_AFTER_S:
            return "stalled"
        return "live"

    @property
    def status(self) -> str:
        """``waiting`` (nothing received yet), ``live``, ``compiling`` (a ``compiling``
        event has come and not its end: steps are slow, not stalled), ``stalled``
        (messages but no step for :data:`STALLED_AFTER_S`), ``gone`` (no message,
        heartbeats included, for :data:`GONE_AFTER_S`) or ``ended`` (the run said
        ``bye``). A gone run whose messages come back is live again."""
        return self.status_at(time.monotonic())

    def note_pending(self, knob: str, value: Any, apply_step: int | None) -> None:
        """Remember an accepted command until a record shows it applied (or an event
        says it failed); nothing to remember if the knob already has that value (the
        step that applied it can arrive before the reply is handled)."""
        if self.knobs.get(knob, _MISSING) != value:
            self.pending[knob] = Pending(value, apply_step)
            self.version += 1

    def log(self, level: str, text: str, t: float | None = None) -> None:
        """Append a line to the event log (``t``: when the run said it, unix s)."""
        self.events.append(LogEntry(level, text, t))
        self.events_total += 1
        self.version += 1

    def _fold_hello(self, body: dict[str, Any], now: float) -> None:
        self.hello = body
        self.schema = {knob["name"]: knob for knob in body.get("knobs") or ()
                       if isinstance(knob, dict) and isinstance(knob.get("name"), str)}

    def _fold_step(self, body: dict[str, Any], now: float) -> None:
        step = body.get("step")
        if type(step) is not int:
            step = None
        rss = _number(body.get("host_rss_bytes"))
        peak_reserved = _number(body.get("mem_peak_reserved_bytes"))
        activation = _number(body.get("activation_bytes"))
        if activation is not None and activation >= 0:
            current = self.activation_bytes
            if current is not None and abs(activation - current) > 0.05 * current:
                self.activation_before_bytes = current
            self.activation_bytes = activation
            self.activation_history.append((step, activation))
        self.steps.append(StepRecord(
            step, _number(body.get("step_time_s")), _number(body.get("data_wait_s")),
            _number(body.get("data_wait_share")), _number(body.get("samples_per_s")),
            _number(body.get("loss")), peak_reserved, rss, self.activation_bytes,
            _number(body.get("tokens_per_s"))))
        self.steps_total += 1
        if self.primary_rank is not None:
            self._note_pace(self.primary_rank, body, now)
        if step is not None:
            self.step = step
        self.last_step = body
        self.last_step_at = now
        self.host_rss_peak_bytes = _max(self.host_rss_peak_bytes, rss,
                                        _number(body.get("host_peak_rss_bytes")),
                                        _number(body.get("host_rss_peak_bytes")))
        if self.compiling_since is not None and (
                self._compiling_until_step is None
                or (step is not None and step >= self._compiling_until_step)):
            self.compiling_since = None  # the step that compiled has completed
        knobs = body.get("knobs")
        if knobs:
            self._set_knobs(knobs, now)

    def _fold_system(self, body: dict[str, Any], now: float) -> None:
        self.system = body

    def _fold_state(self, body: dict[str, Any], now: float) -> None:
        if type(body.get("step")) is int:
            self.step = body["step"]
        knobs = body.get("knobs")
        if knobs:
            self._set_knobs(knobs, now)

    def _fold_event(self, body: dict[str, Any], now: float) -> None:
        if body.get("kind") == "rejected" and body.get("id") in self.own_command_ids:
            return  # this dashboard's own command: its reply says it already
        level = body.get("level")
        self.log(level if level in ("info", "warning", "error") else "info",
                 str(body.get("text", "")), self.message_t)
        knob = body.get("knob")
        kind = body.get("kind")
        if kind in _SETTLING_KINDS and knob in self.pending:
            del self.pending[knob]
        if kind in ("applied", "rolled_back") and isinstance(knob, str) and "value" in body:
            # the run says so before the next step record (which can be seconds away):
            # a key pressed again meanwhile must start from the new value
            self._set_knobs({knob: body["value"]}, now)
        if kind == "compiling":
            self.compiling_since = now
            step = body.get("step")  # the step it compiles in, when the agent says
            self._compiling_until_step = step if type(step) is int else None
        elif kind in _COMPILE_END_KINDS:
            self.compiling_since = None

    def _fold_tune(self, body: dict[str, Any], now: float) -> None:
        candidates = body.get("candidates")
        if not isinstance(candidates, list) or not all(isinstance(c, dict)
                                                       for c in candidates):
            raise ValueError("tune candidates must be a list of maps")
        self.tune = body

    @property
    def tuning(self) -> bool:
        """Whether an in-run search is running (as its latest ``tune`` record says)."""
        return self.tune is not None and self.tune.get("status") == "running"

    def _fold_heartbeat(self, body: dict[str, Any], now: float) -> None:
        if type(body.get("step")) is int:
            self.step = body["step"]
        for key, attribute in (("records_dropped", "agent_records_dropped"),
                               ("errors", "agent_errors")):
            value = body.get(key)
            if type(value) is int:
                setattr(self, attribute, value)

    def _fold_bye(self, body: dict[str, Any], now: float) -> None:
        self.ended = body
        steps = body.get("steps")
        self.log("info", f"run ended ({body.get('reason') or 'no reason given'})"
                 + (f" after {steps} steps" if steps is not None else ""), self.message_t)

    def _set_knobs(self, knobs: dict[str, Any], now: float) -> None:
        for name, value in knobs.items():
            if name in self.knobs and self.knobs[name] == value:
                continue
            if name in self.knobs:
                self.knob_changed_at[name] = now
            self.knobs[name] = value
            pending = self.pending.get(name)
            if pending is not None and pending.value == value:
                del self.pending[name]
