"""The I/O loop: the agent's thread that owns every socket and file of the run.

Owns the ZeroMQ context and sockets (XPUB for telemetry, ROUTER for commands, on ipc in
the private run directory), the tcp gateway child process with the run's CURVE keys
(:mod:`agent.io.gateway`), the run file, the run log's writer (a child process:
:mod:`agent.io.logwriter`), the node relay link of a multi-node job, the sequence numbers
of published messages, greetings of new subscribers, heartbeats, the periodic ``hello``
and ``state``, and the system probe (about 1 Hz).
Each wake-up it drains the step encoder (:mod:`agent.step.encoder`) and hands each command
body to the command desk (:mod:`agent.control.desk`), answering at once. It never runs on the
training thread; what it sends, it sends without blocking (PUB drops at its high-water
mark).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import zmq

from agent.io import helpers
from agent.wire import protocol
from agent.io.multinode import node_link
from agent.io.probes import Nvml, SystemProbe
from agent.wire.protocol import EventKind, Reply
from agent.io.logwriter import LogWriter
from agent.wire.runlog import LOG_SUFFIX, pack_plain
from agent.wire.runs import (
    RUN_ID_ENV,
    RunInfo,
    new_run_id,
    rank_taken,
    remove_run_file,
    run_dir,
    write_run_file,
)

if TYPE_CHECKING:
    from agent.control.desk import CommandDesk
    from agent.step.encoder import StepEncoder
    from agent.control.guard import ChangeGuard
    from agent.wire.knobs import KnobSet
    from agent.search.tune import AutoTune

log = logging.getLogger("gpuwatch.agent")
_HEARTBEAT_INTERVAL_S = 1.0
_HELLO_EVERY_HEARTBEATS = 30  # a new subscriber is greeted at once anyway
#: The I/O thread wakes at least this often to publish the records queued since (ms),
#: as one ``steps`` batch, while someone reads them (a subscriber: a dashboard, ``tail``,
#: a node relay), the rollback guard watches a change or a search is on. Commands, new
#: subscribers and :meth:`IOLoop.stop` wake it at once (a command's latency does not
#: depend on it); each wake-up costs CPU (about 100 us on a 2-core machine, the poll
#: included, and as much again for the batch's message) and the training thread a GIL
#: hand-off, so it is kept rare: 10 a second, a batch of 100 steps at 1,000 steps/s.
_POLL_MS = 100
#: ... and this often (ms) while nobody has subscribed, so that only the run log reads
#: them (its buffer is flushed every 0.5 s anyway): 2 wake-ups a second, batches 5
#: times longer; sooner when the record queue would otherwise hold more than the
#: agent's ``drain_at`` records (a quarter of its bound: 2,048, reached at over 4,000
#: steps/s). Before the first step (no step time yet) too: an idle agent wakes 2 times a
#: second, not 10 (each wake-up costs it 60 to 110 us of CPU here, the kernel's timer
#: and the switch alone 60); the first steps then wait at most this long (a loop of more
#: than 16,000 steps/s overflows the queue before its first read: those steps are
#: counted as dropped, :meth:`agent.step.encoder.StepEncoder.overflowing`).
_QUIET_POLL_MS = 500
#: While an in-run search runs (:mod:`agent.search.tune`): it decides from each step record,
#: and each of its switches waits for the I/O thread to read the record that ends a
#: sub-block, so it reads them within 10 ms (100 wake-ups a second for the search's
#: few minutes: 1 to 2% of a core here, from the 100 to 200 us a wake-up costs; not
#: measured), not within 100 ms: at 40 steps/s a switch then costs about 2 steps of
#: the run's, not 6.
_TUNE_POLL_MS = 10
_MAX_COMMANDS_PER_POLL = 100
#: Command messages read per second at most, valid or not: a flood (even of garbage or
#: of wrong tokens) costs the training process a bounded ~1% of a core; the excess waits
#: in ZeroMQ's small receive queue, and beyond it the sender is throttled.
COMMANDS_PER_S = 200
#: New subscribers are greeted (hello + state, on the wire only) at most this often;
#: those who come in between share the next greeting.
GREETINGS_PER_S = 2
#: Subscription frames read per wake-up at most (the rest wait for the next one).
_MAX_SUBSCRIPTIONS_PER_POLL = 1000
_SEND_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_SEND_LAST = int(zmq.NOBLOCK)


class _Endpoints(TypedDict, total=False):
    """The run file's endpoint fields: the ipc sockets, or a tcp gateway's (with its
    CURVE keys)."""

    pub_endpoint: str
    cmd_endpoint: str
    curve_server_key: str
    curve_client_public_key: str
    curve_client_secret_key: str


class AgentView(Protocol):
    """What the I/O thread reads of its agent (:class:`agent.step.core.Agent`), never waiting.

    The run's facts for ``hello`` and the run file, the hot path's latest state, and where
    to report. Public members only; each read is an attribute read, never a wait."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def token(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def listen(self) -> str | None: ...
    @property
    def device(self) -> Any: ...
    @property
    def model_name(self) -> str: ...
    @property
    def params(self) -> int | None: ...
    @property
    def training(self) -> dict[str, Any]: ...
    @property
    def knobs(self) -> KnobSet: ...
    @property
    def errors(self) -> list[str]: ...
    @property
    def errors_not_kept(self) -> int: ...
    @property
    def started_at(self) -> float: ...
    @property
    def last_step(self) -> int: ...
    @property
    def ending(self) -> bool: ...
    @property
    def bye_reason(self) -> str | None: ...
    @property
    def knob_values(self) -> dict[str, Any]: ...

    def event(self, level: str, text: str, **fields: Any) -> None: ...
    def report_error(self, where: str, exc: BaseException) -> None: ...
    def io_ended(self) -> None: ...


