"""The dashboard at cluster scale: following 1,024 nodes of 8 ranks, a command to all 8,192.

Its live source following a multi-node job of 1,024 nodes of 8 ranks, and one command's
round trip to all 8,192 ranks.

    python benchmarks/bench_nodes.py [--nodes 1024] [--baseline 64] [--seconds 20]
    python benchmarks/bench_nodes.py --short        # a quick check that it works

What is simulated (in one child process, so that this process is the dashboard alone):

- node 0, the dashboard's own node: its 8 ranks as lightweight agents, each a run file
  here (ipc endpoints and a token, as a local agent's), a PUB that sends a ``steps``
  batch of 10 rows every 100 ms (100 steps/s, the columns an agent sends) and a
  heartbeat each second, and a ROUTER that answers commands as an agent's desk does (a
  dry run with its next step and step time, the command with its apply step, a cancel);
  rank 0's run file lists every node's entry, as the job's store gives them.
- each other node, as its relay (:mod:`agent.io.relay`) is seen from outside: a PUB and a
  ROUTER on tcp 127.0.0.1 with CURVE (the server keys, client key and token that the job
  secret gives, :mod:`agent.wire.nodes`), the PUB sending the relay's ``node`` summary of
  its 8 ranks once a second, the ROUTER answering each command phase with one ``reply``
  holding its 8 ranks' replies, at once. Not simulated: the relay's own fan-out to its
  ranks on its node (one node's cost, the same at any number of nodes) and the network.

Measured in this process, which runs the real :class:`gpuwatch.sources.live.LiveSource`
(the dashboard's live source, without the Textual app) and the real
:func:`agent.wire.commands.send_command`, for a baseline job (``--baseline`` nodes) and
the large one, in the same run:

- the live source's CPU over ``--seconds`` once every node has been heard from (this
  process's CPU time, every thread: the main thread only sleeps), in % of one core;
- its memory: this process's RSS growth from before the source started to the end of
  the window (MB);
- a command's round trip (``accum_steps``, both phases, to every rank): the worst of
  ``--commands`` commands, the first (on the command connections to the relays that the
  live source opened when it followed them: each costs a CURVE handshake on both sides)
  and the median of the later ones, s; whether every rank accepted each; with the CPU time a
  command took here and in the simulated relays' process (median): on 2 busy CPUs the
  round trip is mostly the two processes waiting for a CPU, and the relays' share is
  the simulation's (real relays answer in parallel, each on its own node).

Targets at 1,024 nodes: under 10% of a core, under 500 MB, every rank answers within 2 s.

Last line: ``RESULT nodes=<n> source_cpu_pct=<c> source_rss_growth_mb=<m>
command_round_trip_s=<s> command_round_trip_kept_s=<k> every_rank_answered=<0|1>`` for
the large job.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import zmq

from agent.wire import nodes, protocol, runs

PER_NODE = 8
#: node 0's ranks send a batch of this many rows every BATCH_S (100 steps/s)
BATCH_ROWS, BATCH_S = 10, 0.1
STEP_TIME_S = BATCH_S / BATCH_ROWS


# ------------------------------------------------------------------ the simulated job


def _steps_message(run_id: str, rank: int, first: int, seq: int) -> dict[str, Any]:
    steps = list(range(first, first + BATCH_ROWS))
    columns: dict[str, list[Any]] = {
        "step": steps, "micro_batches": [1] * BATCH_ROWS, "samples": [32] * BATCH_ROWS,
        "step_time_s": [STEP_TIME_S] * BATCH_ROWS, "data_wait_s": [0.0001] * BATCH_ROWS,
        "data_wait_share": [0.01] * BATCH_ROWS,
        "samples_per_s": [32 / STEP_TIME_S] * BATCH_ROWS,
        "loss": [2.0 + 1.0 / step for step in steps]}
    return protocol.envelope(protocol.STEPS, protocol.steps_body(
        columns, {"knobs": {"accum_steps": 1}}), run=run_id, rank=rank, seq=seq)


def _answer(body: dict[str, Any], step: int) -> dict[str, Any]:
    """An agent's reply to one phase of a command (accepted)."""
    reply: dict[str, Any] = {"id": body.get("id"), "ok": True, "step": step,
                             "knob": body.get("knob"), "value": body.get("value")}
    if body.get("dry_run"):
        reply.update(dry_run=True, apply_step=step + 2, step_time_s=STEP_TIME_S)
    elif body.get("cancel"):
        reply["cancel"] = True
    else:
        reply["apply_step"] = body.get("apply_step", step + 2)
    return reply


