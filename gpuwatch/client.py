"""The dashboard's side of the sockets: telemetry (SUB) and commands (DEALER).

ZeroMQ sockets are not thread-safe: a :class:`Subscriber` belongs to the thread that
made it, and :func:`send_command` makes a fresh socket each call, so any thread may call
it. Both use the process-wide :func:`zmq.Context.instance`.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import Any, Callable, Iterator

import zmq

from agent import protocol
from agent.knobs import assignment
from agent.runs import RunInfo, run_ranks
from gpuwatch.state import SeqGaps

#: Largest telemetry message received (bytes): ZeroMQ disconnects a sender of a larger
#: one before it is held in memory (it reconnects; seq gaps show what was lost).
RECEIVE_MAX_BYTES = protocol.MAX_MESSAGE_BYTES
#: Telemetry messages queued in the SUB socket at most. Beyond them ZeroMQ stops
#: reading, and the run's PUB queues (up to its own high-water mark) and then drops,
#: which seq gaps show: so a socket holds at most this many times RECEIVE_MAX_BYTES
#: (64 MiB) whatever a sender does.
RECEIVE_HIGH_WATER_MARK = 64
#: How often :func:`send_command` checks whether its wait was cancelled (s).
CANCEL_CHECK_S = 0.1


def secure(socket: zmq.Socket, info: RunInfo) -> None:
    """Set the CURVE client keys of a tcp run (its run file holds them; nothing for an
    ipc run). With the run's server key set, the connection completes only with the
    process that holds its secret key: a port that another process took after the run
    ended is never talked to."""
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


def new_command_id() -> str:
    """A fresh id for a command (its reply and events carry it)."""
    return secrets.token_hex(8)


#: Most steps ahead a command to several ranks is scheduled, whatever the step rate.
MAX_FAN_OUT_MARGIN_STEPS = 1000


def send_command(info: RunInfo, knob: str, value: Any, *, apply_step: int | None = None,
                 timeout_s: float = 3.0, cancelled: Callable[[], bool] | None = None,
                 command_id: str | None = None, checkpoint: bool = False) -> dict[str, Any]:
    """Ask the run to set ``knob`` to ``value`` and wait for its reply.

    The agent validates the value against the knob's schema (strings are parsed there,
    so CLI input can be passed as typed) and answers at once.

    A run of several ranks (``info.world_size > 1``) gets the command on every rank, to
    apply at one common optimizer step, in two phases and without any collective in the
    training: (1) every rank checks it (``dry_run``) and answers with the earliest step
    it could apply it at and its step time; (2) every rank schedules it at the latest
    of those steps plus a margin for the time the second phase takes at the fastest
    rank's pace. If a rank refuses or does not answer (2), every other rank is told to
    cancel it, on the same connection (so after the command), and their answers are
    checked: a rank that applied it already makes the reply say that the ranks may now
    differ. It is refused before (1) when not every rank has a run file on this machine
    (ranks on other machines cannot be reached from here, and a knob must never differ
    between ranks).

    Args:
        info: the run (any rank's file); its ``cmd_endpoint`` and ``token`` are used.
        knob: wire name. value: the new value (a string is parsed by the agent).
        apply_step: the optimizer step to apply at; the agent (or the fan-out) picks the
            next one it can when None. timeout_s: how long to wait for each phase's
            replies, in seconds.
        cancelled: checked every :data:`CANCEL_CHECK_S` while waiting; when it returns
            True the wait ends at once (e.g. the dashboard is quitting).
        checkpoint: save a checkpoint at the same boundary first (``checkpoint=now``
            before a risky change); the change is not applied if that save fails, and a
            run that cannot save one refuses the command.

    Returns:
        The reply body: ``{"id", "ok": True, "knob", "value", "apply_step"}`` (with
        ``"ranks"``, the ranks reached, for a run of several) or ``{"id", "ok": False,
        "reason"}`` (a rank's refusal ends with ``(rank N)``; ``"ranks_differ": True``
        when it could not be withdrawn everywhere). No reply in time (the run is gone
        or busy), a cancelled wait and a run without a usable command endpoint give
        ``ok: False``, ``answered: False`` and the reason (a command sent but not
        answered may still apply later); nothing is raised for them.
    """
    command_id = command_id or new_command_id()
    body: dict[str, Any] = {"id": command_id, "knob": knob, "value": value}
    if checkpoint:
        body["checkpoint"] = True
    if apply_step is not None:
        body["apply_step"] = apply_step
    if info.world_size <= 1 or info.run_id == "?":
        with _Connections([info]) as single:
            return single.exchange(body, timeout_s, cancelled)[0]
    ranks = run_ranks(info.run_id)
    if len(ranks) != info.world_size:
        return {"id": command_id, "ok": False, "answered": False,
                "reason": f"{len(ranks)} of the run's {info.world_size} ranks have a run "
                          "file on this machine; a command must reach every rank (run "
                          "it where they all are, or wait until they have all started)"}
    with _Connections(ranks) as connections:
        checks = connections.exchange({**body, "dry_run": True}, timeout_s, cancelled)
        refusal = _first_refusal(ranks, checks)
        if refusal is not None:
            return refusal
        if apply_step is None:
            body["apply_step"] = (max(check["apply_step"] for check in checks)
                                  + _margin_steps(checks))
        replies = connections.exchange(body, timeout_s, cancelled)
        refusal = _first_refusal(ranks, replies)
        if refusal is None:
            accepted = dict(replies[0])
            accepted["ranks"] = [rank.rank for rank in ranks]
            warnings = [reply["warning"] for reply in replies if reply.get("warning")]
            if warnings:
                accepted["warning"] = warnings[0]
            return accepted
        # withdraw it wherever it may be scheduled: accepted, or not answered (yet)
        reached = [index for index, reply in enumerate(replies)
                   if reply.get("ok") or reply.get("answered") is False]
        answers = connections.exchange({"id": command_id, "cancel": True,
                                        "reason": refusal["reason"]},
                                       2 * timeout_s, None, only=reached)
    refusal["knob"] = knob  # an unanswered reply does not name it
    return _withdrawal(refusal, [(ranks[i], answers[i]) for i in reached])


def _withdrawal(refusal: dict[str, Any], answers: list[tuple[RunInfo, dict[str, Any]]]
                ) -> dict[str, Any]:
    """The refusal, told what became of the command on the other ranks."""
    withdrawn = [rank.rank for rank, answer in answers if answer.get("ok")]
    applied = [(rank.rank, answer["applied_step"]) for rank, answer in answers
               if "applied_step" in answer]
    silent = [rank.rank for rank, answer in answers if answer.get("answered") is False]
    if withdrawn:
        refusal["reason"] += ("; withdrawn from rank" + ("s " if len(withdrawn) > 1 else " ")
                              + ", ".join(map(str, withdrawn)))
    if applied or silent:
        refusal["ranks_differ"] = True
        refusal["reason"] += "; THE RANKS MAY NOW DIFFER: " + "; ".join(
            [f"rank {rank} applied it at step {step}" for rank, step in applied]
            + [f"rank {rank} did not answer the withdrawal" for rank in silent]
        ) + f"; set {refusal['knob']} again to make them agree"
    return refusal


def _margin_steps(checks: list[dict[str, Any]]) -> int:
    """Steps to add to the ranks' earliest common step so that the second phase of a
    fan-out arrives in time: 2, plus what the fastest rank trains in a generous bound
    (0.5 s) on the second phase's round trip (the agent answers within its 50 ms poll)."""
    step_times = [check.get("step_time_s") for check in checks]
    fastest = min((t for t in step_times if isinstance(t, (int, float)) and t > 0),
                  default=None)
    if fastest is None:
        return 2
    return min(MAX_FAN_OUT_MARGIN_STEPS, 2 + math.ceil(0.5 / fastest))


def _first_refusal(ranks: list[RunInfo], replies: list[dict[str, Any]]
                   ) -> dict[str, Any] | None:
    """The first rank's refusal, `` (rank N)`` after its reason; None if all ok."""
    for rank, reply in zip(ranks, replies):
        if not reply.get("ok"):
            refusal = dict(reply)
            refusal["reason"] = f"{reply.get('reason', 'no reason given')} (rank {rank.rank})"
            return refusal
    return None


class _Connections:
    """One DEALER socket per rank for the whole of one command: each rank receives its
    dry run, the command and a cancel on one connection, in the order they were sent."""

    def __init__(self, ranks: list[RunInfo]) -> None:
        """Connect one DEALER per rank (a rank that cannot be reached gets its reason
        instead); raises nothing."""
        self.ranks = ranks
        self._sockets: list[zmq.Socket | None] = []
        self._errors: list[str | None] = []
        for info in ranks:
            sock, error = None, None
            if not info.cmd_endpoint:
                error = "this run has no command endpoint (attach by run id)"
            elif (info.cmd_endpoint.startswith("tcp://") and info.token
                  and not info.curve_server_key):
                error = (f"{info.cmd_endpoint} is tcp without the run's CURVE key in "
                         "its run file, so nothing proves it is the run: its token is "
                         "not sent (an agent of this version always has one)")
            else:
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    secure(sock, info)
                    sock.connect(info.cmd_endpoint)
                except zmq.ZMQError as exc:
                    sock.close(linger=0)
                    sock, error = None, f"cannot connect to {info.cmd_endpoint}: {exc}"
            self._sockets.append(sock)
            self._errors.append(error)

    def __enter__(self) -> _Connections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sock in self._sockets:
            if sock is not None:
                sock.close(linger=0)

    def exchange(self, body: dict[str, Any], timeout_s: float,
                 cancelled: Callable[[], bool] | None,
                 only: list[int] | None = None) -> list[dict[str, Any]]:
        """Send ``body`` (plus each rank's token) to the ranks (``only``: those indexes)
        and wait up to ``timeout_s`` for their replies to it (a late reply to an earlier
        phase is skipped: replies echo ``dry_run`` and ``cancel``); one reply body per
        rank of :attr:`ranks` (``ok: False, answered: False`` and the reason where none
        came, or where the rank was not asked)."""
        command_id = body["id"]
        phase = (bool(body.get("dry_run")), bool(body.get("cancel")))

        def unanswered(reason: str) -> dict[str, Any]:
            return {"id": command_id, "ok": False, "answered": False, "reason": reason}

        asked = range(len(self.ranks)) if only is None else only
        replies: dict[int, dict[str, Any] | None] = {}
        poller = zmq.Poller()
        for index in asked:
            sock, info = self._sockets[index], self.ranks[index]
            if sock is None:
                replies[index] = unanswered(self._errors[index] or "no connection")
                continue
            replies[index] = None
            sock.send_multipart(protocol.encode(protocol.envelope(
                protocol.COMMAND, {**body, "token": info.token}, run=info.run_id)))
            poller.register(sock, zmq.POLLIN)
        owner = {sock: index for index, sock in enumerate(self._sockets) if sock is not None}
        deadline = time.monotonic() + timeout_s
        stopped = False
        while None in replies.values() and (left_s := deadline - time.monotonic()) > 0:
            if cancelled is not None and cancelled():
                stopped = True
                break
            for sock, _ in poller.poll(max(1, int(min(left_s, CANCEL_CHECK_S) * 1000))):
                try:
                    reply = protocol.decode_frames(sock.recv_multipart())
                except protocol.ProtocolError:
                    continue
                answer = reply["body"]
                if (reply["type"] == protocol.REPLY and answer.get("id") == command_id
                        and (bool(answer.get("dry_run")), bool(answer.get("cancel")))
                        == phase):
                    replies[owner[sock]] = answer
        waited = "cancelled" if stopped else (
            f"no reply within {timeout_s:.1f} s (is the run alive?)")
        return [replies.get(index) or unanswered(waited if index in replies else "not asked")
                for index in range(len(self.ranks))]


def reply_text(knob: str, value: Any, reply: dict[str, Any]) -> str:
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
