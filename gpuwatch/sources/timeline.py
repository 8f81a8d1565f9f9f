"""A finished run on a timeline: the dashboard at any optimizer step of a run log.

The log is read once (:mod:`gpuwatch.history`), in the source's thread, and folded into
a :class:`~gpuwatch.state.RunState` as the live dashboard folds it; a copy of that state
is kept every :data:`CHECKPOINT_STEPS` steps. The state at step index ``i`` is the
nearest copy before it with the records up to step ``i`` folded on top (re-read from
the file: at most :data:`CHECKPOINT_STEPS` steps' records), so every panel shows what it
showed live at that step, in memory that grows with the run's length by a copy per
checkpoint only.

Time: records are folded at their own time ``t`` (unix s), and the state is shown at the
time of the last record folded (:meth:`TimelineSource.now`), so the status at a step is
what it was then (live, compiling, stalled, ended at the end).
"""

from __future__ import annotations

import bisect
import time
from array import array
from typing import NamedTuple

from agent import protocol
from agent.protocol import printable
from gpuwatch.history import (HistoryBuilder, LogFiles, LogReader, Position, RunHistory,
                              number)
from gpuwatch.sources import Source
from gpuwatch.state import RunState
from gpuwatch.units import knob_text

#: Step records between two kept copies of the state.
CHECKPOINT_STEPS = 200
#: How often the thread checks whether to stop while loading (records).
STOP_CHECK_RECORDS = 4096


class Mark(NamedTuple):
    """A place on the timeline worth jumping to: the step index where it shows, its
    kind (``change``: a knob's value changed; ``event``: the run said something) and a
    label for people."""

    # the field shadows tuple.index, which nothing here calls (the widgets read mark.index)
    index: int  # type: ignore[assignment]
    kind: str
    label: str


class _Checkpoint(NamedTuple):
    state: RunState  # everything before the step record with index ``index``
    index: int  # type: ignore[assignment]  # shadows tuple.index, as Mark's
    position: Position  # where that step record's line starts
    t: float  # the time of the last record folded into ``state`` (unix s)


