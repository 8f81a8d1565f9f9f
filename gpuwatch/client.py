"""The dashboard's side of the sockets: telemetry (SUB) and commands (DEALER).

ZeroMQ sockets are not thread-safe: a :class:`Subscriber` belongs to the thread that
made it, and :func:`send_command` makes a fresh socket each call, so any thread may call
it. Both use the process-wide :func:`zmq.Context.instance`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable, Iterator

import zmq

from agent import protocol
from agent.runs import RunInfo
from gpuwatch.state import SeqGaps

#: Telemetry queued in the SUB socket before ZeroMQ drops (then seq gaps show it).
RECEIVE_HIGH_WATER_MARK = 100_000
#: How often :func:`send_command` checks whether its wait was cancelled (s).
CANCEL_CHECK_S = 0.1


def secure(socket: zmq.Socket, info: RunInfo) -> None:
    """Set the CURVE client keys of a run that listens beyond its machine (the run file
    holds them); nothing for a local run."""
    if info.curve_server_key:
        socket.curve_serverkey = info.curve_server_key.encode()
        socket.curve_publickey = info.curve_client_public_key.encode()
        socket.curve_secretkey = info.curve_client_secret_key.encode()


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
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            secure(self._socket, info)
            self._socket.connect(info.pub_endpoint)
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise

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
        """The next decoded envelope, or None when none came within ``timeout_s`` s."""
        deadline = time.monotonic() + timeout_s
        while True:
            frames = self.recv_frames(max(0.0, deadline - time.monotonic()))
            if frames is None:
                return None
            try:
                message = protocol.decode_frames(frames)
            except protocol.ProtocolError:
                self.malformed += 1
                continue
            self._gaps.observe(message)
            return message

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


def new_command_id() -> str:
    """A fresh id for a command (its reply and events carry it)."""
    return secrets.token_hex(8)


def send_command(info: RunInfo, knob: str, value: Any, *, apply_step: int | None = None,
                 timeout_s: float = 3.0, cancelled: Callable[[], bool] | None = None,
                 command_id: str | None = None) -> dict[str, Any]:
    """Ask the run to set ``knob`` to ``value`` and wait for its reply.

    The agent validates the value against the knob's schema (strings are parsed there,
    so CLI input can be passed as typed) and answers at once.

    Args:
        info: the run; its ``cmd_endpoint`` and ``token`` are used.
        knob: wire name. value: the new value (a string is parsed by the agent).
        apply_step: the optimizer step to apply at; the agent picks the next one when
            None. timeout_s: how long to wait for the reply, in seconds.
        cancelled: checked every :data:`CANCEL_CHECK_S` while waiting; when it returns
            True the wait ends at once (e.g. the dashboard is quitting).

    Returns:
        The reply body: ``{"id", "ok": True, "knob", "value", "apply_step"}`` or
        ``{"id", "ok": False, "reason"}``. No reply in time (the run is gone or busy),
        a cancelled wait and a run without a usable command endpoint give ``ok: False``,
        ``answered: False`` and the reason (a command sent but not answered may still
        apply later); nothing is raised for them.
    """
    command_id = command_id or new_command_id()
    if not info.cmd_endpoint:
        return {"id": command_id, "ok": False, "answered": False,
                "reason": "this run has no command endpoint (attach by run id)"}
    body: dict[str, Any] = {"id": command_id, "knob": knob, "value": value,
                            "token": info.token}
    if apply_step is not None:
        body["apply_step"] = apply_step
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            secure(sock, info)
            sock.connect(info.cmd_endpoint)
        except zmq.ZMQError as exc:
            return {"id": command_id, "ok": False, "answered": False,
                    "reason": f"cannot connect to {info.cmd_endpoint}: {exc}"}
        sock.send_multipart(protocol.encode(
            protocol.envelope(protocol.COMMAND, body, run=info.run_id)))
        deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            if cancelled is not None and cancelled():
                return {"id": command_id, "ok": False, "answered": False,
                        "reason": "cancelled"}
            if not sock.poll(max(1, int(min(left_s, CANCEL_CHECK_S) * 1000))):
                continue
            try:
                reply = protocol.decode_frames(sock.recv_multipart())
            except protocol.ProtocolError:
                continue
            if reply["type"] == protocol.REPLY and reply["body"].get("id") == command_id:
                return reply["body"]
    finally:
        sock.close(linger=0)
    return {"id": command_id, "ok": False, "answered": False,
            "reason": f"no reply within {timeout_s:.1f} s (is the run alive?)"}


def reply_text(knob: str, value: Any, reply: dict[str, Any]) -> str:
    """One line for people about a reply from :func:`send_command`:
    ``accepted: accum_steps=4 applies at step 123``, ``rejected: <knob>=<value>: <reason>``
    or, when the run never answered, ``no answer: <knob>=<value>: <reason>``."""
    if reply.get("ok"):
        step = reply.get("apply_step")
        return (f"accepted: {reply.get('knob', knob)}={reply.get('value', value)}"
                + (f" applies at step {step}" if step is not None else ""))
    verdict = "no answer" if reply.get("answered") is False else "rejected"
    reason = str(reply.get("reason", "no reason given"))
    if reason.startswith((f"{knob}=", f"{knob}:")):  # the run named the knob already
        return f"{verdict}: {reason}"
    return f"{verdict}: {knob}={value}: {reason}"
