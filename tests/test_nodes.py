"""Multi-node parts on their own: the job secret and what derives from it, torchrun's
layout, store entries, a real node relay (``python -m agent.io.relay``) in front of fake
agents in a run directory of its own (another "node"), the fan-out through it, and the
dashboard's folding of node summaries (with a scale run of a few hundred ranks)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from agent.wire import nodes, protocol, runs
from agent.wire.commands import RankConnections, remote_relays, send_command
from gpuwatch.multinode_commands import node_lines
from gpuwatch.state import RunState
from tests.conftest import FakeAgent, wait_until

RUN_ID = "torchrun-0badcafe"


# ------------------------------------------------------------------ the job secret


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    monkeypatch.setenv(nodes.SECRET_ENV, str(path))
    nodes.create_secret(path)
    return path


def test_keys_and_token_derive_alike_from_one_secret_and_differ_by_run_and_node():
    secret = b"0123456789abcdef0123456789abcdef"
    public, secret_key = nodes.server_keys(secret, RUN_ID, 1)
    assert (public, secret_key) == nodes.server_keys(secret, RUN_ID, 1)
    assert zmq.curve_public(secret_key.encode()).decode() == public
    assert public != nodes.server_keys(secret, RUN_ID, 0)[0]
    assert public != nodes.server_keys(secret, "torchrun-other", 1)[0]
    assert public != nodes.server_keys(b"another secret of 32 bytes......", RUN_ID, 1)[0]
    assert nodes.client_keys(secret, RUN_ID) != nodes.client_keys(secret, "torchrun-other")
    token = nodes.relay_token(secret, RUN_ID)
    assert len(token) == 64 and token not in public + secret_key


def test_the_secret_file_must_be_the_users_own_and_private(tmp_path, secret_file):
    assert len(nodes.load_secret(secret_file)) == 64
    with pytest.raises(FileExistsError):
        nodes.create_secret(secret_file)  # never replaced
    with pytest.raises(nodes.SecretError, match="no job secret .make one with `gpuwatch "
                                                "secret`"):
        nodes.load_secret(tmp_path / "missing")
    secret_file.chmod(0o644)
    with pytest.raises(nodes.SecretError, match="readable or writable by others"):
        nodes.load_secret(secret_file)
    secret_file.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(secret_file)
    with pytest.raises(nodes.SecretError, match="cannot open"):
        nodes.load_secret(link)  # never followed
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(nodes.SecretError, match="holds 3 bytes"):
        nodes.load_secret(short)


def test_gpuwatch_secret_makes_one_and_keeps_it(tmp_path, monkeypatch):
    path = tmp_path / "home" / ".config" / "gpuwatch" / "secret"
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.pop(nodes.SECRET_ENV, None)
    first = subprocess.run([sys.executable, "-m", "gpuwatch", "secret"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and f"wrote a new job secret: {path}" in first.stdout
    assert path.stat().st_mode & 0o777 == 0o600
    content = path.read_text()
    again = subprocess.run([sys.executable, "-m", "gpuwatch", "secret"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already there" in again.stdout
    assert path.read_text() == content


# ------------------------------------------------------------------ layout and store


TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


def test_a_multi_node_layout_comes_from_torchrun_and_one_node_is_left_alone():
    env = nodes.NodeEnv.from_env(TORCHRUN_ENV)
    assert env is not None and (env.node, env.nnodes, env.ranks) == (1, 2, [2, 3])
    assert nodes.listen_address(env, environ={}) == "127.0.0.1"  # towards the store
    assert nodes.listen_address(env, "10.1.2.3") == "10.1.2.3"
    one_node = {**TORCHRUN_ENV, "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "RANK": "1",
                "GROUP_RANK": "0"}
    assert nodes.NodeEnv.from_env(one_node) is None
    assert nodes.NodeEnv.from_env({}) is None


def test_ranks_of_every_node_share_a_run_id_without_a_rendezvous_id(monkeypatch):
    monkeypatch.delenv(runs.RUN_ID_ENV, raising=False)
    for name, value in {**TORCHRUN_ENV, "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(name, value)
    run_id = runs.shared_run_id(4)
    monkeypatch.setenv("GROUP_RANK", "0")  # another node, another launcher: the same id
    monkeypatch.setenv("RANK", "0")
    assert run_id.startswith("torchrun-") and runs.shared_run_id(4) == run_id


def test_a_store_entry_is_checked_before_it_is_used():
    good = {"node": 1, "host": "n1", "pub_endpoint": "tcp://10.0.0.2:5000",
            "cmd_endpoint": "tcp://10.0.0.2:5001", "server_key": "k" * 40, "ranks": [2, 3]}
    assert nodes.node_entry(good) == good
    for bad in ({**good, "node": True}, {**good, "ranks": ["2"]},
                {**good, "pub_endpoint": "ipc:///tmp/x"}, {**good, "ranks": [-1]},
                {key: value for key, value in good.items() if key != "host"}, [good]):
        assert nodes.node_entry(bad) is None


# ------------------------------------------------------------------ a relay, for real


class OtherNode:
    """Node 1 of a job: fake agents of ranks 2 and 3 in a run directory of their own,
    and a real relay process in front of them."""

    def __init__(self, directory: Path, secret: bytes, fake_options: dict) -> None:
        self.directory = runs.private_dir(directory)
        self.fakes = [FakeAgent(directory, run_id=RUN_ID, rank=rank, world_size=4,
                                **fake_options.get(rank, {})).start() for rank in (2, 3)]
        server_public, server_secret = nodes.server_keys(secret, RUN_ID, 1)
        settings = {"run_id": RUN_ID, "node": 1, "host": "node-1", "ranks": [2, 3],
                    "address": "127.0.0.1", "server_public": server_public,
                    "server_secret": server_secret,
                    "client_public": nodes.client_keys(secret, RUN_ID)[0],
                    "token": nodes.relay_token(secret, RUN_ID)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent.io.relay"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            env={**os.environ, runs.RUN_DIR_ENV: str(directory)})
        self.process.stdin.write(json.dumps(settings) + "\n")
        self.process.stdin.flush()
        ports = json.loads(self.process.stdout.readline())
        self.entry = {"node": 1, "host": "node-1", "server_key": server_public,
                      "pub_endpoint": f"tcp://127.0.0.1:{ports['pub_port']}",
                      "cmd_endpoint": f"tcp://127.0.0.1:{ports['cmd_port']}",
                      "ranks": [2, 3]}

    def stop(self) -> None:
        self.process.stdin.close()  # it ends on EOF
        self.process.wait(10)
        for fake in self.fakes:
            fake.stop()


@pytest.fixture
def job(run_dir, tmp_path, secret_file):
    """Node 0 here (fake ranks 0 and 1, whose leader's run file has learnt both nodes
    from the store) and node 1 behind its relay."""
    secret = nodes.load_secret(secret_file)
    made = []

    def make(node1_options=None, node0_options=None):
        other = OtherNode(tmp_path / "node1", secret, node1_options or {})
        made.append(other)
        here = [FakeAgent(run_dir, run_id=RUN_ID, rank=rank, world_size=4,
                          **(node0_options or {}).get(rank, {})).start() for rank in (0, 1)]
        made.extend(here)
        for fake in here:
            fake.info.nnodes = 2
        here[0].info.nodes = [{**other.entry, "node": 0, "ranks": [0, 1]}, other.entry]
        for fake in here:
            runs.write_run_file(fake.info, Path(run_dir))
        return here, other

    yield make
    for thing in made:
        thing.stop()


def drain(fake: FakeAgent) -> list[dict]:
    seen = []
    while not fake.commands.empty():
        seen.append(fake.commands.get())
    return seen


def test_a_command_reaches_the_other_nodes_ranks_through_their_relay(job):
    here, other = job()
    reply = send_command(here[0].info, "precision", "bf16")
    assert reply["ok"] and reply["ranks"] == [0, 1, 2, 3], reply
    for fake in here + other.fakes:
        phases = drain(fake)
        assert [bool(body.get("dry_run")) for body in phases] == [True, False]
        assert phases[1]["apply_step"] == reply["apply_step"]  # one step on every rank
        assert phases[1]["token"] == fake.info.token  # each rank's own, added by the relay


def test_a_refusal_on_another_node_withdraws_the_command_everywhere(job):
    here, other = job({3: {"refuse": "the run is ending"}})
    reply = send_command(here[0].info, "accum_steps", 2)
    assert not reply["ok"] and "ranks_differ" not in reply, reply
    assert reply["reason"] == ("the run is ending (rank 3); withdrawn from ranks 0, 1, 2")
    for fake in here + [other.fakes[0]]:
        assert [(b.get("dry_run", False), b.get("cancel", False)) for b in drain(fake)] == [
            (True, False), (False, False), (False, True)]
        assert not fake.pending


def test_a_stopped_node_refuses_the_command_before_any_rank_takes_it(job):
    here, other = job()
    os.kill(other.process.pid, signal.SIGSTOP)
    try:
        reply = send_command(here[0].info, "accum_steps", 2, timeout_s=1.0)
    finally:
        os.kill(other.process.pid, signal.SIGCONT)
    assert not reply["ok"] and reply["answered"] is False
    assert reply["reason"] == "no reply within 1.0 s (is the run alive?) (rank 2)"
    for fake in here:  # only checked, never scheduled
        assert [body.get("dry_run") for body in drain(fake)] == [True]
        assert not fake.pending


def test_a_relays_connection_is_kept_only_while_all_sent_on_it_was_answered(job):
    """Kept, a command to 1,024 nodes skips 1,023 CURVE handshakes; one with a message
    unanswered is closed (what is queued on it goes with it, never delivered later)."""
    from agent.wire import commands

    here, other = job()
    key = (other.entry["cmd_endpoint"], other.entry["server_key"])
    assert send_command(here[0].info, "precision", "bf16")["ok"]
    kept = commands._kept_relays[key]
    assert send_command(here[0].info, "precision", "fp32")["ok"]
    assert commands._kept_relays[key] is kept  # the same connection
    for fake in other.fakes:
        assert [(body.get("value"), bool(body.get("dry_run"))) for body in drain(fake)] == [
            ("bf16", True), ("bf16", False), ("fp32", True), ("fp32", False)]
    os.kill(other.process.pid, signal.SIGSTOP)
    try:
        stopped = send_command(here[0].info, "accum_steps", 2, timeout_s=1.0)
    finally:
        os.kill(other.process.pid, signal.SIGCONT)
    assert not stopped["ok"] and key not in commands._kept_relays
    assert send_command(here[0].info, "precision", "bf16")["ok"]  # on a new connection
    assert commands._kept_relays[key] is not kept


def test_a_dashboard_following_a_node_opens_its_command_connection_before_a_command(job):
    from agent.wire import commands
    from gpuwatch.sources.live import LiveSource

    here, other = job()
    key = (other.entry["cmd_endpoint"], other.entry["server_key"])
    commands._kept_relays.pop(key, None)
    source = LiveSource(here[0].info)
    source.start()
    try:
        wait_until(lambda: key in commands._kept_relays, "the relay's connection kept")
        kept = commands._kept_relays[key]
        assert send_command(here[0].info, "precision", "bf16")["ok"]
        assert commands._kept_relays[key] is kept  # the first command used it
    finally:
        source.close()


def test_without_the_job_secret_or_with_a_forged_entry_nothing_is_sent(job, monkeypatch,
                                                                       tmp_path):
    here, other = job()
    entry = other.entry
    here[0].info.nodes[1] = {**entry, "server_key": nodes.server_keys(
        b"an attacker's secret, not ours!!", RUN_ID, 1)[0]}  # as planted in the store
    runs.write_run_file(here[0].info, Path(here[0].info.path).parent)
    forged = send_command(here[0].info, "precision", "bf16")
    assert not forged["ok"] and "it is not trusted" in forged["reason"]
    assert forged["reason"].startswith("2 of the run's 4 ranks can be reached from here "
                                       "(ranks 2, 3 cannot: node 1's entry")
    monkeypatch.setenv(nodes.SECRET_ENV, str(tmp_path / "nowhere"))
    here[0].info.nodes[1] = entry
    runs.write_run_file(here[0].info, Path(here[0].info.path).parent)
    no_secret = send_command(here[0].info, "precision", "bf16")
    assert not no_secret["ok"] and "no job secret (make one with `gpuwatch secret`" in \
        no_secret["reason"]
    for fake in here + other.fakes:
        assert drain(fake) == []


def test_a_relay_lets_in_only_the_job_secrets_client_key_and_token(job):
    here, other = job()
    wrong = runs.RunInfo(run_id=RUN_ID, rank=2, world_size=4, pid=0,
                         pub_endpoint=other.entry["pub_endpoint"],
                         cmd_endpoint=other.entry["cmd_endpoint"], token="0" * 64,
                         started_at=0.0)
    # the right server key and client keys, a wrong token: answered, refused
    relay = next(info for node, _, info in remote_relays(RUN_ID, 4, {0})[0] if node == 1)
    with RankConnections([runs.RunInfo(**{**relay.__dict__, "token": "0" * 64})]) as c:
        answer = c.exchange({"id": "x1", "knob": "precision", "value": "bf16",
                             "dry_run": True}, 3.0, None)[0]
    assert answer["relay"] and not answer["ok"]
    assert answer["reason"] == "missing or wrong token"
    # another client key: the CURVE handshake fails, nothing is answered
    stranger_public, stranger_secret = zmq.curve_keypair()
    wrong.curve_server_key = other.entry["server_key"]
    wrong.curve_client_public_key = stranger_public.decode()
    wrong.curve_client_secret_key = stranger_secret.decode()
    with RankConnections([wrong]) as c:
        silent = c.exchange({"id": "x2", "knob": "precision", "value": "bf16",
                             "dry_run": True}, 1.0, None)[0]
    assert silent["answered"] is False
    for fake in other.fakes:
        assert drain(fake) == []


# ------------------------------------------------------------------ the dashboard side


def node_message(node: int, ranks: list[tuple[int, int, float, float]], ago: float = 0.1):
    return protocol.envelope(protocol.NODE, {
        "node": node, "host": f"host-{node}", "expected": [r[0] for r in ranks],
        "ranks": [{"rank": rank, "step": step, "step_time_s": step_time,
                   "data_wait_share": wait, "heard_s_ago": ago}
                  for rank, step, step_time, wait in ranks], "events_dropped": 0},
        run=RUN_ID, rank=ranks[0][0])


def test_node_summaries_give_every_ranks_pace_and_the_straggler_with_its_node():
    state = RunState(primary_rank=0)
    now = time.monotonic()
    state.ingest(node_message(0, [(0, 10, 0.10, 0.0), (1, 10, 0.10, 0.1)]), now)
    state.ingest(node_message(1, [(2, 10, 0.10, 0.2), (3, 9, 0.15, 0.4)]), now)
    assert set(state.ranks) == {1, 2, 3}  # rank 0, the shown one, keeps its own records
    assert state.slowest_rank(now)[0] == 3 and state.node_of(3) == 1
    assert state.nodes[1].data_wait_share == pytest.approx(0.3)
    assert state.most_waiting_node(now) == (1, pytest.approx(0.3))
    assert state.nodes[1].host == "host-1" and state.nodes[1].heard == 2
    lines = node_lines(state, now)
    assert lines[-1] == "slowest: rank 3 (node 1), +50% over the fastest"
    state.ingest(protocol.envelope(protocol.NODE, {"node": "x"}, run=RUN_ID), now)
    assert state.malformed == 1  # read, never raised


@pytest.mark.slow
def test_a_dashboard_follows_a_few_hundred_ranks_through_one_socket_for_all_relays(
        run_dir, secret_file, capsys):
    """64 nodes of 8 ranks (512) as lightweight relays: publishers of real ``node``
    summaries, CURVE with the keys the secret gives, in a child process; the real live
    source follows them from a leader's run file. Reports the dashboard's CPU time and
    memory (no speed is asserted: they are printed)."""
    node_count, per_node = 64, 8
    expected_ranks = (node_count - 1) * per_node + 1  # and rank 0, the local one (its
    # node's other 7 ranks are not simulated)
    nodes.load_secret(secret_file)
    publisher = subprocess.Popen(
        [sys.executable, "-c", SCALE_PUBLISHERS, str(secret_file), RUN_ID, str(node_count),
         str(per_node)], stdout=subprocess.PIPE, text=True)
    try:
        entries = json.loads(publisher.stdout.readline())
        leader = FakeAgent(run_dir, run_id=RUN_ID, rank=0, world_size=node_count * per_node)
        leader.start()
        try:
            leader.info.nnodes = node_count
            leader.info.nodes = entries
            runs.write_run_file(leader.info, Path(run_dir))
            from gpuwatch.sources.live import LiveSource

            source = LiveSource(leader.info)
            before = resource.getrusage(resource.RUSAGE_SELF)
            rss_before = psutil.Process().memory_info().rss
            started = time.monotonic()
            source.start()
            try:
                def all_seen():
                    with source.lock:
                        return len(source.state.nodes) == node_count - 1 and len(
                            source.state.ranks) >= expected_ranks

                wait_until(all_seen, "every node and rank on the dashboard", timeout_s=60,
                           poll_s=0.2)
                time.sleep(5.0)  # a steady stretch to measure (not a wait for an event)
                after = resource.getrusage(resource.RUSAGE_SELF)
                rss_after = psutil.Process().memory_info().rss
                wall_s = time.monotonic() - started
                with source.lock:
                    state = source.state
                    assert len(state.nodes) == node_count - 1  # node 0 is this one
                    assert len(state.ranks) == expected_ranks
                    assert state.node_of(node_count * per_node - 1) == node_count - 1
                    sockets = len(source._followed)
            finally:
                source.close()
        finally:
            leader.stop()
    finally:
        publisher.kill()
        publisher.wait()
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    with capsys.disabled():
        print(f"\nscale: {node_count} nodes x {per_node} ranks, {sockets} sockets: "
              f"dashboard process CPU {cpu_s:.2f} s over {wall_s:.1f} s "
              f"({100 * cpu_s / wall_s:.1f}% of a core, this test's fake rank 0 "
              f"included); resident memory grew by {(rss_after - rss_before) / 2**20:.1f}"
              f" MiB (to {rss_after / 2**20:.0f} MiB, torch of the test process included)")
    assert sockets == 2  # the local rank's, and one for every other node's relay


SCALE_PUBLISHERS = r"""
import json, sys, time
import zmq
from agent.wire import nodes, protocol

