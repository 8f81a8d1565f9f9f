"""``gpuwatch nodes`` (every rank of a multi-node job) and ``gpuwatch secret`` (the job secret).

``nodes`` works from any of the job's nodes; the job secret lets a node's dashboard reach
the others."""

from __future__ import annotations

import argparse
import sys
import time

import zmq

from agent.wire import nodes, protocol
from agent.wire.commands import remote_relays
from agent.wire.protocol import printable
from agent.wire.runs import find_run, node_list, run_ranks
from gpuwatch.client import Subscriber, no_run_text
from gpuwatch.state import GONE_AFTER_S, RunState
from gpuwatch.units import human_ms


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Add ``nodes`` and ``secret`` to the ``gpuwatch`` command line."""
    nodes_ = commands.add_parser(
        "nodes", help="every node and rank of a multi-node job, and its straggler",
        description="Ask each node's relay of a multi-node torchrun job (as the job's "
                    "store names them) for its summary and print every rank's step, "
                    "step time and data wait, by node, and the slowest rank with its "
                    "node. Needs the job secret (see `gpuwatch secret`). Exit status: 0, "
                    "1 when a node did not answer within --wait.")
    nodes_.add_argument("run", nargs="?", metavar="RUN",
                        help="run id or unique prefix (default: the newest live run)")
    nodes_.add_argument("--wait", type=float, default=5.0, metavar="S",
                        help="seconds to wait for every node's summary (default 5)")
    nodes_.set_defaults(handler=_nodes)

    secret = commands.add_parser(
        "secret", help="make the job secret that lets nodes' dashboards reach each other",
        description="Write a new random job secret (mode 0600) at $GPUWATCH_SECRET_FILE "
                    "or ~/.config/gpuwatch/secret, unless there is one. The same file "
                    "must be on every node of a multi-node job (a shared home has it "
                    "once; else copy it, e.g. with scp): every key and token between "
                    "nodes derives from it, and it never leaves the nodes' files.")
    secret.set_defaults(handler=_secret)


def _secret(args: argparse.Namespace) -> int:
    path = nodes.secret_path()
    try:
        nodes.create_secret(path)
    except FileExistsError:
        nodes.load_secret(path)  # says what is wrong with it, if anything
        print(f"a job secret is already there: {path}")
        return 0
    print(f"wrote a new job secret: {path} (put the same file on every node)")
    return 0


def node_lines(state: RunState, now: float) -> list[str]:
    """The table ``gpuwatch nodes`` prints: one line per rank, by node, then the slowest rank.

    The slowest rank (with its node) when two or more were heard."""
    rows = [("NODE", "HOST", "RANK", "STEP", "STEP TIME", "DATA WAIT")]
    for node in sorted(state.nodes):
        pace = state.nodes[node]
        ranks = sorted(rank for rank, of in state.rank_nodes.items() if of == node)
        wait = "-" if pace.data_wait_share is None else f"{pace.data_wait_share:.0%}"
        rows.append((str(node), printable(pace.host or "-", protocol.MAX_NAME_CHARS),
                     f"{pace.heard}/{pace.expected} heard", "", "", wait + " (mean)"))
        for rank in ranks:
            rank_pace = state.ranks.get(rank)
            if rank_pace is None:
                continue
            gone = now - rank_pace.heard_at > GONE_AFTER_S
            rows.append(("", "", str(rank), str(rank_pace.step if rank_pace.step is not None
                                                 else "-"),
                         human_ms(rank_pace.step_time_s) + (" (silent)" if gone else ""),
                         ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in rows]
    slowest = state.slowest_rank(now)
    if slowest is not None:
        rank, excess = slowest
        lines.append(f"slowest: rank {rank} (node {state.node_of(rank)}), "
                     f"+{excess:.0%} over the fastest")
    return lines


def _nodes(args: argparse.Namespace) -> int:
    info = find_run(args.run)
    if info is None:
        print(no_run_text(args.run), file=sys.stderr)
        return 1
    if info.nnodes <= 1:
        print(f"run {printable(info.run_id)} runs on one node: `gpuwatch runs` lists its "
              "ranks", file=sys.stderr)
        return 1
    # every node through its relay, this one's too: one socket per node
    relays, problem = remote_relays(info.run_id, info.world_size, set())
    if problem:
        print(f"gpuwatch nodes: {printable(problem)}", file=sys.stderr)
    known = {entry["node"] for entry in node_list(info.run_id)}
    state = RunState(primary_rank=-1)  # no rank's records fill charts here
    subscribers = []
    try:
        for _, _, relay in relays:
            try:
                subscribers.append(Subscriber(relay))
            except zmq.ZMQError as exc:
                print(f"gpuwatch nodes: cannot subscribe to {relay.pub_endpoint}: {exc}",
                      file=sys.stderr)
        poller = zmq.Poller()
        for subscriber in subscribers:
            poller.register(subscriber.socket, zmq.POLLIN)
        deadline = time.monotonic() + args.wait
        while (len(state.nodes) < len(subscribers)
               and (left_s := deadline - time.monotonic()) > 0):
            for socket, _ in poller.poll(int(left_s * 1000)):
                frames = socket.recv_multipart(zmq.NOBLOCK)
                state.ingest_frames(frames)
    finally:
        for subscriber in subscribers:
            subscriber.close()
    for line in node_lines(state, time.monotonic()):
        print(line)
    missing = sorted(set(range(info.nnodes)) - set(state.nodes))
    if missing:
        unknown = sorted(set(missing) - known)
        print("no summary from node" + ("s " if len(missing) > 1 else " ")
              + ", ".join(map(str, missing))
              + (f" (not in the job's store yet: {', '.join(map(str, unknown))})"
                 if unknown else f" within {args.wait:g} s"), file=sys.stderr)
        return 1
    here = sorted(rank.rank for rank in run_ranks(info.run_id))
    print(f"this machine: node {info.node}, ranks {', '.join(map(str, here))}")
    return 0
