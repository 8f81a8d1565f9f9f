"""The dashboard's model of one run: decoded envelopes folded into bounded buffers.

Pure Python (no textual, no zmq), so it is fast and tested on its own. A source (the live
socket, a replay file) feeds every received frame or envelope to :class:`RunState` under
the source's lock; the app reads the state under the same lock and redraws when
:attr:`RunState.version` moved or :attr:`RunState.status` changed.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import islice, repeat
from typing import Any, Callable, NamedTuple

from agent.wire import protocol
from agent.wire.protocol import MAX_NAME_CHARS, MAX_TEXT_CHARS, shorten
from agent.wire.runlog import MAX_BRANCHES, BranchTree
from gpuwatch.units import counted, human_age, human_duration

#: Step records kept for the charts (about 10 minutes at one step a second).
STEP_HISTORY = 600
#: Activation-memory measurements kept (one every ~20 steps: thousands of steps).
ACTIVATION_HISTORY = 200
#: Agent events kept for the event log.
EVENT_HISTORY = 200
#: No message for this long (s): the run is "gone", unless its process is known to be
#: alive (see :attr:`RunState.process_alive`).
GONE_AFTER_S = 3.0
#: No message for this long (s) from a run whose process is alive: "quiet" (a loaded
#: machine can delay a heartbeat by seconds; a run is not called gone for it).
QUIET_AFTER_S = 15.0
#: Messages but no optimizer step for this long (s), or for :data:`STALL_STEPS` of the
#: run's own recent longest step time when that is longer: the run is "stalled".
STALLED_AFTER_S = 5.0
STALL_STEPS = 3
#: Latest steps whose time sets how long a run may go without a step.
STALL_WINDOW_STEPS = 20
#: Commands that hold the run at a boundary while they work, and its status meanwhile
#: (an evaluation can take minutes: no step then is not a stall).
BUSY_STATUSES = {"evaluate": "evaluating", "checkpoint": "saving"}
#: Entries kept of one map or list from the wire (a knob schema has dozens).
MAX_ITEMS = 256
#: Nesting kept of a value from the wire; deeper parts become None.
MAX_DEPTH = 6
#: Knobs, and ranks, a run may have in the dashboard's memory; more are ignored (a
#: rank's pace is about 150 bytes: 65,536 ranks, 8,192 nodes of 8, hold 10 MB; 1,024
#: left 7,168 ranks of a job of 1,024 nodes unseen).
MAX_KNOBS = 128
MAX_RANKS = 1 << 16


#: Values (strings, numbers, maps, lists) kept of one message's body at most: a body
#: of a million tiny maps (1 MB of msgpack) costs no more than this to keep.
MAX_VALUES = 4096


def bounded(value: Any) -> Any:
    """A copy of a wire value that the dashboard may keep: bounded in size, whatever the value.

    Strings cut to :data:`~agent.wire.protocol.MAX_TEXT_CHARS` (map keys to
    :data:`~agent.wire.protocol.MAX_NAME_CHARS`), maps and lists to their first
    :data:`MAX_ITEMS` entries, nesting to :data:`MAX_DEPTH`, :data:`MAX_VALUES` values in
    all (what is beyond becomes None), values of other types (bytes, ...) None. Numbers,
    booleans and None are kept as they are. Costs at most about :data:`MAX_VALUES` steps,
    whatever the value."""
    budget = [MAX_VALUES]

    def copy(value: Any, depth: int) -> Any:
        kind = type(value)
        if kind is str:
            return value if len(value) <= MAX_TEXT_CHARS else shorten(value)
        if kind is int or kind is float or kind is bool or value is None:
            return value
        budget[0] -= 1
        if depth >= MAX_DEPTH or budget[0] < 0:
            return None
        if kind is dict:
            kept = {}
            for key, item in islice(value.items(), MAX_ITEMS):
                budget[0] -= 1
                if budget[0] < 0:
                    break
                kept[shorten(key, MAX_NAME_CHARS) if type(key) is str else key] = copy(
                    item, depth + 1)
            return kept
        if kind is list or kind is tuple:
            kept_items = []
            for item in value[:MAX_ITEMS]:
                budget[0] -= 1
                if budget[0] < 0:
                    break
                kept_items.append(copy(item, depth + 1))
            return kept_items
        return None

    return copy(value, 0)


class StepRecord(NamedTuple):
    """One optimizer step as the charts and sparklines need it.

    Times in s, shares in 0..1, throughput in samples/s, memory in bytes; None where the
    record lacks it."""

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


#: The run's recent pace is measured over its latest steps whose step times add up to
#: this (s): the timing chart's title and the throughput's number are that window's
#: means, so one slow step (a checkpoint, an evaluation, a GC pause) moves them by its
#: share of the window, not to its own time.
RECENT_S = 10.0


class RecentSteps(NamedTuple):
    """The latest step records that make up the run's recent pace (see :func:`recent_steps`).

    ``records``: oldest first, each with a finite step time; ``span_s``: their step times
    added up (s, :data:`RECENT_S` or more unless the kept steps add up to less)."""

    records: list[StepRecord]
    span_s: float

    @property
    def label(self) -> str:
        """What the figures over these steps are, as the dashboard says it: ``10s mean``.

        The window's span, then ``mean``: :data:`RECENT_S` when full (the oldest step
        straddles its start, so the label does not flicker from 10 to 12 s as steps come),
        fewer seconds while the kept steps add up to less (``600ms`` under 1 s), the
        newest step's own time when it alone is longer (``1m05s mean``)."""
        newest = (self.records[-1].step_time_s or 0.0) if self.records else 0.0
        span_s = min(self.span_s, max(RECENT_S, newest))
        span = human_age(span_s) if span_s >= 1 else human_duration(span_s).replace(" ", "")
        return f"{span} mean"

    def mean(self, field: str, scale: float = 1.0) -> float | None:
        """The mean of ``field`` over the records that have a finite value of it.

        Times ``scale``; None when none has. Costs O(records)."""
        values = [value for record in self.records
                  if (value := getattr(record, field)) is not None and math.isfinite(value)]
        return sum(values) / len(values) * scale if values else None

    def rate(self, field: str) -> float | None:
        """A per-second ``field`` (``samples_per_s``, ``tokens_per_s``) over the window.

        What its records counted divided by their time (each step weighs its time, as the
        wall clock does), over the records that have it; None when none has (or their
        time is 0). Costs O(records)."""
        amount = time_s = 0.0
        for record in self.records:
            value, step_time_s = getattr(record, field), record.step_time_s or 0.0
            if value is not None and math.isfinite(value):
                amount += value * step_time_s
                time_s += step_time_s
        return amount / time_s if time_s > 0 else None


