"""A node's relay in a multi-node job: the node's one tcp door, in a child process of rank 0.

A child process of the node's local rank 0 (``python -m agent.io.relay``), like the tcp
gateway (:mod:`agent.io.gateway`): what remote clients make a process hold is held here,
never by a training process.

It listens with CURVE (its server key pair and the one client key it lets in are
derived from the user's job secret: see :mod:`agent.wire.nodes`), behind the same tcp front
door as the gateway (:class:`agent.io.gateway.Front`: a bounded number of connections per
peer, so no one can exhaust its descriptors or crowd the owner's dashboards out), and:

- commands: a ``command`` with the relay's token is passed to every rank of the node
  (their run files give their endpoints and tokens, as for a dashboard on this node),
  on one connection per rank for all phases of one command id (dry run, command,
  cancel arrive in the order sent), and answered with one ``reply`` holding every
  rank's reply (``relay: true``, ``node``, ``replies``). A rank that does not answer
  within the sender's ``within_s`` is answered for (``answered: false``), so the
  sender withdraws the command everywhere.
- telemetry: one ``node`` message a second sums the node's ranks up (each rank's step,
  smoothed step time and data-wait share); the full stream of global rank 0 (the
  dashboard's charts) and the events and ``bye`` of every rank are forwarded. So a
  dashboard holds one socket per node and receives per second a few messages per node
  plus rank 0's own, whatever the number of ranks.

Settings: one JSON line on stdin (see :func:`serve`); answer: one JSON line on stdout
(``{"pub_port", "cmd_port"}`` or ``{"error"}``); it ends when stdin closes (the agent
closes it, or its process died). No torch.
"""

from __future__ import annotations

import hmac
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from agent.io import helpers
from agent.wire import protocol
from agent.wire.commands import RankConnections, secure, shared_context
from agent.io.gateway import Front
from agent.wire.runs import RunInfo, run_ranks

#: How often the node summary is published, and the run files looked at again (s).
SUMMARY_S = 1.0
#: Events forwarded per second at most (of all the node's ranks); the rest are counted.
EVENTS_PER_S = 50
#: Steps the per-rank pace is smoothed over (an exponential moving average).
PACE_STEPS = 20
#: Commands whose connections are kept (for their later phases), and for how long (s).
KEPT_COMMANDS = 16
KEEP_COMMAND_S = 120.0
#: Longest a relay waits for its ranks' replies to one phase (s).
MAX_WITHIN_S = 30.0


class _Pace:
    """A rank's latest step, smoothed step time (s) and data-wait share, and when it
    was heard (monotonic s)."""

    __slots__ = ("step", "step_time_s", "data_wait_share", "heard_at")

    def __init__(self) -> None:
        self.step: int | None = None
        self.step_time_s: float | None = None
        self.data_wait_share: float | None = None
        self.heard_at = time.monotonic()

    def add(self, body: dict[str, Any]) -> None:
        self.heard_at = time.monotonic()
        step = body.get("step")
        self.step = step if type(step) is int else self.step
        for name in ("step_time_s", "data_wait_share"):
            value = body.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                continue
            old = getattr(self, name)
            setattr(self, name, value if old is None else old + (value - old) / PACE_STEPS)