def serve(run_dir: str, secret_file: str, run_id: str, node_count: int) -> None:
    """The simulated job (the child process): see the module's docstring."""
    secret = nodes.load_secret(Path(secret_file))
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 4 * node_count + 64)
    world = node_count * PER_NODE
    started = time.monotonic()
    local, relays, entries = [], [], []
    for rank in range(PER_NODE):  # node 0: lightweight agents on ipc
        pub, cmd = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
        pub_endpoint = f"ipc://{run_dir}/rank{rank}.pub"
        cmd_endpoint = f"ipc://{run_dir}/rank{rank}.cmd"
        pub.bind(pub_endpoint)
        cmd.bind(cmd_endpoint)
        local.append((rank, pub, cmd, runs.RunInfo(
            run_id=run_id, rank=rank, world_size=world, pid=os.getpid(),
            pub_endpoint=pub_endpoint, cmd_endpoint=cmd_endpoint, token=f"t{rank}",
            started_at=time.time(), name="bench_nodes", node=0, nnodes=node_count)))
    for node in range(1, node_count):  # the other nodes: their relays, CURVE on tcp
        public, private = nodes.server_keys(secret, run_id, node)
        pair = []
        for kind in (zmq.PUB, zmq.ROUTER):
            socket = context.socket(kind)
            socket.curve_secretkey, socket.curve_publickey = private.encode(), public.encode()
            socket.curve_server = True
            pair.append((socket, socket.bind_to_random_port("tcp://127.0.0.1")))
        ranks = list(range(node * PER_NODE, (node + 1) * PER_NODE))
        relays.append((node, ranks, pair[0][0], pair[1][0]))
        entries.append({"node": node, "host": f"node-{node}", "server_key": public,
                        "pub_endpoint": f"tcp://127.0.0.1:{pair[0][1]}",
                        "cmd_endpoint": f"tcp://127.0.0.1:{pair[1][1]}", "ranks": ranks})
    # (a CURVE server without a ZAP handler lets any client key in: the relays' check of
    # the job's client key is not simulated; their token check is)
    token = nodes.relay_token(secret, run_id)
    local[0][3].nodes = [{"node": 0, "host": "node-0", "server_key": "",
                          "pub_endpoint": "tcp://127.0.0.1:1", "cmd_endpoint":
                          "tcp://127.0.0.1:1", "ranks": list(range(PER_NODE))}, *entries]
    for *_, info in local:
        runs.write_run_file(info, Path(run_dir))
    print(json.dumps({"ready": True}), flush=True)

    poller = zmq.Poller()
    for _, _, cmd, _ in local:
        poller.register(cmd, zmq.POLLIN)
    for *_, cmd in relays:
        poller.register(cmd, zmq.POLLIN)
    relay_of = {cmd: (node, ranks) for node, ranks, _, cmd in relays}
    local_of = {cmd: (rank, info) for rank, _, cmd, info in local}
    seq, next_batch, next_summary = 0, 0.0, 0.0
    while True:  # until killed
        now = time.monotonic()
        step = int((now - started) / STEP_TIME_S)
        if now >= next_batch:
            next_batch = now + BATCH_S
            seq += 1
            for rank, pub, _, _ in local:
                pub.send_multipart(protocol.encode(_steps_message(
                    run_id, rank, max(1, step - BATCH_ROWS + 1), seq)))
        if now >= next_summary:
            next_summary = now + 1.0
            for rank, pub, _, _ in local:
                pub.send_multipart(protocol.encode(protocol.envelope(
                    protocol.HEARTBEAT, {"step": step}, run=run_id, rank=rank, seq=seq)))
            for node, ranks, pub, _ in relays:
                pub.send_multipart(protocol.encode(protocol.envelope(protocol.NODE, {
                    "node": node, "host": f"node-{node}", "expected": ranks,
                    "ranks": [{"rank": rank, "step": step, "step_time_s": STEP_TIME_S,
                               "data_wait_share": 0.01, "heard_s_ago": 0.05}
                              for rank in ranks], "events_dropped": 0},
                    run=run_id, rank=ranks[0])))
        for socket, _ in poller.poll(max(0, int((min(next_batch, next_summary) - now) * 1000)) + 1):
            frames = socket.recv_multipart()
            body = protocol.decode_frames(frames[1:])["body"]
            if socket in local_of:
                rank, info = local_of[socket]
                reply = (_answer(body, step) if body.get("token") == info.token else
                         {"id": body.get("id"), "ok": False, "reason": "wrong token"})
            else:
                node, ranks = relay_of[socket]
                reply = {"id": body.get("id"), "relay": True, "node": node,
                         "ok": body.get("token") == token,
                         "replies": [{**_answer(body, step), "rank": rank}
                                     for rank in ranks]}
                for phase in ("dry_run", "cancel"):
                    if body.get(phase):
                        reply[phase] = True
                rank = ranks[0]
            socket.send_multipart([frames[0], *protocol.encode(protocol.envelope(
                protocol.REPLY, reply, run=run_id, rank=rank))])