secret = nodes.load_secret(__import__("pathlib").Path(sys.argv[1]))
run_id, count, per_node = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
context = zmq.Context()
sockets, entries = [], []
commanded = []  # (the dashboard opens a command connection to each relay it follows)
for node in range(count):
    ports = []
    for kind in (zmq.PUB, zmq.ROUTER):
        socket = context.socket(kind)
        public, private = nodes.server_keys(secret, run_id, node)
        socket.curve_secretkey, socket.curve_publickey = private.encode(), public.encode()
        socket.curve_server = True
        ports.append(socket.bind_to_random_port("tcp://127.0.0.1"))
        (sockets if kind == zmq.PUB else commanded).append(socket)
    ranks = list(range(node * per_node, (node + 1) * per_node))
    entries.append({"node": node, "host": f"host-{node}", "server_key": public,
                    "pub_endpoint": f"tcp://127.0.0.1:{ports[0]}",
                    "cmd_endpoint": f"tcp://127.0.0.1:{ports[1]}", "ranks": ranks})
print(json.dumps(entries), flush=True)
step = 0
while True:
    step += 10
    for node, socket in enumerate(sockets):
        socket.send_multipart(protocol.encode(protocol.envelope(protocol.NODE, {
            "node": node, "host": f"host-{node}", "expected": entries[node]["ranks"],
            "ranks": [{"rank": rank, "step": step, "step_time_s": 0.1 + rank * 1e-4,
                       "data_wait_share": 0.05, "heard_s_ago": 0.05}
                      for rank in entries[node]["ranks"]], "events_dropped": 0},
            run=run_id, rank=node * per_node)))
    time.sleep(1.0)
