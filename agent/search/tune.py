"""In-run auto-tune: the run finds its fastest safe configuration while it trains.

The ``tune`` command (``T`` in the dashboard, ``gpuwatch tune``) starts a search that
runs in the agent itself, on its I/O thread, from the agent's own step records: it goes
on when the dashboard that started it disconnects or is killed, and it always ends in
the best configuration it has seen. ``tune`` with ``{"stop": true}`` ends it at once,
keeping the best.

How a setting is judged:

- The measure is the time per unit of work of each optimizer step: ``step_time_s`` over
  the step's tokens where the run reports them, else its samples (so a change of
  micro-batch size compares fairly); throughput is its inverse.
- Warm-up is excluded, detected rather than counted: the step a change applies at is
  always left out, and then the prefix of the steps since the change that MSER (the
  marginal standard error rule, :class:`Series`) finds: worker start-up, allocator
  growth, the first batches after a rebuild. While ``torch.compile`` compiles (from a
  ``compiling`` event to its ``compiled``) no step is measured.
- A candidate is measured interleaved with the best configuration, in short
  sub-blocks (a few steps and at least :data:`SUB_BLOCK_S`): best, candidate,
  candidate, best, best, candidate, ... Each pair of neighbouring sub-blocks gives one
  log throughput ratio; the pairs alternate their order (a linear drift of the
  machine's load cancels) and a paired t-test over them counts the load moving between
  pairs as noise, so a busy, changing host makes the interval wider instead of making
  the verdict wrong. From :data:`MIN_PAIRS_SLOWER` pairs a candidate slower beyond noise
  (the upper end of the 95% interval below zero) is reverted at once; from
  :data:`MIN_PAIRS_FASTER` one faster beyond noise is kept and becomes the best, and one
  whose gain is below :data:`WORTHWHILE_GAIN` beyond noise (the upper end of the
  interval under it) is reverted as not worth it: each further pair costs steps of the
  run, and could at most prove a gain too small to matter. Futility stops the rest
  early: from :data:`MIN_PAIRS_FASTER` pairs a candidate slower on average is reverted,
  and from :data:`FUTILE_FROM_PAIRS` one that :data:`MAX_PAIRS` pairs could not show
  faster at its mean and spread so far (:func:`could_be_shown_faster`); after
  :data:`MAX_PAIRS` it is reverted as not faster beyond noise. The constants were chosen
  with a simulation of this search on the CNN demo's measured step times on a 2-core
  host (a worker's restart at each epoch, load drift, bursts, commands that take steps
  to apply): 260 to 290 steps for the search, ending within 5% of the best
  configuration in 80% (heavy noise) to 100% (a quiet host) of runs
  (``benchmarks/sim_tune.py``).
- Which candidates: a coordinate search from the configuration the run has. Numeric
  knobs move along a ladder (0, 1, 2, 4, ... up to the knob's maximum, for
  ``num_workers`` and ``cpu_threads`` the usable CPUs) one rung at a time, up first, then
  down, as long as each rung is kept; choice and boolean knobs try each other value.
  Knobs that draw on one resource are also moved together, as a trade (:data:`TRADES`:
  a DataLoader worker more for an intra-op thread fewer, and the other way), right after
  the later of the two: each move alone can be slower while the trade is the fastest.
  A full pass that keeps something is followed by one more. A value the run refuses (its
  check) or warns about (slow here, or without effect here, such as ``pin_memory``
  without CUDA) is skipped with the reason. Knobs whose spec says they change numerics
  or memory (:data:`agent.wire.knobs.TUNED_IF_ALLOWED`) are searched only when allowed.

Safety: a candidate that fails to apply, that the out-of-memory path rolls back, or
that is slower, is reverted at once. When the loss is non-finite or the GradScaler
skips :attr:`ChangeGuard.max_skipped_in_row` fp16 steps in a row (for as long as the
rollback guard watches a change of the search's, kept candidates included), the run
goes back to the configuration before the trial, and the next :data:`CHECK_STEPS`
steps with a loss there decide who is to blame: one that trains blames the trial's
candidate (reverted); none that does means the run itself diverged (the data, the
weights), so the search stops there and keeps what it had kept, blaming no setting.
The agent's own non-finite-loss warning is not held back meanwhile.

People first: a person's command on a knob the search explores (any command the desk
accepts whose id is not one of the search's: its ids start with
:data:`agent.wire.protocol.TUNE_ID_PREFIX` and a random part of its own) takes that knob out
of the search at once, with an event and a note in the reply; the search never sends
it again, and a command of the search's for it that reaches the desk after the
person's is refused, so it never reverts past the person's value. A change the search
did not make (a person's, a rollback, a framework's resume) that applies while a trial
measures voids the trial's measurement so far: it is measured again from there.

Several ranks: rank 0 decides, from its own step records, and each change it decides is
a command to every rank sent through :func:`agent.wire.commands.send_command`, the path of a
dashboard's command (a dry run on every rank, then one common optimizer step, withdrawn
everywhere if one rank refuses). The other ranks run no search: they take its commands
as any other. So every rank has the same configuration at every step, with no collective
in the training; under data parallelism rank 0's step time is the job's pace. The
commands go out from a thread of their own, so the I/O thread never waits on a socket.

Cost: per step record, a few additions on the agent's I/O thread; nothing on the
training thread beyond applying the commands, as for any command.
"""

from __future__ import annotations

import math
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from agent.wire import protocol
from agent.wire.commands import send_command
from agent.control.guard import ChangeGuard
from agent.wire.knobs import (
    NOT_TUNED,
    STANDARD_KNOBS,
    TUNED,
    TUNED_IF_ALLOWED,
    KnobError,
    KnobSet,
    assignment,
)
from agent.control.ledger import Change, ChangeLedger
from agent.wire.protocol import EventKind
from agent.wire.runs import RunInfo

#: Default step budget of a search (optimizer steps, warm-up and switches included).
DEFAULT_BUDGET_STEPS = 600
MAX_BUDGET_STEPS = 1_000_000
#: A sub-block: at least this many measured steps (after its warm-up cut), and more
#: until it has this many seconds of them, up to the most steps.
SUB_BLOCK_STEPS = 3
SUB_BLOCK_S = 0.1
MAX_SUB_BLOCK_STEPS = 16
#: Pairs of sub-blocks (best, candidate) after which a candidate may be called slower /
#: faster (or not worth it), and after which it is reverted as not faster beyond noise.
MIN_PAIRS_SLOWER = 2
MIN_PAIRS_FASTER = 3
MAX_PAIRS = 12
#: A gain below this (a fraction of throughput) is not worth more of the run's steps.
WORTHWHILE_GAIN = 0.05
#: Pairs from which a candidate that could not be shown faster even in :data:`MAX_PAIRS`
#: pairs at its mean and spread so far is reverted (:func:`could_be_shown_faster`).
FUTILE_FROM_PAIRS = 6
#: Two-sided confidence of the paired interval of a candidate's gain.
CONFIDENCE = 0.95
#: Full passes over the knobs at most (a pass that keeps nothing ends the search).
MAX_PASSES = 2
#: The order knobs are searched in by default (:attr:`agent.wire.knobs.KnobSpec.search_rank`;
#: others follow in the run's order): the intra-op thread count first, as it sets the
#: pace of every later measurement (on a busy host one thread per core is often far from
#: the best), then the input pipeline, then what needs allowing.
SEARCH_ORDER = tuple(sorted((name for name, spec in STANDARD_KNOBS.items()
                             if spec.search_rank is not None),
                            key=lambda name: STANDARD_KNOBS[name].search_rank or 0))
