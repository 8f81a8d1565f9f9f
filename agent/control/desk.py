"""The command desk: validates commands, schedules them at a step, cancels, applies.

Owns the commands accepted but not yet applied (ordered by the step they apply at), the
ids of those applied lately (for a late cancel's reply), the counters of refused and
rejected commands, and the entries of the :class:`~agent.control.ledger.ChangeLedger` (each
guarded change it applies, and each rollback). It holds no socket: the I/O loop decodes
a ``command`` message and hands its body to :meth:`CommandDesk.answer` (I/O thread);
the training thread calls :meth:`CommandDesk.apply_due` at each optimizer-step boundary
where commands are pending, and :meth:`CommandDesk.roll_back` after an out-of-memory
error.
"""

from __future__ import annotations

import bisect
import hmac
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agent.wire import protocol
from agent.control.guard import GUARDED_KNOBS
from agent.wire.knobs import (CHECKPOINT, RECOVER, STOP, KnobError, KnobSet, assignment,
                              when_applied)
from agent.control.ledger import Change, ChangeLedger, Rollback, StateKeeper
from agent.wire.protocol import (RECOVERY_ID_PREFIX, ROLLBACK_ID_PREFIX, TUNE_ID_PREFIX,
                                 EventKind, Reply)
from agent.search.tune import AutoTune

#: How far ahead a command may be scheduled (optimizer steps).
MAX_STEPS_AHEAD = 100_000
#: Commands accepted but not yet applied, at most; more are rejected (a flood is refused,
#: not queued).
MAX_PENDING_COMMANDS = 32
#: Rewinds a rank remembers, to place a command counted on a branch it has left; one
#: counted on an older branch is rejected.
MAX_REWINDS_KEPT = 64


@dataclass(order=True)
class Pending:
    """A command waiting for its step: ``knob`` set to ``value`` before step ``apply_step``.

    At the boundary before optimizer step ``apply_step``; ordered by step, then by arrival
    (``seq``)."""

    apply_step: int
    seq: int
    knob: str = field(compare=False)
    value: Any = field(compare=False)
    command_id: Any = field(compare=False)
    rollback_reason: str | None = field(compare=False, default=None)
    #: sent with ``checkpoint: true``: applied only if the checkpoint before it was saved
    after_checkpoint: bool = field(compare=False, default=False)


class Rewind(NamedTuple):
    """The run went back (a rewind, a rollback of the state, a loss-spike recovery).

    At the boundary before optimizer step ``at_step`` of the branch left, to the state
    after step ``fork_step``, as branch ``branch``: a command due ``n`` steps after that
    boundary is due ``n`` steps after the fork's, ``at_step - 1 - fork_step`` steps
    earlier (later, for a rewind forward)."""

    branch: int
    at_step: int
    fork_step: int

    @property
    def steps_back(self) -> int:
        """How many steps earlier a command due after this rewind's boundary applies."""
        return self.at_step - 1 - self.fork_step


