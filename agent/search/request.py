"""The ``tune`` command's request (:mod:`agent.search.tune`).

Its budget, the knobs it searches and those it is allowed to change, checked against
the run's knobs."""

from __future__ import annotations

from typing import Any

from agent.wire.knobs import (
    NOT_TUNED,
    TUNED,
    TUNED_IF_ALLOWED,
    KnobError,
    KnobSet,
)
from agent.search.coordinate import SEARCH_ORDER


#: Default step budget of a search (optimizer steps, warm-up and switches included).
DEFAULT_BUDGET_STEPS = 600
MAX_BUDGET_STEPS = 1_000_000


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
