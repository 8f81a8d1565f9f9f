"""Safe changes: roll a live change back when the steps after it go bad.

After a change of precision, accumulation, micro-batch size, kernels or the optimizer's
settings (learning rate scale, weight decay, gradient clipping), the agent watches the
next ``guard_steps`` optimizer steps. A non-finite loss, or the GradScaler skipping
``max_skipped_in_row`` fp16 steps in a row, rolls the guarded knobs back to the values
they had before the change (the last good settings), at the next optimizer-step boundary.
Runs on the agent's I/O thread only, from the values the step markers deliver: it never
reads a device tensor itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent.protocol import TUNE_ID_PREFIX, EventKind

#: Knobs whose changes are watched and rolled back.
GUARDED_KNOBS = frozenset({"precision", "accum_steps", "micro_batch_size", "kernels",
                           "lr_scale", "weight_decay", "max_grad_norm"})


@dataclass
class Rollback:
    """What to restore and why: ``values`` {knob: last good value}, ``reason`` for people."""

    values: dict[str, Any]
    reason: str


@dataclass
class ChangeGuard:
    """Decides rollbacks from applied changes and step outcomes.

    Args:
        guard_steps: steps after a change during which trouble rolls it back.
        max_skipped_in_row: consecutive GradScaler-skipped steps that count as trouble.
        watched: the knobs whose changes are watched (None: every knob's).

    Changes the agent's tuner makes (command ids starting with
    :data:`agent.protocol.TUNE_ID_PREFIX`) are left to the tuner, which watches its
    candidates with a guard of its own and reverts them on every rank at once.
    """

    guard_steps: int = 100
    max_skipped_in_row: int = 10
    watched: frozenset[str] | None = GUARDED_KNOBS
    skipped_total: int = 0
    skipped_in_row: int = 0
    _previous: dict[str, Any] = field(default_factory=dict)
    _change: str = ""
    _until_step: int = 0
    _warned_non_finite: bool = False

    @property
    def watching(self) -> bool:
        """Whether a guarded change is being watched: only then (or for a skipped step
        or a non-finite loss) does :meth:`on_step` have anything to do."""
        return bool(self._previous)

    def on_applied(self, event: dict[str, Any]) -> None:
        """An ``applied`` event: start (or extend) the watch over a guarded change.
        Rollbacks themselves (``kind == "rolled_back"``) are not watched."""
        knob = event.get("knob")
        if event.get("kind") == EventKind.ROLLED_BACK:
            self._end_watch()  # undone already (e.g. on the training thread after an OOM)
            return
        if event.get("kind") != EventKind.APPLIED or (self.watched is not None
                                                      and knob not in self.watched):
            return
        if str(event.get("id") or "").startswith(TUNE_ID_PREFIX):
            return  # the tuner's own candidate: it watches it itself
        self._previous.setdefault(knob, event.get("previous"))
        change = f"{knob}={event.get('value')}"
        self._change = change if not self._change else f"{self._change}, {change}"
        self._until_step = int(event.get("step", 0)) + self.guard_steps
        self.skipped_in_row = 0

    def on_step(self, step: int, loss: float | None, skipped: bool | None) -> Rollback | None:
        """One published step; returns a :class:`Rollback` once when the watched change
        must be undone, else None. Ends the watch when ``guard_steps`` passed cleanly."""
        if skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
        elif skipped is not None:
            self.skipped_in_row = 0
        trouble = None
        if loss is not None and not math.isfinite(loss):
            trouble = f"loss was {loss} at step {step}"
        elif self.skipped_in_row >= self.max_skipped_in_row:
            trouble = (f"the GradScaler skipped {self.skipped_in_row} fp16 steps in a row "
                       f"(inf/NaN gradients) up to step {step}")
        if not self._previous:
            return None
        if trouble is not None:
            rollback = Rollback(dict(self._previous), f"{trouble} after {self._change}")
            self._end_watch()
            return rollback
        if step >= self._until_step:
            self._end_watch()
        return None

    def non_finite_warning(self, step: int, loss: float | None) -> str | None:
        """A warning, once, for a non-finite loss with no change to roll back."""
        if loss is None or math.isfinite(loss) or self._previous or self._warned_non_finite:
            return None
        self._warned_non_finite = True
        return f"loss was {loss} at step {step}, with no recent change to roll back"

    def _end_watch(self) -> None:
        self._previous = {}
        self._change = ""
        self.skipped_in_row = 0
