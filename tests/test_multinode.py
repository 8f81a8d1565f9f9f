"""Beyond one node: two simulated nodes on this machine (two real torchrun processes
with a c10d rendezvous on 127.0.0.1, DDP on gloo, real agents, relays and ZeroMQ),
each with its own run directory, log directory and home, so that they share nothing
but the network (and the job secret, which the user puts on each node)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent.wire import nodes, runs
from gpuwatch.sources.live import LiveSource
from gpuwatch.history import flat_records
from tests.conftest import wait_until

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Node:
    """One simulated node: its own home (with the job secret), run and log directory,
    and its torchrun process (``index``: its ``--node-rank``, which a c10d rendezvous
    does not keep: the node numbers are the order they joined in)."""

    def __init__(self, root: Path, index: int, secret: str) -> None:
        self.index = index
        self.home, self.run_dir, self.log_dir = (root / f"node{index}" / part
                                                 for part in ("home", "run", "log"))
        for path in (self.home, self.run_dir, self.log_dir):
            path.mkdir(parents=True, mode=0o700)
        secret_file = self.home / nodes.DEFAULT_SECRET
        secret_file.parent.mkdir(parents=True, mode=0o700)
        secret_file.write_text(secret)
        secret_file.chmod(0o600)
        self.env = {**{key: value for key, value in os.environ.items()
                       if not key.startswith("GPUWATCH_") and key != "XDG_RUNTIME_DIR"},
                    "HOME": str(self.home), "GPUWATCH_RUN_DIR": str(self.run_dir),
                    "GPUWATCH_LOG_DIR": str(self.log_dir), "OMP_NUM_THREADS": "1"}
        self.process: subprocess.Popen | None = None
        self.output = root / f"node{index}.out"

    def launch(self, rdzv_port: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(self.index), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}",
             str(EXAMPLES / "ddp_attach.py"), "--max-steps", "100000"],
            stdout=self.output.open("w"), stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True)

    def ranks(self) -> list[runs.RunInfo]:
        return sorted(runs.list_runs(self.run_dir), key=lambda info: info.rank)

    def gpuwatch(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def log(self, run_id: str, rank: int) -> list[dict]:
        path = self.log_dir / f"{run_id}.rank{rank}.runlog"
        if not path.exists():
            return []
        return list(flat_records(path))  # (a frame being written is left out)

    def processes(self) -> list[psutil.Process]:
        """torchrun and everything it started (workers, their gateways and relay)."""
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def signal(self, signum: int) -> None:
        for process in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signum)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            leftovers = self.processes()
        self.signal(signal.SIGCONT)
        self.process.send_signal(signal.SIGTERM)  # torchrun passes it to its workers
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for process in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def watching(*nodes_):
    """:func:`tests.conftest.wait_until`'s options for a wait on ``nodes_``: fail as soon
    as one's torchrun ends, say what each printed, poll every 0.2 s for up to 120 s."""
    return {"alive": [node.process for node in nodes_], "timeout_s": 120.0, "poll_s": 0.2,
            "detail": lambda: " | ".join(node.output.read_text()[-2000:] for node in nodes_)}


@pytest.fixture
def two_nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mn-")
    secret = secrets.token_hex(32)
    pair = [Node(root, 0, secret), Node(root, 1, secret)]
    port = free_port()
    try:
        for node in pair:
            node.launch(port)

        def ready():
            found = [node.ranks() for node in pair]
            if [len(ranks) for ranks in found] != [2, 2]:
                return None
            leaders = [ranks[0] for ranks in found]
            if any(len(leader.nodes) != 2 for leader in leaders):
                return None  # each node's relay has not yet learnt of the other's
            return found

        found = wait_until(ready, "both nodes' ranks and relays", **watching(*pair))
        # a c10d rendezvous numbers the nodes as they join: node 0 is the one of rank 0
        order = sorted(range(2), key=lambda i: found[i][0].rank)
        yield [pair[i] for i in order], [found[i] for i in order]
    finally:
        for node in pair:
            node.stop()


def steps_and_events(node: Node, run_id: str, rank: int):
    log = node.log(run_id, rank)
    steps = [m for m in log if m.get("type") == "step"]
    events = [m for m in log if m.get("type") == "event"]
    return steps, events


