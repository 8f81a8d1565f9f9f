"""The agent: the training thread's hot path, and the parts it is assembled from.

Training thread, at each optimizer-step boundary (:meth:`Agent.optimizer_step`): read a
host clock, make a step marker (see :mod:`agent.step.markers`), append the step's typed
record (:class:`agent.step.record.StepRecord`) to a bounded deque, and apply pending commands
whose step has come. Nothing else: no device sync, no ``.item()`` of a device tensor (a
0-dim float32 or float64 host loss is read from its memory, no call; another host loss by
``.item()`` only while the I/O thread lags: :data:`LOSSES_HELD_MAX`), no NVML or
psutil, no I/O, no lock unless a command is pending. That path is in C (its base
:class:`agent.step._hot.HotPath`, agent/step/_hot.c): no Python frame unless listeners or
commands wait.
:class:`Agent` owns that hot path, the events and their in-process listeners, and wires
up the parts that do the rest, each owning one thing:

- :mod:`agent.control.desk`: the command desk (validate, schedule at a step, cancel, apply);
- :mod:`agent.control.ledger`: the one ledger of applied changes, read by both rollback paths
  (the NaN / skipped-steps guard of :mod:`agent.control.guard`, and
  :meth:`Agent.roll_back_last_change` after an out-of-memory error);
- :mod:`agent.step.encoder`: the step records turned into ``steps`` batches;
- :mod:`agent.io.ioloop`: the I/O thread (sockets, CURVE gateway, run file, run log,
  heartbeats).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agent.wire import protocol
from agent.control.desk import CommandDesk
from agent.step.encoder import StepEncoder
from agent.wire.commands import send_command
from agent.control.guard import ChangeGuard
from agent.wire.knobs import KnobSet, assignment
from agent.control.ledger import ChangeLedger, Rollback, StateKeeper
from agent.control.recovery import Recovery, SpikeWatch
from agent.step._hot import HotPath
from agent.step.markers import CpuMarker, marker_for
from agent.io.ioloop import IOLoop
from agent.io.probes import Nvml
from agent.step.record import StepRecord
from agent.wire.protocol import EventKind
from agent.wire.runlog import read_summary, summary_path
from agent.wire.runs import RunInfo, shared_run_id
from agent.search.tune import AutoTune
from gpuopt.environment import usable_cpu_count

log = logging.getLogger("gpuwatch.agent")

#: Step records in the queue past which the training thread reads a host loss itself
#: (:meth:`agent.step.markers.CpuMarker.mark_read`, ``.item()``: 3 to 4 us between real
#: steps) instead of handing the tensor over. A 0-dim float32 or float64 host loss is
#: always read at the boundary, from memory (no call), and never held; this bounds the
#: others (another dtype, a subclass, a device other than CUDA's, whose read is a call,
#: and CUDA's, whose marker is an event): a held loss keeps its autograd graph's
#: nodes alive until the I/O thread reads it (162 KiB a step for a 4-layer transformer
#: encoder of width 64: about 10 MB at its 8 ms steps over a 0.5 s publish interval, but
#: 1.3 GiB over the whole queue when a starved I/O thread falls 8,192 steps behind). A
#: keeping-up I/O thread drains the queue every 0.5 s (``IOLoop``'s quiet poll), so below
#: 2,048 steps/s this is never reached; above, the steps past it are read here: cheaper
#: than the wake-ups a shorter poll would take (about 600 us of CPU each, measured).
LOSSES_HELD_MAX = 1024

#: Distinct internal errors kept in :attr:`Agent.errors`, each logged and published once;
#: past them, errors are counted (:attr:`Agent.errors_not_kept`): a failure whose message
#: varies (a step number in it) must neither grow the list nor flood the event log for
#: the whole run.
ERRORS_KEPT_MAX = 100

#: How long rank 0's rollback waits for each phase of the fan-out to every rank (s): the
#: ranks answer from their I/O threads, which a busy host can starve for a while.
ROLLBACK_TIMEOUT_S = 30.0


class Agent(HotPath):
    """Measures every optimizer step of one rank and takes live commands for its knobs.

    Args:
        knobs: the knobs this run supports (an empty set: monitoring only).
        name: a label for people (script or model name).
        model: the model, for its parameter count in ``hello`` (optional).
        device: the model's device; CUDA enables event timing and CUDA memory fields.
        transport: ``"ipc"`` (a socket file in the private run directory) or ``"tcp"``
            (127.0.0.1, random ports). A tcp run's ports use ZeroMQ CURVE, loopback
            included (loopback is shared with every local user): traffic is encrypted
            and only a client holding the run's client key (kept in the owner-only run
            file) may connect; they are bound by a child process, the gateway
            (:mod:`agent.io.gateway`), which forwards to the agent's private ipc sockets,
            so no tcp client can make the training process hold connections, file
            descriptors or buffers. Commands still need the token.
        listen: an address other than 127.0.0.1 to listen on with tcp (e.g.
            ``"0.0.0.0"``), for a dashboard on another machine (CURVE as above).
        rank, world_size: default from ``torch.distributed`` when initialised, else the
            ``RANK`` / ``WORLD_SIZE`` environment variables, else 0 / 1.
        queue_size: bound of the record queue; when the I/O thread falls that far
            behind, the oldest records are dropped (counted in heartbeats), the training
            thread never waits. Past :data:`LOSSES_HELD_MAX` queued, host losses are
            read as they are recorded (their autograd graphs are not kept); float32 and
            float64 ones always are.
        nvml: the GPU probe (tests pass one with a fake NVML module).
        run_id: the run id, when the caller derives one that every rank of its job
            shares (default: :func:`agent.wire.runs.shared_run_id`).
        training: facts of the training loop for ``hello`` (``framework``, and e.g.
            ``loss_normalization``: how a window's loss and gradient are averaged).
        recover: the settings of loss-spike recovery (:class:`agent.control.recovery.Recovery`),
            which the ``recover`` knob turns on; None: the defaults.

    Raises:
        ValueError: unknown ``transport``.
    """

    def __init__(
        self,
        knobs: KnobSet | None = None,
        *,
        name: str = "",
        model: torch.nn.Module | None = None,
        device: torch.device | str | None = None,
        transport: str = "ipc",
        rank: int | None = None,
        world_size: int | None = None,
        queue_size: int = 8192,
        nvml: Nvml | None = None,
        listen: str | None = None,
        training: dict[str, Any] | None = None,
        run_id: str | None = None,
        recover: Recovery | None = None,
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if listen is not None and transport != "tcp":
            raise ValueError("listen= needs transport='tcp'")
        self.listen = listen
        self.training = dict(training or {})
        self.knobs = knobs or KnobSet()
        self.name = name or os.path.basename(sys.argv[0] or "python")
        self.device = torch.device(device) if device is not None else None
        self.transport = transport
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.token = secrets.token_hex(16)
        self.params = sum(p.numel() for p in model.parameters()) if model is not None else None
        self.model_name = type(model).__name__ if model is not None else ""
        self._marker = marker_for(self.device)
        self._marks_on_host = type(self._marker) is CpuMarker  # (marked in C)
        self._records: deque = deque(maxlen=queue_size)
        #: records queued past which host losses are read at once (and a full queue's
        #: overflow is noted: :meth:`agent.step.encoder.StepEncoder.overflowing`)
        self._held_max = min(LOSSES_HELD_MAX, queue_size)
        self._queue_size = queue_size
        self._knob_values = self.knobs.values()
        self._last_step = 0
        self._last_boundary_t: float | None = None
        self._ending = False
        self._bye_reason: str | None = None
        self._broken = False
        #: the I/O thread has ended (:meth:`io_ended`)
        self._io_ended = False
        #: when the agent was made (s since the epoch)
        self.started_at = time.time()

        def publish(msg_type: str, body: dict[str, Any] | protocol.PackedBody
                    ) -> None:  # (the I/O thread's)
            self._io.publish(msg_type, body)

        #: the guarded changes applied lately: what both rollback paths restore
        self._ledger = ChangeLedger()
        self._change_guard = ChangeGuard(self._ledger)
        #: the ``tune`` command: the in-run search (on rank 0), fed from the records below
        self.tune = AutoTune(self.knobs, self.rank, publish, lambda: self.info,
                             usable_cpu_count(), self.report_error)
        self._desk = CommandDesk(
            self.knobs, token=self.token, ledger=self._ledger, tune=self.tune,
            publish=publish, event=self.event, step_now=lambda: self._last_step,
            ending=lambda: self._ending,
            step_time_s=lambda: self._encoder.recent_step_time_s,
            rank=self.rank, world_size=self.world_size)
        #: the desk's pending commands (the same list, changed in place): the hot path
        #: looks at it each step
        self._pending = self._desk.pending
        self._encoder = StepEncoder(self._records, self._marker, publish=publish,
                                    guard=self._change_guard, check_step=self._check_step,
                                    tune=self.tune, device=self.device,
                                    report_error=self.report_error)
        self._io = IOLoop(self, run_id or shared_run_id(self.world_size), desk=self._desk,
                          encoder=self._encoder, guard=self._change_guard, tune=self.tune,
                          drain_at=queue_size // 4, nvml=nvml)
        #: gpuwatch's own errors (distinct messages, at most :data:`ERRORS_KEPT_MAX`)
        self.errors: list[str] = []
        #: errors reported past those (repeats too), counted: not kept, logged or published
        self.errors_not_kept: int = 0
        self._listeners: tuple[Any, ...] = ()
        if recover is not None and not isinstance(recover, Recovery):
            raise TypeError(f"recover must be an agent.control.recovery.Recovery, got "
                            f"{type(recover).__name__}")
        #: the ``recover`` knob's settings, and the spike watch (rank 0's decides for
        #: every rank; the knob turns it on)
        self.recovery = recover or Recovery()
        self.spikes = SpikeWatch(self.recovery)
        if self.rank == 0:
            self._encoder.loss_watch = self._watch_losses
            self._encoder.change_watch = self.spikes.on_event

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 10.0) -> "Agent":
        """Start the I/O thread and wait until the run file is written (sockets bound).

        Returns self. If the sockets cannot be bound the agent logs the reason and stays
        inert: training goes on unobserved.
        """
        atexit.register(self.close)
        self._io.start(timeout_s)
        return self

    def mark_ending(self, reason: str | None = None) -> None:
        """The run is about to end (e.g. on SIGTERM): commands are rejected, heartbeats say so.

        From now on commands are rejected with "the run is ending" and heartbeats say so;
        ``reason``, if given, is what ``bye`` will say. Any thread; idempotent."""
        if reason is not None and self._bye_reason is None:
            self._bye_reason = reason
        self._ending = True
        self._desk.arrived.set()  # a run held at a boundary (a pause) goes on to its end

    def close(self, reason: str = "finished", timeout_s: float = 5.0) -> None:
        """Publish ``bye``, close the sockets and remove the run file. Idempotent.

        Pending commands that have not been applied are dropped (their senders already
        had their reply). Waits at most ``timeout_s`` for the I/O thread. The exit hook
        :meth:`start` registered goes: it held the closed agent, and through its knobs the
        model and optimizer (with ``recover=on`` the states kept too), until the process
        ended (a sweep of 8 sessions of a 4 MiB model kept all 8; 36 MB each with
        ``recover=on``).
        """
        atexit.unregister(self.close)
        if self._io.stopped:
            return
        self.mark_ending(reason)
        self._io.stop(timeout_s)
        self.tune.close()

    def ended_line(self) -> str:
        """One line for a script to print at its end: steps trained, final loss, where the log is.

        The run is closed first (:meth:`close`, if it is still open); the steps trained, the
        final loss and where its run log is, as the log's summary (saved beside it at close)
        has them::

            run 20260101-000000-abcd ended: steps trained 200, final loss 0.412,
            run log /run/user/1000/gpuwatch/logs/...runlog (`gpuwatch runs --all`)

        Reads one small file; never raises (a figure it cannot read is ``?``)."""
        self.close()
        log_path = self.info.log_path if self.info is not None else ""
        try:
            summary = read_summary(summary_path(log_path)) if log_path else None
        except Exception:  # noqa: BLE001 -- a last line must not fail the script
            summary = None
        steps = f"{summary.steps:,}" if summary is not None else "?"
        loss = (f"{summary.final_loss:.4g}" if summary is not None
                and summary.final_loss is not None else "?")
        where = f"run log {log_path} (`gpuwatch runs --all`)" if log_path else "no run log"
        return f"run {self.run_id} ended: steps trained {steps}, final loss {loss}, {where}"

    # ---------------------------------------------------------------- hot path
    # (optimizer_step and mark_start are HotPath's, in C: agent/step/_hot.c)

    def _apply_pending(self, step: int, ahead: int = 0) -> None:
        if self._desk.apply_due(step, ahead):
            self._knob_values = self.knobs.values()

    def hold(self, should_go_on: Callable[[], bool], wait_s: float = 1.0) -> None:
        """Training thread: wait at this boundary until ``should_go_on()``, applying commands.

        At the boundary after :attr:`last_step`: wait there while ``should_go_on()`` is
        False, applying each command as it arrives (it applies at this boundary: a
        ``pause=off`` among them ends the wait). The thread sleeps on an event that a
        command's arrival sets, and looks at ``should_go_on`` and :attr:`ending` again at
        least every ``wait_s`` seconds: no CPU or GPU is used. It ends too when the run is
        ending, or when the I/O thread has ended (no command could end the wait).

        With one rank, commands sent before the hold for the step after next apply here
        too; with several, only those due at the next step (every rank holds at the same
        boundary, so what applies while held applies on each at the same step).
        """
        desk = self._desk
        desk.holding = True
        try:
            while (not should_go_on() and not self._ending and not self._broken
                   and not self._io_ended):
                desk.arrived.wait(wait_s)
                desk.arrived.clear()
                if self._pending:
                    self._apply_pending(self._last_step, 1 if self.world_size == 1 else 0)
        except Exception as exc:  # the first rule: never crash the training
            self._broken = True
            self.report_error("holding at a boundary", exc)
        finally:
            desk.holding = False
        self.mark_start()  # the next step's time leaves the wait out

    @property
    def run_id(self) -> str:
        """The run's id: the one given (or derived), or a new one if another process held it.

        A new one when another process held it as the sockets were bound."""
        return self._io.run_id

    @property
    def last_step(self) -> int:
        """The latest optimizer step recorded (0 before the first)."""
        return self._last_step

    def rewound(self, step: int, branch: int) -> None:
        """Count on from optimizer step ``step``: the run's state went back to it, as ``branch``.

        Training thread, at a boundary: the run's state is now the one after optimizer step
        ``step``, on the new branch ``branch``.

        A command's earliest step then follows the new branch's steps (not the left
        branch's, where it would land that many steps late), each pending command keeps
        its distance from now (:meth:`agent.control.desk.CommandDesk.rewinding`: a
        ``rescheduled`` event each), and the change guard forgets the left branch's
        changes: none of them is in the state trained from now on. A few list operations.
        """
        with self._desk.rewinding(self._last_step, step, branch):
            self._last_step = step
        self._ledger.clear()

    @property
    def ending(self) -> bool:
        """Whether :meth:`mark_ending` was called: commands are now rejected."""
        return self._ending

    @property
    def bye_reason(self) -> str | None:
        """What ``bye`` will say, if :meth:`mark_ending` was given a reason."""
        return self._bye_reason

    @property
    def knob_values(self) -> dict[str, Any]:
        """The knob values as of the latest applied command (a dict not changed after)."""
        return self._knob_values

    @property
    def info(self) -> RunInfo | None:
        """The run file's facts (endpoints, token, log path), once the sockets are bound.

        None before, or when they could not be (the agent is then inert)."""
        return self._io.info

    @property
    def records_dropped(self) -> int:
        """Step records lost because the queue overflowed (the I/O thread fell behind)."""
        return self._encoder.records_dropped

    @property
    def latest_memory(self) -> dict[str, Any]:
        """The memory readings of the latest step records published; any thread may read it.

        :func:`gpuopt.memory.memory_stats`, read on the I/O thread; replaced whole, so any
        thread may read it."""
        return self._encoder.latest_memory

    @property
    def commands_refused(self) -> int:
        """Valid commands refused because too many were pending (a flood)."""
        return self._desk.commands_refused

    @property
    def commands_rejected(self) -> int:
        """Commands rejected (bad token, knob or value)."""
        return self._desk.commands_rejected

    @property
    def cleanly_watched_step(self) -> int:
        """The step of the latest guarded change whose watch ended without a rollback (0: none yet).

        Nothing before it can be rolled back any more. Any thread."""
        return self._change_guard.clean_through

    def keep_state_with(self, keeper: StateKeeper) -> None:
        """Let rollbacks put back the training state, not only the knob values.

        The ``keeper`` (the run base) keeps it at the boundary where a guarded change starts
        an episode and restores it when the episode is rolled back (with several ranks,
        every rank at the one step of rank 0's rollback commands)."""
        self._desk.state_keeper = keeper

    def roll_back_last_change(self, step: int, reason: str) -> bool:
        """Training thread, between steps: undo the latest guarded changes at once.

        The changes made within the last ``guard_steps`` optimizer steps (e.g. after an
        out-of-memory error), undone at once, to the same last good values the NaN guard
        would restore (one ledger).

        Args:
            step: the 1-based optimizer step that failed (it is retried after this).
            reason: what went wrong, for people (``step 12 ran out of memory``).

        Returns:
            True when something was rolled back (False too with several ranks, where
            one rank alone must not change a knob: a warning says so).
        """
        rolled_back = self._desk.roll_back(step, reason)
        self._knob_values = self.knobs.values()
        return rolled_back

    def event(self, level: str, text: str, **fields: Any) -> None:
        """Publish an ``event`` (``level``: info | warning | error) in order with the step records.

        Any thread; a lock and one deque append (and the listeners' calls). Never lost
        silently: where the record queue's bound drops it, a warning event says how many
        were lost (:meth:`agent.step.encoder.StepEncoder.queue_event`)."""
        body = {"level": level, "text": text, **fields}
        told = {"type": protocol.EVENT, **body} if self._listeners else None
        self._encoder.queue_event(body)
        if told is not None:
            self._tell_listeners(told)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(record)`` with each step's host facts and each event, before publishing.

        With each optimizer step's host facts as it is recorded and with each event as it is
        raised, in this process, before anything is published: what an in-process consumer
        (the framework loggers bridge) reads without a socket, and without waiting for the
        I/O thread.

        A step record: ``{"type": "step", "step", "step_time_s" (None for the first),
        "micro_batches", "samples", "data_wait_s" (s), "tokens" (or None),
        "activation_bytes" (or None), "knobs"}`` (the knob values the step trained
        with; the dict is replaced, never changed, when a knob changes). An event: the
        ``event`` body with ``"type": "event"``. Nothing the device computes (loss,
        GPU time) is in them: that needs the step's marker, read later on the I/O
        thread.

        The call is made on the thread that records: the training thread for steps
        and for most events, the I/O thread for some (agent errors, rank warnings), so
        a listener must be thread-safe and cheap (a deque append), must not block and
        must not keep ``record`` beyond reading it. A listener that raises is removed
        and the error reported once; training goes on.
        """
        self._listeners = (*self._listeners, listener)

    def _tell_step(self, record: StepRecord) -> None:
        """Training thread, from :meth:`optimizer_step` while there are listeners: the
        step's host facts."""
        self._tell_listeners({
            "type": protocol.STEP, "step": record.step, "step_time_s": record.step_time_s,
            "micro_batches": record.micro_batches, "samples": record.samples,
            "data_wait_s": record.data_wait_s, "tokens": record.tokens,
            "activation_bytes": record.activation_bytes, "knobs": record.knobs})

    def _tell_listeners(self, record: dict[str, Any]) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception as exc:
                self._listeners = tuple(kept for kept in self._listeners
                                        if kept is not listener)
                self.report_error("a record listener", exc)

    def refresh_knobs(self) -> None:
        """Re-read the current values of every knob.

        After knobs were added or set outside a command. Call between optimizer steps. Knobs
        added after :meth:`start` are announced to dashboards (a new ``hello`` with the
        schema)."""
        self._knob_values = self.knobs.values()
        self._io.announce = True

    def io_ended(self) -> None:
        """I/O thread, as it ends: nothing reads step records any more.

        It ends closed, or inert (its sockets could not be bound). The records still
        queued are let go, and the hot path's later ones are dropped as they come (each
        would keep its loss, with its autograd graph, until the queue overflowed);
        in-process listeners still get every step. A hold at a boundary (a pause) ends:
        no command can end it any more."""
        queued, self._records = self._records, deque(maxlen=0)
        queued.clear()  # (after the swap: a step appended meanwhile goes too)
        self._io_ended = True
        self._desk.arrived.set()

    def report_error(self, where: str, exc: BaseException) -> None:
        """An internal error of gpuwatch's (``where``: what failed): logged and published once.

        Logged and published as an ``agent_error`` event once per distinct message, for the
        first :data:`ERRORS_KEPT_MAX` messages; past them counted in
        :attr:`errors_not_kept` (one event says so). Training continues. Any thread."""
        message = f"gpuwatch agent: {where} failed: {type(exc).__name__}: {exc}"
        if message in self.errors:
            return
        if len(self.errors) < ERRORS_KEPT_MAX:
            self.errors.append(message)
            log.warning(message)
            self.event("error", message + " (training continues)", kind=EventKind.AGENT_ERROR)
            return
        self.errors_not_kept += 1
        if self.errors_not_kept == 1:
            message = (f"gpuwatch agent: more than {ERRORS_KEPT_MAX} distinct errors of its "
                       f"own; the next ones are counted in heartbeats, not shown (the latest: "
                       f"{where} failed: {type(exc).__name__}: {exc})")
            log.warning(message)
            self.event("error", message + " (training continues)", kind=EventKind.AGENT_ERROR)

    def _check_step(self, step: int, loss: float | None, skipped: bool | None) -> None:
        """I/O thread (from the encoder): a step the guard must see. A rollback it
        decides is scheduled on the desk for the boundary after the next step (with one
        rank; with several, rank 0's is sent to every rank for one common step:
        :meth:`_roll_back_every_rank`, and the other ranks' are left to it), and a
        non-finite loss with nothing to roll back is warned of once."""
        rollback = self._change_guard.on_step(step, loss, skipped)
        if rollback is not None and self.world_size > 1:  # this rank alone must not
            if self.rank == 0:  # rank 0's guard decides for every rank
                self._io.publish(protocol.EVENT, {
                    "level": "warning", "kind": EventKind.ROLLBACK, "step": step,
                    "text": f"{rollback.reason}: rolling back to "
                            + ", ".join(assignment(k, v) for k, v in rollback.values.items())
                            + f" on every rank ({self.world_size})"})
                threading.Thread(target=self._roll_back_every_rank, args=(rollback,),
                                 name="gpuwatch-rollback", daemon=True).start()
            return
        if rollback is not None:
            apply_step = self._last_step + 2
            self._desk.schedule_rollback(rollback, apply_step)
            self._io.publish(protocol.EVENT, {
                "level": "warning", "kind": EventKind.ROLLBACK, "step": apply_step,
                "text": f"{rollback.reason}: rolling back to "
                        + ", ".join(assignment(k, v) for k, v in rollback.values.items())
                        + f" at step {apply_step}"})
            return
        warning = self._change_guard.non_finite_warning(step, loss,
                                                        searching=self.tune.running)
        if warning:
            self._io.publish(protocol.EVENT, {"level": "warning", "kind": EventKind.WARNING,
                                           "text": warning, "step": step})

    def _watch_losses(self, steps: Sequence[int], losses: list[float | None]) -> None:
        """I/O thread, rank 0 (from the encoder, for every published step): a spike
        the watch finds is recovered from on every rank at one boundary (with one rank:
        the boundary after the next step; with several: the step the fan-out picks)."""
        spike = self.spikes.observe(steps, losses)
        if spike is None:
            return
        command_id = f"{protocol.RECOVERY_ID_PREFIX}{spike.first}-{secrets.token_hex(4)}"
        reason = f"loss spike: {spike.describe()}"
        if self.world_size == 1:
            self._desk.schedule_recovery(command_id, reason, self._last_step + 2)
            return
        threading.Thread(target=self._recover_every_rank, args=(command_id, reason),
                         name="gpuwatch-recovery", daemon=True).start()

    def _recover_every_rank(self, command_id: str, reason: str) -> None:
        """Its own thread (rank 0, several ranks): send the recovery to every rank for
        one common step (``recover=on`` with a :data:`agent.wire.protocol.RECOVERY_ID_PREFIX`
        id); a refusal is an event, and the watch looks for spikes again."""
        info = self.info
        reply = (send_command(info, "recover", "on", command_id=command_id, reason=reason,
                              timeout_s=ROLLBACK_TIMEOUT_S) if info is not None else
                 {"ok": False, "reason": "the agent has no sockets"})
        if not reply["ok"]:
            self.spikes.rearm()
            self.event("warning", f"{reason}; not recovered on the {self.world_size} ranks: "
                       f"{reply['reason']}", kind=EventKind.WARNING, step=self._last_step)

    def _roll_back_every_rank(self, rollback: Rollback) -> None:
        """Its own thread (rank 0, several ranks): send ``rollback``'s values to every
        rank as rollback commands (:data:`agent.wire.protocol.ROLLBACK_ID_PREFIX`), the first
        at the step the fan-out picks, the others at that same step, so that every rank
        restores its state at one boundary. A refusal (a rank not reachable, the step
        passed) is an event: nothing is then rolled back anywhere by that command."""
        info, apply_step = self.info, None
        prefix = f"{protocol.ROLLBACK_ID_PREFIX}{secrets.token_hex(4)}-"
        for index, (knob, value) in enumerate(rollback.values.items()):
            reply = (send_command(info, knob, value, apply_step=apply_step,
                                  command_id=f"{prefix}{index}", reason=rollback.reason,
                                  timeout_s=ROLLBACK_TIMEOUT_S) if info is not None else
                     {"ok": False, "reason": "the agent has no sockets"})
            if not reply["ok"]:
                self.event("error", f"{rollback.reason}; {assignment(knob, value)} not "
                           f"rolled back on the {self.world_size} ranks: {reply['reason']}"
                           + (" (gpuwatch set " + " ".join(
                               assignment(k, v) for k, v in rollback.values.items()) + ")"),
                           kind=EventKind.WARNING, step=self._last_step)
                return
            apply_step = reply["apply_step"]


def ending_reason(error: BaseException | None) -> str:
    """What ``bye`` says of a run that ends with ``error`` (None: it finished).

    The same words in every integration (``finished``, ``stopped by SIGINT`` for Ctrl-C,
    ``error: <the exception>``)."""
    if error is None:
        return "finished"
    if isinstance(error, KeyboardInterrupt):
        return "stopped by SIGINT"
    return f"error: {error!r}"


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