def recent_steps(records: Sequence[StepRecord]) -> RecentSteps:
    """The latest of ``records`` (oldest first) whose step times add up to :data:`RECENT_S`.

    All of them when they add up to less; records without a finite, non-negative step
    time are left out (they have no place in a window of time). Costs O(steps in the
    window), at most O(records)."""
    kept: list[StepRecord] = []
    span_s = 0.0
    for record in reversed(records):
        step_time_s = record.step_time_s
        if step_time_s is None or not math.isfinite(step_time_s) or step_time_s < 0:
            continue
        kept.append(record)
        span_s += step_time_s
        if span_s >= RECENT_S:
            break
    kept.reverse()
    return RecentSteps(kept, span_s)


#: A StepRecord from a tuple of its fields, without NamedTuple's Python-level __new__.
_step_record = partial(tuple.__new__, StepRecord)
_FLOATS = {float}
_INTS = {int}


class RankPace(NamedTuple):
    """How one rank of a run of several is doing: its latest step, step time, when last heard.

    Its latest optimizer step, its step time smoothed over about :data:`RANK_PACE_STEPS`
    steps (s), and when it was last heard (monotonic s)."""

    step: int | None
    step_time_s: float | None
    heard_at: float


#: Steps the per-rank step time is smoothed over (an exponential moving average).
RANK_PACE_STEPS = 20
#: Latest steps whose knob values are kept per rank, to compare ranks at one step.
RANK_KNOB_STEPS = 8


class NodePace(NamedTuple):
    """One node of a multi-node job as its relay sums it up (``node`` messages).

    Its host, the global ranks it has and has been heard from, its ranks' mean data-wait
    share (0..1, None when unknown), and when the summary came (monotonic s)."""

    node: int
    host: str
    expected: int
    heard: int
    data_wait_share: float | None
    heard_at: float


#: Nodes a run may have in the dashboard's memory; more are ignored.
MAX_NODES = 4096


class LogEntry(NamedTuple):
    """A line for the event log, with its level and when the run said it.

    ``level`` is info, warning or error; ``t`` is when the run said it (unix time, s), None
    for the dashboard's own lines."""

    level: str
    text: str
    t: float | None = None


class Pending(NamedTuple):
    """A command the agent accepted but has not applied yet."""

    value: Any
    apply_step: int | None


class KnobChange(NamedTuple):
    """A knob's value changed at optimizer ``step``, at unix time ``t``, from ``before``.

    ``step``: the step whose record first has ``value``, or the step an ``applied`` event
    names; ``t`` in s, None when unknown; ``before`` is the value it had."""

    step: int
    t: float | None
    knob: str
    before: Any
    value: Any


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


_KIND = protocol.EventKind


