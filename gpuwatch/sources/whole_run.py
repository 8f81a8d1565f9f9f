"""The whole run behind a live dashboard: its run log read from the first step in a thread.

A thread of its own, so that a dashboard opened late, re-opened from ``r`` or restarted
draws the run from step 1, not only the steps it received since it attached.

The log is folded into a :class:`~gpuwatch.history.RunHistory` (its overview: each
field's minimum, maximum and mean in at most :data:`~gpuwatch.history.OVERVIEW_BUCKETS`
buckets, spikes kept; the first :data:`~gpuwatch.history.MAX_CHANGES` knob changes), in
memory bounded whatever the run's length, and read again from where it stopped every
:data:`FOLLOW_S` for what the run appended since. What is read so far is published as
one immutable :class:`Past` (replaced whole, so the app reads it without a lock) every
:data:`PUBLISH_S` while reading: a 10M-step log fills in from step 1 as it is read. The
live source's thread never waits for this one; this one never writes the log.

The same reading gives a live dashboard the run's events before it joined
(:class:`EarlierEvents`): the records before the first one it received live, folded as
the live path folds them, handed to it once the log has been read to where the two meet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from agent.wire import protocol
from agent.wire.runlog import BranchPath, BranchTree
from gpuwatch import history
from gpuwatch.history import HistoryBuilder, LogReader, Position, number, on_path
from gpuwatch.state import STEP_HISTORY, KnobChange, RunState, bounded
from gpuwatch.units import local_time

#: How often the log is read again for the records appended since (s).
FOLLOW_S = 1.0
#: While reading, how often what was read so far is published (s).
PUBLISH_S = 0.25
#: The fields published: what the dashboard's step charts and throughput draw.
FIELDS = ("step_time_s", "data_wait_s", "loss", "samples_per_s", "tokens_per_s")
#: The run's events before a live dashboard joined that its event log shows at most
#: (the last ones; a line counts the others).
EARLIER_EVENTS = 100
#: Records held, read before the dashboard's first live record was known, at most;
#: past this the oldest are taken as earlier (they were, but for a run that went
#: silent before a record reached the dashboard).
HELD_RECORDS = 256
#: How long after the first live record the log may lack it (s): then the log stopped
#: (its writer failed, the disk filled) and what it has is delivered, saying so.
MEET_WAIT_S = 10.0
#: The records that change what the event log and the panels show of the past.
_FOLDED = frozenset({protocol.EVENT, protocol.STATE, protocol.BYE})


class Past(NamedTuple):
    """The run as its log had it when published.

    Attributes:
        series: field -> its buckets (:class:`~gpuwatch.history.Series`: arrays of at
            most :data:`~gpuwatch.history.OVERVIEW_BUCKETS` first and last steps, means,
            minima, maxima, in the field's unit), for the fields of :data:`FIELDS` with
            a value.
        knob_changes: the run's first knob changes, oldest first.
        rows: step rows read. loaded: the log was read to its end at least once.
    """

    series: dict[str, history.Series]
    knob_changes: tuple[KnobChange, ...]
    rows: int
    loaded: bool


class EarlierEvents:
    """The run's records before a live dashboard joined it, folded from its log.

    The reading thread gives every record of the log in order (:meth:`add`); the live
    source says which record it received first (:meth:`join`). The records before it
    (those with a lower ``seq``, or the same ``seq`` and another type: a greeting repeats
    the latest ``seq``; an earlier process's, whatever their ``seq``, as they are older
    than the first one received) are folded into a :class:`~gpuwatch.state.RunState` of
    their own, as the live path folds them; once the log is read to where the live
    records start (a record of a ``seq`` after it, sent after it), ``deliver`` gets that
    state and the log's last activation measurement, once.

    Args:
        deliver: called with ``(state, activation)`` in the reading thread; activation:
            ``(step, bytes)`` or None.

    The state delivered has the run's last steps before the first live one too (the
    charts' :data:`~gpuwatch.state.STEP_HISTORY`, from the latest ``steps`` batches kept
    whole): a run that has stopped stepping when the dashboard comes (paused, ending)
    shows them, not "no steps yet".

    Cost: memory bounded (:data:`HELD_RECORDS` records at most, the batches of the last
    :data:`~gpuwatch.state.STEP_HISTORY` steps, a state of bounded size); about 1 us a
    record read (a steps batch: one look at its activation column, an append), and the
    kept batches folded once, at delivery.
    """

    def __init__(self, deliver: Callable[[RunState, tuple[int | None, float] | None],
                                         None]) -> None:
        self._deliver = deliver
        self._joined: tuple[int, Any, float | None] | None = None
        self._joined_at = 0.0  # when it was known (monotonic s)
        self._last_t: float | None = None  # the time of the latest record read (unix s)
        self._state = RunState()
        self._held: deque[dict[str, Any]] = deque()
        self._activation: tuple[int | None, float] | None = None
        #: the latest steps batches read (whole), the rows they hold
        self._recent: deque[tuple[dict[str, Any], int]] = deque()
        self._recent_rows = 0
        self.delivered = False

    def join(self, joined: tuple[int, Any, float | None]) -> None:
        """The first record received live: ``(seq, type, t)`` (:attr:`RunState.joined`).

        Any thread; the first call counts."""
        if self._joined is None:
            self._joined_at = time.monotonic()
            self._joined = joined

    def read_to_end(self, now: float | None = None) -> None:
        """The log was read to its end (reading thread): deliver it if it stops short.

        If it still lacks the first live record :data:`MEET_WAIT_S` after it came
        (monotonic ``now``), what it has is delivered, with a line saying it stops there."""
        joined = self._joined
        if now is None:
            now = time.monotonic()
        if self.delivered or joined is None or now - self._joined_at < MEET_WAIT_S:
            return
        if self._fold_held(joined):  # (it was among them after all)
            return
        stops, joined_at = (local_time(t, "%H:%M:%S") for t in (self._last_t, joined[2]))
        self._state.log("warning", f"the run log stops at {stops}: events from then until "
                        f"{joined_at} are not shown")
        self._deliver_state(joined)

    def unreadable(self, path: str) -> None:
        """The log at ``path`` cannot be read: say where the run's earlier events are.

        Once the first live record is known: one line, delivered in place of them."""
        joined = self._joined
        if self.delivered or joined is None:
            return
        self.delivered = True
        self._state.log("warning", f"events before {local_time(joined[2], '%H:%M:%S')} are "
                        f"in the run log {path}, which cannot be read here (not a "
                        "regular file)")
        self._deliver(self._state, None)

    def add(self, envelope: dict[str, Any]) -> None:
        """Take the next record of the log (reading thread, in the log's order)."""
        if self.delivered:
            return
        kind = envelope.get("type")
        self._last_t = number(envelope.get("t")) or self._last_t
        if kind == protocol.STEPS:
            self._measure(envelope)
            self._keep_recent(envelope)
        # a record not folded is held as its head only (where it is is all it tells)
        self._held.append(bounded(envelope) if kind in _FOLDED else {
            key: envelope.get(key) for key in ("type", "seq", "t")})
        joined = self._joined
        if joined is not None:
            self._fold_held(joined)
        elif len(self._held) > HELD_RECORDS:
            self._fold(self._held.popleft())

    def _fold_held(self, joined: tuple[int, Any, float | None]) -> bool:
        """Fold the records held up to the first live one; deliver when it is among them
        (then True)."""
        while self._held:
            held = self._held.popleft()
            if self._meets(held, joined):
                self._held.clear()
                self._deliver_state(joined)
                return True
            self._fold(held)
        return False

    def _deliver_state(self, joined: tuple[int, Any, float | None]) -> None:
        """Deliver the state folded so far, with the steps of the batches kept that came
        before the first live record (folded apart: their knobs must not undo a later
        event's)."""
        steps = RunState()
        for envelope, _ in self._recent:
            if not self._meets(envelope, joined):
                steps.ingest(envelope, 0.0)
        self._recent.clear()
        state = self._state
        state.steps, state.step, state.last_step = steps.steps, steps.step, steps.last_step
        state.host_rss_peak_bytes = steps.host_rss_peak_bytes
        self.delivered = True
        self._deliver(state, self._activation)
        self._state = RunState()  # (what was delivered is the receiver's)

    def _keep_recent(self, envelope: dict[str, Any]) -> None:
        """Keep a steps batch whole (its columns as lists, as the wire has them), and
        as many before it as hold the last :data:`~gpuwatch.state.STEP_HISTORY` steps."""
        body = envelope.get("body")
        if not isinstance(body, dict):
            return
        rows, columns = body.get("n"), body.get("columns")
        if (type(rows) is not int or not 0 < rows <= protocol.MAX_BATCH_STEPS
                or not isinstance(columns, dict)):
            return
        body = {**body, "columns": {name: values.tolist() if hasattr(values, "tolist")
                                    else values for name, values in columns.items()}}
        self._recent.append(({**envelope, "body": body}, rows))
        self._recent_rows += rows
        while self._recent_rows - self._recent[0][1] >= STEP_HISTORY:
            self._recent_rows -= self._recent.popleft()[1]

    def _fold(self, held: dict[str, Any]) -> None:
        if held.get("type") in _FOLDED:
            self._state.ingest(held, 0.0)  # (the time folded: no one asks this state)

    @staticmethod
    def _meets(envelope: dict[str, Any], joined: tuple[int, Any, float | None]) -> bool:
        """Whether ``envelope`` is the first live record or one sent after it."""
        seq, kind, t = joined
        own_seq, own_t = envelope.get("seq"), envelope.get("t")
        if type(own_seq) is not int or not isinstance(own_t, (int, float)) or t is None:
            return False
        if own_seq == seq:
            return envelope.get("type") == kind and own_t == t
        return own_seq > seq and own_t >= t  # (an earlier process's is older)

    def _measure(self, envelope: dict[str, Any]) -> None:
        """Keep the batch's last activation measurement (a column of numbers, a list or
        an array, NaN or None where a step did not measure)."""
        columns = envelope["body"].get("columns") or {}
        values = columns.get("activation_bytes")
        if values is None:
            return
        steps = columns.get("step")
        for row in range(len(values) - 1, -1, -1):
            measured = _number(values[row])
            if measured is not None and measured >= 0:
                step = _number(steps[row]) if steps is not None and row < len(steps) else None
                self._activation = (None if step is None else int(step), measured)
                return


def _number(value: Any) -> float | None:
    """A column's value, a Python or a numpy number, as a finite float; None for others."""
    return number(value.item() if hasattr(value, "item") else value)


class WholeRun:
    """A run log read from its first step, then followed, in a daemon thread.

    Args:
        path: the log's first part (a run file's ``log_path``); never followed through
            a link (:func:`gpuwatch.history.log_at`).
        branch: ``(tree, N)``: read only branch N's path (a finished log's: ``tree`` is
            its :func:`gpuwatch.history.log_summary`'s). By default every record, the
            view following the branch being trained: at each ``branched`` event it
            goes back to the fork step (:meth:`gpuwatch.history.Overview.cut`).
        earlier: given every record read, for a live dashboard's event log (the run's
            events before it joined); told when the log cannot be read.

    Attributes:
        past: the latest :class:`Past`, None until the first is published.
        loaded: set once the log was read to its end (the first time).

    Cost: memory bounded whatever the log's length (a few MiB: the overview, the first
    knob changes, one frame of the log); reading takes about 0.3 s per 100,000 steps
    here, in this thread. Never raises for the log's content (a missing or unreadable
    log is looked for again every :data:`FOLLOW_S`).
    """

    def __init__(self, path: str, *, branch: tuple[BranchTree, int] | None = None,
                 earlier: EarlierEvents | None = None) -> None:
        self.path = path
        self.earlier = earlier
        self._branch = None if branch is None else BranchPath(*branch)
        self.past: Past | None = None
        self.loaded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gpuwatch-WholeRun")

    def start(self) -> None:
        """Start reading (returns at once)."""
        self._thread.start()

    def close(self) -> None:
        """Stop reading; returns within about :data:`PUBLISH_S` (the thread checks then)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=FOLLOW_S + 1.0)

    def _run(self) -> None:
        builder: HistoryBuilder | None = None
        start: Position | None = None
        while not self._stop.is_set():
            log = history.log_at(self.path)  # again: the run may have started a part
            if log is None and self.earlier is not None:
                self.earlier.unreadable(self.path)
            if log is not None:
                if builder is None:
                    builder = HistoryBuilder(log, overview=True, whole=False)
                start = self._read(builder, LogReader(log, start=start, arrays=True))
                self.loaded.set()
                if log.kind != "runlog":  # the earlier format: a finished run's, read once
                    return
            if self._stop.wait(FOLLOW_S):
                return

    def _read(self, builder: HistoryBuilder, reader: LogReader) -> Position | None:
        """Fold what ``reader`` reads into ``builder``, publishing every
        :data:`PUBLISH_S` and at the end; where to read again from."""
        resume = reader.start
        published_at = time.monotonic()
        for position, envelope in reader:
            resume = position._replace(item=position.item + 1)  # after this record
            if self.earlier is not None:
                self.earlier.add(envelope)
            if (kept := on_path(self._branch, envelope)) is None:
                continue
            envelope = kept
            builder.add(envelope)
            if envelope["type"] == protocol.STEPS and (
                    time.monotonic() - published_at >= PUBLISH_S):
                if self._stop.is_set():
                    return resume
                self._publish(builder, loaded=self.loaded.is_set())
                published_at = time.monotonic()
        self._publish(builder, loaded=True)
        if self.earlier is not None:
            self.earlier.read_to_end()
        return resume

    def _publish(self, builder: HistoryBuilder, *, loaded: bool) -> None:
        run = builder.history
        series = {name: found for name in FIELDS
                  if (found := run.overview.get(name)) is not None}
        self.past = Past(series, tuple(run.knob_changes), run.rows, loaded)
