"""A finished run on a timeline: the dashboard at any optimizer step of a run log.

The log is read once (:mod:`gpuwatch.history`), in the source's thread, and folded into
a :class:`~gpuwatch.state.RunState` as the live dashboard folds it; a copy of that state
is kept at the batch of steps that starts every :data:`CHECKPOINT_STEPS` steps, and
when more than :data:`MAX_CHECKPOINTS` are kept, every second one is dropped (the
spacing doubles). The state at step index ``i`` is the nearest copy before it with the
records up to step ``i`` folded on top (re-read from the log), so every panel shows
what it showed live at that step, in memory bounded whatever the run's length (the
copies, the step numbers as runs of consecutive steps, and at most :data:`MAX_MARKS`
marks).

Time: records are folded at their own time ``t`` (unix s), and the state is shown at the
time of the last record folded (:meth:`TimelineSource.now`), so the status at a step is
what it was then (live, compiling, stalled, ended at the end).
"""

from __future__ import annotations

import bisect
import copy
import time
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

from agent.wire import protocol
from agent.wire.protocol import printable
from agent.wire.runlog import BranchPath, BranchTree
from gpuwatch.history import (HistoryBuilder, LogFiles, LogReader, Position, RunHistory,
                              log_summary, number, on_path)
from gpuwatch.sources import Source
from gpuwatch.sources.whole_run import WholeRun
from gpuwatch.state import RunState
from gpuwatch.units import knob_text

#: Step records between two kept copies of the state, at first.
CHECKPOINT_STEPS = 200
#: Copies of the state kept at most (each a few tens of kB).
MAX_CHECKPOINTS = 256
#: Marks (knob changes and events) kept at most: the first ones.
MAX_MARKS = 100_000
#: How often the thread checks whether to stop while loading (records).
STOP_CHECK_RECORDS = 256


class Mark(NamedTuple):
    """A place on the timeline worth jumping to: its step index, its kind and a label.

    The step index where it shows, its kind (``change``: a knob's value changed; ``event``:
    the run said something) and a label for people."""

    # the field shadows tuple.index, which nothing here calls (the widgets read mark.index)
    index: int  # type: ignore[assignment]
    kind: str
    label: str


class _Checkpoint(NamedTuple):
    state: RunState  # everything before the step record with index ``index``
    index: int  # type: ignore[assignment]  # shadows tuple.index, as Mark's
    position: Position  # where the batch that starts with that step record is
    t: float  # the time of the last record folded into ``state`` (unix s)
    path: BranchPath | None  # the branch path's fold, with that batch folded


class StepIndex(Sequence[int]):
    """Step index -> optimizer step, kept as runs of consecutive steps.

    A run of a million steps is two numbers. A record without a step number has its previous
    record's."""

    def __init__(self) -> None:
        self._starts = array("q")  # the index where each run starts
        self._steps = array("q")  # its first step
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def extend(self, steps: list[Any]) -> None:
        """Append the steps of some records, in order.

        A run of consecutive steps in C, a list comparison."""
        if not steps:
            return
        first = steps[0]
        if (type(first) is int and -(1 << 62) < first < (1 << 62) - len(steps)
                and steps == list(range(first, first + len(steps)))):
            if not self._length or first != self[self._length - 1] + 1:
                self._starts.append(self._length)
                self._steps.append(first)
            self._length += len(steps)
            return
        for step in steps:
            if type(step) is not int or not -(1 << 62) < step < (1 << 62):
                step = self[self._length - 1] if self._length else 0
            if not self._length or step != self[self._length - 1] + 1:
                self._starts.append(self._length)
                self._steps.append(step)
            self._length += 1

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self[at] for at in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"step index {index} outside 0..{self._length - 1}")
        run = bisect.bisect_right(self._starts, index) - 1
        return self._steps[run] + index - self._starts[run]

    def index_of(self, step: int) -> int | None:
        """The index of the first record of optimizer step ``step`` or later (steps in order).

        None when there is none."""
        run = bisect.bisect_right(self._steps, step) - 1
        if run < 0:
            return 0 if self._length else None
        end = self._starts[run + 1] if run + 1 < len(self._starts) else self._length
        index = self._starts[run] + step - self._steps[run]
        if index < end:
            return index
        return end if end < self._length else None