#: Knobs that draw on one resource, also searched as a trade
#: (:attr:`agent.wire.knobs.KnobSpec.trades_with`): the first one rung up and the second one
#: rung down, and the other way. A DataLoader worker more for an intra-op thread fewer
#: keeps the threads the run uses: on a CPU-bound host each move alone can be slower (the
#: worker takes a core from the compute threads; one thread fewer leaves a core idle)
#: while the trade is the fastest configuration (bench_tune on this 2-core machine: -18%
#: and -17% alone, the grid's best together).
TRADES = tuple((name, spec.trades_with) for name, spec in STANDARD_KNOBS.items()
               if spec.trades_with)
#: How long the search waits for each phase of its own command's replies (s): on a
#: busy host the run's own I/O thread, which answers, can be starved for seconds; a
#: command not answered at all counts as refused.
COMMAND_TIMEOUT_S = 120.0
#: Events of the search that say what it does (kind of the ``event`` messages).
EVENT_KIND = "tune"
#: The event kind of the final line.
DONE_KIND = "tuned"
#: Steps with a loss, in the configuration before a trial after which the loss was not
#: finite, none of them finite, that say the run itself diverged (a finite one blames
#: the trial).
CHECK_STEPS = 3
#: Event kinds after which the run's configuration changed (a change the search did not
#: make voids a measurement in progress).
CHANGE_KINDS = EventKind.CHANGED | {EventKind.RESUMED}


class TuneRequest:
    """A parsed ``tune`` command value.

    Attributes:
        stop: end a running search. knobs: names to search (None: every tuned knob).
        budget_steps: optimizer steps the search may spend. allow: knobs that change
        numerics or memory that may be searched.
    """

    def __init__(self, value: Any, knobs: KnobSet) -> None:
        """Parse and check ``value`` (see :mod:`agent.wire.protocol`, ``tune``).

        Raises:
            KnobError: not a map, an unknown key, a knob this run does not have or that
                is never tuned, a knob that needs ``allow`` without it, a budget that is
                not an integer in ``[1, MAX_BUDGET_STEPS]``.
        """
        if not isinstance(value, dict):
            raise KnobError(f"tune: the value must be a map (knobs, budget_steps, allow, "
                            f"stop), got {value!r}")
        unknown = sorted(map(str, set(value) - {"knobs", "budget_steps", "allow", "stop"}))
        if unknown:
            raise KnobError(f"tune: unknown option {', '.join(unknown)}")
        self.stop = value.get("stop") is True
        budget = value.get("budget_steps", DEFAULT_BUDGET_STEPS)
        if isinstance(budget, bool) or not isinstance(budget, int) \
                or not 1 <= budget <= MAX_BUDGET_STEPS:
            raise KnobError(f"tune: budget_steps must be an integer from 1 to "
                            f"{MAX_BUDGET_STEPS}, got {budget!r}")
        self.budget_steps = budget
        self.allow = frozenset(_names(value.get("allow"), "allow"))
        for name in sorted(self.allow):
            _searchable(name, knobs, self.allow)
        named = value.get("knobs")
        if named is None:
            self.knobs = sorted(
                (name for name, knob in knobs.knobs.items() if knob.spec.tuning == TUNED
                 or (knob.spec.tuning == TUNED_IF_ALLOWED and name in self.allow)),
                key=lambda name: SEARCH_ORDER.index(name) if name in SEARCH_ORDER
                else len(SEARCH_ORDER))
        else:
            self.knobs = list(dict.fromkeys(_names(named, "knobs")))
            for name in self.knobs:
                _searchable(name, knobs, self.allow)
        if not self.knobs and not self.stop:
            raise KnobError("tune: this run has no knob to search"
                            + (f" (it has: {', '.join(knobs.knobs)})" if knobs.knobs else ""))