"""


async def test_the_dashboard_header_names_a_straggler_on_another_node_with_its_node(job):
    from gpuwatch.app import GpuwatchApp
    from gpuwatch.sources.live import LiveSource
    from tests.conftest import text_of, until

    fast, slow = {"step_fields": {"step_time_s": 0.020}}, {"step_fields": {
        "step_time_s": 0.030, "data_wait_share": 0.4}}
    here, other = job({2: fast, 3: slow}, {0: fast, 1: fast})
    app = GpuwatchApp(LiveSource(here[0].info))
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: "rank 3 (node 1) slowest +50%" in text_of(app, "#header"))
        await until(pilot, lambda: "node 1 data wait 25%" in text_of(app, "#header"))
        assert ("(rank 0 of 4, rank 3 (node 1) slowest +50%, node 1 data wait 25%)"
                in text_of(app, "#header"))  # rank 2 waits 10%, rank 3 40%
        state = app.source.state
        assert set(state.ranks) == {0, 1, 2, 3} and set(state.nodes) == {1}
        # a warning of a rank on another node reaches the log, through its relay
        other.fakes[1].publish(protocol.EVENT, {"level": "warning", "kind": "warning",
                                                "text": "loss is NaN at step 7"})
        await until(pilot, lambda: any(entry.text == "rank 3: loss is NaN at step 7"
                                       for entry in state.events))
        os.kill(other.process.pid, signal.SIGSTOP)  # node 1's relay: no more summaries
        try:
            await until(pilot, lambda: "node 1 silent" in text_of(app, "#header"))
        finally:
            os.kill(other.process.pid, signal.SIGCONT)
        await until(pilot, lambda: "silent" not in text_of(app, "#header"))


def test_tail_with_nodes_prints_the_other_nodes_summaries_and_events(job):
    here, other = job()
    tail = subprocess.Popen([sys.executable, "-m", "gpuwatch", "tail", "--nodes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        def read_until(predicate):  # the run's steps keep lines coming, 50 a second
            deadline = time.monotonic() + 30
            while not any(map(predicate, lines)):
                assert time.monotonic() < deadline, lines[-5:]
                line = tail.stdout.readline()
                assert line, tail.stderr.read()
                lines.append(line.rstrip("\n"))

        read_until(lambda line: line.startswith("node 1 (node-1): rank 2 step ")
                   and ", rank 3 step " in line)
        other.fakes[0].publish(protocol.EVENT, {"level": "warning", "text": "slow disk"})
        read_until(lambda line: line == "[rank 2] [warning] slow disk")
    finally:
        tail.kill()
        tail.wait()
    assert all(line.startswith(("step ", "[", "node 1 ", "run ")) for line in lines), lines


def test_a_rank_of_another_node_too_busy_to_answer_gets_the_command_withdrawn_too(job):
    """Its relay answers for it in time (no reply), and withdraws it there on the same
    connection, after the command it took late."""
    here, other = job({3: {"stall_s": 1.5}})
    reply = send_command(here[0].info, "accum_steps", 2, timeout_s=1.0)
    assert not reply["ok"] and "ranks_differ" not in reply, reply
    assert reply["reason"].startswith("no reply within 0.7 s")
    assert reply["reason"].endswith("(rank 3); withdrawn from ranks 0-3")
    for fake in here + other.fakes:
        assert not fake.pending and fake.knobs["accum_steps"] == 1


# ------------------------------------------------------------------ a job of 1,024 nodes


def test_a_leaders_run_file_listing_a_thousand_nodes_is_read(run_dir):
    """About 240 bytes a node: 1,024 nodes make a file of 250 KB (one of 64 KiB was the
    limit, and the leader's rank then went unseen)."""
    entries = [{"node": node, "host": f"node-{node}", "server_key": "k" * 40,
                "pub_endpoint": f"tcp://10.0.{node // 256}.{node % 256}:29600",
                "cmd_endpoint": f"tcp://10.0.{node // 256}.{node % 256}:29601",
                "ranks": list(range(8 * node, 8 * node + 8))} for node in range(1024)]
    leader = runs.RunInfo(run_id=RUN_ID, rank=0, world_size=8192, pid=os.getpid(),
                          pub_endpoint="ipc:///nowhere", cmd_endpoint="", token="t",
                          started_at=0.0, nnodes=1024, nodes=entries)
    path = runs.write_run_file(leader, Path(run_dir))
    assert path.stat().st_size > 200_000
    assert [info.rank for info in runs.run_ranks(RUN_ID)] == [0]
    assert runs.node_list(RUN_ID) == entries


def test_the_dashboards_sockets_outnumber_zeromqs_default_and_a_low_file_limit():
    """A job of 1,024 nodes: a socket per node's relay, and one more per node while a
    command is out (ZeroMQ's default context holds 1,023; a login node's soft limit of
    open files is often 1,024)."""
    made = subprocess.run([sys.executable, "-c", """
import resource, zmq
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
from agent.wire.commands import shared_context
sockets = [shared_context().socket(zmq.SUB) for _ in range(2100)]
print(len(sockets), resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1024)
"""], capture_output=True, text=True, timeout=60)
    assert made.stdout.split() == ["2100", "True"], made.stderr[-2000:]


def test_node_summaries_of_a_thousand_nodes_give_every_ranks_pace():
    state = RunState(primary_rank=0)
    now = time.monotonic()
    for node in range(1, 1024):
        state.ingest(node_message(node, [(rank, 100, 0.1 + (rank == 5000) * 0.05, 0.01)
                                         for rank in range(8 * node, 8 * node + 8)]), now)
    assert len(state.ranks) == 1023 * 8 and len(state.nodes) == 1023
    assert state.slowest_rank(now)[0] == 5000 and state.node_of(5000) == 625


# ------------------------------------------------------------------ one socket, attacked
# the dashboard's one socket for every other node's relay: a store entry it cannot
# connect to beside good ones, and a relay that comes back at other ports


#: Relays of the nodes given (argv: secret file, run id, nodes as JSON): each publishes
#: a ``node`` summary of its two ranks every 0.2 s, the step counting up from argv[4]
#: + 1, and of the ranks argv[5] (JSON) claims for it besides; the entries (one JSON
#: line) name them, a node given as negative with a malformed endpoint.
RELAYS = r"""
import json, sys, time
import zmq
from agent.wire import nodes, protocol

secret = nodes.load_secret(__import__("pathlib").Path(sys.argv[1]))
run_id, wanted, step = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
claims = json.loads(sys.argv[5])
context = zmq.Context()
sockets, entries, kept = {}, [], []
for node in wanted:
    public, private = nodes.server_keys(secret, run_id, abs(node))
    ports = []
    for kind in (zmq.PUB, zmq.ROUTER):
        socket = context.socket(kind)
        socket.curve_secretkey, socket.curve_publickey = private.encode(), public.encode()
        socket.curve_server = True
        ports.append(socket.bind_to_random_port("tcp://127.0.0.1"))
        kept.append(socket)
    sockets[abs(node)] = kept[-2]
    ranks = [2 * abs(node), 2 * abs(node) + 1]
    entries.append({"node": abs(node), "host": f"host-{abs(node)}", "server_key": public,
                    "pub_endpoint": f"tcp://127.0.0.1:{ports[0]}" if node > 0
                    else "tcp://no-port-here",
                    "cmd_endpoint": f"tcp://127.0.0.1:{ports[1]}", "ranks": ranks})
print(json.dumps(entries), flush=True)
while True:
    step += 1
    for node, socket in sockets.items():
        socket.send_multipart(protocol.encode(protocol.envelope(protocol.NODE, {
            "node": node, "host": f"host-{node}", "expected": [2 * node, 2 * node + 1],
            "ranks": [{"rank": rank, "step": step, "step_time_s": 0.1,
                       "data_wait_share": 0.05, "heard_s_ago": 0.05}
                      for rank in (2 * node, 2 * node + 1, *claims.get(str(node), ()))],
            "events_dropped": 0},
            run=run_id, rank=2 * node)))
    time.sleep(0.2)
"""


class Relays:
    """A child process of :data:`RELAYS`; ``entries`` as the job's store names them."""

    def __init__(self, secret_path: Path, wanted: list[int], first_step: int,
                 claims: dict[int, list[int]]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", RELAYS, str(secret_path), RUN_ID, json.dumps(wanted),
             str(first_step - 1), json.dumps(claims)],
            stdout=subprocess.PIPE, text=True)
        self.entries = json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def relays(secret_file):
    started: list[Relays] = []

    def start(wanted: list[int], first_step: int = 1,
              claims: dict[int, list[int]] | None = None) -> Relays:
        started.append(Relays(secret_file, wanted, first_step, claims or {}))
        return started[-1]

    yield start
    for each in started:
        each.stop()


