"""The step encoder: the step records the training thread queued as ``steps`` batches.

Turned into batches (the format: :mod:`agent.wire.protocol`) on the I/O thread, packed as
msgpack as the steps come (:class:`agent.step._hot.StepsBatch`).

Owns the records in flight (queued, their markers not yet ready), the rows of the batch
being built, the expected next step (to count records lost to the queue's bound), the
data-wait window and its input-bound verdict, and the memory readings of the latest
batch. It reads each step's device values from its marker once ready (never blocking),
hands each step's outcome to the rollback guard and the tuner, and publishes one message
a batch through the I/O loop's ``publish``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

import msgpack
import torch

from agent.wire import protocol
from agent.wire.protocol import EventKind
from agent.wire.runlog import pack_plain
from agent.control.guard import BASELINE_STEPS, ChangeGuard
from agent.step.markers import CpuMarker, host_loss
from agent.step._hot import ShareWindow, StepsBatch, columns
from agent.step.record import StepRecord, host_columns
from agent.search.tune import AutoTune
from gpuopt._hotpath import host_items
from gpuopt.memory import memory_stats
from gpuopt.optim import host_rate

#: The key of an event's number in the record queue (:meth:`StepEncoder.queue_event`),
#: taken off before the event is published.
EVENT_NUMBER = "_event_number"
#: Steps in the sliding window of the data-wait share and the input-bound verdict.
INPUT_WINDOW_STEPS = 20
#: Share of step time spent waiting for data above which a run is called input-bound
#: (as TensorFlow Profiler's "% of step time waiting on input"); above the lower one it is
#: partly input-bound.
INPUT_BOUND_SHARE = 0.5
PARTLY_INPUT_BOUND_SHARE = 0.2


#: The verdicts, by how many of :data:`_VERDICT_SHARES` a share reaches.
_VERDICTS = ("compute-bound", "partly input-bound", "input-bound")
_VERDICT_SHARES = (PARTLY_INPUT_BOUND_SHARE, INPUT_BOUND_SHARE)


class InputWindow(ShareWindow):
    """Data-wait share of step time over the last ``steps`` optimizer steps, and a verdict.

    I/O thread only. ``add(data_wait_s, step_time_s)`` adds one step and returns
    ``(share, verdict)`` over the window: the share in 0 to 1, ``verdict`` one of
    ``"compute-bound"``, ``"partly input-bound"`` (from :data:`PARTLY_INPUT_BOUND_SHARE`)
    and ``"input-bound"`` (from :data:`INPUT_BOUND_SHARE`). ``add_many(waits, times)``
    adds several (two lists) and returns the two lists, as ``add`` would one at a time,
    bit for bit.

    .. note:: In C (:class:`agent.step._hot.ShareWindow`): about 25 ns a step; the sums
       are taken again over the window at each step, so a long run's share does not drift.
    """

    def __new__(cls, steps: int = INPUT_WINDOW_STEPS) -> InputWindow:
        return super().__new__(cls, steps, _VERDICT_SHARES, _VERDICTS)


class StepEncoder:
    """Encodes the queued step records of one rank as ``steps`` batches. I/O thread only.

    Args:
        records: the queue the training thread appends to: step records
            (:class:`agent.step.record.StepRecord`) and events (their ``event`` body, a dict).
        marker: the step markers' API (:func:`agent.step.markers.marker_for`).
        publish: ``publish(msg_type, body)``, the I/O loop's send (which first sends the
            batch built so far, through :meth:`flush`, for any other message type).
        guard: the rollback guard, told each step's loss and GradScaler skip.
        check_step: ``check_step(step, loss, skipped)``, called for a step the guard has
            to see (a change is watched, a step was skipped, or the loss is not finite).
        tune: the in-run search, told of each event, and of each step while one is on.
        device: the model's device; CUDA adds CUDA memory fields (and resets the peaks
            after each batch).
        report_error: ``report_error(where, exc)``, told of a step's value that cannot be
            read (:meth:`agent.step.core.Agent.report_error`): that step is published
            without it, the others as they are.
    """

    def __init__(self, records: deque, marker: Any, *,
                 publish: Callable[[str, dict[str, Any] | protocol.PackedBody], None],
                 guard: ChangeGuard,
                 check_step: Callable[[int, float | None, bool | None], None],
                 tune: AutoTune, device: torch.device | None,
                 report_error: Callable[[str, BaseException], None]) -> None:
        self._records = records
        self._report_error = report_error
        self._marker = marker
        self._publish = publish
        self._guard = guard
        self._check_step = check_step
        self._tune = tune
        self._device = device
        #: records taken from the queue whose markers are not ready yet, oldest first
        self._in_flight: deque = deque()
        #: the marker of the latest step published (the GPU time is between two)
        self._previous_marker: Any = None
        #: the steps of the ``steps`` message being built (see :meth:`drain`), packed as
        #: they come, and how many steps it and :attr:`_rows` hold
        self._batch = StepsBatch(_PACKB, plain=pack_plain)
        self._batch_steps = 0
        #: the memory reading of the wake-up :meth:`drain` is in (None outside one)
        self._reading: dict[str, Any] | None = None
        #: the latest steps of the batch, as rows (one at a time: :meth:`_add_each`)
        self._rows: list[tuple] = []
        #: how many records of the list :meth:`drain` took were handled
        self._done = 0
        self._input = InputWindow()
        #: ``loss_watch(steps, losses)``: told every step published, in order, with its
        #: loss (the agent's loss-spike watch, on rank 0); None: nobody
        self.loss_watch: Callable[[Sequence[int], list[Any]], None] | None = None
        #: ``change_watch(event)``: told every event in its place among the steps (the
        #: spike watch, which starts a new level after a change); None: nobody
        self.change_watch: Callable[[dict[str, Any]], None] | None = None
        #: the step expected next, to count records the queue's bound dropped
        self.expected_step: int | None = None
        #: Step records lost because the queue overflowed (the I/O thread fell behind).
        self.records_dropped = 0
        #: events queued so far (:meth:`queue_event` numbers each), the number of the
        #: next one expected here, and those the queue's bound lost (each loss is said
        #: in a warning event of its own)
        self.events_queued = 0
        self._next_event = 1
        self.events_dropped = 0
        self._event_lock = threading.Lock()
        #: step time (s) of the latest step encoded, for command replies
        self.recent_step_time_s: float | None = None
        #: The memory readings of the latest batch (:func:`gpuopt.memory.memory_stats`);
        #: replaced whole, so any thread may read it.
        self.latest_memory: dict[str, Any] = {}

    def overflowing(self) -> None:
        """Training thread: the record queue is full, and its oldest record goes now.

        Before any step was read (:attr:`expected_step` None), the steps are counted from
        the oldest one queued, so that those the queue drops before its first read are
        counted as later ones are (a loop at 40,000 steps/s lost its first 12,309 steps
        uncounted: drops were counted from the first step read). An event at the queue's
        head waits for the next overflow (events lost are counted by their numbers). A
        few operations, on the slow path only (the I/O thread is far behind); never
        raises."""
        if self.expected_step is not None:
            return
        try:
            oldest = self._records[0]
        except IndexError:  # (drained meanwhile)
            return
        if type(oldest) is not dict and self.expected_step is None:
            self.expected_step = oldest.step

    def queue_event(self, body: dict[str, Any]) -> None:
        """Any thread: queue the event ``body`` in order with the step records, numbered.

        The number (under :data:`EVENT_NUMBER`, taken off before it is published) lets
        :meth:`drain` count every event the queue's bound drops, and say so: an event
        is never lost silently. Step records are not numbered (the training thread's
        append stays one deque append); they are counted by their steps.

        .. note:: A lock and one deque append."""
        with self._event_lock:  # (numbers in the queue's order, whatever the thread)
            self.events_queued += 1
            body[EVENT_NUMBER] = self.events_queued
            self._records.append(body)

    def _count_event(self, body: dict[str, Any]) -> None:
        """Take the number off the event ``body`` (about to be published) and say, in a
        warning event before it, how many events the queue lost before it, if any."""
        number = body.pop(EVENT_NUMBER, None)
        if number is None:
            return
        if number > self._next_event:
            self._events_lost(number - self._next_event)
        self._next_event = number + 1

    def _events_lost(self, lost: int) -> None:
        self.events_dropped += lost
        self._publish(protocol.EVENT, {
            "level": "warning", "kind": EventKind.WARNING,
            "events_dropped": self.events_dropped,
            "text": f"{lost} events lost ({self.events_dropped} in all): the agent's "
                    f"record queue ({self._records.maxlen}) overflowed while its I/O "
                    "thread fell behind; the run log lacks them"})

    def drain(self, final: bool = False) -> None:
        """Turn the records queued since the last call into messages: ``steps`` batches and events.

        The steps into one ``steps`` batch (several past
        :data:`~agent.wire.protocol.MAX_BATCH_STEPS`), each event in its place among them. A
        step whose marker is not ready waits for the next call, and the steps after it with
        it; ``final``: the run is ending, nothing waits (a marker not ready gives no device
        values).

        .. note:: The cost of a step here is paid in GIL time by the training thread,
           so the steps between two events are handled a run at a time
           (:meth:`_add_run`): the usual run is packed from its records in C, with no
           list or number object a step (:meth:`StepsBatch.add_run`); others in
           columns, list operations that loop in C; one at a time (:meth:`_add_each`)
           only while the rollback guard watches a change, a search is on, or a step
           was skipped or has a non-finite loss. The message is closed and sent once a
           batch (:meth:`flush`), the memory read once a call (its batches share it:
           their steps all ran before). An internal error (a value msgpack cannot
           pack among them) drops the run of steps it happened in (the agent reports
           it) and leaves the records after it queued.
        """
        self._reading = None  # (one memory reading serves this wake-up's batches)
        try:
            records, in_flight = self._records, self._in_flight
            if records or in_flight:
                pending = list(in_flight)  # (the records not ready at the last drain)
                in_flight.clear()
                # (popped in C: the training thread may append meanwhile)
                pending += map(deque.popleft, repeat(records, len(records)))
                self._done = 0
                try:
                    self._encode(pending, final)
                finally:
                    if self._done < len(pending):  # not ready yet, or after an error
                        in_flight.extend(pending[self._done:])
            if final and self.events_queued >= self._next_event and not in_flight:
                self._events_lost(self.events_queued - self._next_event + 1)  # (the last)
                self._next_event = self.events_queued + 1
            if self._batch_steps:
                self.flush()
        finally:
            self._reading = None

    def _encode(self, pending: list[Any], final: bool) -> None:
        """Add ``pending``'s records to the batch in order, from :attr:`_done` on (which
        it advances past each record taken); stops at a marker not ready (unless
        ``final``)."""
        kinds = list(map(type, pending))  # dict: an event
        total = len(pending)
        marker_api = self._marker
        cpu = isinstance(marker_api, CpuMarker)
        while self._done < total:
            start = self._done
            if kinds[start] is dict:
                self._done = start + 1
                body = pending[start]
                self._count_event(body)
                self._tune.on_event(body)
                if self.change_watch is not None:
                    self.change_watch(body)
                self._publish(protocol.EVENT, body)  # sends the batch before it
                continue
            try:
                end = kinds.index(dict, start)
            except ValueError:
                end = total
            ready: list[bool] | None = None  # on the host every marker is ready
            if not cpu:
                ready = []
                for record in pending[start:end]:
                    flag = marker_api.ready(record.marker)
                    if not flag and not final:
                        break
                    ready.append(flag)
                end = start + len(ready)
            first = start
            while start < end:  # at most a batch at a time
                stop = min(end, start + protocol.MAX_BATCH_STEPS - self._batch_steps)
                self._done = stop  # (dropped if they fail: never retried forever)
                self._add_run(pending[start:stop],
                              None if ready is None else ready[start - first:stop - first])
                if self._batch_steps >= protocol.MAX_BATCH_STEPS:
                    self.flush()
                start = stop
            if end < total and kinds[end] is not dict:
                return  # a marker not ready: it and what follows wait

    def _device_values(self, run: list[StepRecord], ready: list[bool] | None
                       ) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """The ``(losses, grad norms, skipped flags, GPU step times)`` of a run of step
        records, read from their markers (``ready``: whether each marker is; None: on
        the host, where every one is)."""
        n = len(run)
        losses: list[Any]
        grad_norms: list[Any]
        skipped: list[Any]
        if ready is None:  # the marker is the loss, or (loss, skipped, grad norm)
            # (kinds by their types: ``tensor == None`` is a slow call a value)
            markers, = columns(run, _MARKER)
            nones: list[Any] = [None] * n
            kinds = set(map(type, markers))
            if kinds <= _FLOAT_OR_NONE:  # losses read as they were marked: the usual
                return markers, nones, nones, nones
            loss_ts: Sequence[Any]
            skipped_ts: Sequence[Any]
            norms: Sequence[Any]
            if tuple not in kinds:  # losses alone
                loss_ts, skipped_ts, norms = markers, nones, nones
            else:
                loss_ts, skipped_ts, norms = zip(*markers) if kinds == _TUPLE else zip(*[
                    marker if type(marker) is tuple else (marker, None, None)
                    for marker in markers])
                kinds = set(map(type, loss_ts))
            if kinds == _NONE:
                losses = nones
            elif kinds <= _FLOAT_OR_NONE:
                losses = list(loss_ts)
            elif kinds == _TENSOR:
                # (0-dim float CPU tensors read from memory; a torch.stack(...).tolist()
                # cost 0.30 us a step, item() 0.14)
                try:
                    losses = host_items(loss_ts)
                except Exception:  # (a tensor of more than one element: its mean)
                    losses = self._each(host_loss, loss_ts, "loss")
            else:
                losses = self._each(host_loss, loss_ts, "loss")
            skipped = nones if set(map(type, skipped_ts)) == _NONE else self._each(
                bool, skipped_ts, "GradScaler skip flag")
            grad_norms = nones if set(map(type, norms)) == _NONE else self._each(
                float, norms, "gradient norm")
            return losses, grad_norms, skipped, nones
        marker_api = self._marker
        previous = self._previous_marker
        losses, grad_norms, skipped = [], [], []
        gpu_times: list[Any] = []
        for record, flag in zip(run, ready):
            marker = record.marker
            if flag:
                losses.append(marker_api.loss(marker))
                grad_norms.append(marker_api.grad_norm(marker))
                skipped.append(marker_api.skipped(marker))  # frees the slot: last
                gpu_times.append(marker_api.gpu_time_s(previous, marker))
            else:
                losses.append(None)
                grad_norms.append(None)
                skipped.append(None)
                gpu_times.append(None)
            previous = marker
        return losses, grad_norms, skipped, gpu_times

    def _each(self, read: Callable[[Any], Any], values: Sequence[Any], what: str
              ) -> list[Any]:
        """``read`` of each of ``values`` (None stays None); None for a value it raises
        for, reported (``what``: the field), so that one value nobody can read (a meta
        tensor, a two-element norm) loses only itself, not its batch's steps."""
        try:
            return [None if value is None else read(value) for value in values]
        except Exception:
            pass
        read_values = []
        for value in values:
            try:
                read_values.append(None if value is None else read(value))
            except Exception as exc:
                self._report_error(f"reading a step's {what}", exc)
                read_values.append(None)
        return read_values

    def _add_run(self, run: list[StepRecord], ready: list[bool] | None) -> None:
        """Add a run of step records (no event among them, at most a batch's room) to
        the batch, in columns when nothing needs each step seen alone."""
        losses, grad_norms, skipped, gpu_times = self._device_values(run, ready)
        if ready is not None:  # (a device's: the next run's GPU time starts from it; a
            self._previous_marker = run[-1].marker  # host marker, a loss, is let go)
        n = len(run)
        if (self._tune.tuner is not None or self._guard.watching
                or skipped.count(None) != n or not _finite_or_none(losses, n)):
            self._add_each(run, losses, grad_norms, skipped, gpu_times)
            return
        self._guard.observe(losses[-BASELINE_STEPS:])  # (a change's baseline is of these)
        self._rows_to_columns()
        taken = self._batch.add_run(run, losses, grad_norms, gpu_times, self._input,
                                    self._guard.skipped_total)
        if taken is not None:  # the usual run: packed from the records themselves
            first, last, last_time_s = taken
            self._count_run(first, last)
            if self.loss_watch is not None:
                self.loss_watch(range(first, last + 1), losses)
            if last_time_s is not None:
                self.recent_step_time_s = last_time_s
            self._batch_steps += n
            return
        host = host_columns(run)
        steps, times, waits, rates = (host["step"], host["step_time_s"], host["data_wait_s"],
                                      host["lr"])
        self._count_steps(steps)
        if self.loss_watch is not None:
            self.loss_watch(steps, losses)
        nones = skipped  # every one None
        rate_kinds = set(map(type, rates))
        if rate_kinds == _NONE:
            lr = lr_groups = nones
        elif rate_kinds <= _FLOAT_OR_NONE:  # (float() would give each back as it is)
            lr, lr_groups = rates, nones
        elif rate_kinds <= _RATE_TYPES:
            lr, lr_groups = [None if rate is None else float(rate) for rate in rates], nones
        elif rate_kinds == _TUPLE and set(map(type, chain.from_iterable(rates))) == _FLOAT:
            # each param group's rate as a float (a scheduler's usual): in C
            lr_groups = list(map(list, rates))
            lr = list(map(itemgetter(0), rates)) if all(rates) else [
                groups[0] if groups else None for groups in rates]
        else:
            lr, lr_groups = [], []
            for rate in rates:
                rate, groups = _rates(rate)
                lr.append(rate)
                lr_groups.append(groups)
        shares: list[Any]
        verdicts: list[Any]
        if all(times):
            shares, verdicts = self._input.add_many(waits, times)
            self.recent_step_time_s = times[-1]
        else:  # the run's first step has no step time (and takes no part in the window)
            timed = [index for index, time_s in enumerate(times) if time_s]
            shares, verdicts = [None] * n, [None] * n
            if timed:
                timed_shares, timed_verdicts = self._input.add_many(
                    [waits[index] for index in timed], [times[index] for index in timed])
                for index, share, verdict in zip(timed, timed_shares, timed_verdicts):
                    shares[index] = share
                    verdicts[index] = verdict
                self.recent_step_time_s = times[timed[-1]]
        self._add_columns((steps, host["micro_batches"], host["samples"], times, waits, losses,
                           gpu_times, host["knobs"], skipped, host["activation_bytes"],
                           host["tokens"], lr, lr_groups, grad_norms,
                           [self._guard.skipped_total] * n, shares, verdicts))

    def _add_each(self, run: list[StepRecord], losses: list[Any], grad_norms: list[Any],
                  skipped: list[Any], gpu_times: list[Any]) -> None:
        """Add a run of step records one at a time: the rollback guard sees each step
        it has to (a change is watched, a step was skipped, the loss is not finite)
        and the tuner each step while a search is on, before the step joins the batch
        (what they publish sends the steps before it)."""
        guard = self._guard
        tune = self._tune if self._tune.tuner is not None else None
        window = self._input
        for record, loss, grad_norm, flag, gpu_s in zip(run, losses, grad_norms, skipped,
                                                         gpu_times):
            step, step_time_s, wait_s = record.step, record.step_time_s, record.data_wait_s
            samples, tokens = record.samples, record.tokens
            self._count_steps([step])
            lr, lr_groups = _rates(record.lr)
            if (flag is not None or guard.watching
                    or (loss is not None and loss - loss != 0.0)):  # NaN or inf loss
                self._check_step(step, loss, flag)  # (an event it publishes sends the batch)
            guard.observe((loss,))
            if self.loss_watch is not None:
                self.loss_watch([step], [loss])  # (idem)
            if tune is not None:  # a search is on (started by a command, never here)
                tune.on_step(step, step_time_s, samples, tokens, loss, flag)  # (idem)
            share = verdict = None
            if step_time_s:
                share, verdict = window.add(wait_s, step_time_s)
                self.recent_step_time_s = step_time_s
            self._rows.append((step, record.micro_batches, samples, step_time_s, wait_s, loss,
                               gpu_s, record.knobs, flag, record.activation_bytes, tokens,
                               lr, lr_groups,
                               grad_norm, guard.skipped_total, share, verdict))
            self._batch_steps += 1

    def _count_steps(self, steps: list[int]) -> None:
        """Note the steps taken (in order) and count the records lost before them to the
        queue's bound (a step number skipped)."""
        first, last = steps[0], steps[-1]
        if last - first == len(steps) - 1 and (len(steps) < 3
                                               or steps == list(range(first, last + 1))):
            self._count_run(first, last)
            return
        for step in steps:
            self._count_run(step, step)

    def _count_run(self, first: int, last: int) -> None:
        """Note the consecutive steps ``first`` to ``last`` taken (see :meth:`_count_steps`)."""
        expected = self.expected_step
        if expected is not None and first > expected:
            self.records_dropped += first - expected  # queue overflowed
        self.expected_step = last + 1

    def _rows_to_columns(self) -> None:
        """The rows :meth:`_add_each` added, into the batch."""
        if self._rows:
            rows, self._rows = self._rows, []
            self._batch.add_rows(tuple(map(list, zip(*rows))))

    def _add_columns(self, columns: tuple[list[Any], ...]) -> None:
        """Append the columns of some steps (in the order of a row of
        :meth:`_add_each`) to the batch."""
        self._rows_to_columns()
        self._batch.add_rows(columns)
        self._batch_steps += len(columns[0])

    def flush(self) -> None:
        """Publish the steps batched so far as one ``steps`` message (columns).

        Nothing when there are none. The message is packed as it is sent
        (:class:`agent.step._hot.StepsBatch`), the batch then emptied."""
        try:
            self._rows_to_columns()
        finally:
            self._batch_steps = 0
        batch = self._batch
        if not batch.n:
            return
        memory = self._reading
        if memory is None:  # (the batches one wake-up sends share it: their steps all
            memory = self._reading = self._memory()  # ran before it; the peaks are theirs)
        self.latest_memory = memory
        common = dict(memory)
        try:
            self._publish(protocol.STEPS, protocol.PackedBody(
                lambda head: batch.take(head, common), partial(_plain_body, batch, common)))
        finally:
            batch.clear()  # (sent, or said and logged: never sent twice)

    def read_memory(self) -> None:
        """Take a memory reading now (I/O thread), the first before any step.

        So that :attr:`latest_memory` has one from the start (a short run may end before its
        first batch)."""
        self.latest_memory = self._memory()

    def _memory(self) -> dict[str, Any]:
        """Memory fields of the step records published now; on CUDA the peaks are then
        reset, so each batch of records reports the peak of its own steps."""
        memory: dict[str, Any] = memory_stats(self._device)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        return memory


