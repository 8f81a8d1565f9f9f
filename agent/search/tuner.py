"""The in-run search's state machine (:mod:`agent.search.tune`).

Trials measured in sub-blocks against the best configuration, kept or reverted, and the
blame after a non-finite loss."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.wire import protocol
from agent.control.guard import ChangeGuard
from agent.wire.knobs import (
    KnobError,
    KnobSet,
    assignment,
)
from agent.control.ledger import Change, ChangeLedger
from agent.wire.protocol import EventKind
from agent.search.coordinate import TRADES, Candidate, CoordinateSearch, config_text, ladder
from agent.search.request import TuneRequest
from agent.search.stats import (
    FUTILE_FROM_PAIRS,
    MAX_PAIRS,
    MIN_PAIRS_FASTER,
    MIN_PAIRS_SLOWER,
    WORTHWHILE_GAIN,
    Block,
    Series,
    could_be_shown_faster,
    paired_gain,
)


#: A sub-block: at least this many measured steps (after its warm-up cut), and more
#: until it has this many seconds of them, up to the most steps.
SUB_BLOCK_STEPS = 3
SUB_BLOCK_S = 0.1
MAX_SUB_BLOCK_STEPS = 16
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
    """One candidate measured against the best configuration in sub-blocks.

    See :func:`_side`; it holds the pairs measured so far and the sub-block in progress.

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
    """The search itself: a state machine fed with the agent's step records and events.

    It runs on the I/O thread only, and decides and sends its changes through ``send``.

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
        #: step records taken since the search started (the budget's count: step numbers
        #: repeat after a rewind), and whether the first of them has come
        self._records = 0
        self._started = False
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
                    + f" from {config_text(self.baseline)}, within {request.budget_steps} "
                    f"steps from step {start_step}")
        self._next_candidate()

    @property
    def steps(self) -> int:
        """Steps the search has spent: step records since its start step, on every branch."""
        return self._records

    @property
    def gain(self) -> float:
        """The best configuration's throughput over the baseline's, minus 1.

        The gains of the candidates kept, each measured against the best before it,
        chained (a knob a person took since is left out)."""
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
        """Take the reply to a command this search sent.

        Only a refusal matters: an accepted one is followed by its ``applied`` or
        ``failed`` event."""
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
        elif kind == EventKind.BRANCHED:
            self._branched(event)
        elif kind == EventKind.ROLLED_BACK and knob in self.best:
            self._rolled_back(knob, event.get("value"), str(event.get("text", "")))
        elif (kind in CHANGE_KINDS and not self.own(event.get("id"))
              and (knob not in self.knobs.knobs or not self.knobs.knobs[knob].spec.command)
              and not protocol.applied_unchanged(event)):  # ("(no change)": none)
            self._changed_under(str(event.get("text", kind)))

    def person_set(self, knob: str, value: Any, apply_step: int) -> str | None:
        """Take a person's accepted command on ``knob``.

        A person's command (not one of the search's own) was accepted: ``knob`` set to
        ``value`` from step ``apply_step``. A knob the search explores leaves it: the
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

    def _branched(self, event: dict[str, Any]) -> None:
        """A rewind, rollback or recovery put the run back at a step, on a new branch.

        Step numbers repeat from there and the state put back may bring its own knob
        values (a checkpoint's): the steps measured before it, on the branch left, are
        dropped (the sub-block in progress, and a trial's pairs: it is measured again
        from its first sub-block), the changes the guard watched go with that branch,
        and every searched knob goes back to the best value (a command where the run's
        differs). The budget counts step records, so it goes on unchanged."""
        self._series = Series()
        self._ledger.clear()
        self._closing = False
        trial = self._trial
        again = ""
        if trial is not None and self._check is None:
            candidate = trial.candidate
            candidate.block, candidate.gain, candidate.gain_spread = Block(), None, None
            self._trial = Trial(candidate)
            again = f"; measuring {candidate.text} again from {config_text(self.best)}"
        self._back_to_best()
        self._event("info", f"tune: branch {event.get('branch')} at step "
                            f"{event.get('step')} ({event.get('cause')}): the steps "
                            f"measured before it are dropped{again}")
        self.publish_state()

    def on_step(self, step: int, step_time_s: float | None, samples: int,
                tokens: int | None, loss: float | None, skipped: bool | None) -> None:
        """Take one step record.

        The record: ``step_time_s`` (host clock, None for the first), the step's
        samples and tokens (None if unknown), its loss (None if not read) and whether
        the GradScaler skipped it. Costs a few additions, and the warm-up cut of
        :meth:`Series.block` (O(steps of a sub-block))."""
        if (step < self.start_step and not self._started) or self.status != "running":
            return
        self._started = True  # (a rewind's branch may then go on from an earlier step)
        self._records += 1
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
        self._event("warning", f"tune: {reason}: back to {config_text(self.best)} to see "
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
               f"before the trial ({config_text(self.best)}) {still} at steps "
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
        """End the search with the run, each knob it changed back at its best value.

        The run ends while the search runs: the candidate being tried is not judged,
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
            self.text = (f"tuned: {config_text(changed)} ({self.gain:+.0%} {unit}/s in "
                         f"{self.steps} steps)")
        elif not self.baseline:  # a person took every knob
            self.text = f"tuned: no change in {self.steps} steps"
        else:
            self.text = (f"tuned: no change, {config_text(self.baseline)} stays (nothing "
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


def _gain_text(gain: float, low: float, high: float) -> str:
    """``+12% (+3% to +22%)``: a gain and its interval."""
    return f"{gain:+.0%} ({low:+.0%} to {high:+.0%})"