class Timeline:
    """A run log's steps, with the state kept at checkpoints.

    Args:
        log: the rank's log files.
        initial: the state to fold into (lines the dashboard logged before it loaded
            stay in every position).
        stopped: called every :data:`STOP_CHECK_RECORDS` records; True stops reading
            (the timeline then holds what was read).

    Attributes:
        steps: the optimizer step of each step record (index -> step).
        marks: knob changes and events, by index.
        history: the run's history (segments, knob changes) from the same read.
    """

    def __init__(self, log: LogFiles, initial: RunState, *, stopped=lambda: False) -> None:
        self.log = log
        self.steps = array("q")
        self.marks: list[Mark] = []
        self._checkpoints: list[_Checkpoint] = []
        builder = HistoryBuilder(log)
        reader = LogReader(log)
        state = initial
        t = time.time()
        for count, (position, envelope) in enumerate(reader):
            if count % STOP_CHECK_RECORDS == 0 and stopped():
                break
            t = number(envelope.get("t")) or t
            if envelope["type"] == protocol.STEP:
                index = len(self.steps)
                if index % CHECKPOINT_STEPS == 0:
                    self._checkpoints.append(_Checkpoint(state.copy(), index, position, t))
                step = envelope["body"].get("step")
                self.steps.append(step if type(step) is int else
                                  (self.steps[-1] if self.steps else 0))
            for change in builder.add(envelope):
                self.marks.append(Mark(len(self.steps) - 1, "change",
                                       printable(f"{change.knob}={knob_text(change.value)}", 200)))
            if envelope["type"] == protocol.EVENT:
                self.marks.append(Mark(max(0, len(self.steps) - 1), "event",
                                       printable(envelope["body"].get("text", ""), 200)))
            state.ingest(envelope, t)
        self.history: RunHistory = builder.finish(reader)
        self._end = (state, t)

    @property
    def last_index(self) -> int | None:
        """The index of the last step, None for a log without steps."""
        return len(self.steps) - 1 if self.steps else None

    def state_at(self, index: int) -> tuple[RunState, float]:
        """The state at step index ``index`` (all records up to the next step record)
        and the time it is shown at (unix s). The last index shows the end of the log.

        Raises:
            IndexError: ``index`` is not a step index of this timeline.
        """
        if not 0 <= index < len(self.steps):
            raise IndexError(f"step index {index} outside 0..{len(self.steps) - 1}")
        if index == len(self.steps) - 1:
            state, t = self._end
            return state.copy(), t
        checkpoint = self._checkpoints[index // CHECKPOINT_STEPS]
        state, t = checkpoint.state.copy(), checkpoint.t
        seen = checkpoint.index - 1
        for _, envelope in LogReader(self.log, start=checkpoint.position):
            if envelope["type"] == protocol.STEP:
                seen += 1
                if seen > index:
                    break
            t = number(envelope.get("t")) or t
            state.ingest(envelope, t)
        return state, t

    def index_of_step(self, step: int) -> int | None:
        """The index of the first record of optimizer step ``step`` or later (steps
        in order); None when the run has no such step."""
        index = bisect.bisect_left(self.steps, step)
        return index if index < len(self.steps) else None

    def mark_after(self, index: int, kind: str, direction: int) -> Mark | None:
        """The first mark of ``kind`` after (``direction`` 1) or before (-1) ``index``,
        or None."""
        marks = [mark for mark in self.marks if mark.kind == kind]
        if direction > 0:
            return next((mark for mark in marks if mark.index > index), None)
        return next((mark for mark in reversed(marks) if mark.index < index), None)


class TimelineSource(Source):
    """A finished run log in the dashboard, at one optimizer step at a time; the app's
    timeline keys move it (:meth:`move_by`, :meth:`move_to`, :meth:`move_to_mark`).
    Takes no commands. Opens at the end of the run.

    Args:
        log: the rank's run log (:func:`gpuwatch.history.find_logs`, ``log_at``).

    Attributes:
        timeline: the loaded timeline, None until the thread has read the log.
        index: the step index shown (None before loading, or without steps).
    """

    def __init__(self, log: LogFiles) -> None:
        super().__init__(None, f"run log {log.paths[-1]}", poll_s=0.1)
        self.log = log
        self.timeline: Timeline | None = None
        self.index: int | None = None
        self._now = time.monotonic()

    def now(self) -> float:
        """The time of the last record shown (unix s, the clock records are folded
        with); while loading, the monotonic clock."""
        return self._now

    def _run(self) -> None:
        with self.lock:
            initial = self.state.copy()
        timeline = Timeline(self.log, initial, stopped=self._stop.is_set)
        with self.lock:
            self.timeline = timeline
            last = timeline.last_index
            if last is None:
                self.state, self._now = timeline._end[0].copy(), timeline._end[1]
            else:
                self._show(last)

    def _show(self, index: int) -> None:
        """Show step index ``index`` (call under the lock; the timeline is loaded)."""
        assert self.timeline is not None
        self.state, self._now = self.timeline.state_at(index)
        self.index = index

    def move_to(self, index: int) -> bool:
        """Show step index ``index``, clamped to the run's steps; False when there is
        nothing to move (not loaded, no steps, already there)."""
        with self.lock:
            if self.timeline is None or self.timeline.last_index is None:
                return False
            index = min(max(index, 0), self.timeline.last_index)
            if index == self.index:
                return False
            self._show(index)
            return True

    def move_by(self, steps: int) -> bool:
        """Move ``steps`` step records back (negative) or forward; see :meth:`move_to`."""
        return self.index is not None and self.move_to(self.index + steps)

    def move_to_mark(self, kind: str, direction: int) -> Mark | None:
        """Move to the next (``direction`` 1) or previous (-1) mark of ``kind``
        (``change`` or ``event``); the mark, or None when there is none that way."""
        if self.timeline is None or self.index is None:
            return None
        mark = self.timeline.mark_after(self.index, kind, direction)
        if mark is not None:
            self.move_to(mark.index)
        return mark
