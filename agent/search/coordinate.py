"""The candidates of the in-run search (:mod:`agent.search.tune`).

A coordinate search from the run's configuration, along each knob's ladder and the
trades between knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.wire.knobs import (
    STANDARD_KNOBS,
    assignment,
)
from agent.search.stats import Block


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


@dataclass
class Candidate:
    """One setting tried in place of its knobs' values in the best configuration.

    ``setting`` ({knob: value}, one knob or a trade of two) in place of those knobs'
    values in the best configuration at that moment."""

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
        return config_text(self.setting)

    def to_wire(self) -> dict[str, Any]:
        rate, spread = self.block.rate()
        return {"setting": dict(self.setting), "state": self.state,
                "reason": self.reason, "per_s": rate or None,
                "per_s_spread": spread if rate else None, "gain": self.gain,
                "gain_spread": self.gain_spread, "steps": self.steps}


class CoordinateSearch:
    """Which setting to try next, from the best configuration so far.

    See the module docstring. Pure: no I/O, no clock.

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
        """Search ``knob`` no more.

        Every axis that moves it is passed over (a person set it; see
        :meth:`Tuner.person_set`)."""
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
    """The values a search may try for a bound knob (:class:`agent.wire.knobs.Knob`).

    Returns ``(ordered, values)``. Integers: the minimum, the powers of two and the
    maximum in between (``num_workers`` and ``cpu_threads`` capped at ``cpus``), and
    the current value; choices: the schema's; booleans: both."""
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


def config_text(config: dict[str, Any]) -> str:
    """``num_workers=4, cpu_threads=2``: a configuration as the ``:`` line writes it."""
    return ", ".join(assignment(knob, value) for knob, value in config.items())