def _names(value: Any, option: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise KnobError(f"tune: {option} must be a list of knob names, got {value!r}")
    return value


def _searchable(name: str, knobs: KnobSet, allow: frozenset[str]) -> None:
    if name in knobs.unsupported:
        raise KnobError(f"tune: {name}: {knobs.unsupported[name]}")
    if name not in knobs.knobs:
        raise KnobError(f"tune: this run has no knob {name!r} (it has: "
                        f"{', '.join(knobs.knobs) or 'none'})")
    tuning = knobs.knobs[name].spec.tuning
    if tuning == NOT_TUNED:
        raise KnobError(f"tune: {name} is not a speed setting; it is never searched")
    if tuning == TUNED_IF_ALLOWED and name not in allow:
        raise KnobError(f"tune: {name} changes the training's numerics or memory; "
                        f"search it with --allow {name}")


# ------------------------------------------------------------------ statistics


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile at probability ``p`` with ``df`` degrees of freedom (the
    Cornish-Fisher expansion of Abramowitz & Stegun 26.7.5 around the normal quantile;
    within 1% of the exact value for ``df >= 2``; ``df`` below 1 counts as 1)."""
    z = NormalDist().inv_cdf(p)
    v = max(float(df), 1.0)
    z2 = z * z
    return z * (1 + (z2 + 1) / (4 * v) + (5 * z2 * z2 + 16 * z2 + 3) / (96 * v * v)
                + (3 * z2 ** 3 + 19 * z2 * z2 + 17 * z2 - 15) / (384 * v ** 3)
                + (79 * z2 ** 4 + 776 * z2 ** 3 + 1482 * z2 * z2 - 1920 * z2 - 945)
                / (92160 * v ** 4))


class Block:
    """Measured steps of one configuration: their count, the mean and sample variance of
    seconds per unit, and the units and seconds in all."""

    __slots__ = ("n", "mean", "variance", "units", "seconds")

    def __init__(self, n: int = 0, mean: float = 0.0, variance: float = 0.0,
                 units: float = 0.0, seconds: float = 0.0) -> None:
        self.n, self.mean, self.variance, self.units, self.seconds = (n, mean, variance,
                                                                       units, seconds)

    def rate(self) -> tuple[float, float]:
        """Throughput (units/s) and its 95% half-width, from the mean time per unit."""
        if not self.n or self.mean <= 0:
            return 0.0, 0.0
        rate = 1.0 / self.mean
        if self.n < 2:
            return rate, rate
        half = t_quantile(0.975, self.n - 1) * math.sqrt(self.variance / self.n)
        return rate, rate * half / self.mean


def paired_gain(pairs: list[tuple[Block, Block]], confidence: float = CONFIDENCE
                ) -> tuple[float, float, float]:
    """A candidate's throughput gain over the best configuration's from ``(best's
    sub-block, candidate's sub-block)`` pairs measured next to each other: ``(gain,
    low, high)``, fractions, with the two-sided ``confidence`` interval of a paired
    t-test on the pairs' log ratios (so the machine's load moving between pairs counts
    as noise, and within a pair cancels). The interval is infinite below two pairs."""
    ratios = [math.log(best.mean / candidate.mean) for best, candidate in pairs
              if best.mean > 0 and candidate.mean > 0]
    if not ratios:
        return 0.0, -math.inf, math.inf
    k = len(ratios)
    mean = sum(ratios) / k
    if k < 2:
        return math.expm1(mean), -math.inf, math.inf
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (k - 1))
    margin = t_quantile(0.5 + confidence / 2, k - 1) * sd / math.sqrt(k)
    return math.expm1(mean), math.expm1(mean - margin), math.expm1(mean + margin)


def _not_faster(pairs: int, gain: float, high: float) -> str | None:
    """Why a candidate is reverted without being slower beyond noise after ``pairs``
    pairs (``gain`` and ``high`` of :func:`paired_gain`), or None to measure on."""
    if pairs >= MIN_PAIRS_FASTER and high < WORTHWHILE_GAIN:
        return f"not worth it: under +{WORTHWHILE_GAIN:.0%} beyond noise"
    if pairs >= MAX_PAIRS:
        return "not faster beyond noise"
    if pairs >= MIN_PAIRS_FASTER and gain <= 0:
        return "not faster: slower on average"
    if pairs >= FUTILE_FROM_PAIRS and not could_be_shown_faster(gain, high, pairs):
        return f"not faster beyond noise, nor would {MAX_PAIRS} pairs show it at this mean"
    return None


def could_be_shown_faster(gain: float, high: float, pairs: int) -> bool:
    """Whether :data:`MAX_PAIRS` pairs could show a candidate faster beyond noise if its
    mean gain and the spread of its pairs stayed as they are after ``pairs`` pairs
    (``gain`` and ``high`` as :func:`paired_gain` gives them): the interval at
    :data:`MAX_PAIRS` pairs, ``t(MAX_PAIRS - 1) * sd / sqrt(MAX_PAIRS)`` each side of
    the mean, would be above zero. A futility check of sequential testing: a candidate
    that could not be shown faster even then is not worth its further pairs."""
    if pairs < 2 or not math.isfinite(high):
        return True  # no spread yet: it could be anything
    mean = math.log1p(gain)  # the pairs' mean log ratio (gain > -1: rates are positive)
    sd = (math.log1p(high) - mean) * math.sqrt(pairs) / t_quantile(
        0.5 + CONFIDENCE / 2, pairs - 1)
    return mean > t_quantile(0.5 + CONFIDENCE / 2, MAX_PAIRS - 1) * sd / math.sqrt(MAX_PAIRS)


class Series:
    """The steps since a change, in one configuration, and the block they measure once
    the warm-up is cut off.

    The warm-up is found by MSER, the marginal standard error rule of simulation
    output analysis (White, 1997): of the first half of the steps, cut the prefix that
    minimises the standard error of the mean of what is left,
    ``sum((x - mean)^2) / m^2`` over the ``m`` steps kept. Worker start-up, allocator
    growth and the first batches after a rebuild are such a prefix; steady noise is
    not, as cutting it does not lower that error. After a change the first step (the
    one the change applied in) is always cut.

    Args:
        after_change: the first step is the one a change applied in (always cut); False
            for steps that go on in the same configuration (nothing cut but warm-up).

    Cost: :meth:`add` O(1) (prefix sums); :meth:`block` O(steps).
    """

    def __init__(self, *, after_change: bool = True) -> None:
        self.after_change = after_change
        self._sums: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)]

    def __len__(self) -> int:
        return len(self._sums) - 1

    def add(self, step_time_s: float, units: int) -> None:
        """One step of ``step_time_s`` seconds that did ``units`` samples or tokens."""
        x = step_time_s / units
        s1, s2, seconds, count = self._sums[-1]
        self._sums.append((s1 + x, s2 + x * x, seconds + step_time_s, count + units))

    def block(self) -> Block:
        """The steps after the warm-up (see the class notes)."""
        sums, n = self._sums, len(self)
        end = sums[-1]
        first = 1 if self.after_change else 0
        best, cut = math.inf, first
        for d in range(first, n // 2 + 1) if n - first >= 2 else ():
            m = n - d
            s1, s2 = end[0] - sums[d][0], end[1] - sums[d][1]
            error = (s2 - s1 * s1 / m) / (m * m)
            if error < best:
                best, cut = error, d
        m = n - cut
        if m <= 0:
            return Block()
        s1, s2 = end[0] - sums[cut][0], end[1] - sums[cut][1]
        mean = s1 / m
        variance = max(0.0, (s2 - s1 * mean) / (m - 1)) if m > 1 else 0.0
        return Block(m, mean, variance, end[3] - sums[cut][3], end[2] - sums[cut][2])


# ------------------------------------------------------------------ the search


@dataclass
class Candidate:
    """One setting tried: ``setting`` ({knob: value}, one knob or a trade of two) in place
    of those knobs' values in the best configuration at that moment."""

    setting: dict[str, Any]
    state: str = "measuring"  # measuring | kept | reverted | skipped
    reason: str = ""
    block: Block = field(default_factory=Block)  # its sub-blocks' steps together
    steps: int = 0  # steps while it was tried, the best's sub-blocks and switches included
    gain: float | None = None
    gain_spread: float | None = None

    @property
    def text(self) -> str:
        """``num_workers=1, cpu_threads=1``."""
        return _config_text(self.setting)

    def to_wire(self) -> dict[str, Any]:
        rate, spread = self.block.rate()
        return {"setting": dict(self.setting), "state": self.state,
                "reason": self.reason, "per_s": rate or None,
                "per_s_spread": spread if rate else None, "gain": self.gain,
                "gain_spread": self.gain_spread, "steps": self.steps}