class Timeline:
    """A run log's steps, with the state kept at checkpoints.

    Args:
        log: the rank's log files.
        initial: the state to fold into (lines the dashboard logged before it loaded
            stay in every position).
        path: fold only the records of a branch's path (:class:`BranchPath`, a new
            one), not every record of the log.
        stopped: called every :data:`STOP_CHECK_RECORDS` records; True stops reading
            (the timeline then holds what was read).

    Attributes:
        steps: the optimizer step of each step record (index -> step).
        marks: knob changes (the first :data:`~gpuwatch.history.MAX_CHANGES`) and
            events, by index (the first :data:`MAX_MARKS` in all).
        history: the run's history (segments, knob changes) from the same read.
    """

    def __init__(self, log: LogFiles, initial: RunState, *, stopped=lambda: False,
                 path: BranchPath | None = None) -> None:
        self.log = log
        self.steps = StepIndex()
        self.marks: list[Mark] = []
        self._by_kind: dict[str, list[int]] = {"change": [], "event": []}
        self._checkpoints: list[_Checkpoint] = []
        self._spacing = CHECKPOINT_STEPS
        self._next_checkpoint = 0  # the step index from which the next copy is due
        builder = HistoryBuilder(log, overview=False, whole=False)
        reader = LogReader(log, arrays=True)
        state = initial
        t = time.time()
        for count, (position, envelope) in enumerate(reader):
            if count % STOP_CHECK_RECORDS == 0 and stopped():
                break
            if (kept := on_path(path, envelope, state.pass_over)) is None:
                continue  # another branch's: not lost
            envelope = kept
            t = number(envelope.get("t")) or t
            kind, body = envelope["type"], envelope["body"]
            if kind == protocol.STEPS:
                first = len(self.steps)
                if first >= self._next_checkpoint:  # (the batch read again is kept again)
                    self._keep(_Checkpoint(state.copy(), first, position, t,
                                           copy.deepcopy(path)))
                changes = builder.add(envelope)  # (with the numbers as arrays)
                envelope = {**envelope, "body": {**body, "columns": {  # as the wire's
                    name: values.tolist() if hasattr(values, "tolist") else values
                    for name, values in body["columns"].items()}}}
                steps = envelope["body"]["columns"].get("step") or [
                    body["common"].get("step")] * body["n"]
                self.steps.extend(steps)
                if changes and len(self.marks) < MAX_MARKS:
                    rows = {step: row for row, step in reversed(list(enumerate(steps)))
                            if type(step) is int}
                    for change in changes:
                        self._mark(first + rows.get(change.step, 0), "change",
                                   f"{change.knob}={knob_text(change.value)}")
            else:
                builder.add(envelope)
                if kind == protocol.EVENT:
                    self._mark(max(0, len(self.steps) - 1), "event", body.get("text", ""))
            state.ingest(envelope, t)
        self.history: RunHistory = builder.finish(reader)
        self._end = (state, t)

    def _keep(self, checkpoint: _Checkpoint) -> None:
        """Keep a copy of the state; past :data:`MAX_CHECKPOINTS`, every second one
        goes and the spacing doubles."""
        self._checkpoints.append(checkpoint)
        if len(self._checkpoints) > MAX_CHECKPOINTS:
            self._checkpoints = self._checkpoints[::2]
            self._spacing *= 2
        self._next_checkpoint = self._checkpoints[-1].index + self._spacing

    def _mark(self, index: int, kind: str, text: Any) -> None:
        if len(self.marks) < MAX_MARKS:
            self.marks.append(Mark(index, kind, printable(text, 200)))
            self._by_kind[kind].append(len(self.marks) - 1)

    @property
    def last_index(self) -> int | None:
        """The index of the last step, None for a log without steps."""
        return len(self.steps) - 1 if self.steps else None

    def state_at(self, index: int) -> tuple[RunState, float]:
        """The state at step index ``index`` and the time it is shown at (unix s).

        The state holds all records up to the next step record. The last index shows the end
        of the log.

        Raises:
            IndexError: ``index`` is not a step index of this timeline.
        """
        if not 0 <= index < len(self.steps):
            raise IndexError(f"step index {index} outside 0..{len(self.steps) - 1}")
        if index == len(self.steps) - 1:
            state, t = self._end
            return state.copy(), t
        at = bisect.bisect_right([kept.index for kept in self._checkpoints], index) - 1
        checkpoint = self._checkpoints[max(0, at)]
        state, t = checkpoint.state.copy(), checkpoint.t
        seen = checkpoint.index  # the index of the next step record
        path = copy.deepcopy(checkpoint.path)
        for _, envelope in LogReader(self.log, start=checkpoint.position):
            if (kept := on_path(path, envelope, state.pass_over)) is None:
                continue  # another branch's: not lost
            envelope = kept
            cut = False
            if envelope["type"] == protocol.STEPS:
                if seen > index:
                    break
                body = envelope["body"]
                rows = body["n"]
                if seen + rows > index + 1:  # the rows up to ``index``, and no more
                    rows, cut = index + 1 - seen, True
                    envelope = {**envelope, "body": {**body, "n": rows, "columns": {
                        name: values[:rows] for name, values in body["columns"].items()}}}
                seen += rows
            t = number(envelope.get("t")) or t
            state.ingest(envelope, t)
            if cut:
                break
        return state, t

    def mark_after(self, index: int, kind: str, direction: int) -> Mark | None:
        """The first mark of ``kind`` after (``direction`` 1) or before (-1) ``index``, or None."""
        ids = self._by_kind.get(kind, [])
        indexes = [self.marks[i].index for i in ids]
        if direction > 0:
            at = bisect.bisect_right(indexes, index)
            return self.marks[ids[at]] if at < len(ids) else None
        at = bisect.bisect_left(indexes, index) - 1
        return self.marks[ids[at]] if at >= 0 else None


