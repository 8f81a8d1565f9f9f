"""The tcp front door of a gateway.

It accepts the tcp connections itself, lets in a bounded number per peer, and relays each
one's bytes to a private ipc socket where ZeroMQ (with CURVE) listens.

ZeroMQ has no limit on the connections a bound socket accepts (``ZMQ_MAX_SOCKETS``
counts sockets of a context, not connections; ``ZMQ_HANDSHAKE_IVL`` closes a connection
that never authenticates, but only after it was accepted), so a keyless local user who
keeps opening connections fills whoever holds the port up to its descriptor limit, and
the owner's own dashboard then cannot connect. Here a peer is whoever owns the other end:

- on this machine (loopback, or any of its addresses), the peer's user, from the
  kernel's socket table (``sock_diag``, the table ``ss`` reads): the owner (this
  process's uid) has a share of its own, :data:`OWNER_CONNECTIONS`, that no one else's
  connections count against;
- anyone else, by address: :data:`PEER_CONNECTIONS` each, and all of them together
  :data:`OTHERS_CONNECTIONS`.

A connection over its share is closed at once, before ZeroMQ sees a byte of it. One let in
costs three descriptors (the tcp one, its ipc twin, ZeroMQ's end of that) and at most
:data:`BUFFER_BYTES` of buffer each way; one that does not complete the CURVE handshake
within the ZeroMQ socket's ``HANDSHAKE_IVL`` is closed by ZeroMQ, and so here. So the
process holds at most (:data:`OWNER_CONNECTIONS` + :data:`OTHERS_CONNECTIONS`) x 3
descriptors for connections, whatever a client does.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

#: Connections the owner's own processes may hold (dashboards: 2 each).
OWNER_CONNECTIONS = 64
#: Connections one other peer (another local user, or a remote address) may hold.
PEER_CONNECTIONS = 8
#: Connections all the peers that are not the owner may hold together.
OTHERS_CONNECTIONS = 128
#: Bytes buffered each way per connection before reading from the other side pauses
#: (ZeroMQ then queues up to its high-water mark and drops, as with a slow subscriber).
BUFFER_BYTES = 256 * 1024
_CHUNK = 64 * 1024
_BACKLOG = 128
#: How long a listener rests when the process is out of descriptors (s).
_PAUSE_S = 0.1
#: netlink's sock_diag (linux/sock_diag.h, inet_diag.h)
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1


def peer_uid(connection: socket.socket, netlink: socket.socket | None) -> int | None:
    """The uid that owns the other end of an accepted tcp ``connection``, or None.

    Known when that end is a socket of this machine (in this network namespace), else None
    (a remote peer, or no sock_diag here). One exact lookup in the kernel's socket table, no
    scan."""
    if netlink is None:
        return None
    try:
        family = connection.family
        local, remote = connection.getsockname()[:2], connection.getpeername()[:2]
    except OSError:
        return None
    if family == socket.AF_INET6:  # an IPv4 peer on a dual-stack socket: look it up as such
        mapped = [ipaddress.ip_address(host.split("%")[0]).ipv4_mapped  # type: ignore[union-attr]
                  for host in (local[0], remote[0])]
        if all(mapped):
            family = socket.AF_INET
            local, remote = (str(mapped[0]), local[1]), (str(mapped[1]), remote[1])
    try:
        # the peer's socket: its local end is our remote one, its remote end our local
        sockid = struct.pack("!HH16s16s", remote[1], local[1],
                             socket.inet_pton(family, remote[0].split("%")[0]).ljust(16, b"\0"),
                             socket.inet_pton(family, local[0].split("%")[0]).ljust(16, b"\0"))
    except (OSError, ValueError):
        return None
    sockid += struct.pack("=IQ", 0, 0xFFFF_FFFF_FFFF_FFFF)  # any interface, no cookie
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFF_FFFF) + sockid
    global _sequence
    _sequence = (_sequence + 1) & 0xFFFF_FFFF
    try:
        netlink.send(struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY,
                                 _NLM_F_REQUEST, _sequence, 0) + request)
        while True:  # an answer to an earlier, timed-out question is skipped
            answer = netlink.recv(8192)
            if len(answer) >= 16 and struct.unpack_from("=I", answer, 8)[0] == _sequence:
                break
    except OSError:
        return None
    _, kind = struct.unpack_from("=IH", answer)
    # NLMSG_ERROR: no such socket here (a remote peer); else inet_diag_msg: family, state,
    # timer, retrans (4 x u8), sockid (48 bytes), expires, rqueue, wqueue, uid (u32 each)
    if kind != _SOCK_DIAG_BY_FAMILY or len(answer) < 16 + 4 + 48 + 16:
        return None
    if answer[16 + 4:16 + 4 + 36] != sockid[:36]:  # not the socket asked about
        return None
    (uid,) = struct.unpack_from("=I", answer, 16 + 4 + 48 + 12)
    return int(uid)


_sequence = 0


def _open_netlink() -> socket.socket | None:
    try:
        netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        netlink.settimeout(1.0)
        return netlink
    except (OSError, AttributeError):  # no netlink (not Linux, or forbidden here)
        return None


def _room_for_descriptors(wanted: int) -> None:
    """Raise this process's soft limit on open files to ``wanted`` when it is lower and
    the hard limit allows (a gateway inherits the training process's, often 1,024)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            if ceiling > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    except (ImportError, OSError, ValueError):
        pass


class _Pair:
    """One admitted connection: its tcp side, its ipc twin and what each still owes
    the other."""

    __slots__ = ("outside", "inside", "to_inside", "to_outside", "peer", "events", "open")

    def __init__(self, outside: socket.socket, inside: socket.socket, peer: Any) -> None:
        self.outside, self.inside, self.peer = outside, inside, peer
        self.to_inside = bytearray()
        self.to_outside = bytearray()
        self.events: dict[socket.socket, int] = {}
        self.open = True


class TcpFront:
    """Listening tcp sockets, each relaying to one ipc path, in a thread of its own.

    Args:
        address: where to listen (127.0.0.1, 0.0.0.0, ::, ...).
        inside: for each port to open, the ipc socket path its connections are relayed to.

    Raises:
        OSError: a port cannot be bound.
    """

    def __init__(self, address: str, inside: list[str]) -> None:
        self.owner = os.getuid()
        _room_for_descriptors(3 * (OWNER_CONNECTIONS + OTHERS_CONNECTIONS) + 256)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        bind_to = "" if address in ("*",) else address
        self._listeners: dict[socket.socket, str] = {}
        for path in inside:
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_to, 0))
            listener.listen(_BACKLOG)
            listener.setblocking(False)
            self._listeners[listener] = path
        self.ports = [listener.getsockname()[1] for listener in self._listeners]
        self._netlink = _open_netlink()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._held: dict[Any, int] = {}  # peer -> connections it holds
        self._others = 0  # connections held by peers that are not the owner
        self._paused: dict[socket.socket, float] = {}  # listener -> when to listen again
        #: counters, for tests and the curious
        self.admitted = self.refused = 0
        self._thread = threading.Thread(target=self._run, name="gpuwatch-tcp-front",
                                        daemon=True)

    def start(self) -> TcpFront:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread, close every connection and the ports."""
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(5.0)
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Pair):
                key.data.outside.close()
                key.data.inside.close()
        self._selector.close()
        for listener in self._listeners:
            listener.close()
        if self._netlink is not None:
            self._netlink.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- who may come in ------------------------------------------------------------

    def _peer(self, connection: socket.socket, address: Any) -> Any:
        uid = peer_uid(connection, self._netlink)
        if uid is not None:
            return ("uid", uid)
        host = address[0]
        try:  # an IPv4 peer seen on an IPv6 socket is that IPv4 address
            mapped = ipaddress.ip_address(host)
            if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped:
                host = str(mapped.ipv4_mapped)
        except ValueError:
            pass
        return ("address", host)

    def _admit(self, peer: Any) -> bool:
        held = self._held.get(peer, 0)
        if peer == ("uid", self.owner):
            return held < OWNER_CONNECTIONS
        return held < PEER_CONNECTIONS and self._others < OTHERS_CONNECTIONS

    def _count(self, peer: Any, change: int) -> None:
        held = self._held.get(peer, 0) + change
        if held:
            self._held[peer] = held
        else:
            self._held.pop(peer, None)
        if peer != ("uid", self.owner):
            self._others += change

    # --- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        for listener in self._listeners:
            self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        while True:
            timeout = None
            if self._paused:  # out of descriptors: listen again a little later
                timeout = max(0.0, min(self._paused.values()) - time.monotonic())
            for key, mask in self._selector.select(timeout):
                if key.fileobj == self._wake_r:
                    return
                try:
                    if key.data is None:
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif key.data.open:
                        self._serve(key.data, key.fileobj, mask)  # type: ignore[arg-type]
                except Exception:  # never the end of the door: that one is dropped
                    if key.data is None:
                        if key.fileobj not in self._paused:
                            self._pause(key.fileobj)  # type: ignore[arg-type]
                    elif key.data.open:
                        self._drop(key.data)
            now = time.monotonic()
            for listener, until in list(self._paused.items()):
                if now >= until:
                    del self._paused[listener]
                    self._selector.register(listener, selectors.EVENT_READ, None)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_BACKLOG):  # what is waiting, then the others get their turn
            try:
                outside, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors (or memory): leave them in the backlog and stop
                    # listening a while, rather than spin on a listener always readable
                    return self._pause(listener)
                continue
            peer = self._peer(outside, address)
            if not self._admit(peer):
                self.refused += 1
                outside.close()
                continue
            try:
                inside = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError:  # out of descriptors after all: not let in, and rest
                self.refused += 1
                outside.close()
                return self._pause(listener)
            inside.setblocking(False)
            try:
                inside.connect(self._listeners[listener])
            except OSError:  # ZeroMQ's backlog full, or gone: not let in
                self.refused += 1
                inside.close()
                outside.close()
                continue
            outside.setblocking(False)
            outside.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(outside, inside, peer)
            self._count(peer, +1)
            self.admitted += 1
            for side in (outside, inside):
                pair.events[side] = selectors.EVENT_READ
                self._selector.register(side, selectors.EVENT_READ, pair)

    def _pause(self, listener: socket.socket) -> None:
        self._selector.unregister(listener)
        self._paused[listener] = time.monotonic() + _PAUSE_S

    def _serve(self, pair: _Pair, side: socket.socket, mask: int) -> None:
        if not pair.open:  # dropped earlier in this same batch of events
            return
        other = pair.inside if side is pair.outside else pair.outside
        into = pair.to_inside if side is pair.outside else pair.to_outside
        owed = pair.to_outside if side is pair.outside else pair.to_inside
        try:
            if mask & selectors.EVENT_READ:
                data = side.recv(_CHUNK)
                if not data:
                    return self._drop(pair)
                into += data
                self._flush(pair, other, into)
            if mask & selectors.EVENT_WRITE:
                self._flush(pair, side, owed)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset, broken pipe: that connection is over
            return self._drop(pair)
        self._interest(pair)

    @staticmethod
    def _flush(pair: _Pair, side: socket.socket, owed: bytearray) -> None:
        while owed:
            try:
                sent = side.send(owed)
            except (BlockingIOError, InterruptedError):
                return
            del owed[:sent]

    def _interest(self, pair: _Pair) -> None:
        """Read a side only while the other side's buffer has room; write while owed."""
        for side, into, owed in ((pair.outside, pair.to_inside, pair.to_outside),
                                 (pair.inside, pair.to_outside, pair.to_inside)):
            events = ((selectors.EVENT_READ if len(into) < BUFFER_BYTES else 0)
                      | (selectors.EVENT_WRITE if owed else 0))
            if events != pair.events.get(side):
                if events:
                    if pair.events.get(side):
                        self._selector.modify(side, events, pair)
                    else:
                        self._selector.register(side, events, pair)
                else:
                    self._selector.unregister(side)
                pair.events[side] = events

    def _drop(self, pair: _Pair) -> None:
        pair.open = False
        for side in (pair.outside, pair.inside):
            if pair.events.get(side):
                try:
                    self._selector.unregister(side)
                except (KeyError, ValueError, OSError):
                    pass
            pair.events[side] = 0
            side.close()
        self._count(pair.peer, -1)

    def held(self) -> dict[Any, int]:
        """Connections held now, per peer (a copy; read from another thread)."""
        return dict(self._held)
