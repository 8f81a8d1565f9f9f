"""The client side of the command protocol: one command to every rank of a run, at one step.

Applied at one common optimizer step (:func:`send_command`).

Used by the dashboard and ``gpuwatch set`` (through :mod:`gpuwatch.client`) and by the
agent's own tuner (:mod:`agent.search.tune`), so that a change reaches every rank the same way
whoever decides it. ZeroMQ and the protocol only: no torch. Each call makes its own
sockets on the process-wide context (:func:`shared_context`), or takes the kept ones of
other nodes' relays (one call at a time each: :class:`RankConnections`), so any thread
may call it.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Any, Callable, cast

import zmq

from agent.wire import protocol
from agent.wire.runs import RunInfo, node_list, run_ranks

#: How often :func:`send_command` checks whether its wait was cancelled (s).
CANCEL_CHECK_S = 0.1


#: Sockets the process-wide ZeroMQ context may hold. A dashboard holds one per node of a
#: multi-node job and, while a command is out, one more per node: ZeroMQ's default (1,023)
#: ran out at about 500 nodes.
MAX_SOCKETS = 1 << 16


def shared_context() -> zmq.Context:
    """The process-wide ZeroMQ context of :mod:`agent.wire` and the dashboard; any thread.

    Its own, not :func:`zmq.Context.instance`, whose limit is fixed by whoever makes the
    first socket on it; allowed :data:`MAX_SOCKETS` sockets. The first call also raises this
    process's soft limit of open files towards its hard one (each socket holds one or two
    descriptors; a login node's soft limit is often 1,024). Any thread may call it."""
    global _context
    with _context_lock:
        if _context is None:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            wanted = 2 * MAX_SOCKETS if hard == resource.RLIM_INFINITY else min(
                hard, 2 * MAX_SOCKETS)
            if soft != resource.RLIM_INFINITY and soft < wanted:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                except (ValueError, OSError):
                    pass  # the soft limit stays: fewer nodes can be followed
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
            _context = context
        return _context


_context: zmq.Context | None = None
_context_lock = threading.Lock()


def secure(socket: zmq.Socket, info: RunInfo) -> None:
    """Set the CURVE client keys of a tcp run (its run file holds them; nothing for an ipc run).

    With the run's server key set, the connection completes only with the process that holds
    its secret key: a port that another process took after the run ended is never talked to."""
    if info.curve_server_key:  # (setsockopt: a third of the cost of the attributes)
        socket.setsockopt(zmq.CURVE_SERVERKEY, info.curve_server_key.encode())
        socket.setsockopt(zmq.CURVE_PUBLICKEY, info.curve_client_public_key.encode())
        socket.setsockopt(zmq.CURVE_SECRETKEY, info.curve_client_secret_key.encode())


def new_command_id() -> str:
    """A fresh id for a command (its reply and events carry it)."""
    return secrets.token_hex(8)


#: Most steps ahead a command to several ranks is scheduled, whatever the step rate.
MAX_FAN_OUT_MARGIN_STEPS = 1000


