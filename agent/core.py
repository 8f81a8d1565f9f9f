"""The agent: the training thread's hot path and the I/O thread behind it.

Training thread, at each optimizer-step boundary (:meth:`Agent.optimizer_step`): read a
host clock, make a step marker (see :mod:`agent.markers`), append one small tuple to a
bounded deque, and apply pending commands whose step has come. Nothing else: no device
sync, no ``.item()``, no NVML or psutil, no I/O, no lock unless a command is pending.

I/O thread (:meth:`Agent._io_loop`): owns the ZeroMQ sockets; turns step tuples into
``step`` messages (loss, GPU time, memory), publishes on PUB (which drops at its
high-water mark rather than block), validates commands from the ROUTER and replies at
once, samples the system at about 1 Hz, sends heartbeats and re-sends ``hello``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from agent import protocol
from agent.desk import CommandDesk
from agent.encoder import StepEncoder
from agent.guard import ChangeGuard
from agent.knobs import KnobSet, assignment
from agent.ledger import ChangeLedger
from agent.markers import marker_for
from agent.multinode import node_link
from agent.probes import Nvml, SystemProbe
from agent.protocol import EventKind, Reply
from agent.runlog import RunLog, log_dir
from agent.runs import (RUN_ID_ENV, RunInfo, new_run_id, rank_taken, remove_run_file,
                        run_dir, shared_run_id, write_run_file)
from agent.tune import AutoTune
from gpuopt.environment import usable_cpu_count

log = logging.getLogger("gpuwatch.agent")

_HEARTBEAT_INTERVAL_S = 1.0
_HELLO_EVERY_HEARTBEATS = 30  # a new subscriber is greeted at once anyway
#: The I/O thread wakes at least this often to publish the records queued since (ms),
#: as one ``steps`` batch. Commands and new subscribers wake it at once (a command's
#: latency does not depend on it); each wake-up costs CPU (about 100 us on a 2-core
#: machine, the poll included) and the training thread a GIL hand-off, so it is kept
#: rare: 10 a second, a batch of 100 steps at 1,000 steps/s.
_POLL_MS = 100
_MAX_COMMANDS_PER_POLL = 100
#: Command messages read per second at most, valid or not: a flood (even of garbage or
#: of wrong tokens) costs the training process a bounded ~1% of a core; the excess waits
#: in ZeroMQ's small receive queue, and beyond it the sender is throttled.
COMMANDS_PER_S = 200
#: Receive queue per client (messages) and the largest command message (bytes): bounds
#: what a flood of large messages can make the training process hold.
_COMMAND_QUEUE = 64
_MAX_COMMAND_BYTES = 64 * 1024
#: Largest message a subscriber may send the PUB socket (a subscription: a topic of a
#: few bytes); a larger one disconnects it (a 100 MB "subscription" is never held).
_MAX_SUBSCRIPTION_BYTES = 1024
#: A connection that has not completed its handshake (CURVE on tcp) by then is closed:
#: a peer without the run's key holds a file descriptor this long at most (ms).
_HANDSHAKE_MS = 2000
#: How long the tcp gateway may take to start and bind (s).
_GATEWAY_START_S = 30.0
#: New subscribers are greeted (hello + state, on the wire only) at most this often;
#: those who come in between share the next greeting.
GREETINGS_PER_S = 2
#: Subscription frames read per wake-up at most (the rest wait for the next one).
_MAX_SUBSCRIPTIONS_PER_POLL = 1000
_SEND_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_SEND_LAST = int(zmq.NOBLOCK)
class Agent:
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
            (:mod:`agent.gateway`), which forwards to the agent's private ipc sockets,
            so no tcp client can make the training process hold connections, file
            descriptors or buffers. Commands still need the token.
        listen: an address other than 127.0.0.1 to listen on with tcp (e.g.
            ``"0.0.0.0"``), for a dashboard on another machine (CURVE as above).
        rank, world_size: default from ``torch.distributed`` when initialised, else the
            ``RANK`` / ``WORLD_SIZE`` environment variables, else 0 / 1.
        queue_size: bound of the record queue; when the I/O thread falls that far
            behind, the oldest records are dropped (counted in heartbeats), the training
            thread never waits.
        nvml: the GPU probe (tests pass one with a fake NVML module).
        run_id: the run id, when the caller derives one that every rank of its job
            shares (default: :func:`agent.runs.shared_run_id`).
        training: facts of the training loop for ``hello`` (``framework``, and e.g.
            ``loss_normalization``: how a window's loss and gradient are averaged).

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
        self.run_id = run_id or shared_run_id(self.world_size)
        self.token = secrets.token_hex(16)
        self.params = sum(p.numel() for p in model.parameters()) if model is not None else None
        self.model_name = type(model).__name__ if model is not None else ""
        self.info: RunInfo | None = None
        self._pub: zmq.Socket | None = None
        self._log: RunLog | None = None
        self._marker = marker_for(self.device)
        self._records: deque = deque(maxlen=queue_size)
        self._knob_values = self.knobs.values()
        self._last_step = 0
        self._last_boundary_t: float | None = None
        self._ending = False
        self._bye_reason: str | None = None
        self._broken = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._seq = 0
        self._probe = SystemProbe(nvml)
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._io_main, name="gpuwatch-agent",
                                        daemon=True)
        self._announce = False  # the schema changed: send hello again
        #: the guarded changes applied lately: what both rollback paths restore
        self._ledger = ChangeLedger()
        self._change_guard = ChangeGuard(self._ledger)
        #: the ``tune`` command: the in-run search (on rank 0), fed from the records below
        self.tune = AutoTune(self.knobs, self.rank, self._publish, lambda: self.info,
                             usable_cpu_count(), self.report_error)
        self._desk = CommandDesk(
            self.knobs, token=self.token, ledger=self._ledger, tune=self.tune,
            publish=self._publish, event=self.event, step_now=lambda: self._last_step,
            ending=lambda: self._ending,
            step_time_s=lambda: self._encoder.recent_step_time_s,
            rank=self.rank, world_size=self.world_size)
        #: the desk's pending commands (the same list, changed in place): the hot path
        #: looks at it each step
        self._pending = self._desk.pending
        self._encoder = StepEncoder(self._records, self._marker, publish=self._publish,
                                    guard=self._change_guard, check_step=self._check_step,
                                    tune=self.tune, device=self.device)
        self.errors: list[str] = []
        self._listeners: tuple[Any, ...] = ()

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 10.0) -> "Agent":
        """Start the I/O thread and wait until the run file is written (sockets bound).

        Returns self. If the sockets cannot be bound the agent logs the reason and stays
        inert: training goes on unobserved.
        """
        self._thread.start()
        atexit.register(self.close)
        self._ready.wait(timeout_s)
        return self

    def mark_ending(self, reason: str | None = None) -> None:
        """The run is about to end (e.g. on SIGTERM): from now on commands are rejected
        with "the run is ending" and heartbeats say so; ``reason``, if given, is what
        ``bye`` will say. Any thread; idempotent."""
        if reason is not None and self._bye_reason is None:
            self._bye_reason = reason
        self._ending = True

    def close(self, reason: str = "finished", timeout_s: float = 5.0) -> None:
        """Publish ``bye``, close the sockets and remove the run file. Idempotent.

        Pending commands that have not been applied are dropped (their senders already
        had their reply). Waits at most ``timeout_s`` for the I/O thread.
        """
        if self._stop.is_set():
            return
        self.mark_ending(reason)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.tune.close()

    # ---------------------------------------------------------------- hot path

    def mark_start(self) -> None:
        """Training thread: the loop starts now (the first step's time counts from here)."""
        self._last_boundary_t = time.perf_counter()

    def optimizer_step(self, step: int, micro_batches: int, samples: int,
                       data_wait_s: float, loss: torch.Tensor | None,
                       skipped: torch.Tensor | None = None,
                       activation_bytes: int | None = None, *, tokens: int | None = None,
                       lr: float | tuple[float | None, ...] | None = None,
                       grad_norm: torch.Tensor | float | None = None) -> None:
        """Training thread: record the optimizer step ``step`` that just ended, then apply
        the commands due at step ``step + 1``.

        Args:
            step: 1-based index of the optimizer step just taken.
            micro_batches: micro-batches in its accumulation window.
            samples: samples in the window.
            data_wait_s: host seconds the loop waited for data in this step.
            loss: the step's loss as a 0-dim tensor (any device), or None.
            skipped: in fp16, the GradScaler's 0-dim bool "skipped" tensor, or None.
            activation_bytes: bytes saved for backward by one of its micro-batches, when
                measured (:class:`gpuopt.memory.SavedActivations`); else None.
            tokens: tokens in the window (token models), or None.
            lr: the learning rate the step used (param group 0), a host float, or the
                rate of each param group as a tuple, as the groups hold them (floats or
                tensors; read on the I/O thread, a device tensor not at all), published as
                ``lr`` and ``lr_groups``; or None.
            grad_norm: the global gradient norm the step saw (before clipping), as a
                0-dim tensor (read on the I/O thread once ready) or a float, or None.

        .. note:: Never synchronizes the device and never blocks: a clock read, a marker
           (an asynchronous CUDA event on GPU), one deque append (and the calls of
           :meth:`add_listener`'s listeners, when there are any). Never raises: an
           internal error is reported once and the agent stops observing.
        """
        if self._broken:
            return
        try:
            now = time.perf_counter()
            previous = self._last_boundary_t
            self._last_boundary_t = now
            step_time_s = None if previous is None else now - previous
            self._records.append((
                "step", step, step_time_s, micro_batches,
                samples, data_wait_s, self._marker.mark(loss, skipped, grad_norm),
                self._knob_values, activation_bytes, tokens, lr))
            self._last_step = step
            if self._listeners:
                self._tell_listeners({
                    "type": protocol.STEP, "step": step, "step_time_s": step_time_s,
                    "micro_batches": micro_batches, "samples": samples,
                    "data_wait_s": data_wait_s, "tokens": tokens,
                    "activation_bytes": activation_bytes, "knobs": self._knob_values})
            if self._pending:
                self._apply_pending(step)
        except Exception as exc:  # the first rule: never crash the training
            self._broken = True
            self.report_error("hot path", exc)

    def _apply_pending(self, step: int) -> None:
        if self._desk.apply_due(step):
            self._knob_values = self.knobs.values()

    @property
    def records_dropped(self) -> int:
        """Step records lost because the queue overflowed (the I/O thread fell behind)."""
        return self._encoder.records_dropped

    @property
    def latest_memory(self) -> dict[str, Any]:
        """The memory readings of the latest step records published
        (:func:`gpuopt.memory.memory_stats`, read on the I/O thread); replaced whole, so
        any thread may read it."""
        return self._encoder.latest_memory

    @property
    def commands_refused(self) -> int:
        """Valid commands refused because too many were pending (a flood)."""
        return self._desk.commands_refused

    @property
    def commands_rejected(self) -> int:
        """Commands rejected (bad token, knob or value)."""
        return self._desk.commands_rejected

    def roll_back_last_change(self, step: int, reason: str) -> bool:
        """Training thread, between steps: undo the guarded changes made within the last
        ``guard_steps`` optimizer steps (e.g. after an out-of-memory error), at once, to
        the same last good values the NaN guard would restore (one ledger).

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
        """Publish an ``event`` (``level``: info | warning | error) in order with the
        step records. Any thread; one deque append (and the listeners' calls)."""
        body = {"level": level, "text": text, **fields}
        self._records.append(("event", body))
        if self._listeners:
            self._tell_listeners({"type": protocol.EVENT, **body})

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(record)`` with each optimizer step's host facts as it is
        recorded and with each event as it is raised, in this process, before anything
        is published: what an in-process consumer (the framework loggers bridge) reads
        without a socket, and without waiting for the I/O thread.

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

    def _tell_listeners(self, record: dict[str, Any]) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception as exc:
                self._listeners = tuple(l for l in self._listeners if l is not listener)
                self.report_error("a record listener", exc)

    def refresh_knobs(self) -> None:
        """Re-read the current values of every knob (after knobs were added or set
        outside a command). Call between optimizer steps. Knobs added after
        :meth:`start` are announced to dashboards (a new ``hello`` with the schema)."""
        self._knob_values = self.knobs.values()
        self._announce = True

    def report_error(self, where: str, exc: BaseException) -> None:
        """An internal error of gpuwatch's (``where``: what failed): logged and published
        as an ``agent_error`` event once per distinct message; training continues. Any
        thread."""
        message = f"gpuwatch agent: {where} failed: {type(exc).__name__}: {exc}"
        if message not in self.errors:
            self.errors.append(message)
            log.warning(message)
            self.event("error", message + " (training continues)", kind=EventKind.AGENT_ERROR)

    # ---------------------------------------------------------------- I/O thread

    def _io_main(self) -> None:
        context = zmq.Context()
        try:
            self._io_loop(context)
        except Exception as exc:
            self.report_error("I/O thread", exc)
        finally:
            self._ready.set()
            if self.info is not None:
                remove_run_file(self.info)
            for path in self._ipc_paths:  # bound, even if the run file never came
                Path(path).unlink(missing_ok=True)
            if self._pub is not None:
                self._pub.close(linger=500)  # let bye and the last records leave
            if self._log is not None:
                self._guard("run log", self._log.close)
            self._guard("tcp gateway", self._stop_gateway)
            if self._node_link is not None:
                self._guard("node relay", self._node_link.close)
            context.destroy(linger=0)

    def _start_gateway(self, pub_endpoint: str, cmd_endpoint: str) -> dict[str, str]:
        """Start the tcp side of this run in a child process (:mod:`agent.gateway`):
        tcp ports with CURVE, forwarding to this agent's private ipc sockets, so that
        what a tcp client makes a process hold (connections, descriptors, buffers) is
        never held by the training process. Its keys go in the owner-only run file: a
        client without them gets nothing, one with them knows it reached this run (only
        the gateway holds the server's secret key), so a port taken over after the run
        ended is never trusted.

        Returns:
            The run file's ``pub_endpoint``, ``cmd_endpoint`` and CURVE key fields.

        Raises:
            OSError: the gateway could not be started or did not bind (it says why).
        """
        import json
        import select
        import subprocess

        if not sys.executable:
            raise OSError("no Python executable to start the tcp gateway with")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self._gateway_id = b"gpuwatch-gateway-" + secrets.token_bytes(8)
        address = self.listen or "127.0.0.1"
        settings = {"pub": pub_endpoint, "cmd": cmd_endpoint, "address": address,
                    "server_public": server_public.decode(),
                    "server_secret": server_secret.decode(),
                    "client_public": client_public.decode(),
                    "routing_id": self._gateway_id.hex()}
        home = str(Path(__file__).resolve().parent.parent)  # where `agent` is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            part for part in (home, os.environ.get("PYTHONPATH", "")) if part)}
        gateway = subprocess.Popen([sys.executable, "-m", "agent.gateway"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=env, close_fds=True)
        self._gateway = gateway
        gateway.stdin.write(json.dumps(settings).encode() + b"\n")
        gateway.stdin.flush()
        readable, _, _ = select.select([gateway.stdout], [], [], _GATEWAY_START_S)
        line = gateway.stdout.readline() if readable else b""
        try:
            answer = json.loads(line)
        except ValueError:
            answer = {"error": f"no answer within {_GATEWAY_START_S:.0f} s"}
        if "error" in answer or not isinstance(answer.get("pub_port"), int):
            raise OSError(f"the tcp gateway did not start: {answer.get('error', answer)}")
        shown = "127.0.0.1" if address in ("0.0.0.0", "*") else address
        return {"pub_endpoint": f"tcp://{shown}:{answer['pub_port']}",
                "cmd_endpoint": f"tcp://{shown}:{answer['cmd_port']}",
                "curve_server_key": server_public.decode(),
                "curve_client_public_key": client_public.decode(),
                "curve_client_secret_key": client_secret.decode()}

    def _gateway_gone(self) -> None:
        """The gateway died (killed?): the run file names the private ipc sockets
        instead, so this user's dashboards find the run again; an event says so."""
        status = self._gateway.returncode
        self._stop_gateway()
        assert self.info is not None
        self.info.pub_endpoint, self.info.cmd_endpoint = (
            f"ipc://{path}" for path in self._ipc_paths)
        self.info.curve_server_key = self.info.curve_client_public_key = ""
        self.info.curve_client_secret_key = ""
        write_run_file(self.info, Path(self.info.path).parent)
        self.report_error("tcp gateway", RuntimeError(
            f"it exited with status {status}; the run is now reached over ipc only "
            f"({self.info.pub_endpoint})"))

    def _stop_gateway(self) -> None:
        """Close the gateway's stdin (it ends on EOF); kill it if it lingers."""
        gateway, self._gateway = self._gateway, None
        if gateway is None:
            return
        import subprocess

        try:
            gateway.stdin.close()
            gateway.wait(2.0)
        except (OSError, subprocess.TimeoutExpired):
            gateway.kill()
            gateway.wait()
        gateway.stdout.close()

    #: ipc socket files this agent bound (removed at exit, run file or not)
    _ipc_paths: tuple[str, ...] = ()
    #: the tcp gateway (a child process) and the routing id of its commands
    _gateway: Any = None
    _gateway_id: bytes | None = None
    #: this node's relay and store link (local rank 0 of a multi-node job), or None
    _node_link: Any = None
    #: a new subscriber waits for its greeting; when the next one may be sent
    _greet_due = False
    _next_greeting = 0.0

    def _bind(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """Bind the sockets, open the run log and write the run file.

        Raises:
            agent.runs.UnsafeDirectoryError, OSError: the run directory is refused or
                cannot be made (the agent then stays inert: training goes on
                unobserved). A run log that cannot be opened is not an error: the run
                goes on without one, and an event says why.
        """
        directory = run_dir()  # resolved and checked once, used for all that follows
        holder = rank_taken(self.run_id, self.rank, directory)
        if holder is not None:  # never take over another job's sockets and run file
            taken, self.run_id = self.run_id, new_run_id()
            self.event("warning", f"run id {taken} rank {self.rank} is in use by pid "
                       f"{holder} (another job from the same launcher?); this process is "
                       f"run {self.run_id}: set {RUN_ID_ENV} to one value on every rank "
                       "of a job to keep its ranks together", kind=EventKind.WARNING)
        pub = context.socket(zmq.XPUB)  # a PUB that also hears (un)subscriptions
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, to greet each newcomer
        pub.setsockopt(zmq.SNDHWM, 10_000)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, _MAX_COMMAND_BYTES)
        router.setsockopt(zmq.RCVHWM, _COMMAND_QUEUE)
        for socket in (pub, router):
            socket.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        # ipc in the private run directory, always: only this user can connect; a tcp
        # run's ports are bound by its gateway process, never by the training process
        base = directory / f"{self.run_id}.r{self.rank}"
        endpoints = {}
        for socket, suffix in ((pub, "pub"), (router, "cmd")):
            endpoint = f"ipc://{base}.{suffix}"
            socket.bind(endpoint)
            self._ipc_paths += (f"{base}.{suffix}",)
            os.chmod(f"{base}.{suffix}", 0o600)
            endpoints[f"{suffix}_endpoint"] = endpoint
        if self.transport == "tcp":
            endpoints = self._start_gateway(endpoints["pub_endpoint"],
                                            endpoints["cmd_endpoint"])
        self._log = self._guard("run log", self._open_log)
        self.info = RunInfo(run_id=self.run_id, rank=self.rank, world_size=self.world_size,
                            pid=os.getpid(), token=self.token,
                            started_at=self._started_at, name=self.name,
                            log_path=str(self._log.path) if self._log else "", **endpoints)
        # a multi-node torchrun job: the node's relay and the job's store (local rank 0)
        self._node_link = self._guard("multi-node", node_link, self.info, self.listen,
                                      self.report_error, self.event)
        write_run_file(self.info, directory)
        return pub, router

    def _open_log(self) -> RunLog:
        """The run log of this rank, in :func:`agent.runlog.log_dir`.

        Raises:
            agent.runs.UnsafeDirectoryError, agent.runlog.UnsafeLogFileError, OSError:
                the directory or the file is refused or cannot be made.
        """
        return RunLog(log_dir() / f"{self.run_id}.rank{self.rank}.jsonl")

    def _io_loop(self, context: zmq.Context) -> None:
        pub, router = self._bind(context)
        self._pub = pub
        self._ready.set()
        self._publish(protocol.HELLO, self._hello())
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)
        next_system = next_heartbeat = time.monotonic()
        heartbeats = 0
        budget, budget_until = COMMANDS_PER_S, time.monotonic() + 1.0
        while True:
            stopping = self._stop.is_set()
            ready = dict(poller.poll(0 if stopping else _POLL_MS))
            if router in ready:
                budget -= self._guard("command handling", self._serve_commands, router,
                                      min(budget, _MAX_COMMANDS_PER_POLL), default=0)
                if budget <= 0:
                    poller.unregister(router)  # the rest waits for the next second
            if time.monotonic() >= budget_until:
                if budget <= 0:
                    poller.register(router, zmq.POLLIN)
                budget, budget_until = COMMANDS_PER_S, time.monotonic() + 1.0
            if pub in ready or self._greet_due:
                self._guard("greeting", self._greet_subscribers, pub)
            if self._announce:
                self._announce = False
                self._guard("hello", self._publish, protocol.HELLO, self._hello())
            self._guard("step publishing", self._encoder.drain)
            if self._log is not None:
                self._guard("run log", self._log.maybe_flush)
            now = time.monotonic()
            if now >= next_system:
                next_system = now + _HEARTBEAT_INTERVAL_S
                self._guard("system probe", self._publish_system)
            if now >= next_heartbeat:
                next_heartbeat = now + _HEARTBEAT_INTERVAL_S
                heartbeats += 1
                self._publish(protocol.HEARTBEAT, self._heartbeat())
                if self._gateway is not None and self._gateway.poll() is not None:
                    self._guard("tcp gateway", self._gateway_gone)
                if self._node_link is not None and not self._node_link.alive():
                    self._node_link = None
                    self.report_error("node relay", RuntimeError(
                        "it exited; the other nodes no longer see or steer this one"))
                if heartbeats % _HELLO_EVERY_HEARTBEATS == 0:
                    self._guard("hello", self._publish, protocol.HELLO, self._hello())
                    self._publish(protocol.STATE,
                                  {"knobs": self._knob_values, "step": self._last_step})
            if stopping:
                for _ in range(2):  # the second pass sends events the first one raised
                    self._guard("step publishing", self._encoder.drain, True)
                self._publish(protocol.BYE, {"reason": self._bye_reason or "",
                                             "steps": self._last_step})
                return

    def _greet_subscribers(self, pub: zmq.Socket) -> None:
        """A new subscriber gets ``hello`` and ``state`` at once (no wait for the next
        periodic ``hello``), or, when subscriptions come faster than
        :data:`GREETINGS_PER_S`, with the next greeting allowed, one for all who came in
        between. Greetings go on the wire only, not in the run log (which has the
        ``hello`` it starts with and the periodic ones), and repeat the latest ``seq``:
        resubscribing in a loop can neither fill the log nor look like lost records."""
        for _ in range(_MAX_SUBSCRIPTIONS_PER_POLL):
            try:
                frame = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._greet_due = self._greet_due or frame[:1] == b"\x01"
        now = time.monotonic()
        if self._greet_due and now >= self._next_greeting:
            self._greet_due = False
            self._next_greeting = now + 1.0 / GREETINGS_PER_S
            self._publish(protocol.HELLO, self._hello(), logged=False)
            self._publish(protocol.STATE, {"knobs": self._knob_values, "step": self._last_step},
                          logged=False)

    def _guard(self, where: str, function: Any, *args: Any, default: Any = None) -> Any:
        try:
            return function(*args)
        except Exception as exc:
            self.report_error(where, exc)
            return default

    def _publish(self, msg_type: str, body: dict[str, Any], logged: bool = True) -> None:
        """Send one message (and append it to the run log). ``logged=False``: a repeat
        for new subscribers, sent with the latest ``seq`` and not logged. The steps
        batched so far are sent first, so every message keeps its order with them."""
        if msg_type != protocol.STEPS:
            self._encoder.flush()
        if logged:
            self._seq += 1
        message = protocol.envelope(msg_type, body, run=self.run_id, rank=self.rank,
                                    seq=self._seq)
        if self._log is not None and logged:
            try:
                self._log.write(message)
            except Exception as exc:  # disk full, ...: go on without the log
                self._log = None
                self.report_error("run log", exc)
        try:
            topic, payload = protocol.encode(message)
        except Exception as exc:  # a value msgpack cannot hold: drop this message only
            self.report_error(f"encoding a {msg_type} message", exc)
            return
        try:  # two plain sends: cheaper than send_multipart's Python on this hot I/O path
            self._pub.send(topic, _SEND_MORE)
            self._pub.send(payload, _SEND_LAST)
        except zmq.Again:
            pass  # no subscriber keeps up: PUB drops; the seq gap tells the dashboard

    def _check_step(self, step: int, loss: float | None, skipped: bool | None) -> None:
        rollback = self._change_guard.on_step(step, loss, skipped)
        if rollback is not None and self.world_size > 1:  # this rank alone must not
            self._publish(protocol.EVENT, {
                "level": "warning", "kind": EventKind.WARNING, "step": step,
                "text": f"{rollback.reason}; not rolled back: with {self.world_size} ranks "
                        "only a command to every rank may change a knob (gpuwatch set "
                        + " ".join(assignment(k, v) for k, v in rollback.values.items())
                        + ")"})
            return
        if rollback is not None:
            apply_step = self._last_step + 2
            self._desk.schedule_rollback(rollback, apply_step)
            self._publish(protocol.EVENT, {
                "level": "warning", "kind": EventKind.ROLLBACK, "step": apply_step,
                "text": f"{rollback.reason}: rolling back to "
                        + ", ".join(assignment(k, v) for k, v in rollback.values.items())
                        + f" at step {apply_step}"})
            return
        warning = None if self.tune.running else self._change_guard.non_finite_warning(
            step, loss)  # (the search watches its own changes)
        if warning:
            self._publish(protocol.EVENT, {"level": "warning", "kind": EventKind.WARNING,
                                           "text": warning, "step": step})

    def _publish_system(self) -> None:
        self._publish(protocol.SYSTEM, self._probe.sample())

    def _heartbeat(self) -> dict[str, Any]:
        return {"step": self._last_step, "ending": self._ending,
                "records_dropped": self._encoder.records_dropped,
                "errors": len(self.errors),
                "commands_refused": self._desk.commands_refused,
                "commands_rejected": self._desk.commands_rejected}

    def _hello(self) -> dict[str, Any]:
        if not hasattr(self, "_env_report"):
            self._env_report = _environment_report()
        return {
            "name": self.name, "pid": os.getpid(), "host": self.info.host if self.info else "",
            "rank": self.rank, "world_size": self.world_size,
            "started_at": self._started_at,
            "device": str(self.device) if self.device is not None else "cpu",
            "model": {"name": self.model_name, "params": self.params},
            "env": self._env_report, "knobs": self.knobs.schema(),
            "log_path": self.info.log_path if self.info else "",
            "knob_values": self._knob_values, "training": self.training,
            "errors": self.errors[-10:],  # what a dashboard that comes late missed
        }

    # ---------------------------------------------------------------- commands

    def _serve_commands(self, router: zmq.Socket, limit: int) -> int:
        """Read and answer at most ``limit`` command messages; returns how many."""
        served = 0
        while served < limit:
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            served += 1
            # a command through the tcp gateway comes as [gateway, client, *message]
            hops = 2 if frames[0] == self._gateway_id and len(frames) > 2 else 1
            route, rest = frames[:hops], frames[hops:]
            reply = self._command_reply(rest)
            if reply is None:
                continue
            if isinstance(reply.get("reason"), str):  # a huge bad value is not echoed
                reply["reason"] = protocol.shorten(reply["reason"])
            if "knob" in reply:
                reply["knob"] = protocol.short_name(reply["knob"])
            frames_out = protocol.encode(protocol.envelope(
                protocol.REPLY, reply, run=self.run_id, rank=self.rank))
            try:
                router.send_multipart([*route, *frames_out], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the client went away
        return served

    def _command_reply(self, frames: list[bytes]) -> Reply | None:
        try:
            message = protocol.decode_frames(frames)
        except protocol.ProtocolError as exc:
            return {"id": None, "ok": False, "reason": f"malformed message: {exc}"}
        if message["type"] != protocol.COMMAND:
            return None  # unknown types are ignored (protocol rule)
        return self._desk.answer(message["body"])


def ending_reason(error: BaseException | None) -> str:
    """What ``bye`` says of a run that ends with ``error`` (None: it finished): the same
    words in every integration (``finished``, ``stopped by SIGINT`` for Ctrl-C,
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


def _environment_report() -> dict[str, Any]:
    from gpuopt.environment import environment_report

    return environment_report()