@pytest.fixture
def leader(run_dir):
    """Rank 0 of node 0; ``publish(entries)`` writes the store's entries of the other
    nodes in its run file (as its node link does when the store changes)."""
    agent = FakeAgent(run_dir, run_id=RUN_ID, rank=0, world_size=8).start()

    def publish(entries: list[dict]) -> None:
        agent.info.nnodes = len(entries) + 1
        agent.info.nodes = [{**entries[0], "node": 0, "ranks": [0, 1]}, *entries]
        runs.write_run_file(agent.info, Path(run_dir))

    agent.publish_nodes = publish
    yield agent
    agent.stop()


def step_of(source, rank: int) -> int:
    with source.lock:
        pace = source.state.ranks.get(rank)
        return pace.step if pace is not None and pace.step is not None else 0


def errors(source) -> list[str]:
    with source.lock:
        return [entry.text for entry in source.state.events if entry.level == "error"]


def test_a_malformed_relay_endpoint_is_said_once_and_the_others_followed(leader, relays):
    """Node 2's entry names an endpoint ZeroMQ cannot parse, between two good relays:
    both are followed, and the error is said once (it was said at every look at the
    store, once a second for the whole run)."""
    from gpuwatch.sources.live import LiveSource

    node_relays = relays([1, -2, 3])
    leader.publish_nodes(node_relays.entries)
    source = LiveSource(leader.info)
    source.start()
    try:
        wait_until(lambda: step_of(source, 2) and step_of(source, 6), "nodes 1 and 3 heard")
        wait_until(lambda: errors(source), "the malformed endpoint said")
        first = step_of(source, 6)
        # 3 s of summaries (each 0.2 s): three looks at the store at least
        wait_until(lambda: step_of(source, 6) >= first + 15, "3 s more of node 3")
        assert errors(source) == ["cannot subscribe to tcp://no-port-here: Invalid argument "
                                  "(addr='tcp://no-port-here')"]
        with source.lock:
            assert source.state.node_of(2) == 1 and source.state.node_of(6) == 3
            assert 4 not in source.state.ranks  # node 2: never heard
    finally:
        source.close()