#: A step record's marker (:func:`agent.step._hot.columns`).
_MARKER = ("marker",)
_NONE = {type(None)}
_TENSOR = {torch.Tensor}
#: Types of ``lr`` values read with ``float`` alone (no param groups' tuple).
_RATE_TYPES = frozenset({float, int, type(None)})
_FLOAT_OR_NONE = frozenset({float, type(None)})
_TUPLE = {tuple}
_FLOAT = {float}


#: msgpack's packing of what :class:`StepsBatch` does not pack itself (the wire's).
_PACKB = partial(msgpack.packb, use_bin_type=True)


def _plain_body(batch: StepsBatch, common: dict[str, Any]) -> dict[str, Any]:
    """The ``steps`` body of ``batch`` as a map of Python values, as
    :meth:`StepsBatch.take` would send it (for the run log, when it cannot)."""
    packed, knobs = batch.packed_columns()
    columns = {name: msgpack.unpackb(data, strict_map_key=False)
               for name, data in packed.items()}
    common = dict(common)
    if knobs.count(knobs[0]) == len(knobs):
        common["knobs"] = knobs[0]
    else:
        columns["knobs"] = knobs
    return {"n": batch.n, "columns": columns, "common": common}


def _finite_or_none(losses: list[Any], n: int) -> bool:
    """Whether the ``n`` losses are all None or all finite (one C sum: an inf or NaN
    makes it non-finite; a sum that overflows only sends the steps one at a time)."""
    try:
        total = sum(losses)  # (a None raises: cheaper than counting them among floats)
    except TypeError:
        return losses.count(None) == n
    return total - total == 0.0


def _rates(lr: Any) -> tuple[float | None, list[float | None] | None]:
    """A step's ``(lr, lr_groups)`` from the ``lr`` it recorded: a float, None, or
    every param group's rate as a tuple (floats or host tensors)."""
    lr_groups = None
    if isinstance(lr, tuple):
        lr_groups = [host_rate(rate) for rate in lr]
        lr = lr_groups[0] if lr_groups else None
    if lr is not None:
        lr = float(lr)
    return lr, lr_groups