def send_command(info: RunInfo, knob: str, value: Any, *, apply_step: int | None = None,
                 timeout_s: float = 3.0, cancelled: Callable[[], bool] | None = None,
                 command_id: str | None = None, checkpoint: bool = False,
                 reason: str | None = None) -> protocol.Reply:
    """Ask the run to set ``knob`` to ``value`` and wait for its reply.

    The agent validates the value against the knob's schema (strings are parsed there,
    so CLI input can be passed as typed) and answers at once.

    A run of several ranks (``info.world_size > 1``) gets the command on every rank, to
    apply at one common optimizer step, in two phases and without any collective in the
    training: (1) every rank checks it (``dry_run``) and answers with the earliest step
    it could apply it at, its step time and its branch; (2) every rank schedules it at
    the latest of those steps plus a margin for the time the second phase takes at the
    fastest rank's pace (no margin on a paused run: the step of the boundary its ranks
    are held at, where it applies as it arrives), counted on that branch: a rank that
    went back meanwhile (a rewind) moves it as it moves its pending commands. Ranks that
    answer (1) from different branches (a rewind is applying) refuse it. If a rank
    refuses or does not answer (2), every other rank is told to cancel it, on the same
    connection (so after the command), and their answers are checked: a rank that
    applied it already makes the reply say that the ranks may now differ. It is refused
    before (1) when not every rank can be reached (a knob must never differ between
    ranks): a single-node run needs every rank's run file on this machine; a multi-node
    torchrun job reaches this machine's ranks directly and each other node's through
    that node's relay (:mod:`agent.io.relay`), which the job's store names and the
    user's job secret lets in (:mod:`agent.wire.nodes`). A relay passes each phase to
    its node's ranks and answers for all of them, within ``0.7 * timeout_s``; a node
    that does not answer (stopped, partitioned) counts as a refusal of each of its
    ranks, so the command is refused, or withdrawn, everywhere.

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
        reason: with a ``command_id`` starting with
            :data:`agent.wire.protocol.ROLLBACK_ID_PREFIX`: the command is a rollback, for
            this reason (rank 0's guard, to every rank).

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
    if reason is not None:
        body["reason"] = reason
    if apply_step is not None:
        body["apply_step"] = apply_step
    if info.world_size <= 1 or info.run_id == "?":
        with RankConnections([info]) as single:
            return single.exchange(body, timeout_s, cancelled)[0]
    groups, unreachable = _groups(info)
    if unreachable is not None:
        return {"id": command_id, "ok": False, "answered": False, "reason": unreachable}
    relayed = any(group.node is not None for group in groups)
    if relayed:  # a relay waits this long for its ranks, then answers for them
        body["within_s"] = round(0.7 * timeout_s, 3)
    with RankConnections([group.info for group in groups],
                         keep=[group.node is not None for group in groups]) as connections:
        checks = _expand(groups, connections.exchange({**body, "dry_run": True},
                                                      timeout_s, cancelled))
        refusal = _first_refusal(checks)
        if refusal is not None:
            return refusal
        branches = {check.get("branch", 0) for _, check in checks}
        if len(branches) > 1:  # their steps are counted on different branches
            return {"id": command_id, "ok": False, "knob": knob, "reason": (
                "the ranks are on different branches (a rewind is applying: "
                + "; ".join(f"rank {rank} on branch {check.get('branch', 0)}"
                            for rank, check in checks[:8])
                + "): send it again")}
        # a rank that goes back before the command reaches it places its step as it
        # places its pending commands' (agent.control.desk)
        body["branch"] = branches.pop()
        held = [check["apply_step"] for _, check in checks if check.get("held")]
        if apply_step is None and held:
            # paused: every rank holds at the boundary the pause applied at on each (a
            # rank not held yet is on its way there), and the command applies there on
            # each as it arrives; a margin would name a step no held rank reaches
            body["apply_step"] = max(held)
        elif apply_step is None:
            body["apply_step"] = (max(check["apply_step"] for _, check in checks)
                                  + _margin_steps([check for _, check in checks],
                                                  1.0 if relayed else 0.5))
        answers = connections.exchange(body, timeout_s, cancelled)
        replies = _expand(groups, answers)
        refusal = _first_refusal(replies)
        if refusal is None:
            accepted = replies[0][1].copy()
            accepted["ranks"] = [rank for rank, _ in replies]
            warnings = [reply["warning"] for _, reply in replies if reply.get("warning")]
            if warnings:
                accepted["warning"] = warnings[0]
            return accepted
        # withdraw it wherever it may be scheduled: accepted, or not answered (yet)
        reached = [index for index, group in enumerate(groups)
                   if any(reply.get("ok") or reply.get("answered") is False
                          for _, reply in _expand([group], [answers[index]]))]
        cancels = connections.exchange({"id": command_id, "cancel": True,
                                        "reason": refusal["reason"],
                                        **({"within_s": 2 * body["within_s"]}
                                           if relayed else {})},
                                       2 * timeout_s, None, only=reached)
    refusal["knob"] = knob  # an unanswered reply does not name it
    return _withdrawal(refusal, _expand([groups[i] for i in reached],
                                        [cancels[i] for i in reached]))


class _Group:
    """Where one connection of a command goes: one rank of this node (``node`` None),
    or the relay of another node (``node``), which answers for its ``ranks``."""

    def __init__(self, info: RunInfo, ranks: list[int], node: int | None = None) -> None:
        self.info, self.ranks, self.node = info, ranks, node


def _groups(info: RunInfo) -> tuple[list[_Group], str | None]:
    """The connections that reach every rank of ``info``'s run: this machine's ranks
    directly (their run files), the other nodes' through their relays (as the job's
    store names them; see :mod:`agent.wire.nodes`); or the reason they cannot all be
    reached."""
    ranks = run_ranks(info.run_id)
    groups = [_Group(rank, [rank.rank]) for rank in ranks]
    nnodes = max((rank.nnodes for rank in ranks), default=info.nnodes)
    if nnodes <= 1:
        if len(ranks) != info.world_size:
            return groups, (f"{len(ranks)} of the run's {info.world_size} ranks have a run "
                            "file on this machine; a command must reach every rank (run "
                            "it where they all are, or wait until they have all started)")
        return groups, None
    here = {rank.node for rank in ranks}
    reached = {rank.rank for rank in ranks}
    relays, problem = remote_relays(info.run_id, info.world_size, here)
    for node, entry, relay in relays:
        groups.append(_Group(relay, sorted(entry["ranks"]), node))
        reached.update(entry["ranks"])
    remote = [entry for _, entry, _ in relays]
    missing = sorted(set(range(info.world_size)) - reached)
    if missing:
        known = here | {entry["node"] for entry in remote}
        unknown = [node for node in range(nnodes) if node not in known]
        why = problem or (f"node{'s' if len(unknown) > 1 else ''} "
                          + ", ".join(map(str, unknown)) + " not in the job's store yet"
                          if unknown else "their nodes' relays do not list them")
        return groups, (f"{info.world_size - len(missing)} of the run's {info.world_size} "
                        f"ranks can be reached from here (ranks {_span(missing)} cannot: "
                        f"{why}); a command must reach every rank")
    return groups, None


def remote_relays(run_id: str, world_size: int, here: set[int]
                  ) -> tuple[list[tuple[int, dict[str, Any], RunInfo]], str | None]:
    """The relays of the other nodes of multi-node run ``run_id``, and why some cannot be used.

    The nodes other than ``here`` (the nodes of this machine's ranks), as the job's store
    names them: ``(node, entry, info)`` where ``info`` connects to the relay (its CURVE keys
    and token derived from this user's job secret, :mod:`agent.wire.nodes`); and why some
    cannot be used (no job secret, or an entry whose server key is not the one the secret
    gives), or None."""
    from agent.wire.nodes import SecretError, client_keys, load_secret, relay_token, server_keys

    remote = [entry for entry in node_list(run_id) if entry["node"] not in here]
    if not remote:
        return [], None
    try:
        secret = load_secret()
    except SecretError as exc:
        return [], str(exc)
    client_public, client_secret = client_keys(secret, run_id)
    token = relay_token(secret, run_id)
    relays, problem = [], None
    for entry in remote:
        server_public, _ = server_keys(secret, run_id, entry["node"])
        if entry["server_key"] != server_public:
            problem = (f"node {entry['node']}'s entry in the job's store names a server key "
                       "that is not the one your job secret gives (another secret on that "
                       "node, or a forged entry): it is not trusted")
            continue
        relays.append((entry["node"], entry, RunInfo(
            run_id=run_id, rank=min(entry["ranks"], default=-1), world_size=world_size,
            pid=0, pub_endpoint=entry["pub_endpoint"], cmd_endpoint=entry["cmd_endpoint"],
            token=token, started_at=0.0, host=entry["host"],
            node=entry["node"], curve_server_key=server_public,
            curve_client_public_key=client_public, curve_client_secret_key=client_secret)))
    return relays, problem


def _span(ranks: list[int]) -> str:
    """``2, 3`` or ``4-1023``."""
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _expand(groups: list[_Group], replies: list[protocol.Reply]
            ) -> list[tuple[int, protocol.Reply]]:
    """Each rank's reply, by rank: a relay's reply holds those of its ranks; a relay
    that did not answer (or a malformed answer) stands for each of its ranks."""
    expanded: list[tuple[int, protocol.Reply]] = []
    for group, reply in zip(groups, replies):
        if group.node is None:
            expanded.append((group.ranks[0], reply))
            continue
        inner = reply.get("replies") if reply.get("relay") else None
        by_rank = {item.get("rank"): item for item in inner or ()
                   if isinstance(item, dict)}
        for rank in group.ranks:
            item = by_rank.get(rank)
            if item is None:
                # the relay's own reply but its ranks': a Reply still
                item = cast(protocol.Reply, {key: value for key, value in reply.items()
                                             if key != "replies"})
                if item.get("answered") is not False:  # answered, but not for this rank
                    item["ok"] = False
                    item["reason"] = (f"node {group.node}'s relay: "
                                      f"{reply.get('reason') or f'no reply for rank {rank}'}")
            expanded.append((rank, item))
    expanded.sort(key=lambda pair: pair[0])
    return expanded


def _withdrawal(refusal: protocol.Reply, answers: list[tuple[int, protocol.Reply]]
                ) -> protocol.Reply:
    """The refusal, told what became of the command on the other ranks."""
    withdrawn = [rank for rank, answer in answers if answer.get("ok")]
    applied = [(rank, answer["applied_step"]) for rank, answer in answers
               if "applied_step" in answer]
    silent = [rank for rank, answer in answers if answer.get("answered") is False]
    if withdrawn:
        refusal["reason"] += ("; withdrawn from rank" + ("s " if len(withdrawn) > 1 else " ")
                              + _span(withdrawn))
    if applied or silent:
        refusal["ranks_differ"] = True
        refusal["reason"] += "; THE RANKS MAY NOW DIFFER: " + "; ".join(
            [f"rank {rank} applied it at step {step}" for rank, step in applied]
            + [f"rank {rank} did not answer the withdrawal" for rank in silent]
        ) + f"; set {refusal['knob']} again to make them agree"
    return refusal


def _margin_steps(checks: list[protocol.Reply], bound_s: float = 0.5) -> int:
    """Steps to add to the ranks' earliest common step so that the second phase of a
    fan-out arrives in time: 2, plus what the fastest rank trains in a generous bound
    (``bound_s``: 0.5 s, 1 s through other nodes' relays) on the second phase's round
    trip (the agent answers within its 50 ms poll)."""
    step_times = [check.get("step_time_s") for check in checks]
    fastest = min((t for t in step_times if isinstance(t, (int, float)) and t > 0),
                  default=None)
    if fastest is None:
        return 2
    return min(MAX_FAN_OUT_MARGIN_STEPS, 2 + math.ceil(bound_s / fastest))


def _first_refusal(replies: list[tuple[int, protocol.Reply]]) -> protocol.Reply | None:
    """The first rank's refusal, `` (rank N)`` after its reason; None if all ok."""
    for rank, reply in replies:
        if not reply.get("ok"):
            refusal = reply.copy()
            refusal["reason"] = f"{reply.get('reason', 'no reason given')} (rank {rank})"
            return refusal
    return None


#: Connections to other nodes' relays kept for the next command, at most: a new one
#: costs a CURVE handshake on both sides, 1,023 of them a command to a job of 1,024
#: nodes (3 to 4 s of its 4.5 s round trip on 2 busy CPUs; an exchange on kept
#: connections took 0.3 s). One that goes unanswered is closed.
MAX_KEPT_RELAYS = 1 << 14
#: Longest wait between two tries to reach a rank or relay that is not there (ms; the
#: first waits ZeroMQ's 100 ms, each next one twice as long): kept connections to the
#: relays of a job that ended are not tried 10 times a second each.
RECONNECT_MAX_MS = 10_000
#: Kept relay connections, by (endpoint, server key); a socket is taken out while one
#: command uses it.
_kept_relays: dict[tuple[str, str], zmq.Socket] = {}
_kept_lock = threading.Lock()


class RankConnections:
    """One DEALER socket per rank for the whole of one command (a context manager).

    Each rank receives its dry run, the command and a cancel on one connection, in the
    order they were sent; :func:`send_command` and the node relays
    (:mod:`agent.io.relay`) use it. Connecting costs no round trip (ZeroMQ connects in the
    background); :meth:`exchange` waits at most its ``timeout_s``. Closed on exit, but
    for the connections to other nodes' relays (``keep``) every message of which was
    answered: those are kept for the next command (at most :data:`MAX_KEPT_RELAYS`),
    and nothing is ever left queued on a kept one.
    """

    def __init__(self, ranks: list[RunInfo], keep: list[bool] | None = None) -> None:
        """Connect one DEALER per rank (a rank that cannot be reached gets its reason
        instead), or take the kept connection of a relay (``keep[i]``); raises
        nothing."""
        self.ranks = ranks
        self._sockets: list[zmq.Socket | None] = []
        self._errors: list[str | None] = []
        self._keys: list[tuple[str, str] | None] = []
        #: Messages sent on each socket and not answered yet (only a socket with none
        #: left is kept).
        self._unanswered = [0] * len(ranks)
        for index, info in enumerate(ranks):
            sock: zmq.Socket | None = None
            error: str | None = None
            key = ((info.cmd_endpoint, info.curve_server_key)
                   if keep is not None and keep[index] and info.curve_server_key else None)
            self._keys.append(key)
            if key is not None:
                with _kept_lock:
                    kept = _kept_relays.pop(key, None)
                if kept is not None:
                    self._sockets.append(kept)
                    self._errors.append(None)
                    continue
            if not info.cmd_endpoint:
                error = "this run has no command endpoint (attach by run id)"
            elif (info.cmd_endpoint.startswith("tcp://") and info.token
                  and not info.curve_server_key):
                error = (f"{info.cmd_endpoint} is tcp without the run's CURVE key in "
                         "its run file, so nothing proves it is the run: its token is "
                         "not sent (an agent of this version always has one)")
            else:
                sock = shared_context().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                # a kept connection whose relay went away tries again ever less often
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
                try:
                    secure(sock, info)
                    sock.connect(info.cmd_endpoint)
                except zmq.ZMQError as exc:
                    sock.close(linger=0)
                    sock, error = None, f"cannot connect to {info.cmd_endpoint}: {exc}"
            self._sockets.append(sock)
            self._errors.append(error)

    def __enter__(self) -> RankConnections:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sock, key, unanswered in zip(self._sockets, self._keys, self._unanswered):
            if sock is None:
                continue
            if key is not None and not unanswered:
                with _kept_lock:
                    if key not in _kept_relays and len(_kept_relays) < MAX_KEPT_RELAYS:
                        _kept_relays[key] = sock
                        continue
            sock.close(linger=0)  # what is queued on it goes with it

    def exchange(self, body: dict[str, Any], timeout_s: float,
                 cancelled: Callable[[], bool] | None,
                 only: list[int] | None = None) -> list[protocol.Reply]:
        """Send ``body`` with each rank's token to the ranks; wait ``timeout_s`` for their replies.

        Wait up to ``timeout_s``. ``only``: those rank indexes. A late reply to an earlier
        phase is skipped (replies echo ``dry_run`` and ``cancel``). Returns one reply body
        per rank of :attr:`ranks` (``ok: False, answered: False`` and the reason where none
        came, or where the rank was not asked)."""
        command_id = body["id"]
        phase = (bool(body.get("dry_run")), bool(body.get("cancel")))

        def unanswered(reason: str) -> protocol.Reply:
            return {"id": command_id, "ok": False, "answered": False, "reason": reason}

        asked = range(len(self.ranks)) if only is None else only
        replies: dict[int, protocol.Reply | None] = {}
        poller = zmq.Poller()
        for index in asked:
            sock, info = self._sockets[index], self.ranks[index]
            if sock is None:
                replies[index] = unanswered(self._errors[index] or "no connection")
                continue
            replies[index] = None
            sock.send_multipart(protocol.encode(protocol.envelope(
                protocol.COMMAND, {**body, "token": info.token}, run=info.run_id)))
            self._unanswered[index] += 1
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
                if reply["type"] == protocol.REPLY:
                    self._unanswered[owner[sock]] -= 1
                if (reply["type"] == protocol.REPLY and answer.get("id") == command_id
                        and (bool(answer.get("dry_run")), bool(answer.get("cancel")))
                        == phase):
                    replies[owner[sock]] = answer
        waited = "cancelled" if stopped else (
            f"no reply within {timeout_s:.1f} s (is the run alive?)")
        return [replies.get(index) or unanswered(waited if index in replies else "not asked")
                for index in range(len(self.ranks))]
