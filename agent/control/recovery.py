"""Loss-spike recovery: the policy (:class:`Recovery`) and the spike test (:class:`SpikeWatch`).

With ``recover=on`` the run base (:class:`agent.integrations.run.RunBase`) keeps host
copies of the training state every :attr:`Recovery.keep_every_steps` optimizer steps (a
ring of :attr:`Recovery.keep_states`, within :attr:`Recovery.budget_bytes`). Rank 0's
I/O thread watches the losses the step markers deliver (never a ``.item()`` on the
training thread): a loss far above its running median, by a margin of
:attr:`Recovery.spike_mads` median absolute deviations, for
:attr:`Recovery.spike_steps` steps in a row is a spike (one noisy step is not). The
agent then asks every rank, for one common step, to put back the latest state kept
before the spike began, to move the data past every micro-batch trained since that
state, and to scale the learning rate by :attr:`Recovery.lr_scale` for
:attr:`Recovery.lr_steps` steps; one ``branched`` event says all of it.

A spike whose first step is within :attr:`Recovery.repeat_span_steps` steps after the
last recovery's fork (the span the kept states cover) is a repeat of it: the skipped
data was not its cause. After :attr:`Recovery.max_repeats` repeats in a row, the next
one is not recovered: ``recover`` goes off with one warning and the training goes on. A
spike further from the last fork starts the count again.

Nothing here imports torch: the watch runs on the I/O thread from plain floats.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.wire.knobs import STANDARD_KNOBS
from agent.wire.protocol import EventKind, applied_unchanged

#: Host memory the kept states may take together by default (bytes).
RECOVERY_BUDGET_BYTES = 4 << 30
#: Finite losses the running median is taken over (the latest ones before a step).
MEDIAN_STEPS = 50
#: Losses needed before the watch judges a step (a run's first steps set its level).
MIN_STEPS = 10
#: The event kinds of a setting changed: applied, or put back by a rollback.
_CHANGED = frozenset({EventKind.APPLIED, EventKind.ROLLED_BACK})
#: The MAD is taken as at least this fraction of the median: a loss that has settled
#: to nearly constant values must still move by that much to count.
MIN_SPREAD = 0.02
#: 1.4826 x MAD estimates the standard deviation of normally spread losses.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Recovery:
    """The settings of ``recover=on``; the ``recover`` knob turns it on and off live.

    Given as ``agent.attach(..., recover=Recovery(...))`` or
    ``agent.session(..., recover=...)``.

    Attributes:
        keep_every_steps: keep a host copy of the state at every boundary after an
            optimizer step that is a multiple of this (>= 1).
        keep_states: how many kept states the ring holds (>= 1; 2 or more, so that the
            one from before a spike is still there when a state is kept during it).
        spike_steps: steps in a row whose loss must be above the margin (>= 2: one
            noisy step never fires).
        spike_mads: the margin above the running median, in robust standard
            deviations (``1.4826 x`` the median absolute deviation, at least
            :data:`MIN_SPREAD` of the median).
        lr_scale: multiplier of the ``lr_scale`` knob after a recovery (1: unchanged).
        lr_steps: optimizer steps the scaled learning rate lasts, then it goes back.
        budget_bytes: host memory the kept states may take together; a state that
            would not fit is not kept (the recovery then goes back further, or says it
            cannot).
        max_repeats: recoveries of repeated spikes in a row (>= 0) after which a spike
            that recurs again turns ``recover`` off (:attr:`repeat_span_steps`).
        skip_windows: accumulation windows of data skipped, counted from the kept state
            gone back to (>= 0; PaLM skipped 200-500 batches from about 100 steps before
            its spikes). None: every window trained since it (the data goes on as it is
            now). Fewer than were trained since: the kept state's data position, moved
            on past the first ``skip_windows`` of them (the ones after are trained
            again). More: the data as it is now, then as many more windows (of the last
            window's size) drawn from the loader and dropped. A count the integration's
            data cannot skip exactly is refused with the reason (not recovered).

    Raises:
        ValueError: a setting out of its range.
    """

    keep_every_steps: int = 25
    keep_states: int = 2
    spike_steps: int = 3
    spike_mads: float = 6.0
    lr_scale: float = 1.0
    lr_steps: int = 0
    budget_bytes: int = RECOVERY_BUDGET_BYTES
    max_repeats: int = 2
    skip_windows: int | None = None

    def __post_init__(self) -> None:
        for name, least in (("keep_every_steps", 1), ("keep_states", 1), ("spike_steps", 2),
                            ("lr_steps", 0), ("budget_bytes", 1),
                            ("max_repeats", 0), ("skip_windows", 0)):
            value = getattr(self, name)
            if name == "skip_windows" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Recovery.{name} must be an integer >= {least}, "
                                 f"got {value!r}")
        for name in ("spike_mads", "lr_scale"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"Recovery.{name} must be a number > 0, got {value!r}")

    @property
    def repeat_span_steps(self) -> int:
        """Steps after a recovery's fork within which a spike's first step makes it a repeat.

        The span the kept states cover (``keep_every_steps x keep_states``)."""
        return self.keep_every_steps * self.keep_states

    def describe(self) -> str:
        """The settings in a few words, for the knobs panel and ``?``.

        For example ``every 25 x2, 3 steps > 6 MAD, skip 200, lr x0.5 for 100``
        (``skip N``: :attr:`skip_windows`, when set); ``max_repeats`` is named when not
        the default 2 (``, off after 3 repeats``)."""
        text = (f"every {self.keep_every_steps} x{self.keep_states}, "
                f"{self.spike_steps} steps > {self.spike_mads:g} MAD")
        if self.skip_windows is not None:
            text += f", skip {self.skip_windows}"
        if self.lr_scale != 1 and self.lr_steps:
            text += f", lr x{self.lr_scale:g} for {self.lr_steps}"
        if self.max_repeats != 2:
            text += f", off after {self.max_repeats} repeats"
        return text


@dataclass(frozen=True)
class Spike:
    """A spike found: the losses of steps ``first`` to ``last`` were above ``limit``.

    ``limit`` is the running ``median`` plus the margin; ``loss`` is the last one."""

    first: int
    last: int
    loss: float
    median: float
    limit: float

    def describe(self) -> str:
        """For people: ``loss 41.2 at steps 31-33, above 2.31 (median 0.52 + 6 MAD)``."""
        return (f"loss {self.loss:.4g} at steps {self.first}-{self.last}, above "
                f"{self.limit:.4g} (median {self.median:.4g} + margin)")


class SpikeWatch:
    """Finds loss spikes in the published steps (rank 0's I/O thread only).

    Args:
        policy: the spike's definition (:attr:`Recovery.spike_steps`,
            :attr:`Recovery.spike_mads`).

    Attributes:
        on: whether spikes are looked for (the ``recover`` knob; any thread sets it).
    """

    def __init__(self, policy: Recovery) -> None:
        self.policy = policy
        self.on = False
        self._recent: deque[float] = deque(maxlen=MEDIAN_STEPS)
        #: the steps above the margin in a row: (first step, count)
        self._first = 0
        self._above = 0
        #: the first step of the spike a recovery was asked for (None: none is waiting):
        #: until a step at or before it comes (the new branch), steps are not judged
        self.waiting_since: int | None = None
        self._last_step = 0

    def on_event(self, event: dict[str, Any]) -> None:
        """An event, in its place among the steps :meth:`observe` is told of (I/O thread).

        A change of a knob whose change moves the loss's level by design
        (:attr:`agent.wire.knobs.KnobSpec.shifts_loss`: dropout, the mixture), applied or
        put back by a rollback, starts a new level: the losses before it are dropped from
        the median and the next :data:`MIN_STEPS` ones make the new level before any is
        judged, so such a change is never taken for a spike and undone by a recovery. A
        setting to the value it had ("(no change)": nothing set), or a change of another
        knob, keeps the level (a spike after it is still recovered from; the harm a
        change does is the change guard's to judge). O(1)."""
        if event.get("kind") not in _CHANGED or applied_unchanged(event):
            return
        knob = event.get("knob")
        spec = STANDARD_KNOBS.get(knob) if isinstance(knob, str) else None
        if spec is not None and spec.shifts_loss:
            self._recent.clear()
            self._above = 0

    def rearm(self) -> None:
        """The recovery asked for did not happen: judge the next steps again.

        It was refused, or nothing was kept. Any thread."""
        self.waiting_since = None

    def observe(self, steps: Sequence[int], losses: Sequence[float | None]) -> Spike | None:
        """Published steps with their losses: returns the first spike they complete, or None.

        The steps come in order; a loss of None was not read. A few microseconds a step
        while on (a median of :data:`MEDIAN_STEPS` floats); nothing while off."""
        if not self.on:
            return None
        found = None
        for step, loss in zip(steps, losses):
            if step <= self._last_step:  # a new branch starts: its losses are new
                self._above = 0
                if self.waiting_since is not None and step <= self.waiting_since:
                    self.waiting_since = None
            self._last_step = step
            if loss is None or self.waiting_since is not None or found is not None:
                continue
            spike = self._judge(step, loss)
            if spike is not None:
                found = spike
                self.waiting_since = spike.first
        return found

    def _judge(self, step: int, loss: float) -> Spike | None:
        recent = self._recent
        if len(recent) < MIN_STEPS:
            if math.isfinite(loss):
                recent.append(loss)
            return None
        median = statistics.median(recent)
        spread = max(MAD_TO_SIGMA * statistics.median(abs(x - median) for x in recent),
                     MIN_SPREAD * abs(median))
        limit = median + self.policy.spike_mads * spread
        if not loss <= limit:  # (a NaN or inf loss counts as above)
            if self._above == 0:
                self._first = step
            self._above += 1
            if self._above >= self.policy.spike_steps:
                self._above = 0
                return Spike(self._first, step, loss, median, limit)
            return None  # (a step above is left out of the median)
        self._above = 0
        recent.append(loss)
        return None
