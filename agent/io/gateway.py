"""The tcp side of a run, in a child process of its own.

What a tcp client can make a process hold (connections, file descriptors, buffers) is held
here, never by the training process.

A tcp port, loopback included, is open to every user of the machine, and ZeroMQ has no
limit on the connections a bound socket accepts: 1,200 connections that never finish
their handshake exhaust the file descriptors of whoever holds the port. So the agent
binds only its private ipc sockets, and for a tcp run it starts this gateway (``python
-m agent.io.gateway``). Its tcp ports are a front door of its own (:mod:`agent.io.tcpfront`:
a bounded number of connections per peer, the owner's share apart, so no one can hold
more than a few hundred of its descriptors or crowd the owner out), which relays each
connection let in to the gateway's ZeroMQ sockets with CURVE (only the run's client key
is let in, by a ZAP check; a connection that has not authenticated within
:data:`HANDSHAKE_MS` is closed). Those forward:

- telemetry: its XPUB (tcp) <- XSUB (the agent's ipc PUB), subscriptions upstream;
- commands: its ROUTER (tcp) -> DEALER (the agent's ipc ROUTER) with the client's
  routing id in front (``[client id, *frames]``), replies back to that client.

The gateway reads one JSON line of settings on stdin (see :func:`serve`), answers one
JSON line on stdout (``{"pub_port", "cmd_port"}``, or ``{"error"}``), and ends when its
stdin closes: when the agent closes it, or when the training process dies, however. Its
own limits: at most :data:`MAX_SUBSCRIPTION_BYTES` a subscription message, and
:data:`MAX_COMMAND_BYTES` / :data:`COMMAND_QUEUE` a command message / queued per client,
a :data:`HANDSHAKE_MS` handshake timeout. No torch, no numpy: it starts in a fraction of
a second.
"""

from __future__ import annotations

import hmac
import json
import os
import sys
from typing import Any

import zmq

from agent.io import helpers
from agent.io.tcpfront import TcpFront

from agent.io.helpers import (COMMAND_QUEUE, HANDSHAKE_MS, MAX_COMMAND_BYTES,
                               MAX_SUBSCRIPTION_BYTES, SEND_HIGH_WATER_MARK)


class _OneClientKey:
    """ZAP credentials check: only the run's own client key may connect."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        """``key``: the connecting client's public key, Z85."""
        return hmac.compare_digest(key, self.client_public)


class Front:
    """What clients of a helper process (this gateway, a node's relay) talk to.

    Its two ZeroMQ sockets with CURVE (only ``client_public`` let in, by a ZAP check; a
    connection not authenticated within :data:`HANDSHAKE_MS` closed), ``pub`` (XPUB:
    telemetry out, subscriptions in, at most :data:`MAX_SUBSCRIPTION_BYTES` each) and
    ``cmd`` (ROUTER: commands, at most :data:`MAX_COMMAND_BYTES` and
    :data:`COMMAND_QUEUE` per client), listening on private ipc paths behind a tcp front
    door (:class:`agent.io.tcpfront.TcpFront`) that lets in a bounded number of
    connections per peer.

    Args:
        context: the process's ZeroMQ context (destroyed by the caller, after
            :meth:`close`).
        address: where the tcp ports listen. server_public, server_secret,
            client_public: Z85 CURVE keys.
        inside: two ipc socket paths in a directory only this user may enter (made
            0600 here, removed by :meth:`close`).

    Raises:
        zmq.ZMQError, OSError: a socket cannot be bound.
    """

    def __init__(self, context: zmq.Context, address: str, server_public: str,
                 server_secret: str, client_public: str, inside: list[str]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.inside = inside
        self.door: TcpFront | None = None
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        try:
            self._authenticator.configure_curve_callback(
                domain="*", credentials_provider=_OneClientKey(client_public.encode()))
            self.pub = context.socket(zmq.XPUB)
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription: it greets
            self.pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            self.pub.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
            self.cmd = context.socket(zmq.ROUTER)
            self.cmd.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND_BYTES)
            self.cmd.setsockopt(zmq.RCVHWM, COMMAND_QUEUE)
            for socket, path in zip((self.pub, self.cmd), inside):
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
                socket.curve_secretkey = server_secret.encode()
                socket.curve_publickey = server_public.encode()
                socket.curve_server = True
                socket.bind(f"ipc://{path}")
                os.chmod(path, 0o600)
            self.door = TcpFront(address, inside).start()
        except BaseException:
            self.close()
            raise

    @property
    def ports(self) -> dict[str, int]:
        """``{"pub_port", "cmd_port"}``: the front door's tcp ports."""
        assert self.door is not None
        return {"pub_port": self.door.ports[0], "cmd_port": self.door.ports[1]}

    def close(self) -> None:
        """Close the front door, stop the ZAP check and remove the ipc paths.

        The sockets close with the context."""
        if self.door is not None:
            self.door.close()
        self._authenticator.stop()
        for path in self.inside:
            try:
                os.unlink(path)
            except OSError:
                pass


