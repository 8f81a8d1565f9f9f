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
measures voids the trial's measurement so far: it is measured again from there. A new
branch (a rewind, a rollback of the state, a recovery: step numbers repeat, and a
checkpoint's knob values may come back) drops what was measured on the branch left: the
run goes back to the best configuration and the trial is measured again from its start
(an event says so). The budget counts step records, not step numbers.

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

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from agent.wire import protocol
from agent.wire.commands import send_command
from agent.wire.knobs import (
    KnobError,
    KnobSet,
)
from agent.wire.runs import RunInfo
from agent.search.request import TuneRequest
from agent.search.tuner import Tuner


#: How long the search waits for each phase of its own command's replies (s): on a
#: busy host the run's own I/O thread, which answers, can be starved for seconds; a
#: command not answered at all counts as refused.
COMMAND_TIMEOUT_S = 120.0


class CommandSender:
    """The thread that sends the tuner's commands to every rank.

    It sends through :func:`agent.wire.commands.send_command`, so that the agent's
    I/O thread, which answers them, never waits; replies come back in :meth:`replies`
    (any thread)."""

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
    """The agent's side of the ``tune`` command.

    It parses it, runs the :class:`Tuner` on rank 0, and feeds it the agent's records. I/O
    thread only.

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
        """Why the search's own command on ``knob`` is refused now, or None.

        Refused when a person set that knob during the search: a command sent before
        the search knew it would undo theirs. I/O thread (the desk's)."""
        tuner = self.tuner
        if tuner is None or not self.own(command_id) or knob not in tuner.released:
            return None
        return f"{tuner.released[knob]}: the tune search leaves {knob} to them"

    def person_set(self, command_id: Any, knob: str, value: Any,
                   apply_step: int) -> str | None:
        """Leave a knob a person set while the search explores it.

        The desk accepted a command: when it is a person's (not the search's) on a knob
        the running search explores, the search leaves that knob
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
        """The knobs of ``values`` the running search is trying, with their best values.

        While a search runs: the knobs of ``values`` (the values now) that it is
        trying, each with the value it measures the trial against (the best kept so
        far: the person's setting until the search keeps another). Empty otherwise. Any
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
        """End a running search with the run.

        The run is ending (its last records published): a running search ends with it
        (:meth:`Tuner.run_ended`). I/O thread, before ``bye``."""
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
