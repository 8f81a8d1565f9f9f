"""One model of a run: :class:`RunBase`, what every integration is built on.

Every integration (the reference Trainer, hand-written loops, Lightning, Hugging Face,
accelerate, Lightning Fabric) is a subclass. The base owns, once for all of them:

- **the optimizer-step boundary** (``boundary(record)``, in C: the base
  :class:`agent.step._hot.RunPath`): count the step, note the micro-batches its window
  trained (the data position), hand the typed record (:class:`agent.step.record.StepRecord`)
  to the agent, which applies the commands due, then (:meth:`RunBase._after_boundary`, only
  at a step that has any) hold a pause, take a recovery's step, publish the step's events
  (compile progress) and tick the memory knobs;
- **checkpoint and resume** (:meth:`RunBase.bind_checkpoint`, :meth:`RunBase.restore`):
  the knob values a person chose (never a search's trial), the data position
  (:class:`gpuopt.position.DataPosition`, or the framework's own), and an event that
  names every knob value restored and anything that will differ;
- **rollback of the state** (:meth:`RunBase.keep_state`, :meth:`RunBase.restore_state`):
  where a guarded change starts an episode, the state at that boundary is kept in host
  memory (within :data:`ROLLBACK_BUDGET_BYTES`); when the change is rolled back (a
  non-finite loss, a divergence), the model, optimizer, scheduler, GradScaler, random
  numbers and data position go back to it with the previous setting, and the steps
  since are trained again;
- **rewind and branches** (:meth:`RunBase.rewind_state`, the ``rewind`` command): every
  time the training state is put back (``rewind=<step or path>``, a rollback, spike
  recovery) the run goes on as a new branch, announced by one ``branched`` event before
  any step record of it; ``rewind`` reads a checkpoint of the integration's own format
  (:meth:`RunBase.read_checkpoint`, the code its resume uses) into the rollback's
  snapshot form, with its knob values;
- **loss-spike recovery** (the ``recover`` knob, :mod:`agent.control.recovery`): with
  ``recover=on``, host copies of the state every ``keep_every_steps`` (a ring within a
  byte budget); after a spike rank 0 found, every rank goes back to the latest state
  kept before it (:meth:`RunBase.rewind_state`, a new branch), the data moves past what
  was trained since (or ``skip_windows`` windows from the kept state: drawn and dropped
  through the integration's loader, :meth:`RunBase.drop_micro_batches`), and the
  learning rate is scaled a while (:meth:`RunBase.recover`);
- **pause, stop and evaluate** (the ``pause``, ``stop`` and ``evaluate`` commands):
  ``pause=on`` holds the training thread at the boundary it applies at, asleep on an
  event until ``pause=off`` (or ``stop``) arrives; ``stop`` ends the framework's loop
  there (:meth:`RunBase.end_loop`), after a checkpoint for ``stop=checkpoint``;
  ``evaluate=now`` runs the evaluation an integration binds (:meth:`RunBase.bind_evaluate`)
  and publishes its metrics (:meth:`RunBase.publish_evaluation`);
- **the end** (:meth:`RunBase.close`): on a normal end, an exception, Ctrl-C or SIGTERM,
  the integration's patches are put back and ``bye`` says why, in every integration.

A subclass supplies only its framework's part: how it reads a step (it builds the
record and calls :meth:`RunBase.boundary`), its knob binders, how its framework saves
and loads a checkpoint, and :meth:`RunBase.uninstall`.
"""

from __future__ import annotations

import _imp
import atexit
import logging
from numbers import Real
import os
import re
import signal
import stat
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from agent.wire.knobs import (CHECKPOINT, EVALUATE, LR_SCALE, MIXTURE, PAUSE, RECOVER,
                              REWIND, STOP, Knob, assignment)
from agent.wire.protocol import EventKind
from agent.integrations.adapters import NOT_A_MIXTURE, MemoryKnobs, publish_events
from agent.integrations.ranks import agree, every_rank
from agent.control.checkpoints import (Checkpoints, knobs_text, own_checkpoint, restore_knobs,
                                       set_knobs)
from agent.step._hot import RunPath
from agent.step.core import Agent, ending_reason
from agent.control.recovery import Recovery
from agent.integrations import WindowMeter
from gpuopt.data import batch_size
from gpuopt.memory import format_bytes
from gpuopt.position import DataPosition

log = logging.getLogger("gpuwatch.agent")

#: The most host memory a rollback snapshot may take (bytes): a state larger than this
#: is not kept, and a rollback then restores the knob values only (its event says so).
ROLLBACK_BUDGET_BYTES = 2 << 30


class StateTooLarge(ValueError):
    """The training state is larger than the host memory allowed for a copy of it.

    Attributes:
        size_bytes: the state's tensors' bytes. budget_bytes: what was allowed.
    """

    def __init__(self, size_bytes: int, budget_bytes: int) -> None:
        super().__init__(f"the state ({format_bytes(size_bytes)}) is larger than the "
                         f"{format_bytes(budget_bytes)} allowed")
        self.size_bytes, self.budget_bytes = size_bytes, budget_bytes


class _Recovery(NamedTuple):
    """What a loss-spike recovery puts back on this rank (:meth:`RunBase._plan_recovery`).

    ``snapshot``: the kept state, with the data position as it is now where it goes on
    from there; ``windows``: windows skipped; ``drop``: micro-batches drawn and dropped
    after the load; ``text``: the ``branched`` event's words for the skip and the lr;
    ``lr_to``: ``lr_scale`` from and to, or None (not scaled)."""

    snapshot: Any
    windows: int
    drop: int
    text: str
    lr_to: tuple[float, float] | None