class CommandDesk:
    """Takes the commands of one rank: validate, schedule at a step, cancel, apply.

    Args:
        knobs: the knobs commands may set.
        token: the run's secret; a command without it is rejected.
        ledger: where applied guarded changes and rollbacks are recorded.
        tune: the in-run search, which the ``tune`` command starts; told of each
            person's command it accepts (the search's own, told apart by their ids,
            are not a person's), and asked whether one of the search's own is refused.
        publish: ``publish(msg_type, body)`` on the I/O thread (events of accepting,
            cancelling).
        event: ``event(level, text, **fields)`` from any thread, in order with the step
            records (events of applying, failing, rejecting).
        step_now: the last optimizer step the training thread completed (1-based; 0
            before the first).
        ending: whether the run is ending (commands are then rejected).
        step_time_s: the latest step time published (s), for dry-run replies, or None.
        rank, world_size: this rank and the job's ranks (with several, one rank never
            rolls back alone, and commands due at one boundary apply in id order).

    When the run goes back (:meth:`rewinding`), each pending command keeps its distance
    from now: due ``n`` steps after the boundary the rewind applies at, it applies ``n``
    steps after the fork's, and a ``rescheduled`` event says so. A command counted on a
    branch the rank has left (its ``branch``: the fan-out's second phase, sent before a
    rewind and arriving after it) is placed the same way, so every rank applies it at
    one step whichever side of the rewind it arrived on.
    """

    def __init__(self, knobs: KnobSet, *, token: str, ledger: ChangeLedger,
                 tune: AutoTune, publish: Callable[[str, dict[str, Any]], None],
                 event: Callable[..., None], step_now: Callable[[], int],
                 ending: Callable[[], bool],
                 step_time_s: Callable[[], float | None] = lambda: None,
                 rank: int = 0, world_size: int = 1) -> None:
        self.knobs = knobs
        self.ledger = ledger
        self.tune = tune
        self.rank, self.world_size = rank, world_size
        self._token = token.encode()
        self._publish, self._event = publish, event
        self._step_now, self._ending, self._step_time_s = step_now, ending, step_time_s
        #: commands accepted, not yet applied, by (apply_step, seq); changed in place only
        #: (the agent's hot path holds this list), under ``_lock``
        self.pending: list[Pending] = []
        self._lock = threading.Lock()
        #: set whenever a command is queued: a run held at a boundary (a pause) waits on it
        self.arrived = threading.Event()
        #: the training thread is held at the boundary after the last step (a pause):
        #: a command may apply at the next boundary, this one
        self.holding = False
        self._seq = 0
        #: the branch trained now (0: the run's first; each rewind makes a new one)
        self.branch = 0
        #: the latest rewinds, oldest first, to place commands counted on a branch left
        self._rewinds: deque[Rewind] = deque(maxlen=MAX_REWINDS_KEPT)
        #: steps the run went back during the :meth:`apply_due` under way (the commands
        #: after a rewind at that boundary apply at the fork's step)
        self._moved_back = 0
        #: (command id, step) of the latest applied commands, for a late cancel's reply
        self._applied_ids: deque[tuple[Any, int]] = deque(maxlen=256)
        #: Valid commands refused because too many were pending (a flood).
        self.commands_refused = 0
        #: Commands rejected (bad token, knob or value).
        self.commands_rejected = 0
        self._rejections_reported = 0
        self._next_rejection_event = 0.0
        #: the accepted no-ops (knob, value) that had their event in step
        #: ``_no_op_step`` (the step the run was at when they came)
        self._no_op_step = -1
        self._no_ops_shown: set[tuple[str, Any]] = set()
        #: accepted no-ops whose event was left out, by (knob, value): the next one shown
        #: says how many (``n more``)
        self._no_ops_hidden: dict[tuple[str, Any], int] = {}
        #: keeps the training state at the boundary where a guarded change starts an
        #: episode, and puts it back when the episode is rolled back
        #: (:class:`agent.control.ledger.StateKeeper`: the run base,
        #: :class:`agent.integrations.run.RunBase`); None:
        #: a rollback restores the knob values only
        self.state_keeper: StateKeeper | None = None

    # ------------------------------------------------------------ I/O thread

    def answer(self, body: dict[str, Any]) -> Reply:
        """The reply to one ``command`` body: scheduled, checked, cancelled, or rejected.

        Accepted and scheduled, checked (dry run), cancelled, or rejected with the reason.
        See :mod:`agent.wire.protocol`. A rejection changes nothing. Never raises for bad
        input."""
        command_id = body.get("id")
        if isinstance(command_id, bool) or not isinstance(command_id, (str, int, type(None))):
            return {"id": None, "ok": False, "knob": body.get("knob"),
                    "reason": f"id must be a string or an integer, got {command_id!r}"}
        rejected: Reply = {"id": command_id, "ok": False, "knob": body.get("knob")}
        for flag in ("dry_run", "cancel", "checkpoint"):
            if not isinstance(body.get(flag, False), bool):
                return {**rejected, "reason": f"{flag} must be true or false, "
                                              f"got {body[flag]!r}"}
            if body.get(flag):  # every reply says which phase it answers
                rejected[flag] = True
        token = body.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
                token.encode("utf-8", "replace"), self._token):
            self.note_rejection("missing or wrong token", None, command_id)
            return {**rejected, "knob": None, "reason": "missing or wrong token"}
        if body.get("cancel") is True:
            return self.cancel(command_id, body.get("reason"))
        if self._ending():
            return {**rejected, "reason": "the run is ending"}
        knob_name, raw = body.get("knob"), body.get("value")
        checkpoint = body.get("checkpoint") is True  # save one at the same boundary, first
        try:
            if knob_name == protocol.TUNE:
                value = self.tune.validate(raw)
                if checkpoint:
                    raise KnobError("checkpoint: true goes with a setting, not with tune")
            else:
                value = self.knobs.validate(knob_name, raw)
                if checkpoint:
                    self.knobs.validate(CHECKPOINT.name, "now")
        except KnobError as exc:
            self.note_rejection(str(exc), knob_name, command_id)
            return {**rejected, "reason": str(exc)}
        assert isinstance(knob_name, str)  # validated: tune, or a knob of this run
        if len(self.pending) + checkpoint >= MAX_PENDING_COMMANDS:
            self.commands_refused += 1
            return {**rejected, "reason": f"{MAX_PENDING_COMMANDS} commands are already "
                                          "waiting for the next step boundary; try again"}
        apply_step = body.get("apply_step")  # (None: the earliest, below)
        if "apply_step" in body and (isinstance(apply_step, bool)
                                     or not isinstance(apply_step, int)):
            return {**rejected, "reason": f"apply_step must be an integer, got {apply_step!r}"}
        counted_on = body.get("branch")
        if "branch" in body and (isinstance(counted_on, bool)
                                 or not isinstance(counted_on, int) or counted_on < 0):
            return {**rejected, "reason": f"branch must be an integer >= 0, got {counted_on!r}"}
        with self._lock:  # (a rewind moves the step and the branch together, under it)
            step_now, branch = self._step_now(), self.branch
            if apply_step is not None and counted_on is not None:
                apply_step, passed = self._placed(apply_step, counted_on)
                if passed:
                    return {**rejected, "reason": passed}
        # the training thread is in the middle of the next step, unless it is held at
        # the boundary after step_now (a pause), where a command can apply at once
        earliest = step_now + (1 if self.holding else 2)
        if apply_step is None:
            apply_step = earliest
        if apply_step > earliest + MAX_STEPS_AHEAD:
            return {**rejected, "reason": f"apply_step {apply_step} is more than "
                                          f"{MAX_STEPS_AHEAD} steps ahead"}
        if apply_step < earliest:
            return {**rejected, "reason": f"apply_step {apply_step} has passed on rank "
                                          f"{self.rank} (earliest: {earliest})"}
        search = self.tune.refusal(command_id, knob_name)
        if search is not None:  # sent before a person took that knob from the search
            return {**rejected, "reason": search}
        stopping = self._stopped_before(knob_name, apply_step)
        if stopping is not None:
            return {**rejected, "reason": stopping}
        if body.get("dry_run") is True:  # the first phase of a command to every rank
            check: Reply = {"id": command_id, "ok": True, "dry_run": True, "knob": knob_name,
                            "value": raw if knob_name == protocol.TUNE else value,
                            "apply_step": apply_step, "step_time_s": self._step_time_s()}
            if self.holding:  # the fan-out needs no margin: this rank waits for it
                check["held"] = True
            if branch:  # the fan-out's second phase names it (a rewind may come between)
                check["branch"] = branch
            return check
        if knob_name == protocol.TUNE:  # not a setting: the search starts (rank 0)
            return {"id": command_id, "ok": True, "knob": knob_name, "value": raw,
                    "apply_step": apply_step, "note": self.tune.start(value, apply_step)}
        if checkpoint:  # no id of its own: withdrawing the change leaves a harmless save
            self.schedule(Pending(apply_step, 0, CHECKPOINT.name, "now", None), branch)
        reason = body.get("reason")
        rollback = (protocol.shorten(reason) if isinstance(reason, str)
                    and str(command_id).startswith((ROLLBACK_ID_PREFIX, RECOVERY_ID_PREFIX))
                    else None)
        no_op = (not checkpoint and rollback is None
                 and not self.knobs.knobs[knob_name].spec.command
                 and value == self._value_at(knob_name, apply_step))
        pending = Pending(apply_step, 0, knob_name, value, command_id, rollback,
                          after_checkpoint=checkpoint)
        passed = self.schedule(pending, branch)
        if passed:
            return {**rejected, "reason": passed}
        apply_step = pending.apply_step  # (moved if the run went back meanwhile)
        reply: Reply = {"id": command_id, "ok": True, "knob": knob_name, "value": value,
                        "apply_step": apply_step, "step": step_now}
        if self.branch:
            reply["branch"] = self.branch
        if self.knobs.knobs[knob_name].spec.command:
            reply["after_step"] = apply_step - 1
        text = (f"{assignment(knob_name, value)} accepted, "
                + when_applied(apply_step, reply.get("after_step")))
        if checkpoint:
            reply["checkpoint"] = True
            text += " after a checkpoint"
        if no_op:
            reply["no_change"] = True
        shown = not no_op or self._no_op_shown(knob_name, value, step_now)
        if no_op and shown:
            text += " (no change)"
            hidden = self._no_ops_hidden.pop((knob_name, value), 0)
            if hidden:
                text += f" ({hidden} more before it not shown)"
        if shown:
            self._publish(protocol.EVENT, {"level": "info", "text": text,
                                           "kind": EventKind.ACCEPTED, "knob": knob_name,
                                           "value": value, "step": apply_step,
                                           "id": command_id})
        warning = self.knobs.knobs[knob_name].warning(value)
        if warning:
            reply["warning"] = warning
            self._publish(protocol.EVENT, {"level": "warning", "text": warning,
                                           "kind": EventKind.WARNING, "knob": knob_name})
        note = None if rollback else self.tune.person_set(command_id, knob_name, value,
                                                          apply_step)
        if note:  # a person's command on a knob the search explores: theirs now
            reply["note"] = note
        return reply

    def _stopped_before(self, knob: str, apply_step: int) -> str | None:
        """Why a command for ``knob`` at ``apply_step`` would never take effect, or None.

        A ``stop`` pending at the boundary before ``apply_step`` or an earlier one ends the
        run there: no step trains with a setting of that boundary or a later one (a
        command that is not a setting, a checkpoint, still runs at the stop's own)."""
        with self._lock:
            stops = [(p.apply_step, p.value) for p in self.pending if p.knob == STOP.name]
        if not stops:
            return None
        at, value = min(stops)
        command = knob == protocol.TUNE or self.knobs.knobs[knob].spec.command
        if apply_step < at or (apply_step == at and command):
            return None
        return (f"the run stops at the boundary after step {at - 1} "
                f"({assignment(STOP.name, value)} is pending): no step trains with it")

    def _value_at(self, knob: str, apply_step: int) -> Any:
        """The value ``knob`` will have at step ``apply_step`` as things stand: that of
        the last command pending for it by then, else its value now."""
        with self._lock:
            due = [p.value for p in self.pending
                   if p.knob == knob and p.apply_step <= apply_step]
        return due[-1] if due else self.knobs.knobs[knob].get()

    def _no_op_shown(self, knob: str, value: Any, step_now: int) -> bool:
        """Whether an accepted no-op ``knob=value`` gets its ``accepted`` event: the
        first of its kind in step ``step_now`` does, the repeats are counted (a flood
        of one command made an event each, up to :data:`MAX_PENDING_COMMANDS` a step)."""
        if step_now != self._no_op_step:
            self._no_op_step, self._no_ops_shown = step_now, set()
        key = (knob, value)
        if key not in self._no_ops_shown:
            self._no_ops_shown.add(key)
            return True
        self._no_ops_hidden[key] = self._no_ops_hidden.get(key, 0) + 1
        return False

    def _placed(self, apply_step: int, counted_on: int) -> tuple[int, str]:
        """``apply_step`` counted on branch ``counted_on``, as a step of the branch now,
        and why it cannot be placed ("" when it can): it was due at or before the
        boundary where the run left that branch, or the branch is not known here.
        Under the desk's lock."""
        if counted_on == self.branch:
            return apply_step, ""
        since = [rewind for rewind in self._rewinds if rewind.branch > counted_on]
        if counted_on > self.branch or len(since) != self.branch - counted_on:
            return apply_step, (f"branch {counted_on} is not one rank {self.rank} can count "
                                f"from (it trains branch {self.branch})")
        for rewind in since:
            if apply_step <= rewind.at_step:
                return apply_step, (f"apply_step {apply_step} of branch {counted_on} has "
                                    f"passed on rank {self.rank}: the run went back to "
                                    f"step {rewind.fork_step} at step {rewind.at_step} "
                                    f"(branch {rewind.branch})")
            apply_step -= rewind.steps_back
        return apply_step, ""

    def schedule(self, pending: Pending, branch: int | None = None) -> str:
        """Queue ``pending`` for its step (after those queued for the same step).

        ``branch``: the branch its step was counted on (None: the branch now); when the
        run has left it since, the step is moved as a pending command's is
        (:meth:`rewinding`), or nothing is queued and the reason is returned (it has
        passed). Returns "" when queued. Any thread; takes the desk's lock for an
        insertion."""
        with self._lock:
            if branch is not None:
                pending.apply_step, passed = self._placed(pending.apply_step, branch)
                if passed:
                    return passed
            self._seq += 1
            pending.seq = self._seq
            bisect.insort(self.pending, pending)
        self.arrived.set()
        return ""

    @contextmanager
    def rewinding(self, left_step: int, fork_step: int, branch: int) -> Iterator[None]:
        """Training thread: the run goes back from step ``left_step`` to ``fork_step``.

        At the boundary after ``left_step``, as branch ``branch``; what the ``with`` block
        does (the run's step counter set to the fork's) is seen by the I/O thread's
        :meth:`answer` together with the new branch. Then each pending command keeps its
        distance from now: due ``n`` steps after this boundary, it applies ``n`` steps
        after the fork's boundary, and one ``rescheduled`` event each says so (at most
        :data:`MAX_PENDING_COMMANDS`). A few list operations."""
        rewind = Rewind(branch, left_step + 1, fork_step)
        with self._lock:
            yield
            for pending in self.pending:  # (the order is kept: no new sort)
                pending.apply_step -= rewind.steps_back
            moved = list(self.pending)
            self.branch = branch
            self._rewinds.append(rewind)
        self._moved_back += rewind.steps_back
        for pending in moved:
            after = pending.apply_step - fork_step - 1
            self._event("info", f"{assignment(pending.knob, pending.value)} now applies at "
                        f"step {pending.apply_step}, not {pending.apply_step + rewind.steps_back}"
                        f": the run went back to step {fork_step} at step {rewind.at_step} "
                        f"(branch {branch}) and it stays {after} "
                        f"step{'s' if after != 1 else ''} after that boundary",
                        kind=EventKind.RESCHEDULED, knob=pending.knob, value=pending.value,
                        step=pending.apply_step,
                        previous_step=pending.apply_step + rewind.steps_back,
                        branch=branch, id=pending.command_id)

    def schedule_rollback(self, rollback: Rollback, apply_step: int) -> None:
        """Queue the values of ``rollback`` for step ``apply_step``.

        Each applies as a ``rolled_back`` event naming ``rollback.reason``."""
        for knob, value in rollback.values.items():
            self.schedule(Pending(apply_step, 0, knob, value, None, rollback.reason))

    def schedule_recovery(self, command_id: str, reason: str, apply_step: int) -> None:
        """Queue a loss-spike recovery for the boundary before ``apply_step``.

        Its ``command_id``: :data:`RECOVERY_ID_PREFIX`, the spike's first step, ``-``..."""
        self.schedule(Pending(apply_step, 0, RECOVER.name, "on", command_id, reason))

    def cancel(self, command_id: Any, reason: Any) -> Reply:
        """Withdraw the pending command ``command_id`` (another rank refused it).

        The reply says whether it was pending, applied already (``applied_step``) or
        unknown."""
        with self._lock:
            found = next((p for p in self.pending
                          if command_id is not None and p.command_id == command_id), None)
            if found is not None:
                self.pending.remove(found)
        if found is None:
            applied = next((step for applied_id, step in list(self._applied_ids)
                            if applied_id == command_id), None)
            if applied is not None:
                return {"id": command_id, "ok": False, "cancel": True,
                        "applied_step": applied,
                        "reason": f"it was applied at step {applied}, before the cancel came"}
            return {"id": command_id, "ok": False, "cancel": True,
                    "reason": f"no pending command with id {command_id!r}"}
        why = f": {reason}" if isinstance(reason, str) and reason else ""
        self._publish(protocol.EVENT, {
            "level": "warning", "kind": EventKind.CANCELLED, "knob": found.knob,
            "value": found.value, "step": found.apply_step, "id": command_id,
            "text": f"{assignment(found.knob, found.value)} for step {found.apply_step} "
                    f"cancelled{why}"})
        return {"id": command_id, "ok": True, "cancel": True, "knob": found.knob,
                "value": found.value, "apply_step": found.apply_step}

    def note_rejection(self, reason: str, knob: Any, command_id: Any = None) -> None:
        """Count a rejected command and raise a ``rejected`` event for it: at most one a second.

        A flood of bad commands must not flood the run log and every dashboard."""
        self.commands_rejected += 1
        now = time.monotonic()
        if now < self._next_rejection_event:
            return
        self._next_rejection_event = now + 1.0
        count = self.commands_rejected - self._rejections_reported
        self._rejections_reported = self.commands_rejected
        more = f" ({count - 1} more since the last report)" if count > 1 else ""
        self._event("warning", f"command rejected: {protocol.shorten(reason)}{more}",
                    kind=EventKind.REJECTED, knob=protocol.short_name(knob),
                    id=protocol.short_name(command_id))

    # ------------------------------------------------------------ training thread

    def apply_due(self, step: int, ahead: int = 0) -> bool:
        """Training thread, after optimizer step ``step``: apply the commands due at ``step + 1``.

        And those due up to ``ahead`` steps later (a run held at this boundary), each
        atomically (a knob that fails to set keeps its value, and a ``failed`` event says
        why). Returns whether any applied (the knob values may have changed)."""
        with self._lock:
            due = bisect.bisect_right(self.pending, step + 1 + ahead,
                                      key=lambda p: p.apply_step)
            commands, self.pending[:due] = self.pending[:due], []
        self._moved_back = 0
        if self.world_size > 1:  # arrival order differs between ranks; ids do not
            commands.sort(key=lambda command: (command.apply_step, str(command.command_id)))
        # commands that are not settings (a checkpoint) first: they see the state before
        # the changes of the same boundary (a stable sort keeps the order above); a
        # recovery after the settings: a rollback of the same boundary sets the value its
        # scaled lr starts from and goes back to, not the value the rollback undoes
        commands.sort(key=lambda command: (not self.knobs.knobs[command.knob].spec.command,
                                           _spike_start(command) is not None))
        # a later command for the same knob at the same boundary wins; a recovery is
        # no setting and always applies (a person's recover= beside it dropped it, and
        # the spike watch then waited for it to the run's end)
        last = {command.knob: command for command in commands
                if _spike_start(command) is None}
        checkpoint_failed = changed = False
        rolled_back = ""  # why, once a rollback applied
        recovered = False  # a recovery applied: the state it put back stands
        stopped = None  # the stop applied at this boundary: no step trains after it
        for command in commands:
            if _spike_start(command) is None and last[command.knob] is not command:
                continue
            if stopped is not None and not self.knobs.knobs[command.knob].spec.command:
                self._event("warning", f"{assignment(command.knob, command.value)} not "
                            f"applied: {assignment(STOP.name, stopped.value)} ends the run "
                            f"at the boundary after step {step}, before any step trains "
                            "with it", kind=EventKind.CANCELLED, knob=command.knob,
                            value=command.value, step=step + 1, id=command.command_id)
                continue
            # (after a rewind at this boundary, the fork's step: the rewind's event
            # comes first, the next step record is the fork's next)
            if self._apply(step + 1 - self._moved_back, command, checkpoint_failed):
                changed = True
                if command.knob == STOP.name:
                    stopped = command
                if _spike_start(command) is None:  # (a recovery is no rollback)
                    rolled_back = rolled_back or command.rollback_reason or ""
                else:
                    recovered = True
            elif command.knob == CHECKPOINT.name:
                checkpoint_failed = True
            elif self.world_size > 1 and _spike_start(command) is None:
                # the state goes back all the same: every rank puts it back together
                # (restore_state is a collective), and its failed event says why
                rolled_back = rolled_back or command.rollback_reason or ""
        # (after a recovery at this boundary the state is the one it put back, a later
        # one than the rollback's: its rewind dropped the state kept for the rollback)
        if rolled_back and not recovered and self.state_keeper is not None:
            at = step + 1 - self._moved_back
            level, text = self.state_keeper.restore_state(at, f"rolled back: {rolled_back}")
            self._event(level, text, kind=EventKind.STATE_RESTORED, step=at)
        return changed

    def _apply(self, step: int, command: Pending, checkpoint_failed: bool) -> bool:
        """Apply one due command at the boundary before ``step``; returns whether it
        applied (False: it failed, and a ``failed`` event says why)."""
        knob = self.knobs.knobs[command.knob]
        before = _spike_start(command)
        if before is not None and self.state_keeper is not None:  # not a setting
            assert command.rollback_reason is not None  # (_spike_start checks it)
            self.state_keeper.recover(step - 1, before, command.rollback_reason)
            return True
        action = knob.spec.command
        previous = None if action else knob.get()
        # a setting to the value it has (a person's repeat, a script's periodic set): no
        # set, no episode and no state kept for it, nothing for a rollback to undo
        unchanged = (not action and not command.rollback_reason
                     and previous == command.value)
        # a person's (or a script's) setting: not a rollback, nor the search's trial
        persons = (not action and not command.rollback_reason
                   and not str(command.command_id or "").startswith(TUNE_ID_PREFIX))
        if command.after_checkpoint and checkpoint_failed and self.world_size > 1:
            self._event("warning", f"{assignment(command.knob, command.value)}: the "
                        "checkpoint before it failed on this rank; applied all the same "
                        f"(every one of the {self.world_size} ranks must apply it)",
                        kind=EventKind.WARNING, knob=command.knob, step=step)
        try:
            if command.after_checkpoint and checkpoint_failed and self.world_size == 1:
                raise RuntimeError("the checkpoint asked for before it was not saved")
            if (self.state_keeper is not None and command.knob in GUARDED_KNOBS
                    and persons and not unchanged and self.ledger.starts_episode(step)):
                self.state_keeper.keep_state(step - 1)
            detail = {} if unchanged else dict(knob.set(command.value) or {})
        except Exception as exc:
            kept = "" if action else f"; kept {assignment(command.knob, previous)}"
            self._event("error", f"{assignment(command.knob, command.value)} failed at "
                        f"step {step}: {exc}{kept}",
                        kind=EventKind.FAILED, knob=command.knob, value=command.value,
                        step=step, id=command.command_id)
            return False
        if command.rollback_reason:
            self.ledger.clear()  # a rollback is not a change to watch
        elif command.knob in GUARDED_KNOBS and not unchanged:
            self.ledger.record(Change(step, command.knob, command.value, previous,
                                      command.command_id))
        text = f"{assignment(command.knob, command.value)} applied at step {step}"
        if unchanged:
            text += " (no change)"
        if persons and self.state_keeper is not None:
            text += self.state_keeper.setting_applied(command.knob, previous)
        if command.rollback_reason:
            text += f": rolled back because {command.rollback_reason}"
            if self.state_keeper is not None and not action:
                text += self.state_keeper.setting_rolled_back(command.knob, command.value)
        if "text" in detail:
            text += f": {detail.pop('text')}"
        self._event("warning" if command.rollback_reason else "info", text,
                    kind=EventKind.ROLLED_BACK if command.rollback_reason else EventKind.APPLIED,
                    knob=command.knob, value=command.value, previous=previous,
                    step=step, id=command.command_id, **detail)
        if command.command_id is not None:  # a late cancel can be told so
            self._applied_ids.append((command.command_id, step))
        return True

    def roll_back(self, step: int, reason: str) -> bool:
        """Training thread, between steps: undo at once the ledger's changes for step ``step``.

        ``step`` is 1-based; the changes are those of the last ``guard_steps`` steps, undone
        e.g. after an out-of-memory error. With several ranks nothing is undone (one rank
        alone must not change a knob): a warning names the command that would.

        Returns:
            True when something was rolled back.
        """
        change = self.ledger.last_good(step)
        self.ledger.clear()
        if change is None:
            return False
        why = f"{reason} after {', '.join(change.changes)}"
        if self.world_size > 1:
            self._event("error", f"{why}; not rolled back: with {self.world_size} ranks "
                        "only a command to every rank may change a knob (gpuwatch set "
                        + " ".join(assignment(k, v) for k, v in change.values.items()) + ")",
                        kind=EventKind.WARNING, step=step)
            return False
        for name, value in change.values.items():
            try:
                self.knobs.knobs[name].set(value)
            except Exception as exc:
                self._event("error", f"rolling back {assignment(name, value)} failed: {exc}",
                            kind=EventKind.FAILED, knob=name, value=value, step=step)
                continue
            back = ("" if self.state_keeper is None
                    else self.state_keeper.setting_rolled_back(name, value))
            self._event("warning", f"{assignment(name, value)} applied at step {step}: "
                        f"rolled back because {why}{back}", kind=EventKind.ROLLED_BACK,
                        knob=name, value=value, step=step)
        return True


def _spike_start(command: Pending) -> int | None:
    """The first step of the loss spike that ``command`` recovers from (a ``recover``
    command with a reason and a :data:`RECOVERY_ID_PREFIX` ``<step>-`` id), or None
    when it is not a recovery."""
    command_id = str(command.command_id)
    if (command.knob != RECOVER.name or not command.rollback_reason
            or not command_id.startswith(RECOVERY_ID_PREFIX)):
        return None
    step = command_id.removeprefix(RECOVERY_ID_PREFIX).split("-", 1)[0]
    return int(step) if step.isdigit() and len(step) < 19 else None
