"""The ledger of applied changes: what a guarded knob was before a live change.

One record, read by both rollback paths: the guard of :mod:`agent.control.guard` (a non-finite
loss or fp16 steps skipped in a row, decided on the I/O thread from the step records)
and :meth:`agent.step.core.Agent.roll_back_last_change` (an out-of-memory error, on the
training thread). Both restore the same last good values: those the knobs had before
the first change of the latest episode.

An episode is a run of changes, each made within ``guard_steps`` optimizer steps of the
one before it, of at most :data:`EPISODE_CHANGES_MAX` changes; a change later than that,
or past that many, starts a new episode, and a rollback ends it.
The training thread writes the ledger (where commands are applied); any thread reads
it: the entries are a tuple replaced whole, never changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from agent.wire.knobs import assignment
from agent.wire.protocol import TUNE_ID_PREFIX

#: The most changes one episode holds: the next change starts a new one (where the
#: state is kept again), so a rollback undoes at most this many. Without it, changes
#: each within ``guard_steps`` of the one before (a script setting ``lr_scale`` every
#: 50 steps) made one episode of the whole run: the guard's check of every step it
#: watched read them all on the I/O thread (0.05 ms a step at 100 changes, 4.8 ms at
#: 10,000), each change copied them all, and a rollback went back to the first change.
EPISODE_CHANGES_MAX = 64


@dataclass(frozen=True)
class Change:
    """One applied change: ``knob`` set to ``value`` from ``previous``, from step ``step`` on.

    ``step``: the 1-based optimizer step; ``command_id`` as the command had it."""

    step: int
    knob: str
    value: Any
    previous: Any
    command_id: Any = None

    @property
    def by_tuner(self) -> bool:
        """Made by the agent's tuner, which watches its candidates itself.

        Its ids start with :data:`agent.wire.protocol.TUNE_ID_PREFIX`."""
        return str(self.command_id or "").startswith(TUNE_ID_PREFIX)


@dataclass
class Rollback:
    """What to restore and why: the last good values, the changes undone, and the reason.

    ``values`` {knob: last good value}, ``changes`` the changes undone (``"knob=value"``
    each, in order), ``reason`` for people."""

    values: dict[str, Any]
    changes: list[str]
    reason: str = ""


class StateKeeper(Protocol):
    """What keeps the training state for rollbacks (:class:`agent.integrations.run.RunBase`).

    The run base. Each is called on the training thread, at a boundary."""

    def keep_state(self, step: int) -> None:
        """A guarded change starts an episode after optimizer step ``step``: keep the state there.

        At the boundary after that step; or note why it cannot be kept."""

    def setting_applied(self, knob: str, previous: Any) -> str:
        """A command set ``knob`` (from ``previous``): what was planned for it ends.

        A person's command, changed or not (not a rollback, nor the search's trials,
        which go back to a value of before): a recovery's scaled ``lr_scale`` does not
        come back over it. Returns what the applied event says of it (``""`` or
        ``"; ..."``)."""

    def setting_rolled_back(self, knob: str, value: Any) -> str:
        """A rollback set ``knob`` back to ``value``: what the undone setting ended comes back.

        That is a recovery's scaled ``lr_scale``, with the step it ends after. Returns
        what the rolled-back event says of it (``""`` or ``"; ..."``)."""

    def restore_state(self, step: int, cause: str = "a rollback") -> tuple[str, str]:
        """The episode was rolled back before optimizer step ``step``: put the kept state back.

        At the boundary before ``step`` (``cause``: why), as a new branch; returns the
        event's ``(level, text)`` saying what was restored, what it cost and how many steps
        will be trained again (or why not)."""

    def recover(self, step: int, before: int, reason: str) -> None:
        """A loss spike began at step ``before``: put back the latest state kept before it.

        ``before`` is an optimizer step (``reason``: what it was); called at the boundary
        after ``step``. Moves the data past what was trained since, and says so in one event
        (or why not)."""


class ChangeLedger:
    """The changes of the latest episode, with the values before them.

    Args:
        guard_steps: optimizer steps after a change during which it may be rolled back
            (and within which a further change joins the same episode).

    Raises:
        ValueError: ``guard_steps`` is below 1.
    """

    def __init__(self, guard_steps: int = 100) -> None:
        if guard_steps < 1:
            raise ValueError(f"guard_steps must be at least 1, got {guard_steps!r}")
        self.guard_steps = guard_steps
        #: the changes of the latest episode, oldest first (replaced whole)
        self.entries: tuple[Change, ...] = ()

    def record(self, change: Change) -> None:
        """A change was applied (not a rollback: see :meth:`clear`).

        Costs a tuple copy of the episode (at most :data:`EPISODE_CHANGES_MAX` entries)."""
        entries = () if self.starts_episode(change.step) else self.entries
        self.entries = (*entries, change)

    def starts_episode(self, step: int) -> bool:
        """Whether a change applied at optimizer step ``step`` starts a new episode.

        A new one when no change of the latest one is within ``guard_steps`` of it, or
        that one holds :data:`EPISODE_CHANGES_MAX` changes: the state before it is the one
        a rollback of the episode goes back to."""
        entries = self.entries
        return (not entries or step - entries[-1].step > self.guard_steps
                or len(entries) >= EPISODE_CHANGES_MAX)

    def clear(self) -> None:
        """The episode's changes were undone (or can no longer be): nothing to roll back."""
        self.entries = ()

    def last_good(self, step: int, *, tuner: bool = True) -> Rollback | None:
        """The values to restore at optimizer step ``step`` (1-based), or None.

        Counts the changes applied at or before ``step`` (a reader on another thread may
        see changes for later steps already), and only while ``step`` is within
        ``guard_steps`` of the latest of them.

        Args:
            step: the step that went wrong.
            tuner: whether the tuner's own changes count (the out-of-memory path undoes
                them too; the guard leaves them to the tuner).

        Returns:
            A :class:`Rollback` with ``values`` {knob: value before its first change in
            the episode} and ``reason`` empty (the caller says why), or None when there
            is no such change.
        """
        changes = [change for change in self.entries
                   if change.step <= step and (tuner or not change.by_tuner)]
        if not changes or step - changes[-1].step > self.guard_steps:
            return None
        values: dict[str, Any] = {}
        for change in changes:
            values.setdefault(change.knob, change.previous)
        return Rollback(values, [assignment(change.knob, change.value) for change in changes])