def test_a_relay_back_at_another_port_is_followed_there(leader, relays):
    """A job restarted by torchrun keeps its run id; each node's relay starts again on
    new ports and the store names them: the dashboard follows node 1 there (it kept
    waiting at the old port: node 1 silent for ever), and node 2 all along."""
    from gpuwatch.sources.live import LiveSource

    first, second = relays([1]), relays([2])
    leader.publish_nodes(first.entries + second.entries)
    source = LiveSource(leader.info)
    source.start()
    try:
        wait_until(lambda: step_of(source, 2) and step_of(source, 4), "nodes 1 and 2 heard")
        first.stop()
        again = relays([1], first_step=10_000)  # node 1's relay, back at new ports
        leader.publish_nodes(again.entries + second.entries)
        wait_until(lambda: step_of(source, 2) >= 10_000, "node 1 heard at its new port",
                   timeout_s=20)
    finally:
        source.close()


def test_a_relays_summary_claiming_another_nodes_ranks_is_not_taken_for_them(leader,
                                                                             relays):
    """Node 2's relay (it holds the job secret: a bug, or a node misconfigured) names
    ranks 2 and 3 in its summaries besides its own; the store lists them on node 1,
    whose relay is silent. They stay node 1's, unheard (they were shown as node 2's,
    at node 2's pace)."""
    from gpuwatch.sources.live import LiveSource

    silent = relays([1])
    entries = silent.entries
    silent.stop()
    claiming = relays([2], claims={2: [2, 3]})
    leader.publish_nodes(entries + claiming.entries)
    source = LiveSource(leader.info)
    source.start()
    try:
        wait_until(lambda: step_of(source, 4) >= 3, "node 2 heard three times")
        with source.lock:
            state = source.state
            assert 2 not in state.ranks and 3 not in state.ranks
            assert (state.node_of(2), state.node_of(3), state.node_of(4)) == (1, 1, 2)
    finally:
        source.close()