class TimelineSource(Source):
    """A finished run log in the dashboard, at one optimizer step at a time.

    The app's timeline keys move it (:meth:`move_by`, :meth:`move_to`,
    :meth:`move_to_mark`). Takes no commands. Opens at the end of the run.

    Args:
        log: the rank's run log (:func:`gpuwatch.history.find_logs`, ``log_at``).
        branch: ``(tree, N)``: the path of branch N of the run's ``tree``
            (:func:`gpuwatch.history.log_summary`'s). By default, the path of the branch
            taken last (the whole log for a run of one branch).

    Attributes:
        timeline: the loaded timeline, None until the thread has read the log.
        index: the step index shown (None before loading, or without steps).
    """

    def __init__(self, log: LogFiles, *, branch: tuple[BranchTree, int] | None = None
                 ) -> None:
        super().__init__(None, f"run log {log.first}", poll_s=0.1)
        self.log = log
        self.branch = branch
        self.timeline: Timeline | None = None
        self.index: int | None = None
        # the run up to the step shown, from step 1 (by default it follows the branch
        # trained, which ends on the one taken last)
        self.whole = WholeRun(str(log.first), branch=branch)
        self._now = time.monotonic()

    def now(self) -> float:
        """The time of the last record shown (unix s, the clock records are folded with).

        While loading, the monotonic clock."""
        return self._now

    def _run(self) -> None:
        with self.lock:
            initial = self.state.copy()
        tree, branch = self.branch or (log_summary(self.log)[0].tree, None)
        path = BranchPath(tree, branch) if len(tree) > 1 else None
        timeline = Timeline(self.log, initial, stopped=self._stop.is_set, path=path)
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
        """Show step index ``index``, clamped to the run's steps; False when nothing moves.

        Nothing to move: not loaded, no steps, already there."""
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
        """Move to the next (``direction`` 1) or previous (-1) mark of ``kind``; return the mark.

        ``kind``: ``change`` or ``event``; None when there is none that way."""
        if self.timeline is None or self.index is None:
            return None
        mark = self.timeline.mark_after(self.index, kind, direction)
        if mark is not None:
            self.move_to(mark.index)
        return mark