class CoordinateSearch:
    """Which setting to try next, from the best configuration so far (see the module
    docstring). Pure: no I/O, no clock.

    The search moves along axes, one after the other: each knob on its own, and each
    trade (:data:`TRADES`) whose two knobs are both searched, right after the later of
    them. A step along a trade moves its first knob one rung up and its second one rung
    down (direction +1), or the other way (-1)."""

    def __init__(self, ladders: dict[str, tuple[bool, list[Any]]], start: dict[str, Any],
                 trades: tuple[tuple[str, str], ...] = ()) -> None:
        """``ladders``: per knob, in search order, (ordered?, its values); an ordered
        knob moves one rung at a time, the others try every value. ``start``: the
        configuration the search starts from (the first best: never a candidate).
        ``trades``: pairs of knobs also moved together, in opposite directions (kept
        when both are searched and ordered)."""
        self.ladders = ladders
        self._axes: list[tuple[str, ...]] = [(knob,) for knob in ladders]
        order = list(ladders)
        for pair in trades:
            if all(knob in ladders and ladders[knob][0] for knob in pair):
                after = max(order.index(knob) for knob in pair)
                self._axes.insert(self._axes.index((order[after],)) + 1, pair)
        self._index = 0  # axis being searched
        self._direction = 1  # ordered axes: +1 up, -1 down
        self._kept_this_pass = False
        self._kept_this_axis = False
        self._passes = 1
        self._tried = {_key(start)}
        self._dropped: set[str] = set()

    def drop(self, knob: str) -> None:
        """Search ``knob`` no more: every axis that moves it is passed over (a person
        set it; see :meth:`Tuner.person_set`)."""
        self._dropped.add(knob)

    def next(self, best: dict[str, Any]) -> dict[str, Any] | None:
        """The next setting ({knob: value}) to try from ``best``, or None when done."""
        while self._index < len(self._axes):
            axis = self._axes[self._index]
            if self._dropped.intersection(axis):
                self._next_axis()
                continue
            ordered = self._ordered(axis)
            setting = self._step(axis, ordered, best)
            if setting is None and ordered and self._direction == 1 \
                    and not self._kept_this_axis:
                self._direction = -1  # the top of the ladder: try down
                continue
            if setting is not None:
                config = _key({**best, **setting})
                if config in self._tried:
                    self._advance(ordered)
                    continue
                self._tried.add(config)
                return setting
            self._next_axis()
        return None

    def result(self, kept: bool) -> None:
        """The last setting :meth:`next` gave was kept (it is now in ``best``) or not."""
        if kept:
            self._kept_this_pass = self._kept_this_axis = True
            return
        self._advance(self._ordered(self._axes[self._index]))

    def _ordered(self, axis: tuple[str, ...]) -> bool:
        return all(self.ladders[knob][0] for knob in axis)

    def _step(self, axis: tuple[str, ...], ordered: bool, best: dict[str, Any]
              ) -> dict[str, Any] | None:
        if ordered:
            setting = {}
            for knob, sign in zip(axis, (1, -1)):
                values = self.ladders[knob][1]
                if best[knob] not in values:
                    return None
                target = values.index(best[knob]) + sign * self._direction
                if not 0 <= target < len(values):
                    return None
                setting[knob] = values[target]
            return setting
        knob, = axis
        others = [value for value in self.ladders[knob][1] if value != best[knob]
                  and _key({**best, knob: value}) not in self._tried]
        return {knob: others[0]} if others else None

    def _advance(self, ordered: bool) -> None:
        """The current direction is spent: ordered axes turn down once (if going up
        kept nothing), then the next axis."""
        if ordered and self._direction == 1 and not self._kept_this_axis:
            self._direction = -1
            return
        if not ordered:
            return  # the next other value is found by _step
        self._next_axis()

    def _next_axis(self) -> None:
        self._index += 1
        self._direction = 1
        self._kept_this_axis = False
        if self._index == len(self._axes) and self._kept_this_pass \
                and self._passes < MAX_PASSES:
            self._index, self._passes, self._kept_this_pass = 0, self._passes + 1, False