class RunBase(RunPath):
    """One training run under the agent, as every integration has it.

    Args:
        agent: the run's agent (not started yet: :meth:`start` starts it).
        device: the model's device (memory knobs, the data position's batches).
        tokens_per_sample: tokens in one sample, for :attr:`meter` (None: counted from
            ``input_ids``).

    The boundary is :class:`agent.step._hot.RunPath`'s ``boundary(record)`` (C): every
    integration calls it once per optimizer step with the step's
    :class:`agent.step.record.StepRecord`.

    Attributes:
        agent: the :class:`agent.step.core.Agent`. knobs: its knob set.
        step: optimizer steps taken so far (a resumed run counts on from its checkpoint).
        meter: the window's data wait, micro-batches, samples and tokens
            (:class:`agent.integrations.WindowMeter`), for integrations that time fetches.
        position: the data position (:class:`gpuopt.position.DataPosition`), for
            integrations whose data gpuwatch iterates; others report theirs through
            :meth:`data_state`.
        memory: the ``memory_fraction`` / ``memory_snapshot_steps`` knobs.
        event_sources: callables returning ``(kind, text, fields)`` events to publish
            after each step (e.g. a model backend's compile progress).
        resumed_from: the checkpoint the run resumed from, or None.
        branch: the branch being trained now (0 until the state is put back:
            :meth:`rewind_state`).
    """

    def __init__(self, agent: Agent, *, device: torch.device | str | None = None,
                 tokens_per_sample: int | None = None) -> None:
        self.agent = agent
        self.knobs = agent.knobs
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.step = 0
        self.meter = WindowMeter(batch_size, tokens_per_sample)
        self.position = DataPosition(self.device)
        self.memory = MemoryKnobs(self.device, agent.run_id)
        self.memory.bind(self.knobs)
        self.event_sources: list[Callable[[], list[tuple[str, str, dict[str, Any]]]]] = []
        self.resumed_from: str | None = None
        #: the branch being trained now (0: the run's first)
        self.branch = 0
        #: the highest branch id so far (a new branch's is one more)
        self._last_branch = 0
        #: the ``checkpoint`` command, where bound (``rewind=N`` finds step N's by it)
        self._checkpoints: Checkpoints | None = None
        self.closed = False
        #: :meth:`close` is under way (a SIGTERM then waits for it: :func:`end_on_signals`)
        self.closing = False
        self.broken = False
        #: the state kept for a rollback: ``(step, snapshot, bytes)``, or the reason none is
        self._kept: tuple[int, Any, int] | None = None
        self._not_kept = ""
        agent.keep_state_with(self)
        #: ``pause=on`` applied and no ``pause=off`` since: the next boundary holds
        self._pause_requested = False
        #: the ``stop`` command's value once it applied (``"now"``, ``"checkpoint"``)
        self.stop_requested: str | None = None
        if MIXTURE.name not in self.knobs.knobs and MIXTURE.name not in self.knobs.unsupported:
            self.knobs.bind(MIXTURE, NOT_A_MIXTURE)  # until a MixtureLoader's knobs bind it
        self.knobs.add(Knob(PAUSE, get=lambda: None, set=self._set_pause))
        self.knobs.add(Knob(STOP, get=lambda: None, set=self._set_stop,
                            check=self._check_stop))
        #: micro-batches trained in all (every branch), for what a recovery skips
        self._micro_batches_trained = 0
        #: ``recover=on``: the states kept for a recovery, oldest first, each
        #: ``(step, snapshot, bytes, micro-batches trained by then)``, and why the latest
        #: one due was not kept ("" when it was)
        self._recovering = False
        #: the step the last recovery went back to (None: none since ``recover=on``),
        #: and the repeated spikes recovered from in a row since (Recovery.max_repeats)
        self._recovered_to: int | None = None
        self._repeats = 0
        self._ring: deque[tuple[int, Any, int, int]] = deque()
        self._ring_not_kept = ""
        #: while recovering: ``(step, micro-batches trained in all by then)`` at each
        #: boundary since the oldest kept state (the windows a recovery skips)
        self._window_ends: deque[tuple[int, int]] = deque()
        #: accumulation windows of data recoveries skipped in all (an integration whose
        #: planned epochs end with the data trains on to its planned steps)
        self.skipped_windows = 0
        #: a recovery's scaled learning rate: (the step it ends after, the value then)
        self._lr_back: tuple[int, float] | None = None
        #: the scaled lr_scale and the ``_lr_back`` that a person's lr_scale ended, until
        #: a rollback of that setting's episode puts them back or a guarded setting
        #: starts another episode (:meth:`keep_state`)
        self._lr_back_ended: tuple[float, tuple[int, float]] | None = None
        if type(self).live_state is RunBase.live_state:
            self.knobs.bind(RECOVER, f"{type(self).__name__} keeps no training state to go "
                                     "back to")
        else:
            self.knobs.add(Knob(RECOVER, get=lambda: "on" if self._recovering else "off",
                                set=self._set_recover,
                                detail=agent.recovery.describe()))

    # ------------------------------------------------------------ the boundary

    # (boundary(record): RunPath's, in C)

    def _after_boundary(self) -> None:
        """Training thread, at the boundary (``boundary``, after the step was recorded), when
        the run has more to do: hold a pause, end a rollback's watch, take a recovery's
        step, publish the event sources' events, tick the memory knobs.

        Never raises: an error of gpuwatch's stops the observing (an event says so)."""
        agent = self.agent
        if self._pause_requested:
            self._hold_paused()
        if (self._kept is not None and agent.rank == 0
                and agent.cleanly_watched_step > self._kept[0]):
            # the change's watch ended cleanly: nothing to go back to (rank 0's guard
            # decides for every rank; another rank keeps its state until the next
            # change, since rank 0's rollback may come after its own watch ended)
            self._kept = None
        try:
            if self._recovering or self._lr_back is not None:
                self._recovery_step()
            if self.event_sources:
                for source in self.event_sources:
                    events = source()
                    if events:
                        publish_events(agent, self.step, events)
            if self.memory.snapshot_steps_left:
                self.memory.after_step(agent, self.step)
        except Exception as exc:  # the first rule: never crash the training
            self.fail("after the optimizer step", exc)

    def _hold_paused(self) -> None:
        """Training thread, at the boundary ``pause=on`` applied at: held there until
        ``pause=off`` or ``stop`` (:meth:`agent.step.core.Agent.hold`).

        (Its own method: a lambda in :meth:`_after_boundary` would make ``self`` a cell there,
        one allocation at every step it runs.)"""
        self.agent.hold(lambda: not self._pause_requested or self.stop_requested is not None)

    # ------------------------------------------------------------ checkpoint and resume

    def bind_checkpoint(self, save: Callable[[Path, dict[str, Any]], None], *,
                        directory: str | os.PathLike | None = None,
                        name: str = "step-{step:08d}.pt",
                        step: Callable[[], int] | None = None,
                        refusal: Callable[[], str | None] | None = None,
                        every_rank: bool = False,
                        agree: Callable[[str | None], str | None] | None = None) -> None:
        """Offer the ``checkpoint`` command: write the framework's checkpoint with the knob values.

        ``save(path, knobs)`` writes the framework's checkpoint with the knob values
        ``knobs`` (the person's: see :meth:`chosen_knobs`) and :meth:`data_state` in it. The
        reply warns before saving when :meth:`data_reason` says a resume will not be exact.
        Other arguments as :class:`agent.control.checkpoints.Checkpoints`'."""
        self._checkpoints = Checkpoints(
            self.agent, save, step=step or (lambda: self.step), directory=directory,
            name=name, refusal=refusal, every_rank=every_rank, chosen=self.chosen_knobs,
            warn=self.data_reason, agree=agree)
        self._checkpoints.bind(self.knobs)

    def chosen_knobs(self) -> tuple[dict[str, Any], str | None]:
        """The knob values a checkpoint keeps, and a note when one is not the current value.

        The ones now, except that a knob the in-run search is trying has the value the
        search measures it against (the person's, or the best kept so far), and
        ``lr_scale`` while a recovery scales it has the value it goes back to; and a note
        saying so, or None."""
        values = self.agent.knobs.values()
        trial = self.agent.tune.trial_values(values)
        notes = ["the search was trying " + ", ".join(
            f"{name}={values[name]}" for name in trial)] if trial else []
        if self._lr_back is not None and LR_SCALE.name in values:  # a recovery's, for now
            notes.append(f"a recovery scales {LR_SCALE.name} to {values[LR_SCALE.name]:g} "
                         f"until step {self._lr_back[0]}")
            trial = {**trial, LR_SCALE.name: self._lr_back[1]}
        if not trial:
            return values, None
        values.update(trial)
        return values, ("; ".join(notes) + "; the checkpoint keeps "
                        + ", ".join(f"{k}={v}" for k, v in trial.items()))

    def data_state(self) -> dict[str, Any] | None:
        """The data position a checkpoint keeps.

        :class:`gpuopt.position.DataPosition`'s state by default; an integration whose
        framework positions its own data returns what it needs, or None."""
        return self.position.state_dict()

    @property
    def epoch(self) -> int:
        """Epochs the run's data (:attr:`position`) was iterated to their end.

        The 0-based index of the epoch in progress, the checkpoint's after a resume (a loop
        that counts its epochs goes on with ``for epoch in range(run.epoch, n)``)."""
        return self.position.epochs_done

    def data_reason(self, value: Any = None) -> str | None:
        """Why a resume from a checkpoint now would not train the same data as this run goes on to.

        None when it would (the ``checkpoint`` reply's warning). By default: the data must
        come through :attr:`position` (``run.loader()`` and the like), in a form that can be
        iterated again."""
        if self.position.fetched_total == 0 and self.step:
            return ("this loop's batches do not come through the run (run.loader(), "
                    "run.timed()), so the checkpoint has no data position: the loop must "
                    "put its data back itself")
        return self.position.exact_reason

    def no_position(self, data: dict[str, Any] | None) -> str | None:
        """What a resume from a checkpoint will not have as the saved run did, for ``differs``.

        A checkpoint whose :meth:`data_state` was ``data``. None: it has the data position.
        For :meth:`restore`'s ``differs``."""
        if data is None or (data["fetched_total"] == 0 and self.step):
            return ("the checkpoint has no data position (the loop's batches did not come "
                    "through the run): the loop positions its data itself")
        return None

    def restore(self, knobs: dict[str, Any], source: str, *,
                data: dict[str, Any] | None = None, differs: str | None = None,
                unbound: str = "not in this run", from_run: Any = None) -> dict[str, Any]:
        """Training thread, before training goes on from a checkpoint at :attr:`step`: restore it.

        The data position (``data``, :meth:`data_state`'s), then every knob value of
        ``knobs``; one ``resumed`` event names them all, what could not be set, and
        ``differs`` (what will not be as in the saved run), if anything; ``from_run``:
        the run that saved it (the checkpoint's ``run``), named in the event.

        Returns:
            The knobs of ``knobs`` this run does not have (yet), by name.
        """
        self.resumed_from = source
        if data is not None:
            self.position.load_state_dict(data)
        return restore_knobs(self.agent, knobs, source, self.step, unbound=unbound,
                             differs=differs, from_run=from_run)

    # ------------------------------------------------------------ pause, stop, evaluate

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` applied: a loop whose batches do not come through the run then leaves.

        A loop whose batches do not come through the run (``run.loader()``, which ends by
        itself then) leaves its loop when this is True."""
        return self.stop_requested is not None

    def _set_pause(self, value: str) -> dict[str, Any]:
        was, self._pause_requested = self._pause_requested, value == "on"
        if value == "on":
            return {"text": "the training waits at this boundary, asleep, until pause=off"
                    + (" (it was paused already)" if was else "")}
        return {"text": "the training goes on" if was else "the training was not paused"}

    def _check_stop(self, value: str) -> None:
        if value != "checkpoint":
            return
        checkpoint = self.knobs.knobs.get(CHECKPOINT.name)
        if checkpoint is None:
            raise ValueError("this run has no checkpoint command ("
                             + self.knobs.unsupported.get(CHECKPOINT.name, "none bound")
                             + "): use stop=now")
        if checkpoint.check is not None:
            checkpoint.check("now")

    def _set_stop(self, value: str) -> dict[str, Any]:
        """Training thread, at a boundary: save a checkpoint first for ``checkpoint``
        (with one rank a failed save refuses the stop, so nothing is lost; with several
        every rank stops all the same, as one rank alone must not go on), then end the
        framework's loop there (:meth:`end_loop`) with ``bye`` naming the command."""
        saved = ""
        if value == "checkpoint":
            try:
                detail = self.knobs.knobs[CHECKPOINT.name].set("now") or {}
                saved = f"; checkpoint {detail.get('text', 'saved')}"
            except Exception as exc:
                if self.agent.world_size == 1:
                    raise RuntimeError(f"the checkpoint was not saved ({exc}): the training "
                                       "goes on") from exc
                saved = (f"; the checkpoint failed on this rank ({exc}), stopped all the "
                         f"same (every one of the {self.agent.world_size} ranks stops)")
        self.stop_requested = value
        self.agent.mark_ending(f"stopped by stop={value} after step {self.step}")
        self.end_loop()
        return {"text": f"the training ends after step {self.step}{saved}"}

    def end_loop(self) -> None:
        """Training thread, at a boundary: make the framework's loop end there, cleanly.

        Its end hooks run. Nothing in the base: :meth:`stopping` is True, which the run's
        own loaders and a hand-written loop look at."""

    def bind_evaluate(self, evaluate: Callable[[], dict[str, Any] | None] | None,
                      model: torch.nn.Module | None, *, declare: str) -> None:
        """Offer ``evaluate=now``: ``evaluate()`` runs at a boundary and its metrics go to an event.

        Without ``evaluate``: refuse it, saying to give one as ``declare`` shows, e.g.
        ``agent.session(eval_fn=...)``. At the boundary it applies at, ``evaluate()`` runs
        on the training thread and its metrics (a dict of names to numbers; other values are
        left out) go to an ``evaluation`` event (:meth:`publish_evaluation`). The
        ``model``'s train/eval mode is put back after it; the next step's time leaves the
        evaluation out."""
        if evaluate is None:
            self.knobs.bind(EVALUATE, f"pass {declare} for evaluate=now to run it")
            return

        def now(value: str) -> dict[str, Any]:
            training = model.training if model is not None else None
            try:
                metrics = evaluate()  # (not None: checked above)
            finally:
                if model is not None and training is not None:
                    model.train(training)
            numbers, shown = self.publish_evaluation(self.step, metrics)
            self.agent.mark_start()  # the next step's time leaves the evaluation out
            # the metrics in the reply too: where a dashboard shows one line of events,
            # the applied event is the last, and a script's RunClient.set returns it
            return {"text": shown if numbers else f"the evaluation returned {shown}"}

        self.knobs.add(Knob(EVALUATE, get=lambda: None, set=now))

    def publish_evaluation(self, step: int, metrics: dict[str, Any] | None,
                           **fields: Any) -> tuple[dict[str, float], str]:
        """Publish an ``evaluation`` event at ``step`` with ``metrics``' numbers.

        Returns :func:`metric_numbers`'s numbers and line (call it once the evaluation
        has ended); the event has ``fields`` too, and is for the event log, the dashboard
        and the run log."""
        numbers, shown = metric_numbers(metrics)
        self.agent.event("info", f"evaluation at step {step}: {shown}",
                         kind=EventKind.EVALUATION, step=step, metrics=numbers, **fields)
        return numbers, shown

    # ------------------------------------------------------------ rollback of the state

    def live_state(self) -> Any:
        """Everything a rollback puts back, as it is now (the live tensors), or None.

        Model, optimizer, scheduler, GradScaler, random numbers, data position; None when
        this integration cannot take one. Nothing in the base: an integration that can
        overrides it with :meth:`load_snapshot`. Copies nothing (the random numbers' few
        bytes aside): :meth:`state_snapshot` copies it.

        Raises:
            Exception: why the state cannot be kept now (the rollback's event says it).
        """
        return None

    def state_snapshot(self, budget_bytes: int | None = None) -> Any:
        """A copy in host memory of :meth:`live_state` that later steps cannot change, or None.

        With ``budget_bytes``, the state's size is counted on the live tensors first and
        nothing is copied when it is larger: a state that does not fit never takes the
        host memory (or the time) of a copy.

        Raises:
            StateTooLarge: the state is larger than ``budget_bytes``.
            Exception: :meth:`live_state`'s.
        """
        live = self.live_state()
        if live is None:
            return None
        if budget_bytes is not None:
            size = _host_bytes(live)
            if size > budget_bytes:
                raise StateTooLarge(size, budget_bytes)
        return host_copy(live)

    def load_snapshot(self, snapshot: Any) -> str | None:
        """Put back :meth:`state_snapshot`'s ``snapshot`` (the training goes on from its step).

        Returns what is not as it was, or None."""
        raise NotImplementedError

    def keep_state(self, step: int) -> None:
        """Training thread, at the boundary after ``step``: keep the state there for a rollback.

        Before a guarded change that starts an episode applies.

        .. note:: Copies the state to host memory (a device sync on GPU): the training
           thread waits about the state's size over the copy bandwidth, at such a
           boundary only (a command), never at another step.
        """
        # a rollback of the episode this change starts goes back to the value before
        # it: a recovery's scaled steps that an lr_scale of an earlier episode ended
        # do not come back with it (the one this change ends, if any, comes next)
        self._lr_back_ended = None
        self._kept = None
        try:
            snapshot = self.state_snapshot(ROLLBACK_BUDGET_BYTES)
        except StateTooLarge as exc:
            self._not_kept = (f"the state ({format_bytes(exc.size_bytes)}) is larger than "
                              f"the {format_bytes(ROLLBACK_BUDGET_BYTES)} kept for rollbacks")
            return
        except Exception as exc:  # noqa: BLE001 -- said in the rollback's event
            self._not_kept = f"the state could not be kept ({type(exc).__name__}: {exc})"
            return
        if snapshot is None:
            self._not_kept = (f"{type(self).__name__} does not keep the training state for "
                              "rollbacks")
            return
        self._kept = (step, snapshot, _host_bytes(snapshot))

    def setting_applied(self, knob: str, previous: Any) -> str:
        """Training thread, at a boundary: a command set ``knob``; a recovery's lr ends.

        ``lr_scale`` while a recovery scales it, changed or not (to the scaled value
        too): the person's value holds and the recovery's timer ends (it put the value
        before the recovery back over the person's, a learning rate other than the one
        commanded); both are kept for a rollback of this setting
        (:meth:`setting_rolled_back`), as long as the episode of the change that ended
        them lasts: a further lr_scale of that episode leaves them kept (its rollback
        goes back to the value before the first), one that starts an episode drops
        them (:meth:`keep_state`). Returns what the applied event says of it (``""`` or
        ``"; ..."``)."""
        if knob != LR_SCALE.name:
            return ""
        ended, self._lr_back = self._lr_back, None
        if ended is None:
            return ""
        self._lr_back_ended = (previous, ended)
        return "; the recovery's scaled lr ends: lr_scale is this value from now on"

    def setting_rolled_back(self, knob: str, value: Any) -> str:
        """Training thread, at a boundary: a rollback set ``knob`` back to ``value``.

        The rollback of the person's ``lr_scale`` that ended a recovery's scaled steps
        (back to their scaled value) puts their end back: the value before the
        recovery returns after the step it was planned for (at once when that step has
        passed; a rollback of the state too, then at once, as any rewind ends them), not
        never. Returns what the rolled-back event says of it (``""`` or ``"; ..."``)."""
        if knob != LR_SCALE.name or self._lr_back_ended is None:
            return ""
        (scaled, lr_back), self._lr_back_ended = self._lr_back_ended, None
        if value != scaled or self._lr_back is not None:
            return ""
        if self.step >= lr_back[0]:  # (an out-of-memory rollback, after the planned end:
            # the step retried must not train at the scaled value)
            return self._lr_scale_back(
                lr_back[1], f"the recovery's scaled steps ended after step {lr_back[0]}",
                " now")
        self._lr_back = lr_back
        return (f"; the recovery's scaled steps come back with it: lr_scale back to "
                f"{lr_back[1]:g} after step {lr_back[0]}")

    def restore_state(self, step: int, cause: str = "a rollback") -> tuple[str, str]:
        """Training thread, after a rollback set the knobs back: put the kept state back.

        At the boundary before ``step``; the kept state (see
        :class:`agent.control.ledger.StateKeeper`) goes back through :meth:`rewind_state` (a
        new branch, source ``rollback``; ``cause``: why). With several ranks, every rank
        calls it at that boundary and they agree first (one collective): unless every
        rank holds a state of the same step, none is put back, and the event names each
        rank's."""
        kept, self._kept = self._kept, None
        # one rank alone must not go back: every rank holds a state of one step, or none
        # is put back (a copy failed, or went over the budget, on one)
        ranks = every_rank((None if kept is None else kept[0],
                            self._not_kept or "no state was kept"), self.device)
        held = {kept_step for kept_step, _ in ranks}
        if None in held or len(held) > 1:
            why = (ranks[0][1] if len(ranks) == 1 else "; ".join(
                f"rank {rank}: " + (text if kept_step is None else f"kept step {kept_step}")
                for rank, (kept_step, text) in enumerate(ranks)))
            return "warning", (f"the weights were not restored ({why}): training goes on "
                               "from them with the previous setting")
        assert kept is not None  # (every rank holds one)
        kept_step, snapshot, size = kept
        again = self.step - kept_step
        try:
            _, differs = self.rewind_state(snapshot, kept_step, source="rollback",
                                           cause=cause)
        except Exception as exc:  # noqa: BLE001 -- said in the event, training goes on
            return "error", (f"restoring the state of step {kept_step} failed "
                             f"({type(exc).__name__}: {exc}): training goes on from the "
                             "state as it was, with the previous setting")
        text = (f"state restored to the boundary after step {kept_step}, where the change "
                f"applied: model, optimizer, schedule, GradScaler, random numbers and data "
                f"position ({format_bytes(size)} kept in host memory); {again} steps will "
                "be trained again")
        return "warning", text + (f"; not as before: {differs}" if differs else "")

    # ------------------------------------------------------------ rewind and branches

    def rewind_state(self, snapshot: Any, step: int, *, source: str, cause: str,
                     knobs: dict[str, Any] | None = None,
                     drop: int = 0) -> tuple[int, str | None]:
        """Training thread, at an optimizer-step boundary: put ``snapshot`` back, on a new branch.

        ``snapshot`` is :meth:`state_snapshot`'s, taken at the boundary after ``step``; it
        is put back with :meth:`load_snapshot`, :attr:`step` is set to ``step``, and one
        ``branched`` event (``branch``, ``parent``, ``step``, ``source``, ``cause``,
        ``knobs``) is published before any step record of the new branch. ``knobs``: the
        knob values that come back with the state (a checkpoint's), set after it and named
        in the event; without them, the event names the settings the state itself put
        back (a Trainer's, an optimizer's weight decay: ``back as at step 20:
        weight_decay=0.0``), so that a change made since is not undone unsaid. The states
        ``recover=on`` kept on the branch left go with it, and so does a recovery's
        scaled lr unless this is that recovery (:meth:`_leave_branch`). Each pending
        command then keeps its distance from now
        (:meth:`agent.step.core.Agent.rewound`: a ``rescheduled`` event each). ``drop``:
        micro-batches the data then draws and drops (:meth:`drop_micro_batches`, a
        recovery's skip), within the load's all or nothing.

        All or nothing, on every rank: a host copy of the state as it is (within
        :data:`ROLLBACK_BUDGET_BYTES`) is taken first; when :meth:`load_snapshot` (or the
        drop after it) fails on any rank (a checkpoint of another model loads its matching
        layers, then raises), every rank puts that copy back (the data position with it:
        no rank drops) and raises, and the training goes on as if nothing happened. When
        the ranks cannot agree (a rank gone: its collective raises), each rank that can
        puts its copy back and raises as well. Where no copy could be taken, or putting
        it back failed, the run stops at this boundary (an error event says why): it
        would train on from a state that never existed. Every other rank stops there
        too, told by a second collective (on this failure path only): it would wait for
        the stopped rank in its training's next collective (a hang).

        Returns:
            ``(the new branch's id, what is not as it was or None)``.

        Raises:
            Exception: what :meth:`load_snapshot` (or the drop) raised on this rank, or a
                RuntimeError naming the rank it failed on, or the agreement that failed
                (no new branch then; the state as it was).

        .. note:: A collective (:func:`agent.integrations.ranks.agree`) with several
           ranks, two when the load failed: every rank calls them at the same boundary.
           Copies the state to host memory once (a device sync on GPU), at this boundary
           only.
        """
        before = self.agent.knobs.values() if knobs is None else {}
        differs = self._load_on_every_rank(snapshot, drop)
        self.step = step
        self._kept = None  # a state kept for a rollback belongs to the branch left
        parent, self.branch = self.branch, self._last_branch + 1
        self._last_branch = self.branch
        text = f"branch {self.branch} of branch {parent} at step {step}: {source} ({cause})"
        text += self._leave_branch(step, source, knobs is not None)
        failed: list[str] = []
        if knobs is not None:
            restored, failed, absent = set_knobs(self.agent, knobs)
            text += knobs_text(restored, failed, absent)
        else:  # the state's own settings (a Trainer's, an optimizer's weight decay)
            back = [assignment(name, value) for name, value in self.agent.knobs.values(
                ).items() if name in before and before[name] != value]
            if back:
                text += f"; back as at step {step}: " + ", ".join(back)
        if differs:
            text += f"; not as before: {differs}"
        self.agent.event("warning" if failed or differs else "info", text,
                         kind=EventKind.BRANCHED, branch=self.branch, parent=parent,
                         step=step, source=source, cause=cause, knobs=knobs or {})
        self.agent.rewound(step, self.branch)  # (the pending commands' events follow)
        return self.branch, differs

    def _leave_branch(self, step: int, source: str, other_lineage: bool) -> str:
        """Training thread, in :meth:`rewind_state`: what the recovery kept of the branch
        left goes with it. The states it kept past ``step`` are dropped (all of them
        when the state put back is a checkpoint's, ``other_lineage``: then one is kept
        at ``step`` itself); a rewind that is not a recovery (``source``) ends the
        recovery's scaled lr (``lr_scale`` back to the value before it) and its count of
        repeats. Returns what the ``branched`` event says of it ("" or ``"; ..."``)."""
        if other_lineage:
            self._ring.clear()
        while self._ring and self._ring[-1][0] > step:
            self._ring.pop()
        if self._recovering and other_lineage:
            self._keep_for_recovery(force=True)
        if source == "recovery":
            return ""
        self._recovered_to, self._repeats, self._lr_back_ended = None, 0, None
        if self._lr_back is None:
            return ""
        value, self._lr_back = self._lr_back[1], None
        return self._lr_scale_back(value, "the recovery's scaled lr ends")

    def _lr_scale_back(self, value: float, why: str, when: str = "") -> str:
        """Training thread, at a boundary: ``lr_scale`` back to ``value``, the value before
        a recovery scaled it. Returns what the event says of it: ``"; {why}: lr_scale
        back to {value}{when}"``, or that the knob refused it (the lr stays as it is)."""
        try:
            self.knobs.knobs[LR_SCALE.name].set(value)
        except Exception as exc:  # noqa: BLE001 -- said in the event
            return (f"; lr_scale could not go back to {value:g} after the recovery "
                    f"({type(exc).__name__}: {exc})")
        self.agent.refresh_knobs()
        return f"; {why}: lr_scale back to {value:g}{when}"

    def _load_on_every_rank(self, snapshot: Any, drop: int = 0) -> str | None:
        """:meth:`load_snapshot` of ``snapshot``, then the ``drop`` of micro-batches
        (:meth:`drop_micro_batches`), on every rank, or on none (see
        :meth:`rewind_state`); returns the load's answer."""
        try:
            safe, unsafe = self.state_snapshot(ROLLBACK_BUDGET_BYTES), ""
        except StateTooLarge as exc:
            safe, unsafe = None, (f"the state ({format_bytes(exc.size_bytes)}) is larger "
                                  f"than the {format_bytes(ROLLBACK_BUDGET_BYTES)} a copy "
                                  "may take")
        except Exception as exc:  # noqa: BLE001 -- the load may still go well
            safe, unsafe = None, f"it could not be copied ({type(exc).__name__}: {exc})"
        error: Exception | None = None
        differs = None
        try:
            differs = self.load_snapshot(snapshot)
            if drop:  # (a rank that drops trains other data than one that does not)
                self.drop_micro_batches(drop)
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it first
            error = exc
        agreed = True
        try:
            failure = agree(None if error is None else f"{type(error).__name__}: {error}",
                            self.device)
        except Exception as exc:  # noqa: BLE001 -- a rank gone: what the others did is
            failure = f"the agreement of the ranks ({type(exc).__name__}: {exc})"  # unknown
            agreed = False
        if failure is None:
            return differs
        stuck: str | None = None  # this rank's put-back's failure
        try:
            if safe is None:
                raise RuntimeError(unsafe or "nothing was kept")
            self.load_snapshot(safe)
        except Exception as exc:  # noqa: BLE001 -- the run cannot go on from here
            stuck = f"{type(exc).__name__}: {exc}" if safe is not None else str(exc)
        if agreed:  # every rank stops if one does: the others would wait on it
            try:  # in their next collective
                stuck = agree(stuck, self.device)
            except Exception as exc:  # noqa: BLE001 -- a rank gone since: its state is
                stuck = f"the agreement of the ranks ({type(exc).__name__}: {exc})"
        elif stuck is not None:
            stuck = f"rank {self.agent.rank}: {stuck}"
        if stuck is not None:
            self._stop_partly_put_back(failure, stuck)
        if error is not None:
            raise error
        raise RuntimeError(f"putting the state back failed on {failure}: the state is as "
                           "it was on this rank")

    def _stop_partly_put_back(self, failure: str, stuck: str) -> None:
        """Training thread, in :meth:`_load_on_every_rank`: stop at this boundary, on
        every rank that hears of it (all, but where the agreement itself failed).

        Putting a state back failed (``failure``, the first rank's) and the state as it
        was could not be put back (``stuck``: on which rank, and why): that rank would
        train on from a state that never existed, and a rank that could put its state
        back would wait for it in the next collective. An error event says why."""
        self.stop_requested = "now"
        self.agent.mark_ending(f"stopped after step {self.step}: the state is partly put "
                               "back")
        self.end_loop()
        self.agent.event("error", f"putting a state back failed ({failure}) and the state "
                         f"as it was could not be put back either ({stuck}): the training "
                         f"stops after step {self.step} on every rank rather than train on "
                         "from a state that never existed", kind=EventKind.WARNING,
                         step=self.step)

    def read_checkpoint(self, path: Path) -> tuple[Any, int, dict[str, Any]]:
        """Read the checkpoint at ``path`` into :meth:`state_snapshot`'s form, for ``rewind``.

        Read in this integration's own format, through the code its resume uses:
        ``(snapshot, the optimizer step it holds, its knob values)``. Training thread, at a
        boundary; reads the file (about its size over the disk's read speed). Nothing in the
        base: an integration that can overrides it (and :meth:`rewind_refusal`).

        Raises:
            Exception: it is not such a checkpoint, or cannot be read.
        """
        raise NotImplementedError

    def rewind_refusal(self) -> str | None:
        """Why this run cannot load a checkpoint live (``rewind`` is refused with it), or None.

        By default: unless the integration reads its checkpoints (:meth:`read_checkpoint`)."""
        if type(self).read_checkpoint is RunBase.read_checkpoint:
            return f"{type(self).__name__} does not load a checkpoint into a live run"
        return None

    def _bind_rewind(self) -> None:
        """Offer ``rewind`` (or refuse it with :meth:`rewind_refusal`'s reason)."""
        if REWIND.name in self.knobs.knobs:
            return
        reason = self.rewind_refusal()
        if reason is not None:
            self.knobs.bind(REWIND, reason)
            return
        self.knobs.add(Knob(REWIND, get=lambda: None, set=self._rewind,
                            check=self._check_rewind))

    def _check_rewind(self, value: str) -> None:
        self._checked_checkpoint(value, whole=False)

    def _checked_checkpoint(self, value: str, *, whole: bool = True) -> Path:
        """``rewind``'s value as the checkpoint it names: an integer N is the one the
        ``checkpoint`` command saved at step N (its directory and name), anything else
        an absolute path; returned with its parents' symlinks resolved, once no other
        user can have written or swap it (:func:`agent.control.checkpoints.own_checkpoint`,
        with ``whole``: not ``whole``, a command's check on the I/O thread, looks at the
        checkpoint and its directory only). Any thread: file-system calls, no read (a
        missing step's refusal lists the checkpoint directory's names, to say which
        steps were saved).

        Raises:
            ValueError: :meth:`rewind_refusal`'s reason (one that came since ``rewind`` was
                bound), no such checkpoint, a symlink (not followed), not readable, another
                user's or in reach of another user.
        """
        reason = self.rewind_refusal()
        if reason is not None:
            raise ValueError(reason)
        if _STEP.fullmatch(value):
            if self._checkpoints is None:
                raise ValueError(
                    "this run has no checkpoint command ("
                    + self.knobs.unsupported.get(CHECKPOINT.name, "none bound")
                    + ") to have saved a step: give a checkpoint's absolute path")
            wanted: int | None = int(value)
            path = self._checkpoints.path(int(value))
        else:
            wanted = None
            path = Path(value)
            if not path.is_absolute():
                raise ValueError(f"{value!r} is neither a step nor an absolute path (the "
                                 "training process's working directory is not yours)")
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if wanted is None:
                raise ValueError(f"no checkpoint at {path}") from None
            assert self._checkpoints is not None  # (a step names one it saved)
            raise ValueError(f"the checkpoint command saved no step {wanted} (no {path})"
                             + _saved_steps_text(self._checkpoints.saved_steps(), wanted)
                             ) from None
        except OSError as exc:
            raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
        if stat.S_ISLNK(mode):
            raise ValueError(f"{path} is a symlink, which is not followed: give its target")
        if not os.access(path, os.R_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)):
            raise ValueError(f"{path} is not readable by the training process")
        try:
            return own_checkpoint(path, whole=whole)
        except OSError as exc:
            raise ValueError(f"{path} cannot be examined: {exc.strerror or exc}") from None

    def _rewind(self, value: str) -> dict[str, Any]:
        """Training thread, at a boundary: read the checkpoint ``value`` names and go on
        from it as a new branch (:meth:`rewind_state`, with its knob values). With
        several ranks every rank reads its copy and they agree first: if one cannot,
        every rank refuses (nothing changes on any)."""
        error: Exception | None = None
        try:
            path = self._checked_checkpoint(value)
            snapshot, step, knobs = self.read_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 -- every rank must hear of it first
            error = exc
        failure = agree(None if error is None else f"{type(error).__name__}: {error}",
                        self.device)
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"{failure}: no rank rewinds, the training goes on")
        branch, _ = self.rewind_state(snapshot, step, source=str(path),
                                      cause=assignment(REWIND.name, value), knobs=knobs)
        return {"text": f"branch {branch} goes on from step {step} of {path}",
                "branch": branch, "checkpoint_step": step, "path": str(path)}

    # ------------------------------------------------------------ loss-spike recovery

    def _set_recover(self, value: str) -> dict[str, Any]:
        """``recover=on``: keep the state at this boundary at once (refused with the
        reason where it cannot be kept: with several ranks, on every rank where it
        cannot on one, which the reason names); ``off``: drop the kept states."""
        if value == "off":
            self._recovering = self.agent.spikes.on = False
            self.agent.spikes.rearm()
            self._ring.clear()
            self._window_ends.clear()
            self._recovered_to, self._repeats = None, 0
            return {"text": "no state is kept for recoveries"}
        if not self._recovering:
            self._keep_for_recovery(force=True)
        # one rank alone must not recover: every rank keeps its state, or none turns on
        failure = agree(None if self._ring else self._ring_not_kept, self.device)
        if failure is not None:
            if not self._recovering:
                self._ring.clear()
            raise ValueError(self._ring_not_kept if self.agent.world_size == 1 else
                             f"{failure}: no rank turns recover on")
        self._recovering = self.agent.spikes.on = True
        step, _, size, _ = self._ring[-1]
        return {"text": f"{self.agent.recovery.describe()}; the state after step {step} "
                        f"kept ({format_bytes(size)} in host memory)"}

    def _keep_for_recovery(self, *, force: bool = False) -> None:
        """Training thread, at the boundary after :attr:`step`: keep a host copy of the
        state there when the policy's ``keep_every_steps`` says so (or ``force``),
        dropping the oldest copies beyond ``keep_states`` or the byte budget: before the
        copy is made (as large as the latest one, it is taken to be), so that at no time
        more than ``keep_states`` copies are held, nor more than the budget (the
        ring full and a new copy beside it were one state more than the policy says; a
        copy that then fails has cost the oldest state).

        .. note:: Copies the state to host memory (on GPU a device sync): the training
           thread waits about the state's size over the copy bandwidth at these
           boundaries only.
        """
        policy = self.agent.recovery
        if not force and (self.step % policy.keep_every_steps
                          or (self._ring and self._ring[-1][0] == self.step)):
            return
        started = time.perf_counter()
        self._drop_kept(policy, self._ring[-1][2] if self._ring else 0)
        try:
            snapshot = self.state_snapshot(policy.budget_bytes)
        except StateTooLarge as exc:
            self._ring_not_kept = (f"the state ({format_bytes(exc.size_bytes)}) is larger "
                                   f"than the {format_bytes(policy.budget_bytes)} budget of "
                                   "Recovery")
            return
        except Exception as exc:  # noqa: BLE001 -- said when a recovery needs it
            self._ring_not_kept = (f"the state could not be kept at step {self.step} "
                                   f"({type(exc).__name__}: {exc})")
            return
        if snapshot is None:
            self._ring_not_kept = (f"{type(self).__name__} keeps no training state to go "
                                   "back to")
            return
        size = _host_bytes(snapshot)
        self._drop_kept(policy, size)  # (larger than the one before)
        self._ring.append((self.step, snapshot, size, self._micro_batches_trained))
        self._ring_not_kept = ""
        self.agent.mark_start()  # the next step's time leaves the copy out
        log.debug("kept the state of step %d for recoveries (%s, %.3f s)", self.step,
                  format_bytes(size), time.perf_counter() - started)

    def _drop_kept(self, policy: Recovery, size: int) -> None:
        """Drop the oldest kept states until one more of ``size`` bytes fits the policy."""
        ring = self._ring
        while ring and (len(ring) >= policy.keep_states
                        or sum(kept[2] for kept in ring) + size > policy.budget_bytes):
            ring.popleft()

    def _recovery_step(self) -> None:
        """Training thread, at each boundary while recovering or the lr is scaled: keep
        the state when due, and put the lr back when its steps are over."""
        if self._lr_back is not None and self.step >= self._lr_back[0]:
            value = self._lr_back[1]
            self._lr_back = None
            self.knobs.knobs[LR_SCALE.name].set(value)
            self.agent.refresh_knobs()
            self.agent.event("info", f"lr_scale back to {value:g} after step {self.step}, "
                             "as the recovery planned", kind=EventKind.APPLIED,
                             knob=LR_SCALE.name, value=value, step=self.step + 1)
        if self._recovering:
            self._keep_for_recovery()
            ends = self._window_ends
            while ends and ends[-1][0] >= self.step:  # of a branch left
                ends.pop()
            while ends and self._ring and ends[0][0] < self._ring[0][0]:
                ends.popleft()
            ends.append((self.step, self._micro_batches_trained))

    def recover(self, step: int, before: int, reason: str) -> None:
        """Training thread: go back to the latest state kept before a spike began at ``before``.

        At the boundary after ``step``; the spike began at step ``before`` (``reason``: what
        rank 0 saw). The kept state goes back through :meth:`rewind_state` (a new branch
        from that step) with the data position as it is now, so that the data goes on past
        every micro-batch trained since (the ones that led to the spike among them); scale
        ``lr_scale`` for ``lr_steps`` steps; one ``branched`` event says what was restored,
        skipped and changed (a warning says why not, when nothing was kept before it).
        A spike beginning within :attr:`Recovery.repeat_span_steps` of the last
        recovery's fork is a repeat; one past :attr:`Recovery.max_repeats` repeats in a
        row is not recovered: ``recover`` goes off, with one warning.

        With several ranks every rank recovers, or none does: they agree on the state
        kept (:meth:`_kept_on_every_rank`), then on whether each can go back to it (its
        count of the windows to skip, its data position, the drop, the repeats:
        :meth:`_plan_recovery`), and the first rank that cannot says why for every rank
        (``rank N: ...``, the same warning on each); then the load and the drop
        (:meth:`rewind_state`, all or nothing) and the lr's scaling
        (:meth:`_scale_lr_on_every_rank`).

        .. note:: Collectives (:mod:`agent.integrations.ranks`), two to four, that every
           rank calls at this boundary. Copies the state now (its data position is
           kept), then loads the kept one: the training thread waits about twice the
           state's copy time, at this boundary only.
        """
        policy, spikes = self.agent.recovery, self.agent.spikes
        kept, why = self._kept_on_every_rank(before)
        if kept is None:
            spikes.rearm()
            self.agent.event("warning", f"{reason}; not recovered: {why}",
                             kind=EventKind.WARNING, step=step)
            return
        last = self._recovered_to
        repeats = (self._repeats + 1 if last is not None
                   and before <= last + policy.repeat_span_steps else 0)
        plan: _Recovery | tuple[str, str, bool]
        if repeats > policy.max_repeats:
            plan = ("warning", f"the spike recurs after {repeats} recoveries in a row (each "
                    f"within {policy.repeat_span_steps} steps of the last one's fork at step "
                    f"{last}): its cause is not in the skipped data; recover is off, the "
                    "training goes on", True)
        else:
            try:
                plan = self._plan_recovery(kept, step)
            except Exception as exc:  # noqa: BLE001 -- every rank must hear of it first
                plan = ("error", f"the recovery could not be planned ({type(exc).__name__}: "
                        f"{exc})", False)
        # one rank alone must not go back (nor wait alone in the load's collective for
        # the ranks that left): every rank recovers, or none does
        refusals = [(rank, refusal) for rank, refusal in enumerate(every_rank(
            None if isinstance(plan, _Recovery) else plan, self.device)) if refusal is not None]
        if refusals:
            rank, (level, text, off) = refusals[0]
            if off:
                self._set_recover("off")
                self.agent.refresh_knobs()
            else:
                spikes.rearm()
            if self.agent.world_size > 1:
                text = f"rank {rank}: {text}" + ("" if off else "; no rank goes back")
            self.agent.event(level, f"{reason}; not recovered: {text}",
                             kind=EventKind.WARNING, step=step,
                             **({"knob": RECOVER.name} if off else {}))
            return
        assert isinstance(plan, _Recovery)  # (no rank refused, this one neither)
        kept_step, _, size, _ = kept
        cause = (f"{reason}; restored the state kept after step {kept_step} "
                 f"({format_bytes(size)} in host memory); {plan.text}")
        recovered = True
        try:
            self.rewind_state(plan.snapshot, kept_step, source="recovery", cause=cause,
                              drop=plan.drop)
        except Exception as exc:  # noqa: BLE001 -- said in the event, training goes on
            recovered = False
            spikes.rearm()
            self.agent.event("error", f"{reason}; putting back the state of step "
                             f"{kept_step} failed ({type(exc).__name__}: {exc}): not "
                             "recovered", kind=EventKind.WARNING, step=step)
        if policy.lr_scale != 1 and policy.lr_steps:  # (after: a state may hold the
            # lr_scale it had then; every rank, recovered or not: a collective)
            self._scale_lr_on_every_rank(plan.lr_to, kept_step, step, recovered)
        if not recovered:
            return
        self._recovered_to, self._repeats = kept_step, repeats
        self.skipped_windows += plan.windows
        self.agent.refresh_knobs()

    def _plan_recovery(self, kept: tuple[int, Any, int, int],
                       step: int) -> _Recovery | tuple[str, str, bool]:
        """Training thread, in :meth:`recover`: this rank's recovery to ``kept`` (a state
        :meth:`_kept_on_every_rank` found) at the boundary after ``step``, or why it
        cannot go back: ``(the event's level, why, False)``.

        The windows to skip (:meth:`_skip_plan`), the kept state with the data position
        as it is now (a copy of that part), the drop's refusal (:meth:`drop_refusal`)
        and the lr's scaling. Changes nothing.

        Raises:
            Exception: what counting the windows or reading the lr raised.
        """
        kept_step, snapshot, _, _ = kept
        skip = self._skip_plan(kept_step, step)
        if isinstance(skip, str):
            return "warning", skip, False
        windows, drop, skipped_text = skip
        try:
            if windows >= step - kept_step:  # the data as it is now, then any drop
                now = self.live_state()  # (the data position's part only is copied)
                snapshot = {**snapshot,
                            **{key: host_copy(now[key]) for key in self.recovery_data_keys}}
            refusal = self.drop_refusal(snapshot, drop) if drop else None
        except Exception as exc:  # noqa: BLE001 -- said in the event, training goes on
            return "error", (f"the data position could not be read ({type(exc).__name__}: "
                             f"{exc})"), False
        if refusal is not None:
            return "warning", (f"skip_windows={windows} needs {drop} micro-batches drawn and "
                               f"dropped, and {refusal}"), False
        policy = self.agent.recovery
        lr_text, lr_knob, lr_to = "", self.knobs.knobs.get(LR_SCALE.name), None
        if policy.lr_scale != 1 and policy.lr_steps:
            if lr_knob is None:
                lr_text = "; the lr is not scaled (" + self.knobs.unsupported.get(
                    LR_SCALE.name, "this run has no lr_scale knob") + ")"
            else:  # (a recovery during the scaled steps scales the value before them)
                base = self._lr_back[1] if self._lr_back is not None else lr_knob.get()
                lr_to = (base, base * policy.lr_scale)
                lr_text = f"; lr_scale {base:g} -> {lr_to[1]:g} for {policy.lr_steps} steps"
        return _Recovery(snapshot, windows, drop, skipped_text + lr_text, lr_to)

    def _scale_lr_on_every_rank(self, lr_to: tuple[float, float] | None, kept_step: int,
                                step: int, recovered: bool) -> None:
        """Training thread, in :meth:`recover` after the load at the boundary after
        ``step``: set ``lr_scale`` from ``lr_to[0]`` to ``lr_to[1]`` until
        ``lr_steps`` after ``kept_step``, on every rank or on none.

        One collective (:func:`agent.integrations.ranks.agree`) that every rank calls,
        ``recovered`` or not (this rank's load went well; ``lr_to`` None: no lr_scale
        knob, nothing to set): where the setting failed on one rank, or one did not
        recover, a rank that set it puts its value back, and an error event says so
        (ranks that train at different learning rates split, as DDP replicas would).
        """
        knob = self.knobs.knobs[LR_SCALE.name] if lr_to is not None else None
        error, was = (None if recovered else "it did not recover"), None
        if recovered and knob is not None and lr_to is not None:
            try:
                was = knob.get()
                knob.set(lr_to[1])
            except Exception as exc:  # noqa: BLE001 -- every rank must hear of it first
                error, was = f"{type(exc).__name__}: {exc}", None
        failure = agree(error, self.device)
        if failure is None:
            if lr_to is not None:
                self._lr_back = (kept_step + self.agent.recovery.lr_steps, lr_to[0])
                self._lr_back_ended = None
            return
        if not recovered or lr_to is None:
            return  # (this rank's event says why: it did not recover)
        where = error if self.agent.world_size == 1 else f"{failure}; no rank scales it"
        text = f"lr_scale={lr_to[1]:g} after the recovery failed ({where}): the lr stays as it is"
        if knob is not None and was is not None:
            try:
                knob.set(was)
            except Exception as exc:  # noqa: BLE001 -- said in the event
                text += (f", but lr_scale could not go back to {was:g} on this rank "
                         f"({type(exc).__name__}: {exc}): its lr differs from the others'")
        self.agent.event("error", text, kind=EventKind.FAILED, knob=LR_SCALE.name, step=step)

    def _skip_plan(self, kept_step: int, step: int) -> tuple[int, int, str] | str:
        """What a recovery from the state kept after ``kept_step``, at the boundary after
        ``step``, skips: ``(windows, micro-batches to draw and drop, the event's words)``
        (:attr:`Recovery.skip_windows`), or why it cannot be counted.

        ``windows`` at least those trained since (``step - kept_step``): the data as it
        is now, then the micro-batches of the windows beyond them (each of the last
        window's size) dropped; fewer: the kept state's data, then the micro-batches of
        its first ``windows`` windows dropped."""
        trained = step - kept_step
        windows = self.agent.recovery.skip_windows
        ends = dict(self._window_ends)
        ends[step] = self._micro_batches_trained  # (this boundary's: counted, not noted)
        if kept_step not in ends:
            return (f"the windows trained since step {kept_step} were not counted (kept "
                    f"from step {min(ends, default=step)})")
        since = ends[step] - ends[kept_step]
        if windows is None or windows == trained:
            return trained, 0, (f"skipped the {since} micro-batches ({trained} windows) "
                                "trained since")
        if windows < trained:
            drop = ends[kept_step + windows] - ends[kept_step]
            return windows, drop, (
                f"skipped {drop} micro-batches ({windows} windows) from it; the "
                f"{since - drop} after them ({_windows(trained - windows)}) are trained "
                "again")
        last = ends[step] - ends.get(step - 1, ends[step])
        drop = (windows - trained) * last
        return windows, drop, (
            f"skipped {since + drop} micro-batches ({windows} windows) from it: the "
            f"{since} trained since ({_windows(trained)}) and {drop} more drawn and "
            f"dropped ({_windows(windows - trained)} of {last})")

    def drop_refusal(self, snapshot: Any, micro_batches: int) -> str | None:
        """Why the data cannot skip ``micro_batches`` from ``snapshot``'s position, or None.

        ``snapshot``: :meth:`state_snapshot`'s, about to be put back. By default the
        batches must come through :attr:`position` (``run.loader()``, ``run.timed()``),
        whose iteration draws and drops them."""
        if self.position.fetched_total == 0:
            return ("this loop's batches do not come through the run (run.loader(), "
                    "run.timed()), which would draw and drop them")
        return None

    def drop_micro_batches(self, micro_batches: int) -> None:
        """Training thread, after a recovery: draw the next ``micro_batches`` and drop them.

        After a recovery put a state back: they are drawn from the loader, untrained. By
        default through :attr:`position` (:meth:`gpuopt.position.DataPosition.drop`):
        as the iteration goes on, before the next micro-batch it yields."""
        self.position.drop(micro_batches)

    def _kept_on_every_rank(self, before: int) -> tuple[tuple[int, Any, int, int] | None, str]:
        """Training thread, in :meth:`recover`: the latest state kept before step ``before``
        that every rank holds (one collective, :func:`agent.integrations.ranks.every_rank`,
        of the steps each kept), or None and why (every rank's part in it: the same text
        on each). A rank whose copy at a step failed, or went over its budget, holds an
        older one: the ranks go back to one step or none does."""
        kept_steps = [entry[0] for entry in self._ring if entry[0] < before]
        if not self._recovering:
            mine = "recover is off"
        else:
            mine = ("kept: " + (", ".join(f"step {entry[0]}" for entry in self._ring)
                                or "none")
                    + (f"; {self._ring_not_kept}" if self._ring_not_kept else ""))
        ranks = every_rank((kept_steps if self._recovering else [], mine), self.device)
        common = set(ranks[0][0]).intersection(*(set(steps) for steps, _ in ranks[1:]))
        if common:
            step = max(common)
            return next(entry for entry in self._ring if entry[0] == step), ""
        if len(ranks) == 1:
            return None, ("recover is off on this rank" if not self._recovering else
                          f"no state was kept before step {before} ({mine})")
        return None, (f"no state kept before step {before} is held by every rank (one "
                      "rank alone must not go back): " + "; ".join(
                          f"rank {rank} {text}" for rank, (_, text) in enumerate(ranks)))

    #: the keys of :meth:`state_snapshot`'s dict that hold the data position and the
    #: random numbers (which draw random batches and the next epoch's order): a
    #: recovery puts back the rest of a kept state and these as they are now, so the
    #: data goes on as the run without the recovery would have had it
    recovery_data_keys: tuple[str, ...] = ("data", "rng")

    # ------------------------------------------------------------ the end

    def start(self) -> None:
        """Announce the knobs, start the agent and the first step's clock, close on any process end.

        Every way the process ends closes this run (:func:`end_on_signals`)."""
        self._bind_rewind()
        self.agent.refresh_knobs()
        self.agent.start()
        self.agent.mark_start()
        end_on_signals(self)

    def uninstall(self) -> None:
        """Put back what the integration patched in its framework.

        Called once, by :meth:`close`, before ``bye``. Nothing in the base."""

    def close(self, reason: str = "finished") -> None:
        """End the run: :meth:`uninstall`, then ``bye`` with ``reason`` and the run file removed.

        Idempotent; any exit path calls it (see :func:`end_on_signals`). An exit hook
        registered for it (accelerate's) goes: it would hold the closed run, its model
        and optimizer, until the process ended."""
        atexit.unregister(self.close)
        if self.closed:
            return
        self.closed = self.closing = True
        try:
            try:
                self.uninstall()
            except Exception as exc:  # noqa: BLE001 -- closing must go on
                self.agent.report_error("putting the framework back", exc)
            self.agent.close(reason)
        finally:
            self.closing = False
        if _sigterm_waiting:  # a SIGTERM came during this close: it is handled now
            os.kill(os.getpid(), signal.SIGTERM)

    def fail(self, where: str, exc: BaseException) -> None:
        """Stop observing after an internal error (``where``: what failed); an error event says so.

        Training goes on, untouched."""
        self.broken = True
        message = (f"gpuwatch agent: {where} failed: {type(exc).__name__}: {exc}; the run "
                   "is no longer observed (training continues)")
        log.warning(message)
        self.agent.event("error", message, kind=EventKind.AGENT_ERROR)

    def __enter__(self) -> "RunBase":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close(ending_reason(exc_info[1]))


def _windows(count: int) -> str:
    """``1 window``, ``3 windows``: a count of accumulation windows in words."""
    return f"{count} window" + ("" if count == 1 else "s")


#: ``rewind``'s value when it names a step
_STEP = re.compile(r"[0-9]{1,12}")
#: How long a SIGTERM that came during an import waits to be handled again (s).
SIGTERM_RETRY_S = 0.01
#: Runs not yet closed, for the process-wide exit paths below.
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_exit_paths_installed = False
#: A SIGTERM came while a run was closing: the close sends it again once done.
_sigterm_waiting = False


def _close_live(reason: str) -> None:
    for run in list(_LIVE):
        run.close(reason)


def end_on_signals(run: Any) -> None:
    """End ``run`` cleanly on SIGTERM where nobody handles it yet, and name uncaught exceptions.

    ``run``: anything with ``close(reason)``. SIGTERM is torchrun's and schedulers' stop;
    the process then dies of it as before; an uncaught exception is named in ``bye``. The
    hooks are installed once per process; a normal exit is the agent's ``atexit``."""
    global _exit_paths_installed
    _LIVE.add(run)
    if _exit_paths_installed:
        return
    _exit_paths_installed = True
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        _close_live(ending_reason(error))
        previous_hook(kind, error, tb)

    sys.excepthook = excepthook
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script's own handler decides (it may raise, then excepthook names it)

    def on_sigterm(signum: int, frame: Any) -> None:
        if _imp.lock_held():
            # interrupted inside an import (accelerate looks for packages at every
            # optimizer step): the I/O thread may be waiting for that lock to finish its
            # own, and closing here waits for the I/O thread, so neither would move until
            # the close timed out and the run log lost its bye. Come back in a moment.
            threading.Timer(SIGTERM_RETRY_S, os.kill, (os.getpid(), signal.SIGTERM)).start()
            return
        if any(getattr(live, "closing", False) for live in list(_LIVE)):
            # it interrupted a run's close (a framework's own SIGTERM handling, Lightning's,
            # ended the run): dying now would cut that close short, without its bye and
            # with its run file left. The close sends the signal again when it is done.
            global _sigterm_waiting
            _sigterm_waiting = True
            return
        _close_live("stopped by SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the exit status says SIGTERM, as before

    signal.signal(signal.SIGTERM, on_sigterm)


#: Saved steps a refused ``rewind=N`` names at most (those nearest N).
MAX_NAMED_STEPS = 6


def _saved_steps_text(steps: list[int], wanted: int) -> str:
    """What a refused ``rewind=N`` adds: the saved steps nearest ``wanted``, in order.

    ``; saved: steps 707, 806``, or that none is saved yet."""
    if not steps:
        return "; none saved yet (checkpoint=now saves one)"
    nearest = sorted(sorted(steps, key=lambda step: abs(step - wanted))[:MAX_NAMED_STEPS])
    shown = ", ".join(str(step) for step in nearest)
    more = len(steps) - len(nearest)
    return (f"; saved: step{'s' if len(steps) > 1 else ''} {shown}"
            + (f" ({more:,} more)" if more else ""))


def metric_numbers(metrics: dict[str, Any] | None) -> tuple[dict[str, float], str]:
    """The numbers of a dict of metrics, as floats by name, and a line showing them.

    The metrics are an evaluation's or a framework's logs; the line is ``"no numbers"`` when
    there are none.

    Python ints and floats, NumPy scalars and one-element tensors are numbers (nan and
    inf kept as they are); booleans and other values are left out, and so is an
    integer too large for a float, which the line notes.

    .. note:: A tensor is read with ``item()``, which waits for the device: call it
       where that is fine (an evaluation has ended, a framework logged the values).
    """
    numbers: dict[str, float] = {}
    too_large: list[str] = []
    for key, value in (metrics or {}).items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, Real):
            continue  # (NumPy registers its integers and floats as Real, not its bool)
        try:
            numbers[str(key)] = float(value)
        except OverflowError:
            too_large.append(str(key))
    shown = ", ".join(f"{key}={value:.4g}" for key, value in numbers.items()) or "no numbers"
    if too_large:
        shown += f"; left out: {', '.join(too_large)} (an integer too large for a float)"
    return numbers, shown


def host_copy(state: Any) -> Any:
    """``state`` with every tensor copied to host memory, detached: later steps cannot change it.

    ``state``: dicts, lists, tuples of tensors and plain values; a snapshot later steps
    cannot change."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: host_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(item) for item in state)
    return state


def _host_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (as :func:`host_copy` walks it)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_host_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_host_bytes(item) for item in state)
    return 0