class Relay:
    """The relay's two jobs, each on a thread of its own with its own socket."""

    def __init__(self, settings: dict[str, Any], front_pub: zmq.Socket,
                 front_cmd: zmq.Socket) -> None:
        self.run_id: str = settings["run_id"]
        self.node: int = settings["node"]
        self.host: str = settings.get("host", "")
        self.expected: list[int] = list(settings["ranks"])
        self.token: str = settings["token"]
        self.front_pub, self.front_cmd = front_pub, front_cmd
        self.stop = threading.Event()
        self._connections: dict[str, tuple[RankConnections, float]] = {}

    # ---------------------------------------------------------------- commands

    def serve_commands(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front_cmd, zmq.POLLIN)
        try:
            while not self.stop.is_set():
                if not poller.poll(100):
                    self._expire()
                    continue
                try:
                    frames = self.front_cmd.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                reply = self._reply(frames[1:])
                if reply is None:
                    continue
                out = protocol.encode(protocol.envelope(
                    protocol.REPLY, reply, run=self.run_id,
                    rank=min(self.expected, default=0)))
                try:
                    self.front_cmd.send_multipart([frames[0], *out], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the client went away
        finally:
            for connections, _ in self._connections.values():
                connections.__exit__()

    def _reply(self, frames: list[bytes]) -> protocol.Reply | None:
        try:
            message = protocol.decode_frames(frames)
        except protocol.ProtocolError as exc:
            return {"id": None, "ok": False, "relay": True, "reason": f"malformed: {exc}"}
        if message["type"] != protocol.COMMAND:
            return None
        body = message["body"]
        command_id = body.get("id")
        answer: protocol.Reply = {"id": command_id, "ok": False, "relay": True,
                                  "node": self.node}
        if body.get("dry_run") is True:
            answer["dry_run"] = True
        if body.get("cancel") is True:
            answer["cancel"] = True
        token = body.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(
                token.encode("utf-8", "replace"), self.token.encode()):
            return {**answer, "reason": "missing or wrong token"}
        if not isinstance(command_id, str) or not command_id:
            return {**answer, "reason": "a command to a relay needs a string id"}
        within_s = body.get("within_s", 2.0)
        if isinstance(within_s, bool) or not isinstance(within_s, (int, float)):
            within_s = 2.0
        within_s = min(MAX_WITHIN_S, max(0.1, float(within_s)))
        kept = self._connections.get(command_id)
        if kept is None:
            connections = RankConnections(self._local_ranks())
            self._expire(room_for_one=True)
        else:
            connections = kept[0]
        self._connections[command_id] = (connections, time.monotonic())
        forwarded = {key: value for key, value in body.items()
                     if key not in ("token", "within_s")}
        replies = connections.exchange(forwarded, within_s, None)
        per_rank: list[protocol.Reply] = [{**reply, "rank": info.rank}
                                          for info, reply in zip(connections.ranks, replies)]
        found = {info.rank for info in connections.ranks}
        per_rank += [{"id": command_id, "ok": False, "answered": False, "rank": rank,
                      "reason": f"rank {rank} has no run file on node {self.node}"}
                     for rank in self.expected if rank not in found]
        per_rank.sort(key=lambda reply: reply["rank"])
        return {**answer, "ok": all(reply.get("ok") for reply in per_rank),
                "replies": per_rank}

    def _local_ranks(self) -> list[RunInfo]:
        try:
            return [info for info in run_ranks(self.run_id) if info.rank in self.expected]
        except OSError:
            return []

    def _expire(self, room_for_one: bool = False) -> None:
        now = time.monotonic()
        for command_id, (connections, used_at) in sorted(
                self._connections.items(), key=lambda item: item[1][1]):
            if (now - used_at > KEEP_COMMAND_S
                    or (room_for_one and len(self._connections) >= KEPT_COMMANDS)):
                connections.__exit__()
                del self._connections[command_id]

    # ---------------------------------------------------------------- telemetry

    def serve_telemetry(self) -> None:
        subscribers: dict[int, tuple[RunInfo, zmq.Socket]] = {}
        paces: dict[int, _Pace] = {}
        cached: dict[str, list[bytes]] = {}  # rank 0's latest hello and state
        greet_due, next_greeting = False, 0.0
        events_left, events_dropped = EVENTS_PER_S, 0
        next_summary = 0.0
        poller = zmq.Poller()
        poller.register(self.front_pub, zmq.POLLIN)
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_summary:
                    next_summary = now + SUMMARY_S
                    events_left = EVENTS_PER_S
                    self._follow_ranks(subscribers, poller)
                    self._send(protocol.encode(self._summary(paces, events_dropped)))
                ready = dict(poller.poll(100))
                if self.front_pub in ready:
                    for _ in range(1000):
                        try:
                            frame = self.front_pub.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        greet_due = greet_due or frame[:1] == b"\x01"
                if greet_due and now >= next_greeting:
                    greet_due, next_greeting = False, now + 0.5
                    for frames in cached.values():
                        self._send(frames)
                for rank, (_, socket) in list(subscribers.items()):
                    if socket not in ready:
                        continue
                    for _ in range(1000):
                        try:
                            frames = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            message = protocol.decode_frames(frames)
                        except protocol.ProtocolError:
                            continue
                        kind, body = message["type"], message["body"]
                        if kind in (protocol.STEP, protocol.STEPS):
                            pace = paces.setdefault(rank, _Pace())
                            try:
                                for row in (protocol.step_bodies(body)
                                            if kind == protocol.STEPS else [body]):
                                    pace.add(row)
                            except protocol.ProtocolError:
                                continue
                        elif rank in paces:
                            paces[rank].heard_at = time.monotonic()
                        if rank == 0:
                            if kind in (protocol.HELLO, protocol.STATE):
                                cached[kind] = frames
                            self._send(frames)
                        elif kind in (protocol.EVENT, protocol.BYE):
                            if events_left > 0 or kind == protocol.BYE:
                                events_left -= 1
                                self._send(frames)
                            else:
                                events_dropped += 1
        finally:
            for _, socket in subscribers.values():
                socket.close(linger=0)

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.front_pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no subscriber keeps up: dropped, as the agent's PUB does

    def _follow_ranks(self, subscribers: dict[int, tuple[RunInfo, zmq.Socket]],
                      poller: zmq.Poller) -> None:
        """Subscribe to the node's ranks whose run files appeared (or changed)."""
        for info in self._local_ranks():
            known = subscribers.get(info.rank)
            if known is not None and (known[0].pid, known[0].pub_endpoint) == (
                    info.pid, info.pub_endpoint):
                continue
            if known is not None:
                poller.unregister(known[1])
                known[1].close(linger=0)
            socket: zmq.Socket = shared_context().socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, 1000)
            socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                secure(socket, info)
                socket.connect(info.pub_endpoint)
            except zmq.ZMQError:
                socket.close(linger=0)
                continue
            subscribers[info.rank] = (info, socket)
            poller.register(socket, zmq.POLLIN)

    def _summary(self, paces: dict[int, _Pace], events_dropped: int) -> dict[str, Any]:
        now = time.monotonic()
        ranks = [{"rank": rank, "step": pace.step, "step_time_s": pace.step_time_s,
                  "data_wait_share": pace.data_wait_share,
                  "heard_s_ago": round(now - pace.heard_at, 3)}
                 for rank, pace in sorted(paces.items())]
        return protocol.envelope(protocol.NODE, {
            "node": self.node, "host": self.host, "expected": self.expected,
            "ranks": ranks, "events_dropped": events_dropped},
            run=self.run_id, rank=min(self.expected, default=0))