def _key(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A configuration as a set member."""
    return tuple(sorted(config.items(), key=lambda item: item[0]))


def ladder(knob: Any, cpus: int) -> tuple[bool, list[Any]]:
    """The values a search may try for a bound knob (:class:`agent.wire.knobs.Knob`):
    ``(ordered, values)``. Integers: the minimum, the powers of two and the maximum in
    between (``num_workers`` and ``cpu_threads`` capped at ``cpus``), and the current
    value; choices: the schema's; booleans: both."""
    spec = knob.spec
    if spec.kind == "bool":
        return False, [False, True]
    if spec.kind == "choice":
        return False, list(spec.choices)
    low = int(spec.minimum if spec.minimum is not None else 0)
    high = int(spec.maximum if spec.maximum is not None else max(low, 1) * 64)
    current = knob.get()
    if spec.name in ("num_workers", "cpu_threads"):
        high = max(min(high, max(cpus, low)), current)
    values = {low, high, current}
    power = 1
    while power < high:
        if power > low:
            values.add(power)
        power *= 2
    return True, sorted(value for value in values if low <= value <= high)


@dataclass
class _Check:
    """Trouble after a change of the search's (``reason``), checked in the configuration
    before the trial: the steps there whose loss was not finite so far."""

    reason: str
    bad_steps: list[int] = field(default_factory=list)


def _side(sub_block: int) -> str:
    """Which configuration sub-block ``sub_block`` of a trial measures: ``"best"`` or
    ``"candidate"``, in the order best, candidate, candidate, best, best, candidate,
    ... (pairs (0, 1), (2, 3), ... alternate their order, so a linear drift of the
    load cancels over two pairs, and every pair has one sub-block just after a switch)."""
    return "best" if (sub_block + 1) // 2 % 2 == 0 else "candidate"


class Trial:
    """One candidate measured against the best configuration in sub-blocks (see
    :func:`_side`): the pairs measured so far and the sub-block in progress.

    Args:
        candidate: what is measured. side: the configuration the first sub-block
            measures (a trial measured again after a change it did not make starts on
            the side the run is on: ``"candidate"`` begins at sub-block 2, whose pair
            has the candidate first).
    """

    def __init__(self, candidate: Candidate, side: str = "best") -> None:
        self.candidate = candidate
        self.sub_block = 0 if side == "best" else 2
        self.pairs: list[tuple[Block, Block]] = []
        self._half: Block | None = None  # the first sub-block of the pair in progress

    @property
    def side(self) -> str:
        """The configuration the sub-block in progress measures."""
        return _side(self.sub_block)

    def add(self, block: Block) -> None:
        """The sub-block in progress is done, with ``block``."""
        if self._half is None:
            self._half = block
        else:
            first, self._half = self._half, None
            self.pairs.append((first, block) if _side(self.sub_block - 1) == "best"
                              else (block, first))
        self.sub_block += 1


class Tuner:
    """The search itself: a state machine fed with the agent's step records and events
    (on its I/O thread only), which decides and sends its changes through ``send``.

    Each candidate is a :class:`Trial`: sub-blocks of steps alternate between the best
    configuration and the candidate (best, candidate, candidate, best, best, ...; a
    switch between two, none within one side); after each pair, a paired t-test on the
    pairs' log throughput ratios (:func:`paired_gain`) says whether the candidate is
    slower (from :data:`MIN_PAIRS_SLOWER` pairs: reverted at once), faster (from
    :data:`MIN_PAIRS_FASTER`: kept) or not faster (:func:`_not_faster`: not worth it,
    slower on average, futile, or after :data:`MAX_PAIRS` pairs not faster beyond noise;
    reverted). While a switch is on its way, steps count against the budget and measure
    nothing.

    People first: a person's command on a knob the search explores takes that knob out
    of the search (:meth:`person_set`, from the command desk when it accepts the
    command); a change the search did not make that applies while a trial measures (a
    person's, a rollback, a framework's resume) makes the trial measure again from
    there (:meth:`_changed_under`). Trouble after one of its changes (a non-finite loss,
    skipped fp16 steps) sends the run back to the configuration before the trial, where
    the next :data:`CHECK_STEPS` steps with a loss say whether the trial is to blame
    (one trains: it is reverted) or the run itself diverged (none does: the search
    stops, keeping what it kept).

    Args:
        request: what to search. knobs: the run's knobs (values read on this thread).
        start_step: the first step of the search (steps before it are ignored).
        send: ``send(command_id, knob, value)`` queues a command to every rank; its
            reply comes back through :meth:`on_reply`, its effect as an ``applied`` or
            ``failed`` event through :meth:`on_event`.
        publish: ``publish(msg_type, body)`` publishes a message (``tune``, ``event``).
        cpus: usable CPUs (the ladder of ``num_workers`` and ``cpu_threads``).
    """

    def __init__(self, request: TuneRequest, knobs: KnobSet, start_step: int,
                 send: Callable[[str, str, Any], None],
                 publish: Callable[[str, dict[str, Any]], None], cpus: int) -> None:
        self.request = request
        self.knobs = knobs
        self.start_step = start_step
        self._send, self._publish = send, publish
        values = knobs.values()
        self.baseline = {name: values[name] for name in request.knobs}
        self.best = dict(self.baseline)
        self.search = CoordinateSearch({name: ladder(knobs.knobs[name], cpus)
                                        for name in request.knobs}, self.baseline, TRADES)
        self.candidates: list[Candidate] = []
        self.status = "running"
        self.text = ""
        self.step = start_step - 1
        self.unit: str | None = None
        #: the search's own changes, and the guard that watches them for trouble
        self._ledger = ChangeLedger()
        self._guard = ChangeGuard(self._ledger, tuner=True)
        self._trial: Trial | None = None
        #: the next candidate is chosen once the switch on its way applies (see
        #: :meth:`_next_candidate`)
        self._choosing = False
        self._series = Series()  # the sub-block in progress
        #: the sub-block in progress ends when the switch on its way applies
        self._closing = False
        self._best_block: Block | None = None  # the best's latest sub-block
        self._compiling = False
        #: the search's commands on their way: command id -> (knob, value); nothing is
        #: measured until each has applied
        self._waiting: dict[str, tuple[str, Any]] = {}
        self._watch = False  # whether the switch awaited is watched for trouble
        #: the search's command ids start with this (its own, told apart from people's:
        #: :meth:`own`; random, so that no other search's or person's id has it)
        self.id_prefix = f"{protocol.TUNE_ID_PREFIX}{secrets.token_hex(4)}-"
        self._command_seq = 0
        #: knobs a person set during the search, which it leaves: {knob: what was set}
        self.released: dict[str, str] = {}
        #: trouble after a change of the search's: its check in the configuration before
        #: the trial (see :meth:`_trouble`), or None
        self._check: _Check | None = None
        self._stop_reason: str | None = None
        self._event("info", "tune: searching " + ", ".join(request.knobs)
                    + f" from {_config_text(self.baseline)}, within {request.budget_steps} "
                    f"steps from step {start_step}")
        self._next_candidate()

    @property
    def steps(self) -> int:
        """Steps the search has spent."""
        return max(0, self.step - self.start_step + 1)

    @property
    def gain(self) -> float:
        """The best configuration's throughput over the baseline's, minus 1: the gains
        of the candidates kept, each measured against the best before it, chained (a
        knob a person took since is left out)."""
        product = 1.0
        for candidate in self.candidates:
            if (candidate.state == "kept" and candidate.gain is not None
                    and not self.released.keys() & candidate.setting.keys()):
                product *= 1 + candidate.gain
        return product - 1

    def own(self, command_id: Any) -> bool:
        """Whether ``command_id`` is one of this search's commands (not a person's)."""
        return isinstance(command_id, str) and command_id.startswith(self.id_prefix)

    @property
    def _candidate(self) -> Candidate | None:
        return self._trial.candidate if self._trial is not None else None

    # ---------------------------------------------------------------- inputs

    def stop(self, reason: str) -> None:
        """End the search at the next step record, in the best configuration."""
        if self.status == "running":
            self._stop_reason = reason

    def on_reply(self, command_id: str, reply: protocol.Reply) -> None:
        """The reply to a command this search sent (only a refusal matters: an accepted
        one is followed by its ``applied`` or ``failed`` event)."""
        if command_id not in self._waiting or reply.get("ok"):
            return
        knob, value = self._waiting.pop(command_id)
        reason = str(reply.get("reason", "no reason given"))
        if self._watch and self._candidate is not None:  # a switch to the candidate
            self._verdict("skipped", f"refused: {assignment(knob, value)}: {reason}"
                          if len(self._candidate.setting) > 1 else f"refused: {reason}")
            self._back_to_best()  # the rest of its setting may apply
            self._next_candidate()
        else:  # a way back was refused: stop where we are, and say so
            self._finish("stopped", f"the run refused {assignment(knob, value)}: {reason}")

    def on_event(self, event: dict[str, Any]) -> None:
        """One event of the run, in order with its step records."""
        kind, knob = event.get("kind"), event.get("knob")
        if kind == EventKind.COMPILING:  # (re)compiling: nothing is measured until "compiled"
            self._compiling = True
        elif kind == EventKind.COMPILED:
            self._compiling = False
            self._series = Series()
        if self.status != "running":
            return
        if event.get("id") in self._waiting:
            del self._waiting[event["id"]]
            if kind == EventKind.APPLIED:
                if self._watch:  # watched here (the agent's guard leaves it to us)
                    self._ledger.record(Change(int(event.get("step", 0)), str(knob),
                                               event.get("value"), event.get("previous")))
                if not self._waiting:
                    self._switched()
            elif kind == EventKind.FAILED and self._watch:  # that knob kept its value
                self._verdict("reverted", f"applying it failed: {event.get('text', '')}")
                self._back_to_best()  # the rest of its setting may have applied
                self._next_candidate()
            elif kind == EventKind.FAILED:
                self._finish("stopped", f"going back failed: {event.get('text', '')}")
        elif kind == EventKind.ROLLED_BACK and knob in self.best:
            self._rolled_back(knob, event.get("value"), str(event.get("text", "")))
        elif kind in CHANGE_KINDS and not self.own(event.get("id")) and (
                knob not in self.knobs.knobs
                or self.knobs.knobs[knob].spec.kind != "action"):
            self._changed_under(str(event.get("text", kind)))

    def person_set(self, knob: str, value: Any, apply_step: int) -> str | None:
        """A person's command (not one of the search's own) was accepted: ``knob`` set
        to ``value`` from step ``apply_step``. A knob the search explores leaves it: the
        search never sends it again (so never reverts past the person's value), a trial
        that moves it ends without a verdict, and its other knobs go back to the best;
        with no knob left the search ends. I/O thread (the desk's, when it accepts).

        Returns:
            What it did, for the command's reply and an event; None when the search
            does not explore ``knob`` (or is not running).
        """
        if self.status != "running" or knob not in self.best:
            return None
        what = f"{assignment(knob, value)} set by a person for step {apply_step}"
        self.released[knob] = what
        del self.best[knob], self.baseline[knob]
        self.search.drop(knob)
        waited = bool(self._waiting)  # its commands for the knob: not awaited any more
        self._waiting = {command_id: setting for command_id, setting in self._waiting.items()
                         if setting[0] != knob}
        left = [name for name in self.request.knobs if name in self.best]
        note = (f"the tune search leaves {knob} to you" + (
            f" and goes on with {', '.join(left)}" if left else " and ends (no knob left)"))
        self._event("info", f"tune: {what}: {note}")
        trial = self._trial
        if not left:
            self._verdict("reverted", f"not judged: {what}")
            self._finish("stopped", "a person set every knob it searched")
        elif trial is not None and knob in trial.candidate.setting and self._check is None:
            self._verdict("reverted", f"not judged: {what}")
            self._back_to_best()  # the rest of its setting, if it is a trade
            self._next_candidate()
        elif waited and not self._waiting:
            self._switched()
        else:
            self.publish_state()
        return note

    def _changed_under(self, what: str) -> None:
        """A change the search did not make applied (``what``: its event's text): the
        steps before it measured another configuration. A trial in progress is measured
        again from here, on the side the run is on or switching to (its pairs so far are
        dropped); otherwise the sub-block in progress starts again."""
        self._series = Series()
        trial = self._trial
        if trial is None or self._check is not None:
            return
        side = _side(trial.sub_block + 1) if self._closing else trial.side
        self._closing = False  # the switch on its way, if any, starts that side
        candidate = trial.candidate
        candidate.block, candidate.gain, candidate.gain_spread = Block(), None, None
        self._trial = Trial(candidate, side)
        self._event("info", f"tune: {protocol.shorten(what)}, during the measurement of "
                            f"{candidate.text}: measuring it again")
        self.publish_state()

    def on_step(self, step: int, step_time_s: float | None, samples: int,
                tokens: int | None, loss: float | None, skipped: bool | None) -> None:
        """One step record: ``step_time_s`` (host clock, None for the first), the
        step's samples and tokens (None if unknown), its loss (None if not read) and
        whether the GradScaler skipped it. Costs a few additions, and the warm-up cut
        of :meth:`Series.block` (O(steps of a sub-block))."""
        if step < self.start_step or self.status != "running":
            return
        self.step = step
        rollback = self._guard.on_step(step, loss, skipped)
        if rollback is not None and self._check is None:
            candidate = self._candidate
            self._trouble(self._guard.trouble + (
                f" while trying {candidate.text}" if candidate is not None
                else f" after {rollback.changes[-1]}"))
            return
        if self._stop_reason is not None or self.steps >= self.request.budget_steps:
            self._wind_up(self._stop_reason)
            return
        if self._check is not None:
            self._checking(step, loss, skipped)
            return
        if self._candidate is not None:
            self._candidate.steps += 1
        units = tokens or samples
        if ((self._waiting and not self._closing) or self._compiling or self._trial is None
                or not step_time_s or step_time_s <= 0 or not units):
            return
        if self.unit is None:
            self.unit = "tokens" if tokens else "samples"
        self._series.add(step_time_s, units)
        if not self._closing and len(self._series) > SUB_BLOCK_STEPS:
            block = self._series.block()
            if block.n >= MAX_SUB_BLOCK_STEPS or (block.n >= SUB_BLOCK_STEPS
                                                  and block.seconds >= SUB_BLOCK_S):
                self._sub_block_done(block)

    # ---------------------------------------------------------------- trials

    def _sub_block_done(self, block: Block) -> None:
        """The sub-block in progress has its steps. Within a pair (its first half) the
        switch to the other side goes out now, and the sub-block closes when it applies
        (:meth:`_close_sub_block`): the steps until then ran in this side's
        configuration, and count for it (a command applies two boundaries after the
        step the search saw, and the records reach it a little later). At the end of a
        pair (the next sub-block is of the same side: no switch), the pair is judged."""
        trial = self._trial
        assert trial is not None
        following = _side(trial.sub_block + 1)
        if following != trial.side:
            setting = trial.candidate.setting
            self._switch(setting if following == "candidate"
                         else {knob: self.best[knob] for knob in setting},
                         watch=following == "candidate")
            self._closing = True
            return
        self._record(trial, block)
        if not self._judge(trial):
            self._series = Series(after_change=False)  # same configuration: no switch

    def _close_sub_block(self) -> None:
        """The switch that ends the first half of a pair applied: that half is done."""
        self._closing = False
        if self._trial is not None:
            self._record(self._trial, self._series.block())

    def _record(self, trial: Trial, block: Block) -> None:
        if trial.side == "best":
            self._best_block = block
        else:
            trial.candidate.block = _pooled(trial.candidate.block, block)
        trial.add(block)

    def _judge(self, trial: Trial) -> bool:
        """After a pair: the verdict if there is one (True), else False."""
        candidate, k = trial.candidate, len(trial.pairs)
        gain, low, high = paired_gain(trial.pairs)
        candidate.gain = gain
        candidate.gain_spread = (high - low) / 2 if math.isfinite(high - low) else None
        in_candidate = _side(trial.sub_block - 1) == "candidate"
        if k >= MIN_PAIRS_SLOWER and high < 0:
            self._verdict("reverted", f"slower: {_gain_text(gain, low, high)}")
            if in_candidate:
                self._back_to_best()
            self._next_candidate()
        elif k >= MIN_PAIRS_FASTER and low > 0:
            self.best.update(candidate.setting)
            self._verdict("kept", f"faster: {_gain_text(gain, low, high)}")
            if not in_candidate:
                self._switch(candidate.setting, watch=True)
            self._next_candidate()
        elif (why := _not_faster(k, gain, high)) is not None:
            self._verdict("reverted", f"{why}: {_gain_text(gain, low, high)}")
            if in_candidate:
                self._back_to_best()
            self._next_candidate()
        else:
            self.publish_state()
            return False
        return True

    def _switch(self, setting: dict[str, Any], *, watch: bool = False) -> None:
        """Send each ``knob=value`` of ``setting``, in its order; measure again once all
        have applied (and, with ``watch``, watch the changes for trouble: a candidate,
        not a way back). Commands sent earlier and still on their way are not awaited."""
        self._waiting = {self._send_one(knob, value): (knob, value)
                         for knob, value in setting.items()}
        self._watch = watch

    def _switched(self) -> None:
        """Every command the search awaited has applied: the first half of a pair ends
        there, measuring starts afresh, and a choice that waited is made."""
        if self._closing:
            self._close_sub_block()
        self._series = Series()
        if self._choosing:
            self._next_candidate()

    def _send_one(self, knob: str, value: Any) -> str:
        self._command_seq += 1  # zero-padded: ranks order same-step commands by id
        command_id = f"{self.id_prefix}{self._command_seq:06d}"
        self._send(command_id, knob, value)
        return command_id

    def _back_to_best(self) -> None:
        """Send the best value of every knob that differs from it, or has a command of
        the search's on its way."""
        in_flight = {knob for knob, _ in self._waiting.values()}
        back = {knob: value for knob, value in self.best.items()
                if knob in in_flight or self.knobs.knobs[knob].get() != value}
        self._switch(back)
        if not back:
            self._series = Series()

    def _next_candidate(self) -> None:
        """Start the trial of the next setting the search gives, or end the search.

        The setting is chosen once the run's knobs show the best configuration: while a
        switch is on its way they do not yet, and a value whose effect depends on
        another knob (``prefetch_factor`` without workers) would be judged against the
        knobs the run is leaving. So while one is, the choice waits for it to apply
        (:meth:`on_event`)."""
        self._trial = None
        self._check = None
        self._choosing = bool(self._waiting)
        if self._choosing:
            return
        while True:
            following = self.search.next(self.best)
            if following is None:
                self._finish("done")
                return
            candidate = Candidate(following)
            self.candidates.append(candidate)
            reason = self._skip_reason(candidate.setting)
            if reason is None:
                break
            self._skip(candidate, reason)
        self._trial = Trial(candidate)
        self._series = Series()
        self._event("info", f"tune: trying {candidate.text}")
        self.publish_state()

    def _skip(self, candidate: Candidate, reason: str) -> None:
        candidate.state, candidate.reason = "skipped", reason
        self.search.result(False)
        self._event("info", f"tune: skipping {candidate.text}: {reason}")

    def _skip_reason(self, setting: dict[str, Any]) -> str | None:
        """Why ``setting`` is not tried here (the run refuses one of its values, or warns
        that it is slow or has no effect here), or None."""
        for knob, value in setting.items():
            try:
                self.knobs.validate(knob, value)
            except KnobError as exc:
                return str(exc)
            reason = self.knobs.knobs[knob].warning(value)
            if reason:
                return reason
        return None

    def _verdict(self, state: str, reason: str) -> None:
        """The candidate being tried (if any) is ``state`` (kept, reverted, skipped)
        because ``reason``: an event, and the search moves on from it."""
        candidate, self._trial = self._candidate, None
        self._closing = False
        if candidate is None:
            return
        candidate.state, candidate.reason = state, reason
        self.search.result(state == "kept")
        rate, spread = candidate.block.rate()
        measured = (f" ({rate:,.0f} ± {spread:,.0f} {self.unit}/s over "
                    f"{candidate.block.n} steps)" if rate else "")
        trouble = state == "reverted" and not reason.startswith(("slower", "not "))
        self._event("warning" if trouble else "info",
                    f"tune: {candidate.text} {state}: "
                    f"{reason}{measured}")
        self.publish_state()

    def _rolled_back(self, knob: str, value: Any, text: str) -> None:
        """The agent's out-of-memory path undid ``knob`` on the training thread."""
        self._check = None
        trial = self._trial
        for kept in self.candidates:
            if kept.state == "kept" and kept.setting.get(knob, value) != value:
                kept.state, kept.reason = "reverted", text
        self.best[knob] = value
        if trial is not None and knob in trial.candidate.setting:
            self._verdict("reverted", text)
            self._back_to_best()  # the rest of its setting, if it is a trade
            self._next_candidate()
        else:
            self._series = Series()

    def _trouble(self, reason: str) -> None:
        """A non-finite loss or skipped steps after a change the search made: back to
        the configuration before the trial (the best so far: what it kept stays), where
        :meth:`_checking` tells the trial's fault from the run's. Nothing is measured
        meanwhile."""
        self._check = _Check(reason)
        self._closing = self._choosing = False  # the next choice waits for the check
        self._ledger.clear()
        self._back_to_best()
        self._event("warning", f"tune: {reason}: back to {_config_text(self.best)} to see "
                               "whether the run trains there")

    def _checking(self, step: int, loss: float | None, skipped: bool | None) -> None:
        """A step while the trouble is checked: once in the configuration before the
        trial, a step with a finite loss (and not skipped) blames the trial, which is
        reverted; :data:`CHECK_STEPS` steps without one say the run itself diverged:
        the search stops, keeping what it had kept."""
        check = self._check
        assert check is not None
        if self._waiting or loss is None:  # not there yet, or no loss read
            return
        if math.isfinite(loss) and not skipped:
            self._verdict("reverted", f"{check.reason} (the loss was finite at step "
                                      f"{step} without it)")
            self._next_candidate()
            return
        check.bad_steps.append(step)
        if len(check.bad_steps) < CHECK_STEPS:
            return
        still = (f"the loss was still {loss}" if not math.isfinite(loss)
                 else "the GradScaler still skipped")
        why = (f"the run itself diverged: {check.reason}, and back in the configuration "
               f"before the trial ({_config_text(self.best)}) {still} at steps "
               f"{check.bad_steps[0]}-{step}")
        self._verdict("reverted", "not judged: the run itself diverged")
        self._finish("stopped", why)

    def _wind_up(self, reason: str | None) -> None:
        """Budget spent or stop asked: a candidate being tried goes back; the end."""
        why = reason or f"the budget of {self.request.budget_steps} steps is spent"
        self._verdict("reverted", f"not judged: {why}")
        self._back_to_best()
        self._waiting = {}  # nothing more to measure: the commands go out all the same
        self._finish("stopped" if reason else "done", "" if reason is None else why)

    def run_ended(self) -> None:
        """The run ends while the search runs: the candidate being tried is not judged,
        each knob the search changed goes back to its best value, set here at once (no
        step boundary comes any more; the training thread waits for the agent's close),
        and the search ends ``stopped`` with an event that says so. I/O thread."""
        if self.status != "running":
            return
        self._verdict("reverted", "not judged: the run ended")
        put_back, failed = [], []
        for knob, value in self.best.items():
            if self.knobs.knobs[knob].get() == value:
                continue
            try:
                self.knobs.knobs[knob].set(value)
                put_back.append(assignment(knob, value))
            except Exception as exc:  # noqa: BLE001 -- said in the search's last words
                failed.append(f"{assignment(knob, value)} failed: {exc}")
        self._waiting = {}
        self._finish("stopped", "; ".join(
            ["the run ended before the search did"]
            + ([f"put back {', '.join(put_back)}"] if put_back else []) + failed))

    def _finish(self, status: str, why: str = "") -> None:
        self.status = status
        self._trial = None
        self._check = None
        changed = {knob: value for knob, value in self.best.items()
                   if value != self.baseline[knob]}
        unit = self.unit or "samples"
        if changed:
            self.text = (f"tuned: {_config_text(changed)} ({self.gain:+.0%} {unit}/s in "
                         f"{self.steps} steps)")
        elif not self.baseline:  # a person took every knob
            self.text = f"tuned: no change in {self.steps} steps"
        else:
            self.text = (f"tuned: no change, {_config_text(self.baseline)} stays (nothing "
                         f"was faster beyond noise in {self.steps} steps)")
        if self.released:
            self.text += "; left to a person: " + ", ".join(self.released.values())
        if why:
            self.text += f"; {why}"
        self._event("info", self.text, kind=DONE_KIND)
        self.publish_state()

    # ---------------------------------------------------------------- output

    def publish_state(self) -> None:
        """Publish the search's state as a ``tune`` message (the run log keeps it)."""
        body: dict[str, Any] = {
            "status": self.status, "started_step": self.start_step, "step": self.step,
            "steps": self.steps, "budget_steps": self.request.budget_steps,
            "unit": self.unit or "samples", "knobs": list(self.request.knobs),
            "space": {knob: values for knob, (_, values) in self.search.ladders.items()
                      if knob in self.best},
            "baseline": dict(self.baseline), "best": dict(self.best), "gain": self.gain,
            "candidates": [candidate.to_wire() for candidate in self.candidates]}
        if self._best_block is not None:
            body["best_per_s"], body["best_per_s_spread"] = self._best_block.rate()
        if self.text:
            body["text"] = self.text
        self._publish(protocol.TUNE, body)

    def _event(self, level: str, text: str, *, kind: str = EVENT_KIND) -> None:
        self._publish(protocol.EVENT, {"level": level, "kind": kind, "text": text,
                                       "step": self.step})


def _pooled(first: Block, second: Block) -> Block:
    """Two blocks of one configuration as one (their steps together)."""
    n = first.n + second.n
    if not first.n or not second.n:
        return second if not first.n else first
    mean = (first.n * first.mean + second.n * second.mean) / n
    squares = ((first.n - 1) * first.variance + first.n * first.mean ** 2
               + (second.n - 1) * second.variance + second.n * second.mean ** 2)
    variance = max(0.0, (squares - n * mean * mean) / (n - 1))
    return Block(n, mean, variance, first.units + second.units,
                 first.seconds + second.seconds)


def _config_text(config: dict[str, Any]) -> str:
    return ", ".join(assignment(knob, value) for knob, value in config.items())


def _gain_text(gain: float, low: float, high: float) -> str:
    """``+12% (+3% to +22%)``: a gain and its interval."""
    return f"{gain:+.0%} ({low:+.0%} to {high:+.0%})"


class CommandSender:
    """The thread that sends the tuner's commands to every rank
    (:func:`agent.wire.commands.send_command`), so that the agent's I/O thread, which answers
    them, never waits; replies come back in :meth:`replies` (any thread)."""

    def __init__(self, info: Callable[[], RunInfo | None]) -> None:
        self._info = info
        self._queue: queue.SimpleQueue[tuple[str, str, Any] | None] = queue.SimpleQueue()
        self._replies: deque[tuple[str, protocol.Reply]] = deque()
        self._thread: threading.Thread | None = None

    def send(self, command_id: str, knob: str, value: Any) -> None:
        """Queue ``knob=value`` (the thread starts with the first one)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuwatch-tune",
                                            daemon=True)
            self._thread.start()
        self._queue.put((command_id, knob, value))

    def replies(self) -> list[tuple[str, protocol.Reply]]:
        """The replies that came since the last call, in order."""
        replies = []
        while self._replies:
            replies.append(self._replies.popleft())
        return replies

    def close(self) -> None:
        """Stop the thread after the commands already queued."""
        if self._thread is not None:
            self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            command_id, knob, value = item
            info = self._info()
            reply: protocol.Reply
            if info is None:
                reply = {"id": command_id, "ok": False, "reason": "the agent has no sockets"}
            else:
                reply = send_command(info, knob, value, command_id=command_id,
                                     timeout_s=COMMAND_TIMEOUT_S)
            self._replies.append((command_id, reply))


class AutoTune:
    """The agent's side of the ``tune`` command: parses it, runs the :class:`Tuner` on
    rank 0, and feeds it the agent's records. I/O thread only.

    Args:
        knobs: the run's knobs. rank: this process's rank.
        publish: publishes a message from the I/O thread.
        info: the run file of this rank (its command endpoint and token), once bound.
        cpus: usable CPUs.
        report_error: ``report_error(where, exc)``, for an error of the search's own:
            the search ends there (the run's settings stay as they are), the records
            and the training go on.
    """

    def __init__(self, knobs: KnobSet, rank: int,
                 publish: Callable[[str, dict[str, Any]], None],
                 info: Callable[[], RunInfo | None], cpus: int,
                 report_error: Callable[[str, BaseException], None]) -> None:
        self.knobs, self.rank, self.cpus = knobs, rank, cpus
        self._publish = publish
        self._report_error = report_error
        self._sender = CommandSender(info)
        self.tuner: Tuner | None = None
        #: the command id prefix of every search this run has had (a late command of an
        #: ended one is still the search's, not a person's)
        self._id_prefixes: tuple[str, ...] = ()

    def validate(self, value: Any) -> TuneRequest:
        """Parse a ``tune`` command's value.

        Raises:
            KnobError: with the reason (see :class:`TuneRequest`), or a stop with no
                search running on rank 0.
        """
        request = TuneRequest(value, self.knobs)
        if not request.stop and self.running:
            raise KnobError("tune: a search is running already (stop it with "
                            "gpuwatch tune --stop)")
        return request

    @property
    def running(self) -> bool:
        """Whether a search is running (on rank 0)."""
        return self.tuner is not None and self.tuner.status == "running"

    def own(self, command_id: Any) -> bool:
        """Whether ``command_id`` is a command of a search of this rank's (rank 0)."""
        return isinstance(command_id, str) and command_id.startswith(self._id_prefixes)

    def refusal(self, command_id: Any, knob: Any) -> str | None:
        """Why the search's own command on ``knob`` is refused now (a person set that
        knob during the search: a command sent before the search knew it would undo
        theirs), or None. I/O thread (the desk's)."""
        tuner = self.tuner
        if tuner is None or not self.own(command_id) or knob not in tuner.released:
            return None
        return f"{tuner.released[knob]}: the tune search leaves {knob} to them"

    def person_set(self, command_id: Any, knob: str, value: Any,
                   apply_step: int) -> str | None:
        """The desk accepted a command: when it is a person's (not the search's) on a
        knob the running search explores, the search leaves that knob
        (:meth:`Tuner.person_set`); returns what it did, for the reply, or None. I/O
        thread (the desk's)."""
        tuner = self.tuner
        if tuner is None or self.own(command_id):
            return None
        try:
            return tuner.person_set(knob, value, apply_step)
        except Exception as exc:
            self._failed(exc)
            return None

    def trial_values(self, values: dict[str, Any]) -> dict[str, Any]:
        """While a search runs: the knobs of ``values`` (the values now) that it is
        trying, each with the value it measures the trial against (the best kept so far:
        the person's setting until the search keeps another). Empty otherwise. Any
        thread (reads a dict replaced whole)."""
        tuner = self.tuner
        if tuner is None or tuner.status != "running":
            return {}
        best = dict(tuner.best)
        return {name: value for name, value in best.items()
                if name in values and values[name] != value}

    def start(self, request: TuneRequest, apply_step: int) -> str:
        """Start (or stop) a search at ``apply_step``; returns what to tell the sender."""
        if self.rank != 0:
            return "rank 0 runs the search; this rank takes its commands"
        if request.stop:
            if not self.running:
                return "no search is running"
            assert self.tuner is not None
            self.tuner.stop("stopped by request")
            return "stopping: the best configuration so far stays"
        self.tuner = Tuner(request, self.knobs, apply_step, self._sender.send,
                           self._publish, self.cpus)
        self._id_prefixes += (self.tuner.id_prefix,)
        return (f"searching {', '.join(request.knobs)} from step {apply_step}, within "
                f"{request.budget_steps} steps")

    def on_event(self, event: dict[str, Any]) -> None:
        """An event record of the agent's (in order with the steps)."""
        if self.tuner is not None:
            try:
                self.tuner.on_event(event)
            except Exception as exc:
                self._failed(exc)

    def on_step(self, step: int, step_time_s: float | None, samples: int,
                tokens: int | None, loss: float | None, skipped: bool | None) -> None:
        """A step record of the agent's, once its loss is read."""
        tuner = self.tuner
        if tuner is None:
            return
        try:
            for command_id, reply in self._sender.replies():
                tuner.on_reply(command_id, reply)
            tuner.on_step(step, step_time_s, samples, tokens, loss, skipped)
        except Exception as exc:
            self._failed(exc)

    def run_ended(self) -> None:
        """The run is ending (its last records published): a running search ends with
        it (:meth:`Tuner.run_ended`). I/O thread, before ``bye``."""
        if self.tuner is not None:
            try:
                self.tuner.run_ended()
            except Exception as exc:
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.tuner = None
        self._report_error("the tune search", exc)

    def close(self) -> None:
        """The agent is closing: let the sender's thread end."""
        self._sender.close()
