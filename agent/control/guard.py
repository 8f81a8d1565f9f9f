"""Safe changes: roll a live change back when the steps after it go bad.

After a change of a guarded knob (:attr:`agent.wire.knobs.KnobSpec.guarded`: precision,
accumulation, micro-batch size, kernels, the optimizer's settings, dropout), the agent
watches the next ``guard_steps`` optimizer steps. A non-finite loss, a divergence (the
loss above :data:`DIVERGENCE_FACTOR` times its median over the steps before the change
for :data:`DIVERGENCE_STEPS` steps in a row: caught while the loss is still finite,
before the weights are), or the GradScaler skipping ``max_skipped_in_row`` fp16 steps in
a row, rolls the guarded knobs back to the values they had before the change (the last
good settings, read from the :class:`~agent.control.ledger.ChangeLedger` that the out-of-memory
path reads too), at the next optimizer-step boundary. Runs on the agent's I/O thread
only, from the values the step markers deliver: it never reads a device tensor itself.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

from agent.wire.knobs import STANDARD_KNOBS
from agent.control.ledger import Change, ChangeLedger, Rollback

#: Knobs whose changes are watched and rolled back (:attr:`agent.wire.knobs.KnobSpec.guarded`).
GUARDED_KNOBS = frozenset(name for name, spec in STANDARD_KNOBS.items() if spec.guarded)


#: A loss this many times its median before the change counts toward a divergence ...
DIVERGENCE_FACTOR = 10.0
#: ... for this many steps in a row (one noisy step is not a divergence).
DIVERGENCE_STEPS = 3
#: Finite losses before a change that its baseline median is taken over (at least 5).
BASELINE_STEPS = 20


class ChangeGuard:
    """Decides rollbacks from the changes in a ledger and the outcomes of steps.

    Args:
        ledger: the changes to watch (the window, ``guard_steps``, is the ledger's).
        max_skipped_in_row: consecutive GradScaler-skipped steps that count as trouble.
        tuner: whether the tuner's changes (command ids starting with
            :data:`agent.wire.protocol.TUNE_ID_PREFIX`) are watched. The agent's guard leaves
            them to the tuner, which watches its candidates with a guard of its own and
            reverts them on every rank at once.
    """

    def __init__(self, ledger: ChangeLedger, max_skipped_in_row: int = 10, *,
                 tuner: bool = False) -> None:
        self.ledger = ledger
        self.max_skipped_in_row = max_skipped_in_row
        self.tuner = tuner
        #: GradScaler-skipped steps in all, and in a row up to the latest step
        self.skipped_total = 0
        self.skipped_in_row = 0
        #: the latest change seen, and the latest one answered (rolled back or watched
        #: cleanly through its window): nothing before it is watched again
        self._seen: Change | None = None
        self._answered: Change | None = None
        self._warned_non_finite = False
        #: the latest finite losses (:meth:`observe`), for a change's baseline
        self._recent: deque[float] = deque(maxlen=BASELINE_STEPS)
        #: the median loss before the change being watched (None: too few steps), and
        #: the steps in a row above :data:`DIVERGENCE_FACTOR` times it
        self._baseline: float | None = None
        self._above = 0
        #: what went wrong at the latest rollback decided (``loss was nan at step 12``),
        #: without the changes it undoes
        self.trouble = ""
        #: the step of the latest change whose watch ended cleanly (no rollback): the
        #: state kept for it can go (0: none yet). Only grows; any thread may read it.
        self.clean_through = 0

    def observe(self, losses: Iterable[float | None]) -> None:
        """Steps published: their finite losses join the window a change's baseline is taken from.

        In order, after :meth:`on_step` saw them. A C-level extend."""
        self._recent.extend(loss for loss in losses if loss is not None and loss - loss == 0)

    @property
    def guard_steps(self) -> int:
        """Optimizer steps after a change during which trouble rolls it back."""
        return self.ledger.guard_steps

    @property
    def watching(self) -> bool:
        """Whether a change is being watched; one attribute read.

        Only then (or for a skipped step or a non-finite loss) does :meth:`on_step` have
        anything to do."""
        entries = self.ledger.entries
        return bool(entries) and entries[-1] is not self._answered

    def on_step(self, step: int, loss: float | None, skipped: bool | None) -> Rollback | None:
        """One published step; returns a rollback when the watched changes must be undone.

        A :class:`~agent.control.ledger.Rollback`, returned once when the watched changes
        must be undone, else None. Ends the watch when ``guard_steps`` passed cleanly."""
        entries = self.ledger.entries
        latest = next((change for change in reversed(entries) if change.step <= step),
                      None) if entries else None
        if latest is not None and latest is not self._seen:  # a new change: count afresh
            self._seen = latest
            self.skipped_in_row = 0
            self._above = 0
            self._baseline = (statistics.median(self._recent) if len(self._recent) >= 5
                              else None)
        if skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
        elif skipped is not None:
            self.skipped_in_row = 0
        if latest is None or latest is self._answered:
            return None
        last_good = self.ledger.last_good(step, tuner=self.tuner)
        if last_good is None:  # none watched, or the window passed cleanly
            if step - latest.step >= self.guard_steps or not any(
                    self.tuner or not change.by_tuner for change in entries):
                self._answered = latest
                self.clean_through = max(self.clean_through, latest.step)
            return None
        trouble = None
        baseline = self._baseline
        if loss is not None and math.isfinite(loss) and baseline is not None and baseline > 0:
            self._above = self._above + 1 if loss > DIVERGENCE_FACTOR * baseline else 0
        if loss is not None and not math.isfinite(loss):
            trouble = f"loss was {loss} at step {step}"
        elif self._above >= DIVERGENCE_STEPS:
            trouble = (f"the loss diverged: {loss:.4g} at step {step}, above "
                       f"{DIVERGENCE_FACTOR:g}x its median before the change "
                       f"({baseline:.4g}) for {self._above} steps in a row")
        elif self.skipped_in_row >= self.max_skipped_in_row:
            trouble = (f"the GradScaler skipped {self.skipped_in_row} fp16 steps in a row "
                       f"(inf/NaN gradients) up to step {step}")
        if trouble is None:
            if step - latest.step >= self.guard_steps:
                self._answered = latest
                self.clean_through = max(self.clean_through, latest.step)
            return None
        self._answered = latest
        self.trouble = trouble
        last_good.reason = f"{trouble} after {', '.join(last_good.changes)}"
        return last_good

    def non_finite_warning(self, step: int, loss: float | None, *,
                           searching: bool = False) -> str | None:
        """A warning, once, for a non-finite loss with no change to roll back.

        ``searching``: while the in-run search runs (it checks its own changes)."""
        if (loss is None or math.isfinite(loss) or self.watching
                or self._warned_non_finite):
            return None
        self._warned_non_finite = True
        if searching:
            return (f"loss was {loss} at step {step}, with no change of a person's to roll "
                    "back (the tune search checks whether its trial caused it)")
        return f"loss was {loss} at step {step}, with no recent change to roll back"
