"""The step encoder: turns the step records the training thread queued into ``steps``
batches (see :func:`agent.protocol.steps_body`), on the I/O thread.

Owns the records in flight (queued, their markers not yet ready), the rows of the batch
being built, the expected next step (to count records lost to the queue's bound), the
data-wait window and its input-bound verdict, and the memory readings of the latest
batch. It reads each step's device values from its marker once ready (never blocking),
hands each step's outcome to the rollback guard and the tuner, and publishes one message
a batch through the I/O loop's ``publish``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from agent import protocol
from agent.guard import ChangeGuard
from agent.markers import CpuMarker
from agent.tune import AutoTune
from gpuopt.memory import memory_stats
from gpuopt.optim import host_rate

#: Steps in the sliding window of the data-wait share and the input-bound verdict.
INPUT_WINDOW_STEPS = 20
#: Share of step time spent waiting for data above which a run is called input-bound
#: (as TensorFlow Profiler's "% of step time waiting on input"); above the lower one it is
#: partly input-bound.
INPUT_BOUND_SHARE = 0.5
PARTLY_INPUT_BOUND_SHARE = 0.2


class InputWindow:
    """Data-wait share of step time over the last ``steps`` optimizer steps, and a verdict.

    I/O thread only. ``add`` is O(1).
    """

    def __init__(self, steps: int = INPUT_WINDOW_STEPS) -> None:
        self._window: deque = deque(maxlen=steps)
        self._wait_s = 0.0
        self._step_s = 0.0

    def add(self, data_wait_s: float, step_time_s: float) -> tuple[float, str]:
        """Add one step; return ``(share, verdict)`` over the window. ``verdict`` is
        ``"input-bound"``, ``"partly input-bound"`` or ``"compute-bound"``."""
        if len(self._window) == self._window.maxlen:
            old_wait, old_step = self._window[0]
            self._wait_s -= old_wait
            self._step_s -= old_step
        self._window.append((data_wait_s, step_time_s))
        self._wait_s += data_wait_s
        self._step_s += step_time_s
        share = min(1.0, max(0.0, self._wait_s / self._step_s)) if self._step_s > 0 else 0.0
        if share >= INPUT_BOUND_SHARE:
            return share, "input-bound"
        if share >= PARTLY_INPUT_BOUND_SHARE:
            return share, "partly input-bound"
        return share, "compute-bound"


class StepEncoder:
    """Encodes the queued step records of one rank as ``steps`` batches. I/O thread only.

    Args:
        records: the queue the training thread appends to: ``("step", ...)`` tuples
            (see :meth:`agent.core.Agent.optimizer_step`) and ``("event", body)``.
        marker: the step markers' API (:func:`agent.markers.marker_for`).
        publish: ``publish(msg_type, body)``, the I/O loop's send (which first sends the
            batch built so far, through :meth:`flush`, for any other message type).
        guard: the rollback guard, told each step's loss and GradScaler skip.
        check_step: ``check_step(step, loss, skipped)``, called for a step the guard has
            to see (a change is watched, a step was skipped, or the loss is not finite).
        tune: the in-run search, told of each event, and of each step while one is on.
        device: the model's device; CUDA adds CUDA memory fields (and resets the peaks
            after each batch).
    """

    def __init__(self, records: deque, marker: Any, *,
                 publish: Callable[[str, dict[str, Any]], None], guard: ChangeGuard,
                 check_step: Callable[[int, float | None, bool | None], None],
                 tune: AutoTune, device: torch.device | None) -> None:
        self._records = records
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
        #: the rows of the ``steps`` message being built (see :meth:`drain`)
        self._batch: list[tuple] = []
        self._input = InputWindow()
        #: the step expected next, to count records the queue's bound dropped
        self.expected_step: int | None = None
        #: Step records lost because the queue overflowed (the I/O thread fell behind).
        self.records_dropped = 0
        #: step time (s) of the latest step encoded, for command replies
        self.recent_step_time_s: float | None = None
        #: The memory readings of the latest batch (:func:`gpuopt.memory.memory_stats`);
        #: replaced whole, so any thread may read it.
        self.latest_memory: dict[str, Any] = {}

    def drain(self, final: bool = False) -> None:
        """Turn the records queued since the last call into messages: the steps into
        one ``steps`` batch (several past :data:`~agent.protocol.MAX_BATCH_STEPS`),
        each event in its place among them. A step whose marker is not ready waits for
        the next call, and the steps after it with it; ``final``: the run is ending,
        nothing waits (a marker not ready gives no device values).

        .. note:: The cost of a step here is paid in GIL time by the training thread:
           per step it is a tuple of plain values and a few float operations; the dict
           work, the encoding and the send happen once a batch (:meth:`flush`).
        """
        records, in_flight = self._records, self._in_flight
        while records:
            in_flight.append(records.popleft())
        batch = self._batch
        marker_api = self._marker
        cpu = isinstance(marker_api, CpuMarker)
        guard = self._guard
        window = self._input
        tune = self._tune if self._tune.tuner is not None else None
        previous_marker = self._previous_marker
        while in_flight:
            record = in_flight[0]
            if record[0] == "event":
                in_flight.popleft()
                self._tune.on_event(record[1])
                self._publish(protocol.EVENT, record[1])  # sends the batch before it
                batch = self._batch
                continue
            (_, step, step_time_s, micro_batches, samples, wait_s, marker, knobs,
             activation_bytes, tokens, lr) = record
            ready = cpu or marker_api.ready(marker)
            if not ready and not final:
                break
            in_flight.popleft()
            expected = self.expected_step
            if expected is not None and step > expected:
                self.records_dropped += step - expected  # queue overflowed
            self.expected_step = step + 1
            if cpu:  # the marker is (loss, skipped, grad norm), tensors or None
                loss_t, skipped_t, norm = marker
                loss = None if loss_t is None else (
                    loss_t.item() if loss_t.dim() == 0 else float(loss_t.float().mean()))
                skipped = None if skipped_t is None else bool(skipped_t)
                grad_norm = None if norm is None else float(norm)
                gpu_s = None
            elif ready:
                loss = marker_api.loss(marker)
                grad_norm = marker_api.grad_norm(marker)
                skipped = marker_api.skipped(marker)
                gpu_s = marker_api.gpu_time_s(previous_marker, marker)
            else:
                loss = grad_norm = skipped = gpu_s = None
            lr_groups = None
            if isinstance(lr, tuple):  # every param group's, floats or host tensors
                lr_groups = [host_rate(rate) for rate in lr]
                lr = lr_groups[0] if lr_groups else None
            if lr is not None:
                lr = float(lr)
            if (skipped is not None or guard.watching
                    or (loss is not None and loss - loss != 0.0)):  # NaN or inf loss
                self._check_step(step, loss, skipped)
                batch = self._batch  # an event it published sent the batch
            if tune is not None:  # a search is on (started by a command, never here)
                tune.on_step(step, step_time_s, samples, tokens, loss, skipped)
                batch = self._batch  # the tuner may publish (and so send the batch)
            share = verdict = None
            if step_time_s:
                share, verdict = window.add(wait_s, step_time_s)
                self.recent_step_time_s = step_time_s
            batch.append((step, micro_batches, samples, step_time_s, wait_s, loss, gpu_s,
                          knobs, skipped, activation_bytes, tokens, lr, lr_groups,
                          grad_norm, guard.skipped_total, share, verdict))
            previous_marker = self._previous_marker = marker
            if len(batch) >= protocol.MAX_BATCH_STEPS:
                self.flush()
                batch = self._batch
        if batch:
            self.flush()

    def flush(self) -> None:
        """Publish the rows batched so far as one ``steps`` message (columns); nothing
        when there are none."""
        rows, self._batch = self._batch, []
        if not rows:
            return
        (steps, micro_batches, samples, times, waits, losses, gpu_times, knobs, skipped,
         activation, tokens, lr, lr_groups, grad_norm, skipped_total, share_window,
         verdict) = map(list, zip(*rows))
        columns: dict[str, list[Any]] = {
            "step": steps, "micro_batches": micro_batches, "samples": samples,
            "step_time_s": times, "data_wait_s": waits,
            "data_wait_share": [min(1.0, wait / time_s) if time_s else None
                                for wait, time_s in zip(waits, times)],
            "samples_per_s": [count / time_s if time_s else None
                              for count, time_s in zip(samples, times)],
            "loss": losses, "gpu_step_time_s": gpu_times,
            "skipped_steps_total": skipped_total,
        }
        n = len(rows)
        for name, values in (("grad_scaler_skipped", skipped),
                             ("activation_bytes", activation), ("tokens", tokens),
                             ("lr", lr), ("lr_groups", lr_groups),
                             ("grad_norm", grad_norm),
                             ("data_wait_share_window", share_window),
                             ("input_verdict", verdict)):
            if values.count(None) != n:
                columns[name] = values
        if "tokens" in columns:
            columns["tokens_per_s"] = [count / time_s if count is not None and time_s
                                       else None for count, time_s in zip(tokens, times)]
        memory = self.latest_memory = self._memory()
        common = dict(memory)
        first = knobs[0]
        if all(value is first for value in knobs):  # the same map unless a knob changed
            common["knobs"] = first
        else:
            columns["knobs"] = knobs
        self._publish(protocol.STEPS, protocol.steps_body(columns, common))

    def read_memory(self) -> None:
        """Take a memory reading now (I/O thread): the first, before any step, so that
        :attr:`latest_memory` has one from the start (a short run may end before its
        first batch)."""
        self.latest_memory = self._memory()

    def _memory(self) -> dict[str, Any]:
        """Memory fields of the step records published now; on CUDA the peaks are then
        reset, so each batch of records reports the peak of its own steps."""
        memory: dict[str, Any] = memory_stats(self._device)
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        return memory