def serve(settings: dict[str, Any], stdin_fd: int, out: Any) -> int:
    """Bind, say the ports on ``out``, forward until ``stdin_fd`` reaches EOF.

    Args:
        settings: ``pub`` and ``cmd`` (the agent's ipc endpoints), ``address`` (where to
            listen: 127.0.0.1 or e.g. 0.0.0.0), ``server_public``, ``server_secret``,
            ``client_public`` (Z85 CURVE keys), ``routing_id`` (hex: the id the agent
            knows this gateway's commands by), ``inside_pub`` and ``inside_cmd`` (paths in
            the agent's private run directory where the gateway's own ZeroMQ sockets
            listen, behind its tcp front door: :mod:`agent.io.tcpfront`).
        stdin_fd: closed by the agent (or by the training process's death) to stop.
        out: where the one JSON line with the ports goes.

    Returns:
        The exit status (0).

    Raises:
        zmq.ZMQError: a socket cannot be bound or connected.
    """
    context = zmq.Context()
    front: Front | None = None
    try:
        # ZeroMQ listens on private ipc sockets; the tcp ports are the front door's,
        # which lets in a bounded number of connections per peer and relays their bytes
        front = Front(context, settings["address"], settings["server_public"],
                      settings["server_secret"], settings["client_public"],
                      [settings["inside_pub"], settings["inside_cmd"]])
        back_pub = context.socket(zmq.XSUB)
        back_cmd = context.socket(zmq.DEALER)
        back_cmd.setsockopt(zmq.ROUTING_ID, bytes.fromhex(settings["routing_id"]))
        for socket in (back_pub, back_cmd):
            socket.setsockopt(zmq.LINGER, 0)
        back_pub.connect(settings["pub"])
        back_cmd.connect(settings["cmd"])
        out.write(json.dumps(front.ports) + "\n")
        out.flush()
        _forward(front.pub, front.cmd, back_pub, back_cmd, stdin_fd)
    finally:
        if front is not None:
            front.close()
        context.destroy(linger=0)
    return 0


def _forward(front_pub: zmq.Socket, front_cmd: zmq.Socket, back_pub: zmq.Socket,
             back_cmd: zmq.Socket, stdin_fd: int) -> None:
    """Forward in both directions until ``stdin_fd`` is readable (EOF: the agent is
    gone or done). Never blocks on a send: a slow peer loses messages (counted by the
    dashboard's sequence gaps), it never stalls the gateway."""
    poller = zmq.Poller()
    for socket in (front_pub, front_cmd, back_pub, back_cmd):
        poller.register(socket, zmq.POLLIN)
    poller.register(stdin_fd, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if stdin_fd in ready:
            return
        # commands keep their client's routing id in front both ways: the agent answers
        # [gateway id, client id, reply], which reaches the client as [reply]
        for source, sink in ((back_pub, front_pub), (front_pub, back_pub),
                             (front_cmd, back_cmd), (back_cmd, front_cmd)):
            if source not in ready:
                continue
            for _ in range(1000):  # then the others get their turn
                try:
                    frames = source.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    sink.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError:  # full, or a client that went away: drop it
                    pass


if __name__ == "__main__":
    sys.exit(helpers.main(serve, (zmq.ZMQError,)))