class RunState:
    """Everything the dashboard knows about one run, in bounded memory.

    What it keeps from the wire is bounded as it is folded: texts cut to
    :data:`~agent.wire.protocol.MAX_TEXT_CHARS`, names to
    :data:`~agent.wire.protocol.MAX_NAME_CHARS`, maps and lists to :data:`MAX_ITEMS`, at most
    :data:`MAX_KNOBS` knobs and :data:`MAX_RANKS` ranks (see :func:`bounded`). Control
    characters are kept (a panel or the log shows them visibly, never raw).

    Attributes (read them under the source's lock):
        run_id: from the first envelope. hello: the latest ``hello`` body.
        schema: knob schema by name (wire maps: ``name``, ``kind``, ``choices``, ``min``,
            ``max``, ``help``). absent: knobs the run cannot have, by name, with its
            reason (what the loop would declare to have one; the hello's ``absent``).
            knobs: current knob values by name.
        knob_changed_at: monotonic time (s) a knob's value last changed.
        knob_changes: the last :data:`EVENT_HISTORY` changes of knob values, as
            :class:`KnobChange` (the charts mark them).
        pending: accepted commands not applied yet, by knob name.
        steps: the last :data:`STEP_HISTORY` step records; steps_total counts all ever.
        last_step: the latest ``step`` body as received (memory, data-wait verdict; one
            body of at most the receive limit: panels cut what they draw). step: the last
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
            ``compiled`` or ``failed`` event, or the step it applied at) has not come;
            or of the start of a compile a ``system`` sample reports (a recompile no
            event announced), until the next step.
        agent_records_dropped, agent_errors, agent_commands_rejected: the agent's own
            counts from its latest heartbeat (records its queue dropped; internal
            errors, training goes on; commands it rejected: bad token, knob or value).
        system: the latest ``system`` body, or None. ended: the ``bye`` body, or None
            (cleared if the same run id speaks again: it was restarted).
        tune: the latest ``tune`` body (the in-run search: status, best, candidates),
            or None before any search.
        events: the last :data:`EVENT_HISTORY` log entries; events_total counts all ever
            logged (not those :meth:`add_earlier` puts first). log_epoch: bumped when
            lines are put before those logged (the run's events from before the
            dashboard joined, :meth:`add_earlier`): the log is drawn afresh.
        joined: ``(seq, type, t)`` of the first envelope of the shown rank folded (where
            the run log's records and the live ones meet), None before one with a seq.
        records: envelopes ingested. missed: records lost (sequence gaps).
        message_t: the ``t`` (unix time, s) of the latest envelope, None if it had none.
        primary_rank: the rank whose records fill the charts, panels and log (the first
            rank heard, unless given). ranks: :class:`RankPace` of every rank heard; the
            other ranks' records update only that, and their warnings and errors go to
            the log with the rank named.
        nodes, rank_nodes: in a multi-node job, each node's :class:`NodePace` and the
            node of each rank, from the nodes' relays (the ranks of another node are
            known from its summary, about once a second) and the job's store
            (:meth:`list_ranks`).
        malformed: frames or bodies that could not be read (dropped, never raised).
        version: bumped on every change; compare it to know whether to redraw.
    """

    def __init__(self, primary_rank: int | None = None) -> None:
        self.primary_rank = primary_rank
        self.ranks: dict[int, RankPace] = {}
        #: multi-node jobs: each node's summary (its relay's ``node`` messages), and the
        #: node of each rank they named
        self.nodes: dict[int, NodePace] = {}
        self.rank_nodes: dict[int, int] = {}
        #: the node of each rank as the job's store (or this machine's run files) lists
        #: it: a summary of another node does not speak for it
        self._listed: dict[int, int] = {}
        #: ranks whose pace comes from node summaries (not from their own records)
        self._relayed: set[int] = set()
        #: knob values of each rank's latest few steps: {rank: {step: knobs}}
        self._rank_knobs: dict[int, dict[int, dict[str, Any]]] = {}
        self.run_id: str | None = None
        self.hello: dict[str, Any] = {}
        self.schema: dict[str, dict[str, Any]] = {}
        self.absent: dict[str, str] = {}
        #: ids of the commands this dashboard sent (bounded by the person's key presses)
        self.own_command_ids: set[str] = set()
        self.knobs: dict[str, Any] = {}
        self.knob_changed_at: dict[str, float] = {}
        self.knob_changes: deque[KnobChange] = deque(maxlen=EVENT_HISTORY)
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
        #: how long each compile of this run took (s, as the dashboard saw it), oldest
        #: first: the estimate shown while the next one runs
        self.compile_durations_s: list[float] = []
        self._compiling_until_step: int | None = None
        #: the graph torch.compile is compiling now, from the latest ``system`` sample
        #: (``graph``: Dynamo's compile id ``frame/attempt``, ``kind``: forward or
        #: backward, ``number``: its place in this compile, from 1), or None
        self.compile_graph: dict[str, Any] | None = None
        self._graphs_before_compile: int | None = None  # the run's count at its start
        self.agent_records_dropped = 0
        self.agent_errors = 0
        self.agent_commands_rejected = 0
        #: True when the source saw the run's process alive (its run file, live pid)
        #: since it last heard from it, False when it saw it gone, None: no way to know
        self.process_alive: bool | None = None
        self.system: dict[str, Any] | None = None
        self.tune: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None
        #: the step after which ``pause=on`` holds the run (None: not paused)
        self.paused_after: int | None = None
        self.events: deque[LogEntry] = deque(maxlen=EVENT_HISTORY)
        self.events_total = 0
        self.log_epoch = 0
        self.joined: tuple[int, Any, float | None] | None = None
        #: knobs (``pause`` included) an event folded here named: the run said what
        #: became of them, so the events before it say nothing newer (:meth:`add_earlier`)
        self._knobs_told: set[str] = set()
        self.records = 0
        self.malformed = 0
        self.version = 0
        self.first_seen_at: float | None = None
        self.last_seen_at: float | None = None
        self.last_step_at: float | None = None
        self.message_t: float | None = None
        #: the latest step's knobs map as received, and as kept (see _step_knobs)
        self._raw_knobs: Any = None
        self._kept_knobs: dict[str, Any] | None = None
        self._gaps = SeqGaps()
        #: the run's branches (the latest record's: :attr:`BranchTree.current`)
        self.tree = BranchTree()
        self._fold: dict[str, Callable[[dict[str, Any], float], None]] = {
            protocol.HELLO: self._fold_hello,
            protocol.STEP: self._fold_step,
            protocol.STEPS: self._fold_steps,
            protocol.SYSTEM: self._fold_system,
            protocol.STATE: self._fold_state,
            protocol.EVENT: self._fold_event,
            protocol.HEARTBEAT: self._fold_heartbeat,
            protocol.BYE: self._fold_bye,
            protocol.TUNE: self._fold_tune,
        }

    def copy(self) -> RunState:
        """An independent copy, to fold on from where this one is (a timeline keeps such copies).

        The containers that folding changes in place are copied; the records and bodies in
        them, never changed once folded, are shared."""
        clone = copy.copy(self)
        for name, value in vars(self).items():
            if type(value) in (dict, set, list):
                setattr(clone, name, value.copy())
            elif type(value) is deque:
                setattr(clone, name, deque(value, maxlen=value.maxlen))
        clone._rank_knobs = {rank: dict(recent) for rank, recent in self._rank_knobs.items()}
        clone._gaps = copy.copy(self._gaps)
        clone._gaps._last = dict(self._gaps._last)
        clone.tree = copy.deepcopy(self.tree)
        clone._fold = {kind: getattr(clone, fold.__name__)
                       for kind, fold in self._fold.items()}
        return clone

    @property
    def shown_step(self) -> int | None:
        """The step shown: the latest step record's, else the last step the run reported.

        The step a person is shown. The latest step record's is what the charts draw; the
        last step reported is a heartbeat's or a ``state``'s, which run ahead of the
        records: the agent sends a step's record once its time is measured."""
        if self.steps and self.steps[-1].step is not None:
            return self.steps[-1].step
        return self.step

    @property
    def missed(self) -> int:
        """Records lost between the run and this dashboard (sequence gaps)."""
        return self._gaps.missed

    def pass_over(self, message: dict[str, Any]) -> None:
        """Account for a record left out on purpose: its ``seq`` is then no gap.

        A replay of one branch's path leaves out the other branches' records, which were
        not lost. Folds nothing else of it."""
        self._gaps.observe(message)

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
            message: an envelope as :func:`agent.wire.protocol.decode` returns it.
            now: receive time, monotonic s (``time.monotonic()`` when omitted).
        """
        if now is None:
            now = time.monotonic()
        self.records += 1
        self.version += 1
        rank = message.get("rank")
        if message.get("type") == protocol.NODE:  # a node's summary, not a rank's record
            try:
                self._fold_node(message.get("body") or {}, now)
            except (TypeError, ValueError, AttributeError, KeyError):
                self.malformed += 1
            return
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
            self.run_id = bounded(message.get("run"))
        self._gaps.observe(message)
        msg_type: Any = message.get("type")  # as decoded: any value; one with no fold is ignored
        if self.joined is None and type(message.get("seq")) is int:
            self.joined = (message["seq"], msg_type, self.message_t)
        if self.ended is not None and msg_type != protocol.BYE:
            self.ended = None  # the same run id speaks after bye: restarted by its agent
            self.first_seen_at, self.last_step_at = now, None  # stalled counts afresh
            self.log("info", "run restarted (records after its bye)", self.message_t)
        fold = self._fold.get(msg_type)
        if fold is None:
            return
        try:
            fold(message.get("body") or {}, now)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.malformed += 1

    def _fold_other_rank(self, rank: int, message: dict[str, Any], now: float) -> None:
        body = message.get("body")
        if not isinstance(body, dict) or (rank not in self.ranks
                                          and len(self.ranks) >= MAX_RANKS):
            self.malformed += 1
            return
        msg_type = message.get("type")
        if msg_type == protocol.STEP:
            self._note_pace(rank, body, now)
        elif msg_type == protocol.STEPS:
            try:
                self._note_batch_pace(rank, body, now)
            except (TypeError, ValueError, AttributeError, KeyError):
                self.malformed += 1
        elif msg_type == protocol.EVENT and body.get("level") in ("warning", "error"):
            t = message.get("t")
            self.log(body["level"], f"rank {rank}: {_text(body.get('text', ''))}",
                     t if type(t) is float or type(t) is int else None)
        elif rank in self.ranks:  # heard: a heartbeat, hello, ...
            self.ranks[rank] = self.ranks[rank]._replace(heard_at=now)

    def list_ranks(self, node: int, ranks: Iterable[int]) -> None:
        """``ranks`` are ``node``'s, as the job's store (or a rank's run file) lists them.

        A node summary naming one of them for another node is not taken for it (a relay
        holds the job secret, but speaks for its own node only: a bug, or a node
        misconfigured, must not show another node's ranks at its pace)."""
        for rank in ranks:
            self._listed[rank] = self.rank_nodes[rank] = node

    def _fold_node(self, body: dict[str, Any], now: float) -> None:
        """A node relay's summary: its ranks' pace (ranks heard directly, the shown one
        or those of this machine, keep their own), and the node's data wait."""
        node = body.get("node")
        if type(node) is not int or (node not in self.nodes
                                     and len(self.nodes) >= MAX_NODES):
            self.malformed += 1
            return
        expected = body.get("expected")
        shares, heard = [], 0
        for entry in (body.get("ranks") or [])[:MAX_ITEMS]:
            rank = entry.get("rank") if isinstance(entry, dict) else None
            if type(rank) is not int or self._listed.get(rank, node) != node:
                continue
            self.rank_nodes[rank] = node
            share = _number(entry.get("data_wait_share"))
            if share is not None:
                shares.append(min(1.0, max(0.0, share)))
            ago = _number(entry.get("heard_s_ago"))
            heard_at = now - ago if ago is not None and ago >= 0 else now
            if ago is not None and ago <= GONE_AFTER_S:
                heard += 1
            known = self.ranks.get(rank)
            if rank == self.primary_rank or (known is not None and known.heard_at > heard_at
                                             and rank not in self._relayed):
                continue  # heard directly, more recently
            if rank not in self.ranks and len(self.ranks) >= MAX_RANKS:
                continue
            self._relayed.add(rank)
            step = entry.get("step")
            self.ranks[rank] = RankPace(step if type(step) is int else None,
                                        _number(entry.get("step_time_s")), heard_at)
        host = body.get("host")
        self.nodes[node] = NodePace(
            node, shorten(host, MAX_NAME_CHARS) if isinstance(host, str) else "",
            len(expected) if isinstance(expected, list) else heard, heard,
            sum(shares) / len(shares) if shares else None, now)

    def silent_nodes(self, now: float) -> list[int]:
        """Nodes whose relay has sent no summary for :data:`GONE_AFTER_S`: commands wait for them.

        Stopped, partitioned, or its relay died: a command to the run is refused until they
        answer again."""
        return sorted(node for node, pace in self.nodes.items()
                      if now - pace.heard_at > GONE_AFTER_S)

    def most_waiting_node(self, now: float) -> tuple[int, float] | None:
        """Of the nodes heard lately, the one whose ranks wait longest for data, and that share.

        Heard within :data:`GONE_AFTER_S`; the share: mean data-wait share, 0..1. None when
        no node summary says. One node's input pipeline starving sets everyone's pace."""
        shares = [(pace.data_wait_share, node) for node, pace in self.nodes.items()
                  if pace.data_wait_share is not None
                  and now - pace.heard_at <= GONE_AFTER_S]
        if not shares:
            return None
        share, node = max(shares)
        return node, share

    def node_of(self, rank: int) -> int | None:
        """The node of ``rank`` in a multi-node job (as a relay named it), or None."""
        return self.rank_nodes.get(rank)

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
        if rank != self.primary_rank:
            knobs = bounded(knobs) if isinstance(knobs, dict) and len(knobs) <= MAX_KNOBS \
                else None
        if type(step) is int and isinstance(knobs, dict):
            recent = self._rank_knobs.setdefault(rank, {})
            recent[step] = knobs
            for old in sorted(recent)[:-RANK_KNOB_STEPS]:
                del recent[old]

    def _note_batch_pace(self, rank: int, body: dict[str, Any], now: float) -> None:
        """:meth:`_note_pace` for the rows of a ``steps`` batch: the step-time average
        over all of them, the knobs of the latest :data:`RANK_KNOB_STEPS`.

        Raises:
            agent.wire.protocol.ProtocolError (a ValueError), TypeError: a malformed batch.
        """
        columns, common = body["columns"], body.get("common", {})
        if not isinstance(common, dict):
            raise protocol.ProtocolError("common must be a map")
        n = body["n"]
        steps = columns["step"]
        if type(n) is not int or type(steps) is not list or len(steps) != n or not n:
            raise protocol.ProtocolError("a steps body needs n and a step column")
        times = columns.get("step_time_s")
        previous = self.ranks.get(rank)
        smoothed = previous.step_time_s if previous is not None else None
        if type(times) is not list:
            times = ()
        elif set(map(type, times)) != _FLOATS or min(times) < 0:  # None, ints, ...
            times = [time_s for time_s in times if type(time_s) is float and time_s >= 0]
        if times and smoothed is None:
            smoothed = times[0]
        share = 1.0 / RANK_PACE_STEPS
        for step_time in times:
            smoothed += (step_time - smoothed) * share
        step = steps[-1]
        self.ranks[rank] = RankPace(step if type(step) is int else None, smoothed, now)
        knob_column = columns.get("knobs")
        if knob_column is None:
            knobs = common.get("knobs")
            if not isinstance(knobs, dict):
                return
            if rank != self.primary_rank:
                knobs = bounded(knobs) if len(knobs) <= MAX_KNOBS else None
            latest = [(step, knobs) for step in steps[-RANK_KNOB_STEPS:]]
        else:
            if type(knob_column) is not list or len(knob_column) != n:
                raise protocol.ProtocolError("the knobs column must hold n values")
            latest = list(zip(steps[-RANK_KNOB_STEPS:], knob_column[-RANK_KNOB_STEPS:]))
            if rank != self.primary_rank:
                latest = [(step, bounded(knobs) if isinstance(knobs, dict)
                           and len(knobs) <= MAX_KNOBS else None) for step, knobs in latest]
        recent = None
        for step, knobs in latest:
            if type(step) is int and isinstance(knobs, dict):
                if recent is None:
                    recent = self._rank_knobs.setdefault(rank, {})
                recent[step] = knobs
        if recent is not None and len(recent) > RANK_KNOB_STEPS:
            for old in sorted(recent)[:-RANK_KNOB_STEPS]:
                del recent[old]

    def knobs_differ(self) -> tuple[int, int, str, Any, Any] | None:
        """A knob whose value at one optimizer step differs between the shown rank and another.

        ``(rank, step, knob, shown rank's value, that rank's value)``, or None. Commands
        apply at one step on every rank; this catches what went wrong anyway."""
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
        """The slowest rank by smoothed step time and how much longer it is than the fastest's.

        With two or more ranks heard within :data:`GONE_AFTER_S` (0.08: 8%); else None.
        Under data parallelism every rank waits for the slowest at each gradient all-reduce,
        so a straggler sets the pace of all."""
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
        judged_at = now
        if now - self.last_seen_at > GONE_AFTER_S:
            if not self.process_alive:  # dead, or no way to know (a log, an endpoint)
                return "gone"
            if now - self.last_seen_at > QUIET_AFTER_S:
                return "quiet"
            judged_at = self.last_seen_at  # unheard is not unstepping: as last heard
        if self.compiling_since is not None:
            return "compiling"
        if self.paused_after is not None and (self.step is None
                                              or self.step <= self.paused_after):
            return "paused"  # at once: the run said so (no step after it: not lost)
        if judged_at - (self.last_step_at or self.first_seen_at) > self.stall_after_s():
            return next((status for knob, status in BUSY_STATUSES.items()
                         if self._due(knob)), "stalled")
        return "live"

    def _due(self, knob: str) -> bool:
        """Whether a command of ``knob`` was accepted for the boundary after the last
        step (so the run is at it) and has not settled."""
        pending = self.pending.get(knob)
        return (pending is not None and pending.apply_step is not None
                and self.step is not None and pending.apply_step <= self.step + 1)

    def stall_after_s(self) -> float:
        """How long this run may go without an optimizer step before it is "stalled".

        :data:`STALLED_AFTER_S`, or :data:`STALL_STEPS` times the longest of its last
        :data:`STALL_WINDOW_STEPS` step times when that is longer (a run of 10 s steps is
        not stalled after 5 s)."""
        longest = 0.0
        for record in islice(reversed(self.steps), STALL_WINDOW_STEPS):
            if record.step_time_s is not None and record.step_time_s > longest:
                longest = record.step_time_s
        return max(STALLED_AFTER_S, STALL_STEPS * longest)

    @property
    def status(self) -> str:
        """The run's status: waiting, live, compiling, stalled, paused, busy, gone, quiet, ended.

        Busy is ``evaluating`` or ``saving``. ``waiting``: nothing received
        yet. ``compiling``: a ``compiling`` event has come and not its end (steps are slow,
        not stalled). ``stalled``: messages but no step for :meth:`stall_after_s` (a
        heartbeat whose step moved counts as a step). ``paused``: ``pause=on`` holds the run
        (:attr:`paused_after`, and no step after it), from its applied event on.
        ``evaluating``, ``saving``: as stalled, but an accepted ``evaluate`` /
        ``checkpoint`` command is due at the boundary after the last step
        (:data:`BUSY_STATUSES`). ``gone``: no message, heartbeats included, for
        :data:`GONE_AFTER_S`, and its process is not known to be alive. ``quiet``: nothing
        heard for :data:`QUIET_AFTER_S` but its process is alive. ``ended``: the run said
        ``bye``. A gone run whose messages come back is live again."""
        return self.status_at(time.monotonic())

    def note_pending(self, knob: str, value: Any, apply_step: int | None) -> None:
        """Remember an accepted command until a record shows it applied or an event that it failed.

        Nothing to remember if the knob already has that value (the step that applied it can
        arrive before the reply is handled)."""
        if self.knobs.get(knob, _MISSING) != value:
            self.pending[knob] = Pending(value, apply_step)
            self.version += 1

    def log(self, level: str, text: str, t: float | None = None) -> None:
        """Append a line to the event log (``t``: when the run said it, unix s), cut in length.

        Cut to :data:`~agent.wire.protocol.MAX_TEXT_CHARS` (the log widget makes its control
        characters visible)."""
        self.events.append(LogEntry(level, _text(text), t))
        self.events_total += 1
        self.version += 1

    def add_earlier(self, earlier: RunState, *, shown: int,
                    activation: tuple[int | None, float] | None = None) -> None:
        """Put the run's past before what this state folded since it joined the run.

        ``earlier`` is the run's records before :attr:`joined` (from its log) folded into
        a state of their own, as the live path folds them. Its last ``shown`` log lines go
        before this state's, after a line counting those left out; its knob values, its
        accepted commands not yet applied, its pause and its branches are taken where
        this state has heard nothing of them (a later event wins); ``activation``
        (``(step, bytes)``, the log's last measurement) where this state has none; its
        last steps (the charts' and the panels') where this state has received none (a
        run paused or stopping when the dashboard came: its panels said "no steps yet").
        Bumps :attr:`log_epoch`; the lines put first are not counted in
        :attr:`events_total` (they were not logged now: nothing holds them as news)."""
        lines = list(earlier.events)[-shown:] if shown > 0 else []
        left_out = earlier.events_total - len(lines)
        if left_out > 0:
            lines.insert(0, LogEntry("info", f"+{left_out:,} earlier events in the run log"))
        if lines:
            self.events = deque([*lines, *self.events], maxlen=EVENT_HISTORY)
            self.log_epoch += 1
        for name, value in earlier.knobs.items():
            if name not in self.knobs and len(self.knobs) < MAX_KNOBS:
                self.knobs[name] = value
        for name, pending in earlier.pending.items():
            if (name not in self._knobs_told and name not in self.pending
                    and self.knobs.get(name, _MISSING) != pending.value):
                self.pending[name] = pending
        if "pause" not in self._knobs_told and self.paused_after is None:
            self.paused_after = earlier.paused_after
        if len(self.tree) == 1 and len(earlier.tree) > 1:
            self.tree = earlier.tree
        if activation is not None and self.activation_bytes is None:
            self.activation_bytes = activation[1]
            self.activation_history.appendleft(activation)
        if not self.steps and earlier.steps:
            self.steps.extend(earlier.steps)
            self.step, self.last_step = earlier.step, earlier.last_step
            self.host_rss_peak_bytes = _max(self.host_rss_peak_bytes,
                                            earlier.host_rss_peak_bytes)
        self.version += 1

    def _fold_hello(self, body: dict[str, Any], now: float) -> None:
        body = bounded(body)
        if not self.hello:  # errors the run had before this dashboard came (no log, ...)
            for text in (body.get("errors") or [])[:10]:
                if isinstance(text, str):
                    self.log("error", f"the run reported: {text}", self.message_t)
        self.hello = body
        knobs = body.get("knobs") or ()
        self.schema = {knob["name"]: knob for knob in knobs[:MAX_KNOBS]
                       if isinstance(knob, dict) and isinstance(knob.get("name"), str)
                       and len(knob["name"]) <= MAX_NAME_CHARS}
        absent = body.get("absent")
        self.absent = {name: reason for name, reason in absent.items()
                       if isinstance(reason, str)} if isinstance(absent, dict) else {}

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
        self.tree.stepped(1, step, step)
        raw_knobs = body.get("knobs")
        knobs = self._step_knobs(raw_knobs) if isinstance(raw_knobs, dict) else None
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
            self._compile_ended(now)  # the step that compiled has completed
        if knobs:
            self._set_knobs(knobs, now)
        elif raw_knobs is not None and knobs is None:
            raise TypeError("knobs must be a map")  # counted as malformed

    def _fold_steps(self, body: dict[str, Any], now: float) -> None:
        """Fold a ``steps`` batch: what :meth:`_fold_step` does for each row, column by
        column (about 1 us a row): the chart records of its rows, the state of its
        latest row. A batch whose knobs changed within it is folded row by row.

        Raises:
            agent.wire.protocol.ProtocolError (a ValueError), TypeError, KeyError: a
                malformed batch (counted in :attr:`malformed` by :meth:`ingest`).
        """
        columns, common = body["columns"], body.get("common", {})
        if "knobs" in columns or not isinstance(common, dict):
            for row in protocol.step_bodies(body):
                self._fold_step(row, now)
            return
        n = body["n"]
        if type(n) is not int or not 0 < n <= protocol.MAX_BATCH_STEPS:
            raise protocol.ProtocolError(f"a steps batch of {n!r} rows")
        for values in columns.values():
            if type(values) is not list or len(values) != n:
                raise protocol.ProtocolError(f"every column must hold {n} values")
        kept = min(n, STEP_HISTORY)  # rows that stay in the charts

        def column(name: str) -> list[float | None] | float | None:
            values = columns.get(name)
            if values is None:
                return _number(common.get(name))
            if kept < n:
                values = values[n - kept:]
            if set(map(type, values)) == _FLOATS:  # the usual case: taken as it is
                return values
            return [value if type(value) is float else _number(value) for value in values]

        steps = columns["step"][n - kept:] if kept < n else columns["step"]
        if set(map(type, steps)) != _INTS:
            steps = [step if type(step) is int else None for step in steps]
        fields = [column(name) for name in (
            "step_time_s", "data_wait_s", "data_wait_share", "samples_per_s", "loss",
            "mem_peak_reserved_bytes", "host_rss_bytes")]
        activation = columns.get("activation_bytes")
        activations: list[float | None] | float | None  # a column, or one for every row
        if activation is None:
            activations = self.activation_bytes
        else:
            activations = []
            for step, value in zip(columns["step"], activation):
                value = _number(value)
                if value is not None and value >= 0:
                    current = self.activation_bytes
                    if current is not None and abs(value - current) > 0.05 * current:
                        self.activation_before_bytes = current
                    self.activation_bytes = value
                    self.activation_history.append((step if type(step) is int else None,
                                                    value))
                activations.append(self.activation_bytes)
            activations = activations[n - kept:]
        fields += [activations, column("tokens_per_s")]
        parts = [field if type(field) is list else repeat(field, kept) for field in fields]
        self.steps.extend(map(_step_record, zip(steps, *parts)))
        self.steps_total += n
        self.tree.stepped(n, columns["step"][0], columns["step"][-1])
        last = dict(common)  # the latest row, as protocol.step_bodies makes it
        for name, values in columns.items():
            if values[-1] is not None or name in protocol.STEP_FIELDS:
                last[name] = values[-1]
        if self.primary_rank is not None:
            self._note_batch_pace(self.primary_rank, body, now)
        step = last.get("step")
        if type(step) is int:
            self.step = step
        self.last_step = last
        self.last_step_at = now
        rss = fields[6]
        if isinstance(rss, list):  # (a column is a plain list)
            rss = max((value for value in rss if value is not None), default=None)
        self.host_rss_peak_bytes = _max(
            self.host_rss_peak_bytes, rss, _number(common.get("host_peak_rss_bytes")),
            _number(common.get("host_rss_peak_bytes")))
        if self.compiling_since is not None and (
                self._compiling_until_step is None
                or (type(step) is int and step >= self._compiling_until_step)):
            self._compile_ended(now)  # the step that compiled has completed
        raw_knobs = common.get("knobs")
        knobs = self._step_knobs(raw_knobs) if isinstance(raw_knobs, dict) else None
        if knobs:
            self._set_knobs(knobs, now)
        elif raw_knobs is not None and knobs is None:
            raise TypeError("knobs must be a map")  # counted as malformed

    def _step_knobs(self, knobs: Any) -> Any:
        """A step's knobs map as the state keeps it (:func:`_bounded_knobs`); the same
        kept map again while the run sends equal ones (every step, mostly)."""
        if knobs is not self._raw_knobs and knobs != self._raw_knobs:
            self._raw_knobs, self._kept_knobs = knobs, _bounded_knobs(knobs)
        return self._kept_knobs

    def _fold_system(self, body: dict[str, Any], now: float) -> None:
        self.system = bounded(body)
        graph, graph_s = body.get("compiling_graph"), body.get("compiling_graph_s")
        if not isinstance(graph, str) or not isinstance(graph_s, (int, float)):
            self.compile_graph = None
            return
        done = body.get("graphs_compiled")
        done = done if type(done) is int else 0
        if self.compiling_since is None:  # a recompile no event announced: it is one
            self.compiling_since = now - max(0.0, graph_s)
            self._compiling_until_step = (self.step or 0) + 1  # ends with the next step
        if self._graphs_before_compile is None or done < self._graphs_before_compile:
            self._graphs_before_compile = done
        kind = body.get("compiling_graph_kind")
        self.compile_graph = {"graph": shorten(graph, MAX_NAME_CHARS),
                              "kind": kind if kind in ("forward", "backward") else "",
                              "number": done - self._graphs_before_compile + 1}

    def _fold_state(self, body: dict[str, Any], now: float) -> None:
        if type(body.get("step")) is int:
            self.step = body["step"]
        knobs = _bounded_knobs(body.get("knobs"))
        if knobs:
            self._set_knobs(knobs, now)

    def _fold_event(self, body: dict[str, Any], now: float) -> None:
        if body.get("kind") == _KIND.REJECTED and body.get("id") in self.own_command_ids:
            return  # this dashboard's own command: its reply says it already
        level = body.get("level")
        self.log(level if level in ("info", "warning", "error") else "info",
                 _text(body.get("text", "")), self.message_t)
        knob = body.get("knob")
        if type(knob) is str and len(knob) > MAX_NAME_CHARS:
            knob = None  # no knob of ours has such a name
        kind = body.get("kind")
        step = body.get("step")
        if type(knob) is str and len(self._knobs_told) < MAX_KNOBS:
            self._knobs_told.add(knob)
        if kind == _KIND.ACCEPTED and knob in BUSY_STATUSES and type(step) is int:
            self.pending[knob] = Pending(body.get("value"), step)  # any client's command
        if kind in _KIND.SETTLING and knob in self.pending:
            del self.pending[knob]
        elif kind == _KIND.RESCHEDULED and knob in self.pending:
            step = body.get("step")  # the run went back: it applies at another step
            if type(step) is int and self.pending[knob].value == body.get("value"):
                self.pending[knob] = Pending(self.pending[knob].value, step)
        if kind in _KIND.SETTLING and knob in BUSY_STATUSES:
            self.last_step_at = now  # the wait for the next step starts after it
        if kind == _KIND.APPLIED and knob == "pause":  # (an action: no knob value)
            step = body.get("step")
            if body.get("value") != "on" and self.paused_after is not None:
                self.last_step_at = now  # the wait for its next step starts now, not
                # at its last step before the pause (it would read as stalled at once)
            self.paused_after = (step - 1 if type(step) is int else 0) if (
                body.get("value") == "on") else None
        if kind in _KIND.CHANGED and isinstance(knob, str) and "value" in body:
            # the run says so before the next step record (which can be seconds away):
            # a key pressed again meanwhile must start from the new value
            step = body.get("step")
            self._set_knobs({knob: bounded(body["value"])}, now,
                            at_step=step if type(step) is int else None)
        if kind == _KIND.COMPILING:
            self.compiling_since = now
            step = body.get("step")  # the step it compiles in, when the agent says
            self._compiling_until_step = step if type(step) is int else None
        elif kind in _KIND.COMPILE_ENDED:
            self._compile_ended(now)
        elif kind == _KIND.BRANCHED:
            self._branched(body)

    def _branched(self, body: dict[str, Any]) -> None:
        """A ``branched`` event: the run went back to its fork step and goes on as a
        new branch, so the charts continue along its path: the step records, knob
        changes and activation measurements after the fork step are dropped (the
        parent's steps up to it stay), and the log says so."""
        parent = self.tree.current
        branch = self.tree.branched(body)
        if branch is None:
            self.log("warning", f"more than {MAX_BRANCHES:,} branches: the charts no longer "
                     "follow the run's branches", self.message_t)
            return
        fork = branch.fork_step
        if fork is not None:
            for kept in (self.steps, self.knob_changes, self.activation_history):
                while kept and kept[-1][0] is not None and kept[-1][0] > fork:
                    kept.pop()
            self.step = fork
        where = "?" if fork is None else f"{fork:,}"
        self.log("info", f"now on branch b{branch.branch}, from step {where} of b{parent}: "
                 f"the charts go on from step {where}", self.message_t)

    def _compile_ended(self, now: float) -> None:
        """The compile under way (if any) is over: keep how long it took."""
        if self.compiling_since is not None:
            self.compile_durations_s = [*self.compile_durations_s[-9:],
                                        max(0.0, now - self.compiling_since)]
        self.compiling_since = None
        self.compile_graph = None
        self._graphs_before_compile = None

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
            if self.step is not None and body["step"] > self.step:
                self.last_step_at = now  # it stepped (its step records may be lost)
            self.step = body["step"]
        for key, attribute in (("records_dropped", "agent_records_dropped"),
                               ("errors", "agent_errors"),
                               ("commands_rejected", "agent_commands_rejected")):
            value = body.get(key)
            if type(value) is int:
                setattr(self, attribute, value)

    def _fold_bye(self, body: dict[str, Any], now: float) -> None:
        body = bounded(body)
        self.ended = body
        steps = body["steps"] if type(body.get("steps")) is int else None
        reason = str(body.get("reason") or "no reason given")
        counts = (f" after {counted(steps, 'step')}" if steps is not None
                  and not reason.endswith(f"after step {steps}") else "")
        self.log("info", f"run ended ({reason}){counts}", self.message_t)

    def _set_knobs(self, knobs: dict[str, Any], now: float, *,
                   at_step: int | None = None) -> None:
        """Fold knob values (bounded already; a knob beyond :data:`MAX_KNOBS` is
        ignored); a change is noted at ``at_step`` (default: the last completed step)."""
        for name, value in knobs.items():
            if name in self.knobs and self.knobs[name] == value:
                continue
            if name not in self.knobs and len(self.knobs) >= MAX_KNOBS:
                continue
            if name in self.knobs:
                self.knob_changed_at[name] = now
                step = at_step if at_step is not None else self.step
                if step is not None:
                    self.knob_changes.append(KnobChange(step, self.message_t, name,
                                                        self.knobs[name], value))
            self.knobs[name] = value
            pending = self.pending.get(name)
            if pending is not None and pending.value == value:
                del self.pending[name]


def _text(value: Any) -> str:
    """A text from the wire as the event log keeps it: a string (anything else as its
    ``str``), cut to :data:`~agent.wire.protocol.MAX_TEXT_CHARS`."""
    if type(value) is not str:
        value = str(bounded(value))
    return shorten(value)


def _bounded_knobs(knobs: Any) -> dict[str, Any] | None:
    """A knobs map from the wire as the state keeps it: names of at most
    :data:`~agent.wire.protocol.MAX_NAME_CHARS` characters (longer ones are no knob of
    ours), at most :data:`MAX_KNOBS` of them, values :func:`bounded`; None for what is
    none.

    Raises:
        TypeError: ``knobs`` is neither a map nor None (a malformed body).
    """
    if knobs is None:
        return None
    if not isinstance(knobs, dict):
        raise TypeError("knobs must be a map")
    return {name: bounded(value) for name, value in islice(knobs.items(), MAX_KNOBS)
            if type(name) is str and len(name) <= MAX_NAME_CHARS}