# ------------------------------------------------------------------ the dashboard side


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(node_count: int, seconds: float, commands: int) -> dict[str, Any]:
    """Simulate a job of ``node_count`` nodes and measure the live source following it.

    See the module's docstring."""
    from agent.wire.commands import send_command
    from gpuwatch.sources.live import LiveSource

    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as directory:
        run_dir = runs.private_dir(Path(directory) / "runs")
        secret_file = Path(directory) / "secret"
        nodes.create_secret(secret_file)
        os.environ[runs.RUN_DIR_ENV] = str(run_dir)
        os.environ[nodes.SECRET_ENV] = str(secret_file)
        run_id = f"torchrun-bench{node_count}"
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(run_dir), str(secret_file), run_id,
             str(node_count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(child.stdout.readline())["ready"]  # type: ignore[union-attr]
            info = min(runs.run_ranks(run_id), key=lambda found: found.rank)
            process = psutil.Process()
            rss_before = process.memory_info().rss
            started = time.monotonic()
            source = LiveSource(info)
            source.start()
            try:
                while True:
                    with source.lock:
                        seen = (len(source.state.nodes), len(source.state.ranks))
                    if seen[0] >= node_count - 1 and seen[1] >= node_count * PER_NODE - 1:
                        break
                    if time.monotonic() - started > 120:
                        raise SystemExit(f"only {seen} nodes and ranks seen in 120 s")
                    time.sleep(0.2)
                all_seen_s = time.monotonic() - started
                cpu_start, wall_start = _cpu_s(), time.monotonic()
                time.sleep(seconds)
                cpu_pct = 100 * (_cpu_s() - cpu_start) / (time.monotonic() - wall_start)
                rss_growth_mb = (process.memory_info().rss - rss_before) / 2**20
                trips, answered, own_cpu, relays_cpu = [], True, [], []
                relays = psutil.Process(child.pid)
                for index in range(commands):
                    began, cpu, child_cpu = time.monotonic(), _cpu_s(), sum(
                        relays.cpu_times()[:2])
                    reply = send_command(info, "accum_steps", 2 + index % 2, timeout_s=5.0)
                    trips.append(time.monotonic() - began)
                    own_cpu.append(_cpu_s() - cpu)
                    relays_cpu.append(sum(relays.cpu_times()[:2]) - child_cpu)
                    answered = answered and bool(reply.get("ok")) and (
                        reply.get("ranks") == list(range(node_count * PER_NODE)))
                    if not reply.get("ok"):
                        print(f"  command refused: {reply.get('reason')}", flush=True)
            finally:
                source.close()
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            child.kill()
            child.wait()
    return {"nodes": node_count, "all_seen_s": all_seen_s, "cpu_pct": cpu_pct,
            "rss_growth_mb": rss_growth_mb, "trip_s": max(trips), "first_trip_s": trips[0],
            "trip_median_s": statistics.median(trips[1:] or trips), "answered": answered,
            "command_cpu_s": statistics.median(own_cpu),
            "relays_cpu_s": statistics.median(relays_cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--baseline", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--commands", type=int, default=5)
    parser.add_argument("--short", action="store_true", help="16 and 128 nodes, 3 s")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_dir, secret_file, run_id, count = args.serve
        serve(run_dir, secret_file, run_id, int(count))
        return
    if args.short:
        args.baseline, args.nodes, args.seconds, args.commands = 16, 128, 3.0, 2
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    results = []
    for count in (args.baseline, args.nodes):
        result = measure(count, args.seconds, args.commands)
        results.append(result)
        print(f"{count:5d} nodes x {PER_NODE} ranks: every node heard in "
              f"{result['all_seen_s']:.1f} s; live source {result['cpu_pct']:.1f}% of a "
              f"core, RSS +{result['rss_growth_mb']:.1f} MB; command to every rank: "
              f"worst {result['trip_s']:.3f} s (the first {result['first_trip_s']:.3f}, the "
              f"later ones' median {result['trip_median_s']:.3f}), "
              f"{'every rank accepted' if result['answered'] else 'NOT every rank'}; CPU a "
              f"command: dashboard {result['command_cpu_s']:.2f} s (its source's included), "
              f"simulated relays {result['relays_cpu_s']:.2f} s (their summaries included)",
              flush=True)
    base, large = results
    print(f"ratios {large['nodes']} / {base['nodes']} nodes: CPU "
          f"x{large['cpu_pct'] / max(base['cpu_pct'], 1e-9):.1f}, RSS growth "
          f"x{large['rss_growth_mb'] / max(base['rss_growth_mb'], 1e-9):.1f}, round trip "
          f"x{large['trip_s'] / base['trip_s']:.1f} (nodes x{large['nodes'] / base['nodes']:.0f})"
          f"; load average {os.getloadavg()[0]:.1f}")
    print(f"RESULT nodes={large['nodes']} source_cpu_pct={large['cpu_pct']:.2f} "
          f"source_rss_growth_mb={large['rss_growth_mb']:.1f} "
          f"command_round_trip_s={large['trip_s']:.3f} "
          f"command_round_trip_kept_s={large['trip_median_s']:.3f} "
          f"every_rank_answered={int(large['answered'])}")


if __name__ == "__main__":
    main()
