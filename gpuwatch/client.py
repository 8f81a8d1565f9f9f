"""The client side of a run's sockets: telemetry (SUB) and commands (DEALER).

For the dashboard and for scripts.

A script (or an LLM agent) steers a run as a person does from the dashboard through
:class:`RunClient` (no torch needed)::

    from gpuwatch.client import RunClient, list_runs

    print([run.run_id for run in list_runs()])     # the live runs on this machine
    with RunClient() as run:                       # the only (or newest) one
        for step in run.steps():                   # each optimizer step's record
            if step["loss"] < 0.5:
                event = run.set("lr_scale", 0.5)   # waits until it applied
                print(event["text"])               # lr_scale=0.5 applied at step 123
                break

ZeroMQ sockets are not thread-safe: a :class:`Subscriber` (and a :class:`RunClient`)
belongs to the thread that made it. :func:`send_command` (from :mod:`agent.wire.commands`,
which the agent's tuner uses too) makes fresh sockets each call, so any thread may call
it. Both use the process-wide context (:func:`agent.wire.commands.shared_context`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator

import zmq

from agent.wire import protocol
from agent.wire.commands import new_command_id, secure, send_command, shared_context
from agent.wire.knobs import STANDARD_KNOBS, assignment, when_applied
from agent.wire.runs import RunInfo, find_run, list_runs, run_dir
from gpuwatch.state import SeqGaps

__all__ = ["CommandError", "RunClient", "Subscriber", "list_runs", "new_command_id",
           "reply_text", "secure", "send_command"]

#: Largest telemetry message received (bytes): ZeroMQ disconnects a sender of a larger
#: one before it is held in memory (it reconnects; seq gaps show what was lost).
RECEIVE_MAX_BYTES = protocol.MAX_MESSAGE_BYTES
#: Telemetry messages queued in the SUB socket at most, per connection. Beyond them
#: ZeroMQ stops reading, and the run's PUB queues (up to its own high-water mark) and
#: then drops, which seq gaps show: so a connection holds at most this many times
#: RECEIVE_MAX_BYTES (64 MiB) whatever its sender does; a socket connected to many
#: publishers (:meth:`Subscriber.connect`: every other node's relay) that many times.
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
        self._socket: zmq.Socket = shared_context().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.MAXMSGSIZE, RECEIVE_MAX_BYTES)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            self.connect(info)
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise

    def connect(self, info: RunInfo) -> None:
        """Also receive the telemetry of ``info`` (another publisher) on this socket.

        Its CURVE keys (:func:`agent.wire.commands.secure`) are this connection's alone:
        ZeroMQ takes a socket's options at each connect, so one socket follows many
        publishers (every other node's relay of a multi-node job), each of its own server
        key, and a poll costs one socket, not one per publisher. Each connection keeps
        its own :data:`RECEIVE_HIGH_WATER_MARK`. The publishers of one socket must all be
        tcp with CURVE, or all not: a connect without keys keeps the previous ones.

        Raises:
            zmq.ZMQError: the endpoint is malformed.
        """
        secure(self._socket, info)
        self._socket.connect(info.pub_endpoint)

    @property
    def socket(self) -> zmq.Socket:
        """The SUB socket, to poll several subscribers at once (this thread only)."""
        return self._socket

    @property
    def missed(self) -> int:
        """Records lost so far (sequence gaps per run and rank)."""
        return self._gaps.missed

    def recv_frames(self, timeout_s: float) -> list[bytes] | None:
        """The next raw multipart message, or None after ``timeout_s`` seconds.

        ``timeout_s`` 0: the message waiting, or None, without a poll (pyzmq's
        ``Socket.poll`` makes a poller each call)."""
        if timeout_s <= 0:
            try:
                return self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
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
    """``"accum_steps=8"`` -> ``("accum_steps", "8")``: a command as people type it.

    On ``gpuwatch set`` and the dashboard's command line; the run parses and checks the
    value against its schema.

    Raises:
        ValueError: no ``=``, or nothing before it (the message says what was typed).
    """
    knob, equals, value = text.strip().partition("=")
    if not equals or not knob.strip():
        raise ValueError(f"expected KNOB=VALUE, got {text!r}")
    return knob.strip(), value.strip()


def reply_text(knob: str, value: Any, reply: protocol.Reply) -> str:
    """What to tell people about a reply from :func:`send_command`: accepted, rejected, no answer.

    ``accepted: accum_steps=4 applies at step 123`` (``accepted: stop=now at the boundary
    after step 122`` for a command that is not a setting; ``... (no change)`` for a setting to
    the value it will have by then; ``... on ranks 0, 1`` for several),
    followed by a second line ``warning: ...`` when the run warned about the value (e.g. an
    autocast precision that is slow on its hardware), ``rejected: <knob>=<value>: <reason>``
    or, when the run never answered, ``no answer: <knob>=<value>: <reason>``."""
    if reply.get("ok"):
        step = reply.get("apply_step")
        ranks = reply.get("ranks")
        warning = reply.get("warning")
        return (f"accepted: {assignment(reply.get('knob', knob), reply.get('value', value))}"
                + (" " + when_applied(step, reply.get("after_step"))
                   if step is not None else "")
                + (" (no change)" if reply.get("no_change") else "")
                + (" after a checkpoint" if reply.get("checkpoint") else "")
                + (" on ranks " + ", ".join(map(str, ranks))
                   if isinstance(ranks, list) and len(ranks) > 1 else "")
                + (f"\nwarning: {warning}" if isinstance(warning, str) and warning else ""))
    verdict = "no answer" if reply.get("answered") is False else "rejected"
    reason = str(reply.get("reason", "no reason given"))
    if reason.startswith((f"{knob}=", f"{knob}:")):  # the run named the knob already
        return f"{verdict}: {reason}"
    return f"{verdict}: {assignment(knob, value)}: {reason}"


class CommandError(RuntimeError):
    """A command the run refused, did not answer, or could not apply.

    The message says why, as :func:`reply_text` does, its control characters shown as
    text (:func:`agent.wire.protocol.printable`: it quotes the run, whose reasons may
    quote a crafted file); :attr:`body` is the reply or the ``failed`` event, as sent."""

    def __init__(self, text: str, body: dict[str, Any]) -> None:
        super().__init__(protocol.printable(text, newlines=True))
        self.body = body


class RunClient:
    """One live run, for a script: follow its records, send a command and wait until it applied.

    Args:
        run: the run: a :class:`agent.wire.runs.RunInfo`, a run id or name (as ``gpuwatch
            set --run`` takes it), or None for the only (else the newest) run here.

    The constructor returns once the run's first message has come (the ``hello`` it greets
    each new subscriber with), so nothing published after it returns is missed (ZeroMQ
    drops what a run sends before its subscription has arrived there, which takes a few
    milliseconds after the connect). Messages read while :meth:`set` waits are kept for
    :meth:`records` (up to :data:`KEPT_MESSAGES`, the oldest dropped first), that first
    one too.

    Raises:
        LookupError: no such run.
        TimeoutError: nothing came from the run within ``timeout_s`` seconds (the socket
            is closed).
    """

    #: Messages :meth:`set` read past while waiting, kept for :meth:`records` at most.
    KEPT_MESSAGES = 10_000

    def __init__(self, run: RunInfo | str | None = None, timeout_s: float = 10.0) -> None:
        info = run if isinstance(run, RunInfo) else find_run(run)
        if info is None:
            raise LookupError(f"no live run {run!r}" if run else "no live run")
        self.info = info
        self._subscriber = Subscriber(info)
        self._kept: deque[dict[str, Any]] = deque(maxlen=self.KEPT_MESSAGES)
        #: the ``bye`` once the run said it (its ``reason``), else None
        self.bye: dict[str, Any] | None = None
        first = self._subscriber.recv(timeout_s)  # (any message: the subscription is live)
        if first is None:
            self._subscriber.close()
            raise TimeoutError(f"run {protocol.printable(info.run_id)} sent nothing within "
                               f"{timeout_s:g} s of subscribing (is it still running?)")
        self._kept.append(first)

    def records(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Every message of the run as it comes, until its ``bye``.

        Envelopes (``type``, ``body``, ...). The ``bye`` is yielded last; with
        ``timeout_s``, until nothing came for that many seconds."""
        while self.bye is None:
            message = self._next(timeout_s)
            if message is None:
                return
            yield message

    def steps(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """The body of each optimizer step's record, as :meth:`records` ends.

        ``step``, ``loss``, ``lr``, ``step_time_s``, ``knobs``, ..."""
        for message in self.records(timeout_s):
            if message["type"] == protocol.STEP:
                yield message["body"]

    def set(self, knob: str, value: Any, *, apply_step: int | None = None,
            timeout_s: float = 60.0) -> dict[str, Any]:
        """Send ``knob=value`` and wait until the run applied it.

        A setting, or a command such as ``pause=on``, ``evaluate=now``.

        Returns:
            The ``applied`` event's body (``step``: the step it applies at; ``text``).

        Raises:
            CommandError: refused or unanswered (the reply), failed or withdrawn when
                due (the event), or the run ended first.
            TimeoutError: not applied within ``timeout_s`` seconds.
        """
        reply = send_command(self.info, knob, value, apply_step=apply_step)
        if not reply.get("ok"):
            raise CommandError(reply_text(knob, value, reply), dict(reply))
        deadline = time.monotonic() + timeout_s
        due = f"accepted for step {reply.get('apply_step')}"
        while True:
            left = deadline - time.monotonic()
            message = self._subscriber.recv(max(0.0, left)) if left > 0 else None
            if message is None:
                raise TimeoutError(f"{assignment(knob, value)} not applied within "
                                   f"{timeout_s:g} s ({due})")
            self._kept.append(message)
            body = message.get("body") or {}
            if message["type"] == protocol.BYE:
                self.bye = body
                raise CommandError(f"{assignment(knob, value)}: the run ended first "
                                   f"({body.get('reason')})", body)
            if message["type"] != protocol.EVENT or body.get("id") != reply.get("id"):
                continue
            if body.get("kind") == protocol.EventKind.RESCHEDULED:  # the run went back
                due += f", moved to step {body.get('step')} of branch {body.get('branch')}"
            elif body.get("kind") in protocol.EventKind.SETTLING:
                if body["kind"] == protocol.EventKind.APPLIED:
                    return body
                raise CommandError(str(body.get("text")), body)

    def _next(self, timeout_s: float | None) -> dict[str, Any] | None:
        message = self._kept.popleft() if self._kept else None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while message is None:
            wait_s = 1.0 if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                return None
            message = self._subscriber.recv(wait_s)
        if message["type"] == protocol.BYE:
            self.bye = message.get("body") or {}
        return message

    def close(self) -> None:
        """Close the telemetry socket."""
        self._subscriber.close()

    def __enter__(self) -> RunClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def no_run_text(selector: str | None) -> str:
    """What a command says when no live run matches ``selector`` (None: any run).

    With a selector, where to look for the runs there are; without one, where run
    files are looked for and how to start a run. ``selector`` is shown with ``repr``
    (a control character in it is escaped). A selector that names a knob (``gpuwatch
    checkpoint``, ``gpuwatch precision=bf16``) is told the ``set`` command; another word
    (``gpuwatch history``: run ids are digits) where the commands are listed."""
    if selector:
        text = f"gpuwatch: no live run matches {selector!r} (see `gpuwatch runs`)"
        name, equals, value = selector.partition("=")
        spec = STANDARD_KNOBS.get(name)
        if spec is not None:
            value = (protocol.printable(value, 100) if equals else spec.choices[0]
                     if spec.kind == "action" and spec.choices else "VALUE")
            text += f"; a knob: did you mean `gpuwatch set {name}={value}`?"
        elif selector.isalpha():
            text += ("; the commands: `gpuwatch --help` (finished runs and their logs: "
                     "`gpuwatch runs --all`)")
        return text
    return (f"gpuwatch: no live run found (run files in {run_dir()}).\n"
            "Start one:\n"
            "  gpuwatch demo                 a small training job, with the dashboard on it\n"
            "  agent.attach(trainer)         in your own training script")
