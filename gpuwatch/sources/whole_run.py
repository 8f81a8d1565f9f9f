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
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from agent.wire import protocol
from agent.wire.runlog import BranchPath, BranchTree
from gpuwatch import history
from gpuwatch.history import HistoryBuilder, LogReader, Position, on_path
from gpuwatch.state import KnobChange

#: How often the log is read again for the records appended since (s).
FOLLOW_S = 1.0
#: While reading, how often what was read so far is published (s).
PUBLISH_S = 0.25
#: The fields published: what the dashboard's step charts and throughput draw.
FIELDS = ("step_time_s", "data_wait_s", "loss", "samples_per_s", "tokens_per_s")


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


class WholeRun:
    """A run log read from its first step, then followed, in a daemon thread.

    Args:
        path: the log's first part (a run file's ``log_path``); never followed through
            a link (:func:`gpuwatch.history.log_at`).
        branch: ``(tree, N)``: read only branch N's path (a finished log's: ``tree`` is
            its :func:`gpuwatch.history.log_summary`'s). By default every record, the
            view following the branch being trained: at each ``branched`` event it
            goes back to the fork step (:meth:`gpuwatch.history.Overview.cut`).

    Attributes:
        past: the latest :class:`Past`, None until the first is published.
        loaded: set once the log was read to its end (the first time).

    Cost: memory bounded whatever the log's length (a few MiB: the overview, the first
    knob changes, one frame of the log); reading takes about 0.3 s per 100,000 steps
    here, in this thread. Never raises for the log's content (a missing or unreadable
    log is looked for again every :data:`FOLLOW_S`).
    """

    def __init__(self, path: str, *, branch: tuple[BranchTree, int] | None = None) -> None:
        self.path = path
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
        return resume

    def _publish(self, builder: HistoryBuilder, *, loaded: bool) -> None:
        run = builder.history
        series = {name: found for name in FIELDS
                  if (found := run.overview.get(name)) is not None}
        self.past = Past(series, tuple(run.knob_changes), run.rows, loaded)
