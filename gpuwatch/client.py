"""The dashboard's side of the sockets: telemetry (SUB) and commands (DEALER).

ZeroMQ sockets are not thread-safe: a :class:`Subscriber` belongs to the thread that
made it. :func:`send_command` (from :mod:`agent.wire.commands`, which the agent's tuner uses
too) makes fresh sockets each call, so any thread may call it. Both use the
process-wide :func:`zmq.Context.instance`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator

import zmq

from agent.wire import protocol
from agent.wire.commands import new_command_id, secure, send_command
from agent.wire.knobs import assignment
from agent.wire.runs import RunInfo
from gpuwatch.state import SeqGaps

__all__ = ["Subscriber", "new_command_id", "reply_text", "secure", "send_command"]

#: Largest telemetry message received (bytes): ZeroMQ disconnects a sender of a larger
#: one before it is held in memory (it reconnects; seq gaps show what was lost).
RECEIVE_MAX_BYTES = protocol.MAX_MESSAGE_BYTES
#: Telemetry messages queued in the SUB socket at most. Beyond them ZeroMQ stops
#: reading, and the run's PUB queues (up to its own high-water mark) and then drops,
#: which seq gaps show: so a socket holds at most this many times RECEIVE_MAX_BYTES
#: (64 MiB) whatever a sender does.
RECEIVE_HIGH_WATER_MARK = 64


class Subscriber:
    """A SUB socket connected to a run's telemetry endpoint.

    Iterate it (or call :meth:`recv`) for decoded envelopes; malformed frames are
    dropped and counted in :attr:`malformed`, lost records in :attr:`missed`.

    Args:
        info: the run; its ``pub_endpoint`` is connected, all message types subscribed.

    Raises:
        zmq.ZMQError: the endpoint is malformed (e.g. a bad run file). A run that is not
            there yet is not an error: ZeroMQ connects when it appears.
    """

    def __init__(self, info: RunInfo) -> None:
        self.malformed = 0
        """Frames dropped because they were not gpuwatch envelopes."""
        self._gaps = SeqGaps()
        self._rows: deque[dict[str, Any]] = deque()  # of a batch, not yet returned
        self._socket: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.MAXMSGSIZE, RECEIVE_MAX_BYTES)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            secure(self._socket, info)
            self._socket.connect(info.pub_endpoint)
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise

    @property
    def socket(self) -> zmq.Socket:
        """The SUB socket, to poll several subscribers at once (this thread only)."""
        return self._socket

    @property
    def missed(self) -> int:
        """Records lost so far (sequence gaps per run and rank)."""
        return self._gaps.missed

    def recv_frames(self, timeout_s: float) -> list[bytes] | None:
        """The next raw multipart message, or None after ``timeout_s`` seconds."""
        if not self._socket.poll(int(timeout_s * 1000)):
            return None
        return self._socket.recv_multipart(zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        """The next decoded envelope, or None when none came within ``timeout_s`` s.

        A ``steps`` batch comes out as its rows, one ``step`` envelope each
        (:func:`agent.wire.protocol.expand`), in order, one a call."""
        if self._rows:
            return self._rows.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            frames = self.recv_frames(max(0.0, deadline - time.monotonic()))
            if frames is None:
                return None
            try:
                message = protocol.decode_frames(frames)
                rows = protocol.expand(message)
            except protocol.ProtocolError:
                self.malformed += 1
                continue
            self._gaps.observe(message)
            if not rows:  # an empty batch
                continue
            self._rows.extend(rows[1:])
            return rows[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Envelopes as they come, forever (stop by breaking out of the loop)."""
        while True:
            message = self.recv(timeout_s=1.0)
            if message is not None:
                yield message

    def close(self) -> None:
        """Close the socket (pending messages are dropped)."""
        self._socket.close(linger=0)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def parse_assignment(text: str) -> tuple[str, str]:
    """``"accum_steps=8"`` -> ``("accum_steps", "8")``: a command as people type it (on
    ``gpuwatch set`` and the dashboard's command line); the run parses and checks the
    value against its schema.

    Raises:
        ValueError: no ``=``, or nothing before it (the message says what was typed).
    """
    knob, equals, value = text.strip().partition("=")
    if not equals or not knob.strip():
        raise ValueError(f"expected KNOB=VALUE, got {text!r}")
    return knob.strip(), value.strip()


def reply_text(knob: str, value: Any, reply: protocol.Reply) -> str:
    """What to tell people about a reply from :func:`send_command`:
    ``accepted: accum_steps=4 applies at step 123`` (``... on ranks 0, 1`` for several),
    followed by a second line ``warning: ...`` when the run warned about the value (e.g.
    an autocast precision that is slow on its hardware),
    ``rejected: <knob>=<value>: <reason>``
    or, when the run never answered, ``no answer: <knob>=<value>: <reason>``."""
    if reply.get("ok"):
        step = reply.get("apply_step")
        ranks = reply.get("ranks")
        warning = reply.get("warning")
        return (f"accepted: {assignment(reply.get('knob', knob), reply.get('value', value))}"
                + (f" applies at step {step}" if step is not None else "")
                + (" after a checkpoint" if reply.get("checkpoint") else "")
                + (" on ranks " + ", ".join(map(str, ranks))
                   if isinstance(ranks, list) and len(ranks) > 1 else "")
                + (f"\nwarning: {warning}" if isinstance(warning, str) and warning else ""))
    verdict = "no answer" if reply.get("answered") is False else "rejected"
    reason = str(reply.get("reason", "no reason given"))
    if reason.startswith((f"{knob}=", f"{knob}:")):  # the run named the knob already
        return f"{verdict}: {reason}"
    return f"{verdict}: {assignment(knob, value)}: {reason}"