class IOLoop:
    """The I/O thread of one agent: sockets, gateway, run file, run log, heartbeats.

    Args:
        agent: the agent whose run this is: its facts (name, rank, knobs, errors) and
            the hot path's latest step and knob values are read here.
        run_id: the run's id, kept in :attr:`run_id` (replaced when another process
            holds it, see :meth:`_bind`).
        desk: answers each command body.
        encoder: drained at each wake-up, and flushed before any other message.
        guard: the rollback guard; while it watches a change the loop wakes often.
        tune: the in-run search; while it runs the loop wakes more often still.
        drain_at: records the queue should hold at most between two quiet wake-ups (the
            poll wakes in time for that many at the latest step time, but waits at least
            :data:`_POLL_MS`); None: no such bound.
        nvml: the GPU probe (tests pass one with a fake NVML module).
    """

    def __init__(self, agent: AgentView, run_id: str, *, desk: CommandDesk,
                 encoder: StepEncoder, guard: ChangeGuard, tune: AutoTune,
                 drain_at: int | None, nvml: Nvml | None = None) -> None:
        self._agent = agent
        #: the run's id: the one given, or a new one if another process held it
        self.run_id = run_id
        self._desk = desk
        self._encoder = encoder
        self._change_guard = guard
        self._tune = tune
        self._drain_at = drain_at
        #: the run file's facts, once the sockets are bound (None before, or when they
        #: could not be)
        self.info: RunInfo | None = None
        #: the knob schema changed: send ``hello`` again at the next wake-up
        self.announce = False
        self._pub: zmq.Socket | None = None
        #: the run log's writer (a child process), or None
        self._log: LogWriter | None = None
        #: the sequence number of the latest message published (and logged)
        self.seq = 0
        self._probe = SystemProbe(nvml)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="gpuwatch-agent",
                                        daemon=True)
        #: ipc socket files bound (removed at exit, run file or not)
        self._ipc_paths: tuple[str, ...] = ()
        #: the tcp gateway (a child process) and the routing id of its commands
        self._gateway: Any = None
        self._gateway_id: bytes | None = None
        #: this node's relay and store link (local rank 0 of a multi-node job), or None
        self._node_link: Any = None
        #: a new subscriber waits for its greeting; when the next one may be sent
        self._greet_due = False
        self._next_greeting = 0.0
        #: subscriptions the PUB socket was sent (subscribe minus unsubscribe messages):
        #: while none, the quiet interval applies. A subscriber that disconnects sends
        #: no unsubscribe (ZeroMQ drops its subscriptions silently), so once anyone has
        #: subscribed the interval stays short (as it always was)
        self._subscriptions = 0
        #: a pipe whose read end the poll watches and :meth:`stop` writes to (made by
        #: :meth:`start`, closed by :meth:`stop` once the thread has ended)
        self._wake: tuple[int, int] | None = None
        self._env_report: dict[str, Any] | None = None

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    def start(self, timeout_s: float) -> None:
        """Start the thread; wait at most ``timeout_s`` (s) until the sockets are bound.

        Until the sockets are bound and the run file written, or binding failed (the agent
        then stays inert)."""
        self._wake = os.pipe()
        for fd in self._wake:
            os.set_blocking(fd, False)
        self._thread.start()
        self._ready.wait(timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Publish what is queued and ``bye``, close the sockets, remove the run file, join.

        Wait at most ``timeout_s`` (s) for the thread; one still running then (stuck: a
        flood of connections in ZeroMQ's poll, a listener that blocks) is left to end with
        the process, and a warning says that the run log may lack its last steps and its
        end. Any thread but the I/O one."""
        self._stop.set()
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")  # the poll returns now
            except OSError:
                pass  # the pipe is full: it is woken already
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("gpuwatch agent: its I/O thread did not end within %g s: the "
                            "run log may lack its last steps and its end (the thread is "
                            "left to end with the process)", timeout_s)
        if self._wake is not None and not self._thread.is_alive():
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def _main(self) -> None:
        helpers.block_broken_pipe_signal()  # a helper's death is an EPIPE here, not a kill
        context = zmq.Context()
        try:
            self._loop(context)
        except Exception as exc:
            self._agent.report_error("I/O thread", exc)
        finally:
            self._ready.set()
            self._agent.io_ended()
            if self._log is not None:  # first: whatever fails below, the log keeps bye
                self._guard("run log", self._log.close)
            if self.info is not None:
                self._guard("run file", remove_run_file, self.info)
            for path in self._ipc_paths:  # bound, even if the run file never came
                self._guard("socket file", Path(path).unlink, True)
            if self._pub is not None:
                self._pub.close(linger=500)  # let bye and the last records leave
            self._guard("tcp gateway", self._stop_gateway)
            for path in self._ipc_paths:  # the gateway's, should it have been killed
                self._guard("socket file", Path(f"{path}.gw").unlink, True)
            if self._node_link is not None:
                self._guard("node relay", self._node_link.close)
            self._guard("system probe", self._probe.close)
            context.destroy(linger=0)

    def _start_gateway(self, pub_endpoint: str, cmd_endpoint: str) -> _Endpoints:
        """Start the tcp side of this run in a child process (:mod:`agent.io.gateway`):
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
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self._gateway_id = b"gpuwatch-gateway-" + secrets.token_bytes(8)
        address = self._agent.listen or "127.0.0.1"
        settings = {"pub": pub_endpoint, "cmd": cmd_endpoint, "address": address,
                    "server_public": server_public.decode(),
                    "server_secret": server_secret.decode(),
                    "client_public": client_public.decode(),
                    "routing_id": self._gateway_id.hex(),
                    # where its ZeroMQ sockets listen behind its tcp front door
                    "inside_pub": f"{self._ipc_paths[0]}.gw",
                    "inside_cmd": f"{self._ipc_paths[1]}.gw"}
        self._gateway, answer = helpers.start("agent.io.gateway", settings, "tcp gateway")
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
        self._agent.report_error("tcp gateway", RuntimeError(
            f"it exited with status {status}; the run is now reached over ipc only "
            f"({self.info.pub_endpoint})"))

    def _stop_gateway(self) -> None:
        """Close the gateway's stdin (it ends on EOF); kill it if it lingers."""
        gateway, self._gateway = self._gateway, None
        if gateway is not None:
            helpers.stop(gateway)

    def _bind(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """Bind the sockets, open the run log and write the run file.

        Raises:
            agent.wire.runs.UnsafeDirectoryError, OSError: the run directory is refused or
                cannot be made (the agent then stays inert: training goes on
                unobserved). A run log that cannot be opened is not an error: the run
                goes on without one, and an event says why.
        """
        agent = self._agent
        directory = run_dir()  # resolved and checked once, used for all that follows
        holder = rank_taken(self.run_id, agent.rank, directory)
        if holder is not None:  # never take over another job's sockets and run file
            taken, self.run_id = self.run_id, new_run_id()
            agent.event("warning", f"run id {taken} rank {agent.rank} is in use by pid "
                        f"{holder} (another job from the same launcher?); this process is "
                        f"run {self.run_id}: set {RUN_ID_ENV} to one value on every rank "
                        "of a job to keep its ranks together", kind=EventKind.WARNING)
        pub = context.socket(zmq.XPUB)  # a PUB that also hears (un)subscriptions
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, to greet each newcomer
        pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # and every unsubscription: who still reads
        pub.setsockopt(zmq.SNDHWM, helpers.SEND_HIGH_WATER_MARK)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.MAXMSGSIZE, helpers.MAX_SUBSCRIPTION_BYTES)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, helpers.MAX_COMMAND_BYTES)
        router.setsockopt(zmq.RCVHWM, helpers.COMMAND_QUEUE)
        for socket in (pub, router):
            socket.setsockopt(zmq.HANDSHAKE_IVL, helpers.HANDSHAKE_MS)
        # ipc in the private run directory, always: only this user can connect; a tcp
        # run's ports are bound by its gateway process, never by the training process
        base = directory / f"{self.run_id}.r{agent.rank}"
        ipc = {}
        for socket, suffix in ((pub, "pub"), (router, "cmd")):
            endpoint = f"ipc://{base}.{suffix}"
            socket.bind(endpoint)
            self._ipc_paths += (f"{base}.{suffix}",)
            os.chmod(f"{base}.{suffix}", 0o600)
            ipc[suffix] = endpoint
        endpoints: _Endpoints = {"pub_endpoint": ipc["pub"], "cmd_endpoint": ipc["cmd"]}
        if agent.transport == "tcp":
            endpoints = self._start_gateway(endpoints["pub_endpoint"],
                                            endpoints["cmd_endpoint"])
        self._log = self._guard("run log", self._open_log)
        self.info = RunInfo(run_id=self.run_id, rank=agent.rank,
                            world_size=agent.world_size,
                            pid=os.getpid(), token=agent.token,
                            started_at=agent.started_at, name=agent.name,
                            log_path=str(self._log.path) if self._log else "", **endpoints)
        # a multi-node torchrun job: the node's relay and the job's store (local rank 0)
        self._node_link = self._guard("multi-node", node_link, self.info, agent.listen,
                                      agent.report_error, agent.event)
        write_run_file(self.info, directory)
        return pub, router

    def _open_log(self) -> LogWriter:
        """The writer of this rank's run log, in :func:`agent.wire.runlog.log_dir`.

        A child process (:mod:`agent.io.logwriter`), started but not waited for; the
        log's file is made and checked first (about 3 ms in all).

        Raises:
            OSError: the directory or the file is refused or cannot be made, or no
                process could be started.
        """
        return LogWriter.start(f"{self.run_id}.rank{self._agent.rank}{LOG_SUFFIX}",
                               self._agent.report_error)

    def _loop(self, context: zmq.Context) -> None:
        pub, router = self._bind(context)
        self._pub = pub
        self._guard("memory reading", self._encoder.read_memory)
        # the first system sample (NVML's start, psutil's first readings: about 1 ms)
        # is part of the start-up, taken before hello and sent right after it
        first_system = self._guard("system probe", self._probe.sample)
        self._ready.set()
        self.publish(protocol.HELLO, self._hello())
        if first_system is not None:
            self.publish(protocol.SYSTEM, first_system)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)
        assert self._wake is not None  # made by start()
        wake = self._wake[0]
        poller.register(wake, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        next_system = next_heartbeat + (_HEARTBEAT_INTERVAL_S if first_system else 0.0)
        heartbeats = 0
        budget, budget_until = COMMANDS_PER_S, time.monotonic() + 1.0
        while True:
            stopping = self._stop.is_set()
            ready = dict(poller.poll(0 if stopping else self._poll_ms()))
            if wake in ready:
                self._guard("wake-up pipe", os.read, wake, 64)
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
            if self.announce:
                self.announce = False
                self._guard("hello", self.publish, protocol.HELLO, self._hello())
            self._guard("step publishing", self._encoder.drain)
            if self._log is not None:
                self._guard("run log", self._log.pump)
            now = time.monotonic()
            if now >= next_system:
                next_system = now + _HEARTBEAT_INTERVAL_S
                self._guard("system probe", self._publish_system)
            if now >= next_heartbeat:
                next_heartbeat = now + _HEARTBEAT_INTERVAL_S
                heartbeats += 1
                self.publish(protocol.HEARTBEAT, self._heartbeat())
                if self._gateway is not None and self._gateway.poll() is not None:
                    self._guard("tcp gateway", self._gateway_gone)
                if self._node_link is not None and not self._node_link.alive():
                    self._node_link = None
                    self._agent.report_error("node relay", RuntimeError(
                        "it exited; the other nodes no longer see or steer this one"))
                if heartbeats % _HELLO_EVERY_HEARTBEATS == 0:
                    self._guard("hello", self.publish, protocol.HELLO, self._hello())
                    self.publish(protocol.STATE, self._state())
            if stopping:
                for _ in range(2):  # the second pass sends events the first one raised
                    self._guard("step publishing", self._encoder.drain, True)
                self._guard("tune", self._tune.run_ended)
                self.publish(protocol.BYE, protocol.Bye(reason=self._agent.bye_reason or "",
                                                       steps=self._agent.last_step))
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
            kind = frame[:1]
            if kind == b"\x01":
                self._subscriptions += 1
                self._greet_due = True
            elif kind == b"\x00":
                self._subscriptions = max(0, self._subscriptions - 1)
        now = time.monotonic()
        if self._greet_due and now >= self._next_greeting:
            self._greet_due = False
            self._next_greeting = now + 1.0 / GREETINGS_PER_S
            self.publish(protocol.HELLO, self._hello(), logged=False)
            self.publish(protocol.STATE, self._state(), logged=False)

    def _poll_ms(self) -> int:
        """How long the next poll may wait (ms): :data:`_TUNE_POLL_MS` while a search
        is on, :data:`_POLL_MS` while someone reads the records or the guard watches a
        change, else
        :data:`_QUIET_POLL_MS` or less (the time ``drain_at`` records take at the latest
        step time; :data:`_QUIET_POLL_MS` before the first step)."""
        if self._tune.running:
            return _TUNE_POLL_MS
        if self._subscriptions or self._change_guard.watching:
            return _POLL_MS
        step_time_s = self._encoder.recent_step_time_s
        drain_at = self._drain_at
        if step_time_s is None or drain_at is None:
            return _QUIET_POLL_MS
        return int(min(_QUIET_POLL_MS, max(_POLL_MS, drain_at * step_time_s * 1000)))

    def _guard(self, where: str, function: Any, *args: Any, default: Any = None) -> Any:
        try:
            return function(*args)
        except Exception as exc:
            self._agent.report_error(where, exc)
            return default

    def publish(self, msg_type: str, body: Mapping[str, Any] | protocol.PackedBody,
                logged: bool = True) -> None:
        """Send one message (and hand it to the run log's writer), in order with the steps batched.

        ``logged=False``: a repeat for new subscribers, sent with the latest ``seq`` and not
        logged. The steps batched so far are sent first, so every message keeps its order
        with them. An event is cut to a bounded size first
        (:func:`agent.wire.protocol.bounded_event`), so that large, frequent ones never
        crowd the steps out of the dashboards' queues."""
        if msg_type != protocol.STEPS:
            self._encoder.flush()
            if msg_type == protocol.EVENT and isinstance(body, Mapping):
                body = protocol.bounded_event(dict(body))
        if logged:
            self.seq += 1
        message = protocol.envelope(msg_type, body, run=self.run_id,
                                    rank=self._agent.rank, seq=self.seq)
        log = self._log if logged else None
        try:
            topic, payload = protocol.encode(message)
        except Exception as exc:  # a value msgpack cannot hold: not sent, only logged
            self._agent.report_error(f"encoding a {msg_type} message", exc)
            if log is not None:
                if isinstance(body, protocol.PackedBody):
                    message["body"] = body.plain()
                log.send(pack_plain(message))  # what it cannot hold as its repr
            return
        if log is not None:
            log.send(payload)  # the wire's bytes: the log writer's work is its own
        assert self._pub is not None  # bound before the first message, closed after the last
        try:  # two plain sends: cheaper than send_multipart's Python on this hot I/O path
            self._pub.send(topic, _SEND_MORE)
            self._pub.send(payload, _SEND_LAST)
        except zmq.Again:
            pass  # no subscriber keeps up: PUB drops; the seq gap tells the dashboard

    def _publish_system(self) -> None:
        self.publish(protocol.SYSTEM, self._probe.sample())

    def _heartbeat(self) -> protocol.Heartbeat:
        return {"step": self._agent.last_step, "ending": self._agent.ending,
                "records_dropped": self._encoder.records_dropped,
                "errors": len(self._agent.errors) + self._agent.errors_not_kept,
                "commands_refused": self._desk.commands_refused,
                "commands_rejected": self._desk.commands_rejected}

    def _state(self) -> protocol.State:
        return {"knobs": self._agent.knob_values, "step": self._agent.last_step}

    def _hello(self) -> protocol.Hello:
        if self._env_report is None:
            self._env_report = _environment_report()
        agent = self._agent
        return {
            "name": agent.name, "pid": os.getpid(),
            "host": self.info.host if self.info else "",
            "rank": agent.rank, "world_size": agent.world_size,
            "started_at": agent.started_at,
            "device": str(agent.device) if agent.device is not None else "cpu",
            "model": {"name": agent.model_name, "params": agent.params},
            "env": self._env_report, "knobs": agent.knobs.schema(),
            "absent": dict(agent.knobs.unsupported),
            "log_path": self.info.log_path if self.info else "",
            "knob_values": agent.knob_values, "training": agent.training,
            "errors": agent.errors[-10:],  # what a dashboard that comes late missed
        }

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
                protocol.REPLY, reply, run=self.run_id, rank=self._agent.rank))
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


def _environment_report() -> dict[str, Any]:
    from gpuopt.environment import environment_report

    return environment_report()
