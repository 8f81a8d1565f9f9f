"""The live source: a thread that reads a run's telemetry socket into a RunState.

A run that goes away and comes back under the same run id (restarted by its agent, or
a stall that ends) is followed: the SUB socket reconnects by itself to the same
endpoint (ZeroMQ does, for tcp and ipc), and while the run is gone, or when its
``hello`` shows a new process, the run file is read again, so that a new endpoint is
connected and commands carry the new process's token.

Silence alone does not make a run "gone": while nothing is heard, the run file is
looked at every second, and a run whose file is there with a live pid is not gone (a
loaded machine can hold a heartbeat back for seconds), only "quiet" after a long grace.

A run of several ranks is followed on every rank's socket found on this machine (looked
for again until all are there): the charts, panels and log show the rank given (rank 0
by default), the other ranks' steps give their pace (:attr:`RunState.ranks`, the
slowest rank in the header) and their warnings and errors reach the log.

A multi-node job's other nodes are followed through their relays (all on one socket,
as the job's store names them: :func:`agent.wire.commands.remote_relays`): their ``node``
summaries give their ranks' pace and the node's data wait, the relay of rank 0's node
forwards rank 0's own records (the charts show rank 0 from any node), and every rank's
events reach the log.

The charts show the whole run from step 1: the run's log (its run file's ``log_path``)
is read by :class:`~gpuwatch.sources.whole_run.WholeRun` in a thread of its own, which
this source's thread never waits for (not when it follows rank 0 of another node: that
log is on the other machine). The same reading fills the event log with the run's events
before the first record received (:class:`~gpuwatch.sources.whole_run.EarlierEvents`),
and the panels with what they imply; where the log cannot be read, one line says where
those events are.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq

from agent.wire import protocol
from agent.wire.commands import RankConnections, remote_relays
from agent.wire.runs import RunInfo, list_runs, run_ranks
from gpuwatch import state as run_state
from gpuwatch.client import Subscriber
from gpuwatch.sources import Source
from gpuwatch.sources.whole_run import EARLIER_EVENTS, EarlierEvents, WholeRun
from gpuwatch.units import local_time

#: How long the thread waits for a message before checking whether to stop (s).
POLL_S = 0.1
#: Messages received per wake-up at most, and bytes and seconds spent decoding them:
#: they are decoded outside the lock and folded under it in one go, so the app never
#: waits long for the lock, whatever comes (1 MB records, floods).
BATCH = 1000
BATCH_BYTES = 4 << 20
BATCH_S = 0.02
#: While the run is gone, how often its run file is looked for again (s).
RECHECK_S = 1.0
#: While another node's relay is silent, how often the job's store is looked at for
#: the node at other ports (s): a job restarted by torchrun keeps its run id, and its
#: relays start again on new ports. A look derives every other node's keys from the
#: job secret (80 ms of CPU at 1,024 nodes): not every second for a node gone for good.
SILENT_RECHECK_S = 10.0


class LiveSource(Source):
    """Telemetry of a live run, received on a SUB socket in a daemon thread.

    Args:
        info: the run (from :func:`agent.wire.runs.find_run`); commands go to it too.
    """

    def __init__(self, info: RunInfo) -> None:
        super().__init__(info, f"run {info.run_id} at {info.pub_endpoint}", poll_s=POLL_S)
        self._info = info
        self.state.primary_rank = info.rank
        # found in its run file with a live pid; looked at again whenever it is silent
        self.state.process_alive = True if info.run_id != "?" and info.pid else None
        #: Subscribers of the run's other ranks, by rank (this thread's).
        self._others: dict[int, Subscriber] = {}
        #: The one subscriber of every other node's relay (this thread's; None before the
        #: first), and the endpoint it is connected to of each node: a poll's cost grows
        #: with the sockets polled (1.65 ms of CPU a poll of 1,031 sockets, 22 polls/s at
        #: 1,024 nodes: a third of the source's CPU), not with the publishers a socket is
        #: connected to.
        self._relay_hub: Subscriber | None = None
        self._relay_endpoints: dict[int, str] = {}
        #: The endpoint of each node that could not be connected to (malformed), said
        #: once: tried again only when the store names another (looked for every
        #: :data:`SILENT_RECHECK_S`).
        self._relay_unusable: dict[int, str] = {}
        #: Every subscriber of this thread, by socket, each registered in the one poller
        #: (a wake-up costs what is ready, not what is followed).
        self._followed: dict[zmq.Socket, Subscriber] = {}
        self._poller = zmq.Poller()
        #: The ranks of this machine besides the shown one (a multi-node job's other
        #: ranks are heard through their relays: their files are not looked for).
        self._local_others = (info.world_size // info.nnodes if info.nnodes > 1
                              else info.world_size) - 1
        self._relay_problem: str | None = None
        if info.nnodes > 1 and info.rank != 0:  # rank 0's charts, through its node's relay
            relays, _ = remote_relays(info.run_id, info.world_size, {info.node})
            if any(0 in entry["ranks"] for _, entry, _ in relays):
                self.state.primary_rank = 0
        #: the run's records before the first one received, from its log (None: no
        #: log here to read them from)
        self._earlier: EarlierEvents | None = None
        self._joined = False  # the first record received was handed on
        if info.log_path and self.state.primary_rank == info.rank:  # the charts' rank
            self._earlier = EarlierEvents(self._add_earlier)
            # the run from step 1, and its events before this dashboard, from its log
            self.whole = WholeRun(info.log_path, earlier=self._earlier)

    def _add_earlier(self, earlier: run_state.RunState,
                     activation: tuple[int | None, float] | None) -> None:
        """Put the run's events before the first record received before the others
        (the log reader's thread)."""
        with self.lock:
            self.state.add_earlier(earlier, shown=EARLIER_EVENTS, activation=activation)

    def _join(self, joined: tuple[int, object, float | None]) -> None:
        """The first record of the shown rank was received: ``(seq, type, t)``; where
        the run's earlier events come from, or one line saying where they are."""
        self._joined = True
        if self._earlier is not None:
            self._earlier.join(joined)
            return
        before = local_time(joined[2], "%H:%M:%S")
        where = ("are in rank 0's run log, on its node" if self.state.primary_rank
                 != self._info.rank else "are not shown: the run keeps no run log")
        with self.lock:
            self.state.log("info", f"events before {before} {where}")

    def _subscribe(self, info: RunInfo) -> Subscriber | None:
        try:
            return self._open(info)
        except zmq.ZMQError as exc:  # e.g. a malformed endpoint in the run file
            self._cannot_follow(info, exc)
            return None

    def _open(self, info: RunInfo) -> Subscriber:
        """A subscriber of ``info``, registered in the poller.

        Raises:
            zmq.ZMQError: the endpoint is malformed."""
        subscriber = Subscriber(info)  # the socket lives in this thread
        self._followed[subscriber.socket] = subscriber
        self._poller.register(subscriber.socket, zmq.POLLIN)
        return subscriber

    def _cannot_follow(self, info: RunInfo, exc: zmq.ZMQError) -> None:
        with self.lock:
            self.state.log("error", f"cannot subscribe to {info.pub_endpoint}: {exc}")

    def _unsubscribe(self, subscriber: Subscriber) -> None:
        self._poller.unregister(subscriber.socket)
        del self._followed[subscriber.socket]
        subscriber.close()

    def _run(self) -> None:
        subscriber = self._subscribe(self._info)
        if subscriber is None:
            return
        heard_at = time.monotonic()
        next_check = next_rank_check = next_relay_check = 0.0
        next_adopt = 0.0  # when to look for the run file of a new process again
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if len(self._others) < self._local_others and now >= next_rank_check:
                    next_rank_check = now + RECHECK_S
                    self._subscribe_other_ranks()
                if self._info.nnodes > 1 and now >= next_relay_check:
                    if (len(self._relay_endpoints) + len(self._relay_unusable)
                            < self._info.nnodes - 1):  # nodes not in the store yet
                        next_relay_check = now + RECHECK_S
                        self._subscribe_relays()
                    elif self._relay_unusable or self._relay_silent(now):
                        next_relay_check = now + SILENT_RECHECK_S
                        self._subscribe_relays()
                    else:
                        next_relay_check = now + RECHECK_S
                ready = self._poll(subscriber)
                now = time.monotonic()
                if subscriber not in ready:
                    if now - heard_at > run_state.GONE_AFTER_S and now >= next_check:
                        next_check = now + RECHECK_S
                        subscriber = self._refresh(subscriber)
                    if not ready:
                        continue
                else:
                    heard_at = now
                batch = self._receive(ready)
                with self.lock:
                    for message in batch:
                        if message is None:
                            self.state.malformed += 1
                            self.state.version += 1
                        else:
                            self.state.ingest(message, now)
                    hello = self.state.hello
                    joined = self.state.joined
                    speaker = (hello.get("pid"), hello.get("started_at")) if hello else None
                if joined is not None and not self._joined:
                    self._join(joined)
                adopted = (self._info.pid, self._info.started_at)
                if (speaker is not None and speaker != adopted and self._info.run_id != "?"
                        and self.state.primary_rank == self._info.rank
                        and now >= next_adopt):  # a new process: its run file has its token
                    next_adopt = now + RECHECK_S  # until that file is read
                    subscriber = self._refresh(subscriber)
        finally:
            for followed in list(self._followed.values()):
                self._unsubscribe(followed)

    @staticmethod
    def _receive(ready: list[Subscriber]) -> list[dict[str, Any] | None]:
        """Decoded envelopes waiting on the ``ready`` subscribers (None for a malformed
        one): at most :data:`BATCH` messages, :data:`BATCH_BYTES` bytes and about
        :data:`BATCH_S` seconds of decoding; the rest waits for the next wake-up."""
        batch: list[dict[str, Any] | None] = []
        size, deadline = 0, time.monotonic() + BATCH_S
        for subscriber in ready:
            while len(batch) < BATCH and size < BATCH_BYTES:
                frames = subscriber.recv_frames(0)
                if frames is None:
                    break
                size += sum(len(frame) for frame in frames)
                try:
                    batch.append(protocol.decode_frames(frames))
                except protocol.ProtocolError:
                    batch.append(None)
                if time.monotonic() > deadline:
                    return batch
        return batch

    def _poll(self, first: Subscriber) -> list[Subscriber]:
        """The subscribers with a message waiting, after up to :data:`POLL_S`; ``first``
        (the shown rank's) first when it is one of them."""
        ready = [self._followed[socket] for socket, _ in self._poller.poll(
            int(POLL_S * 1000))]
        if first in ready and ready[0] is not first:
            ready.remove(first)
            ready.insert(0, first)
        return ready

    def _subscribe_other_ranks(self) -> None:
        """Subscribe to the run's ranks found since the last look (a rank's file
        appears when it has started)."""
        try:
            found = run_ranks(self._info.run_id)
        except OSError:
            return  # the run directory went away: look again later
        for info in found:
            if info.nnodes > 1:
                with self.lock:  # (a relay's summary names the other nodes' ranks)
                    self.state.list_ranks(info.node, [info.rank])
            if info.rank != self._info.rank and info.rank not in self._others:
                subscriber = self._subscribe(info)
                if subscriber is not None:
                    self._others[info.rank] = subscriber

    def _subscribe_relays(self) -> None:
        """Subscribe to the relays of the other nodes the job's store has named since
        the last look, or at another endpoint since (a job restarted by torchrun); say
        once why some cannot be (no job secret, a forged entry, a malformed endpoint)."""
        try:
            relays, problem = remote_relays(self._info.run_id, self._info.world_size,
                                            {self._info.node})
        except OSError:
            return
        new = [info for node, _, info in relays
               if info.pub_endpoint not in (self._relay_endpoints.get(node),
                                            self._relay_unusable.get(node))]
        if new:
            with self.lock:  # (a summary speaks for its own node's ranks only)
                for node, entry, _ in relays:
                    self.state.list_ranks(node, entry["ranks"])
        for info in new:
            old = self._relay_endpoints.pop(info.node, None)
            if old is not None and self._relay_hub is not None:  # a restarted job's
                # relay, on new ports: the old ones are nobody's now, or another's
                with contextlib.suppress(zmq.ZMQError):
                    self._relay_hub.socket.disconnect(old)
            try:
                if self._relay_hub is None:
                    self._relay_hub = self._open(info)
                else:
                    self._relay_hub.connect(info)
            except zmq.ZMQError as exc:  # e.g. a malformed endpoint in the store
                self._relay_unusable[info.node] = info.pub_endpoint
                self._cannot_follow(info, exc)
                continue
            self._relay_unusable.pop(info.node, None)
            self._relay_endpoints[info.node] = info.pub_endpoint
        if new:  # their command connections too, kept for the first command: a CURVE
            # handshake each (1,023 at 1,024 nodes), paid now rather than while it waits
            with RankConnections(new, keep=[True] * len(new)):
                pass
        if problem and problem != self._relay_problem:
            self._relay_problem = problem
            with self.lock:
                self.state.log("warning", f"other nodes not followed: {problem}")

    def _relay_silent(self, now: float) -> bool:
        """Whether a node followed is silent (its relay gone, or moved: see
        :data:`SILENT_RECHECK_S`)."""
        with self.lock:
            return bool(self.state.silent_nodes(now))

    def _refresh(self, subscriber: Subscriber) -> Subscriber:
        """Read the run file of this run id and rank again; if another process wrote
        it, send commands there and, if its endpoint moved, subscribe there."""
        current = self._info
        try:
            fresh = next((info for info in list_runs() if info.run_id == current.run_id
                          and info.rank == current.rank), None)
        except OSError as exc:  # the run directory went away: keep listening
            with self.lock:
                self.state.log("warning", f"cannot read the run files: {exc}")
            return subscriber
        with self.lock:  # a run file with a live pid: not gone, however long it is silent
            self.state.process_alive = fresh is not None
        if fresh is None or (fresh.pid, fresh.token, fresh.pub_endpoint, fresh.cmd_endpoint
                             ) == (current.pid, current.token, current.pub_endpoint,
                                   current.cmd_endpoint):
            return subscriber
        self._info = fresh
        moved = fresh.pub_endpoint != current.pub_endpoint
        with self.lock:
            self.info = fresh
            self.state.log("info", f"run {fresh.run_id} restarted (pid {fresh.pid})"
                           + (f"; reconnecting to {fresh.pub_endpoint}" if moved else ""))
        if not moved:
            return subscriber
        replacement = self._subscribe(fresh)
        if replacement is None:
            return subscriber
        self._unsubscribe(subscriber)
        return replacement
