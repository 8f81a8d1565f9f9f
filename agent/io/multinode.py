"""The agent's side of a multi-node job: the node relay, and a thread that finds the others.

On each node's local rank 0, the node relay (:mod:`agent.io.relay`) and a thread that says
where it is in the job's store and learns where the other nodes' relays are (see
:mod:`agent.wire.nodes`).

Nothing here runs on the training thread, nor on the agent's I/O thread beyond
starting it: the store is reached from a thread of its own (``gpuwatch-store``), whose
TCPStore calls release the GIL and may wait as long as they like; a store or a node
that is unreachable costs the training nothing.
"""

from __future__ import annotations

import json
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from agent.io import helpers
from agent.wire.protocol import EventKind
from agent.wire.nodes import (NodeEnv, listen_address, load_secret, node_entry, relay_token,
                              client_keys, server_keys, store_key)
from agent.wire.runs import RunInfo, write_run_file

#: The store is looked at this often until every node is known, then this often (s).
STORE_POLL_S, STORE_RECHECK_S = 1.0, 10.0
#: How long one attempt to reach the store may take (s).
STORE_CONNECT_S = 10.0


class NodeLink:
    """This node's relay and its entry in the job's store (local rank 0 only).

    Args:
        info: the agent's run info (its file gains ``nodes``; ``node``, ``nnodes`` and
            ``store`` are set by the caller for every rank).
        env: the job's layout. listen: the address to listen on (the agent's
            ``listen=``), else see :func:`agent.wire.nodes.listen_address`.
        report: called with (where, exception) for what goes wrong (the agent's
            ``report_error``: an event, training goes on).

    Raises:
        agent.wire.nodes.SecretError: no usable job secret (the node is then seen and
            steered from itself only). OSError: the relay did not start.
    """

    def __init__(self, info: RunInfo, env: NodeEnv, listen: str | None,
                 report: Callable[[str, BaseException], None]) -> None:
        self.info, self.env, self.report = info, env, report
        secret = load_secret()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        server_public, server_secret = server_keys(secret, info.run_id, env.node)
        client_public, _ = client_keys(secret, info.run_id)
        address = listen_address(env, listen)
        self.relay, answer = helpers.start("agent.io.relay", {
            "run_id": info.run_id, "node": env.node, "host": socket.gethostname(),
            "ranks": env.ranks, "address": address, "server_public": server_public,
            "server_secret": server_secret, "client_public": client_public,
            "token": relay_token(secret, info.run_id)}, "node relay")
        shown = f"[{address}]" if ":" in address else address
        self.relay_endpoints = (f"tcp://{shown}:{answer['pub_port']}",
                                f"tcp://{shown}:{answer['cmd_port']}")
        self.entry = {"node": env.node, "host": socket.gethostname(),
                      "pub_endpoint": self.relay_endpoints[0],
                      "cmd_endpoint": self.relay_endpoints[1],
                      "server_key": server_public, "ranks": env.ranks}
        self._nodes: dict[int, dict[str, Any]] = {env.node: self.entry}
        self._write()
        self._thread = threading.Thread(target=self._store_main, name="gpuwatch-store",
                                        daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the relay still runs (the I/O thread asks at each heartbeat)."""
        return self.relay.poll() is None

    def close(self) -> None:
        """Stop the store thread (it ends by itself at its next wake-up) and the relay."""
        self._stop.set()
        helpers.stop(self.relay)

    def _write(self) -> None:
        with self._lock:
            self.info.nodes = [self._nodes[node] for node in sorted(self._nodes)]
            if self.info.path:
                write_run_file(self.info, Path(self.info.path).parent)

    # ------------------------------------------------------------ store thread

    def _store_main(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                    if store is None:
                        self._stop.wait(STORE_POLL_S * 5)
                        continue
                    store.set(store_key(self.info.run_id, self.env.node),
                              json.dumps(self.entry))
                changed = False
                for node in range(self.env.nnodes):
                    if node == self.env.node:
                        continue
                    key = store_key(self.info.run_id, node)
                    if not store.check([key]):  # never waits: get only what is there
                        continue
                    try:
                        entry = node_entry(json.loads(store.get(key)))
                    except ValueError:
                        entry = None
                    if entry is not None and entry["node"] == node \
                            and self._nodes.get(node) != entry:
                        self._nodes[node] = entry
                        changed = True
                if changed:
                    self._write()
            except Exception as exc:  # the store went away (the job ends?): try again
                store = None
                if not self._stop.is_set():
                    self.report("job store", exc)
            every = STORE_RECHECK_S if len(self._nodes) == self.env.nnodes else STORE_POLL_S
            self._stop.wait(every)

    def _connect(self) -> Any:
        """A TCPStore client of the job's store, or None while nothing listens there
        (a plain connect is tried first: TCPStore's own retries print tracebacks)."""
        try:
            socket.create_connection((self.env.store_host, self.env.store_port),
                                     timeout=STORE_CONNECT_S).close()
        except OSError:
            return None
        from torch.distributed import TCPStore

        return TCPStore(self.env.store_host, self.env.store_port, is_master=False,
                        timeout=timedelta(seconds=STORE_CONNECT_S),
                        wait_for_workers=False)


def node_link(info: RunInfo, listen: str | None, report: Callable[[str, BaseException], None],
              event: Callable[..., None]) -> NodeLink | None:
    """When the agent's run file is written: set ``info``'s multi-node fields, start the link.

    Set the multi-node fields of ``info`` (every rank of a multi-node torchrun job) and, on
    a node's local rank 0, start the :class:`NodeLink`. None for a single-node job (nothing
    changes) or when it cannot start (an event says why; the node is then steered from
    itself only)."""
    env = NodeEnv.from_env()
    if env is None or env.world_size != info.world_size:
        return None
    info.node, info.nnodes = env.node, env.nnodes
    info.store = f"{env.store_host}:{env.store_port}"
    if env.local_rank != 0:
        return None
    try:
        return NodeLink(info, env, listen, report)
    except (OSError, ValueError) as exc:  # SecretError is an OSError
        event("warning", f"multi-node: node {env.node}'s ranks are seen and steered from "
              f"this node only, and a command from here cannot reach the other "
              f"{env.nnodes - 1} nodes: {exc}", kind=EventKind.WARNING)
        return None