def serve(settings: dict[str, Any], stdin_fd: int, out: Any) -> int:
    """Bind, say the ports on ``out``, relay until ``stdin_fd`` reaches EOF.

    Args:
        settings: ``run_id``, ``node``, ``host``, ``ranks`` (the node's global ranks),
            ``address`` (where to listen), ``server_public``, ``server_secret``,
            ``client_public`` (Z85 CURVE keys) and ``token`` (what commands must carry).
        stdin_fd: closed by the agent (or by its process's death) to stop.
        out: where the one JSON line with the ports goes.

    Raises:
        zmq.ZMQError: a socket cannot be bound.
    """
    import select

    context = zmq.Context()
    threads: list[threading.Thread] = []
    relay = None
    front: Front | None = None
    private = tempfile.mkdtemp(prefix="gpuwatch-relay-")  # 0700: this user's only
    try:
        # ZeroMQ listens on private ipc sockets behind the tcp front door, which lets
        # in a bounded number of connections per peer (as the gateway's)
        front = Front(context, settings["address"], settings["server_public"],
                      settings["server_secret"], settings["client_public"],
                      [os.path.join(private, "pub"), os.path.join(private, "cmd")])
        relay = Relay(settings, front.pub, front.cmd)
        # the sockets move to their threads here (starting a thread is a memory barrier)
        threads = [threading.Thread(target=relay.serve_commands, daemon=True),
                   threading.Thread(target=relay.serve_telemetry, daemon=True)]
        for thread in threads:
            thread.start()
        out.write(json.dumps(front.ports) + "\n")
        out.flush()
        while not select.select([stdin_fd], [], [], 1.0)[0]:
            if not all(thread.is_alive() for thread in threads):
                return 1
    finally:
        if relay is not None:
            relay.stop.set()
        for thread in threads:
            thread.join(5.0)
        if front is not None:
            front.close()
        context.destroy(linger=0)
        shutil.rmtree(private, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(helpers.main(serve, (zmq.ZMQError,)))