def test_a_command_from_node_0_applies_on_all_four_ranks_at_one_step_and_a_stopped_node_changes_nothing(  # noqa: E501 - the name says what it checks
        two_nodes):
    (node0, node1), (ranks0, ranks1) = two_nodes
    run_id = ranks0[0].run_id
    assert {info.run_id for info in ranks0 + ranks1} == {run_id}  # one job, one run id
    assert sorted(info.rank for info in ranks0 + ranks1) == [0, 1, 2, 3]
    assert {info.node for info in ranks0} != {info.node for info in ranks1}
    assert all(info.nnodes == 2 and info.world_size == 4 for info in ranks0 + ranks1)
    # nothing secret in the store: what the leaders learnt from it is public
    for entry in ranks0[0].nodes:
        assert set(entry) == set(nodes.NODE_FIELDS)

    # ranks at which each node's rank 0 is by rank, for the logs
    where = {info.rank: node for node, ranks in ((node0, ranks0), (node1, ranks1))
             for info in ranks}
    wait_until(lambda: all(steps_and_events(where[r], run_id, r)[0] for r in range(4)),
               "every rank's log to have steps", **watching(node0, node1))

    done = node0.gpuwatch("set", "precision=bf16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("accepted: precision=bf16 applies at step ")
    assert done.stdout.rstrip().endswith("on ranks 0, 1, 2, 3")
    apply_step = int(done.stdout.split("applies at step ")[1].split()[0])

    def applied_everywhere():
        for rank in range(4):
            steps, _ = steps_and_events(where[rank], run_id, rank)
            if not steps or steps[-1]["step"] < apply_step + 2:
                return False
        return True

    wait_until(applied_everywhere, "every rank past the step", **watching(node0, node1))
    for rank in range(4):
        steps, events = steps_and_events(where[rank], run_id, rank)
        applied = [(e["knob"], e["step"]) for e in events if e.get("kind") == "applied"]
        assert applied == [("precision", apply_step)], (rank, applied)
        assert {s["knobs"]["precision"] for s in steps if s["step"] < apply_step} == {"fp32"}
        assert {s["knobs"]["precision"] for s in steps if s["step"] >= apply_step} == {"bf16"}

    # from node 1: the CLI and the dashboard see node 0's ranks, through its relay
    runs_out = node1.gpuwatch("runs")
    assert f"{run_id}: node 1 of 2; the job's store names node 0 (" in runs_out.stdout
    table = node1.gpuwatch("nodes")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NODE", "HOST", "RANK", "STEP", "STEP", "TIME", "DATA",
                                "WAIT"]
    assert [line.split()[0] for line in lines[1:] if line.startswith(" ")] == [
        "0", "1", "2", "3"], table.stdout  # each node's ranks under it
    host = socket.gethostname()
    assert [line.split()[:3] for line in lines[1:] if line[:1].isdigit()] == [
        ["0", host, "2/2"], ["1", host, "2/2"]], table.stdout  # both heard in full
    assert lines[-2].startswith("slowest: rank ") and "(node " in lines[-2]
    assert lines[-1] == "this machine: node 1, ranks 2, 3"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(node1.home))
        patch.setenv(runs.RUN_DIR_ENV, str(node1.run_dir))
        patch.delenv(nodes.SECRET_ENV, raising=False)
        source = LiveSource(runs.find_run(run_id, node1.run_dir))
        source.start()
        try:
            def sees_every_rank():
                with source.lock:
                    state = source.state
                    return (set(state.ranks) == {0, 1, 2, 3} and 0 in state.nodes
                            and state.steps and state.primary_rank == 0
                            and state.schema and state)
            state = wait_until(sees_every_rank, "node 1's dashboard to see every rank",
                               **watching(node0, node1))
            with source.lock:
                assert {rank: state.node_of(rank) for rank in range(4)} == {
                    0: 0, 1: 0, 2: 1, 3: 1}
                assert state.nodes[0].expected == 2 and state.nodes[0].host
                assert state.hello["rank"] == 0  # rank 0's charts, from node 1
        finally:
            source.close()

    # node 1 stopped (torchrun, its workers, its relay): the command reaches node 0's
    # ranks, node 1 never answers, and it is refused everywhere
    node1.signal(signal.SIGSTOP)
    try:
        refused = node0.gpuwatch("set", "accum_steps=2", "--timeout", "2")
    finally:
        node1.signal(signal.SIGCONT)
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert refused.stderr.startswith("no answer: accum_steps=2: no reply within 2.0 s"), (
        refused.stderr)
    assert "(rank 2)" in refused.stderr and "DIFFER" not in refused.stderr
    resumed_at = {rank: steps_and_events(where[rank], run_id, rank)[0][-1]["step"]
                  for rank in range(4)}

    def trained_on():  # well past any step the refused command could have named
        return all(steps_and_events(where[r], run_id, r)[0][-1]["step"]
                   >= resumed_at[r] + 30 for r in range(4))

    wait_until(trained_on, "every rank to train on after the stop", **watching(node0, node1))
    for rank in range(4):
        steps, events = steps_and_events(where[rank], run_id, rank)
        assert not [e for e in events if e.get("knob") == "accum_steps"], rank
        assert {s["knobs"]["accum_steps"] for s in steps} == {1}, rank
