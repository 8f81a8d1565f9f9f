"""Several ranks: one run id per job, and every command applied at one common optimizer
step on every rank (real torchrun with DDP on gloo, real agents, real sockets)."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import agent
from agent.wire import runs
from gpuopt import Trainer
from agent.wire.commands import RankConnections
from gpuwatch.client import Subscriber, reply_text, send_command
from tests.conftest import FakeAgent, wait_until
from tests.jobs import finish, run_job, torchrun
from tests.training import Gate, digits_loader, messages, model as make_model, start
from gpuwatch.history import flat_records

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
JOBS = Path(__file__).parent


def wait_for_ranks(process, world_size, timeout_s=90):
    """The run files of the job's ranks, once all ``world_size`` are there (polled: they
    are written by other processes)."""
    def all_there():
        found = runs.list_runs()
        return sorted(found, key=lambda info: info.rank) if len(found) == world_size else None

    return wait_until(all_there, f"{world_size} run files", timeout_s=timeout_s, poll_s=0.1,
                      alive=[process])


@pytest.fixture
def ddp_job(run_dir):
    process = torchrun(str(EXAMPLES / "ddp_attach.py"), "--max-steps", "100000")
    yield process
    workers = [info.pid for info in runs.list_runs()]
    process.send_signal(signal.SIGTERM)  # torchrun stops its workers (own sessions)
    try:
        process.wait(30)
    finally:
        for pid in workers:  # in case it could not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
def test_ddp_ranks_share_one_run_and_a_command_applies_at_the_same_step_on_each(ddp_job,
                                                                                run_dir):
    rank0, rank1 = wait_for_ranks(ddp_job, 2)
    assert rank0.run_id == rank1.run_id and (rank0.rank, rank1.rank) == (0, 1)
    assert rank0.world_size == rank1.world_size == 2 and rank0.pid != rank1.pid
    assert runs.find_run().rank == 0  # the dashboard's default: the lowest rank
    with Subscriber(rank0) as sub0, Subscriber(rank1) as sub1:
        for sub in (sub0, sub1):  # both ranks are training
            messages(sub, lambda m: m["type"] == "step", timeout_s=60)
        reply = send_command(rank1, "precision", "bf16")  # any rank's file will do
        assert reply["ok"] and reply["ranks"] == [0, 1], reply
        apply_step = reply["apply_step"]
        assert reply_text("precision", "bf16", reply) == (
            f"accepted: precision=bf16 applies at step {apply_step} on ranks 0, 1")
        for sub in (sub0, sub1):
            seen = messages(sub, lambda m: m["type"] == "step"
                            and m["body"]["step"] >= apply_step + 2, timeout_s=60)
            steps = [m["body"] for m in seen if m["type"] == "step"]
            assert {b["knobs"]["precision"] for b in steps if b["step"] < apply_step} <= {
                "fp32"}
            assert {b["knobs"]["precision"] for b in steps if b["step"] >= apply_step} == {
                "bf16"}
            applied = [m["body"] for m in seen if m["type"] == "event"
                       and m["body"].get("kind") == "applied"]
            assert [(e["knob"], e["step"]) for e in applied] == [("precision", apply_step)]
        refused = send_command(rank0, "accum_steps", 0)
        assert not refused["ok"]
        assert refused["reason"] == "accum_steps: 0 is below the minimum 1 (rank 0)"
        assert reply_text("accum_steps", 0, refused) == (
            "rejected: accum_steps: 0 is below the minimum 1 (rank 0)")
    cli = subprocess.run([sys.executable, "-m", "gpuwatch", "set", "accum_steps=2"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("accepted: accum_steps=2 applies at step ")
    assert cli.stdout.rstrip().endswith("on ranks 0, 1")
    ddp_job.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
    ddp_job.wait(60)
    assert list(Path(run_dir).glob("*.json")) == []  # each rank ended cleanly


@pytest.mark.slow
def test_a_paused_job_of_several_ranks_goes_on_and_stops_at_the_boundary_held(ddp_job,
                                                                               run_dir):
    """pause=on holds both ranks at one boundary; a command sent then applies there on
    each (no margin past a step no held rank reaches): pause=off lets both go on with
    no step lost or repeated, and stop=now at a second pause ends both with bye."""
    rank0, rank1 = wait_for_ranks(ddp_job, 2)
    subs = [Subscriber(rank0), Subscriber(rank1)]
    steps: list[list[int]] = [[], []]

    def until(rank, done):
        def seen(message):
            if message["type"] == "step":
                steps[rank].append(message["body"]["step"])
            return done(message)
        return messages(subs[rank], seen, timeout_s=60)

    def applied(knob):
        return lambda m: (m["type"] == "event" and m["body"].get("kind") == "applied"
                          and m["body"].get("knob") == knob)

    try:
        for rank in (0, 1):
            until(rank, lambda m: m["type"] == "step")
        paused = send_command(rank0, "pause", "on", timeout_s=30)
        assert paused["ok"], paused
        held_at = paused["apply_step"]
        for rank in (0, 1):
            [event] = [m["body"] for m in until(rank, applied("pause"))
                       if m["type"] == "event" and m["body"].get("kind") == "applied"]
            assert event["step"] == held_at and event["value"] == "on"
        resumed = send_command(rank1, "pause", "off", timeout_s=30)
        assert resumed["ok"] and resumed["apply_step"] == held_at, resumed
        assert reply_text("pause", "off", resumed) == (
            f"accepted: pause=off at the boundary after step {held_at - 1} on ranks 0, 1")
        for rank in (0, 1):
            until(rank, lambda m: m["type"] == "step" and m["body"]["step"] >= held_at + 5)
            first = steps[rank][0]
            assert steps[rank] == list(range(first, held_at + 6)), rank  # none lost
        paused = send_command(rank0, "pause", "on", timeout_s=30)   # or repeated
        assert paused["ok"], paused
        held_at = paused["apply_step"]
        for rank in (0, 1):
            until(rank, applied("pause"))
        stopped = send_command(rank0, "stop", "now", timeout_s=30)
        assert stopped["ok"] and stopped["apply_step"] == held_at, stopped
        for rank in (0, 1):
            [bye] = [m["body"] for m in until(rank, lambda m: m["type"] == "bye")
                     if m["type"] == "bye"]
            assert bye["reason"] == f"stopped by stop=now after step {held_at - 1}", bye
            assert steps[rank][-1] == held_at - 1
        assert ddp_job.wait(60) == 0
        assert list(Path(run_dir).glob("*.json")) == []  # each rank ended cleanly
    finally:
        for sub in subs:
            sub.close()


def test_a_command_needs_every_rank_reachable(run_dir):
    lone = FakeAgent(run_dir, run_id="20250101-000000-ab12", rank=0, world_size=2).start()
    try:
        reply = send_command(lone.info, "precision", "bf16")
        assert not reply["ok"] and reply["answered"] is False
        assert reply["reason"].startswith("1 of the run's 2 ranks have a run file on this "
                                          "machine; a command must reach every rank")
        assert lone.commands.empty()  # nothing was sent to the one it could reach
    finally:
        lone.stop()


def test_a_rank_refusing_the_second_phase_gets_the_command_withdrawn_everywhere(
        run_dir, monkeypatch):
    monkeypatch.setenv(runs.RUN_ID_ENV, "20250101-000000-cd34")
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer, rank=0, world_size=2)
    other = FakeAgent(run_dir, run_id=monitor.run_id, rank=1, world_size=2,
                      refuse="the run is ending").start()
    try:
        with Subscriber(monitor.info) as sub:
            reply = send_command(monitor.info, "accum_steps", 2)
            assert not reply["ok"]
            assert reply["reason"] == "the run is ending (rank 1); withdrawn from rank 0"
            seen = messages(sub, lambda m: m["type"] == "event"
                            and m["body"].get("kind") == "cancelled")
            cancelled = seen[-1]["body"]
            assert cancelled["knob"] == "accum_steps" and cancelled["value"] == 2
            assert cancelled["text"].endswith("cancelled: the run is ending (rank 1)")
        trainer.fit(max_steps=10)  # past the step it named (2 + a margin of 2)
        assert trainer.accum_steps == 1  # never applied on rank 0
    finally:
        other.stop()


def test_cancel_withdraws_a_pending_command_and_says_when_it_came_too_late(run_dir):
    model = make_model()
    gate = Gate(hold_at=6)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader(), callbacks=[gate])
    single = agent.attach(trainer).info
    assert send_command(single, "accum_steps", 3, apply_step=5, command_id="c1")["ok"]
    assert send_command(single, "accum_steps", 2, apply_step=3, command_id="c2")["ok"]
    cancel = {"id": "c1", "cancel": True, "reason": "changed my mind"}
    with RankConnections([single]) as connection:
        assert connection.exchange(cancel, 3.0, None)[0]["ok"]
        again = connection.exchange(cancel, 3.0, None)[0]
    assert not again["ok"] and again["reason"] == "no pending command with id 'c1'"
    thread = start(trainer, max_steps=8)
    assert gate.reached.wait(30)
    with RankConnections([single]) as connection:  # too late: it says when it applied
        late = connection.exchange({"id": "c2", "cancel": True}, 3.0, None)[0]
    gate.release.set()
    thread.join(30)
    assert not late["ok"] and late["applied_step"] == 3
    assert late["reason"] == "it was applied at step 3, before the cancel came"
    assert trainer.accum_steps == 2  # c2 applied, c1 never


def test_a_rank_too_busy_to_answer_in_time_gets_the_command_withdrawn_too(
        run_dir, monkeypatch):
    """The second phase times out on a held-up rank that takes the command later: it
    must be withdrawn there as well (on the same connection, so after it)."""
    monkeypatch.setenv(runs.RUN_ID_ENV, "20250101-000000-ef56")
    model = make_model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer, rank=0, world_size=2)
    held_up = FakeAgent(run_dir, run_id=monitor.run_id, rank=1, world_size=2,
                        knobs={"accum_steps": 1}, stall_s=1.5).start()
    try:
        reply = send_command(monitor.info, "accum_steps", 2, timeout_s=1.0)
        assert not reply["ok"] and "ranks_differ" not in reply, reply
        assert reply["reason"].startswith("no reply within 1.0 s")
        assert reply["reason"].endswith("(rank 1); withdrawn from ranks 0, 1")
        trainer.fit(max_steps=30)  # well past the step it named
        assert trainer.accum_steps == 1 and held_up.knobs["accum_steps"] == 1
    finally:
        held_up.stop()


def test_ranks_of_one_torchrun_job_agree_on_a_run_id_whatever_runs_between(monkeypatch):
    monkeypatch.delenv(runs.RUN_ID_ENV, raising=False)
    for name, value in (("TORCHELASTIC_RUN_ID", "3f2c-uuid"), ("MASTER_ADDR", "10.0.0.1"),
                        ("MASTER_PORT", "29400")):
        monkeypatch.setenv(name, value)
    run_id = runs.shared_run_id(2)
    assert run_id.startswith("torchrun-") and run_id == runs.shared_run_id(2)
    assert runs.shared_run_id(1) != run_id  # one process: a run of its own
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # no rendezvous id: the launcher's
    assert not runs.shared_run_id(2).startswith("torchrun-")


HOLDER = """
import sys
import agent
monitor = agent.Agent(name="first-job", rank=0, world_size=2).start()
print(monitor.run_id, flush=True)
sys.stdin.read()
"""


def test_a_second_job_with_the_same_run_id_gets_its_own(run_dir, monkeypatch):
    monkeypatch.setenv(runs.RUN_ID_ENV, "20250101-000000-same")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "20250101-000000-same"
        second = agent.Agent(name="second-job", rank=0, world_size=2).start()
        try:
            assert second.run_id != "20250101-000000-same"
            first = [info for info in runs.list_runs() if info.pid == holder.pid]
            assert [info.run_id for info in first] == ["20250101-000000-same"]  # untouched
        finally:
            second.close()
        texts = [record.get("text", "") for record in flat_records(second.info.log_path)]
        assert any(f"rank 0 is in use by pid {holder.pid} (another job from the same "
                   "launcher?)" in text for text in texts)  # the run log holds every event
    finally:
        holder.stdin.close()
        holder.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_a_rollback_restores_every_rank_at_one_step(run_dir, tmp_path, wrap):
    """DDP (or FSDP2: each rank its shards) on gloo, 2 ranks, a hand-written loop:
    precision=bf16 at step 7 makes the loss NaN on both ranks; rank 0's guard sends
    the rollback to every rank, and each puts its state back to the boundary after
    step 6 at the same step: steps 7-20 then equal a twin job's that never made the
    change on each rank (bit-equal losses and final parameters)."""
    finish(*(torchrun(str(JOBS / "ddp_rollback_job.py"), str(tmp_path), mode, wrap)
             for mode in ("twin", "change")))
    restored_at = set()
    for rank in (0, 1):
        twin = torch.load(tmp_path / f"twin-rank{rank}.pt")
        changed = torch.load(tmp_path / f"change-rank{rank}.pt")
        [rolled] = [e for e in changed["events"] if e["kind"] == "rolled_back"]
        [restored] = [e for e in changed["events"] if e["kind"] == "state_restored"]
        assert "precision=fp32" in rolled["text"] and "loss was nan" in rolled["text"]
        assert "boundary after step 6" in restored["text"], restored
        assert rolled["step"] == restored["step"]
        restored_at.add(restored["step"])
        assert {step: changed["losses"][step] for step in range(1, 21)} == {
            step: twin["losses"][step] for step in range(1, 21)}, rank
        for mine, theirs in zip(changed["params"], twin["params"], strict=True):
            assert torch.equal(mine, theirs)
    assert len(restored_at) == 1  # the same step on both ranks


@pytest.mark.slow
def test_a_rollback_puts_no_state_back_unless_every_rank_kept_one(run_dir, tmp_path):
    """The rollback job of the test above, where rank 1 could not copy its state when
    the change applied (host memory short): no rank puts its state back, and each says
    why with every rank's part, at the same step (rank 0 went back alone before)."""
    run_job(str(JOBS / "ddp_rollback_job.py"), str(tmp_path), "no-copy", "ddp")
    ranks = [torch.load(tmp_path / f"no-copy-rank{rank}.pt") for rank in (0, 1)]
    steps = set()
    for saved in ranks:
        [rolled] = [e for e in saved["events"] if e["kind"] == "rolled_back"]
        [restored] = [e for e in saved["events"] if e["kind"] == "state_restored"]
        assert "precision=fp32" in rolled["text"], rolled
        assert restored["text"].startswith("the weights were not restored (rank 0: kept "
                                           "step 6; rank 1: the state could not be kept "
                                           "(MemoryError: injected"), restored
        steps.add(restored["step"])
    assert len(steps) == 1
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))  # (NaN too)


def _recovery_job(out, mode):
    """``tests/ddp_recovery_job.py`` (2 ranks) in ``mode``, to its end; each rank's results."""
    run_job(str(JOBS / "ddp_recovery_job.py"), str(out), mode)
    return [torch.load(out / f"{mode}-rank{rank}.pt") for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mode, fork", [("loop", 20), ("fabric", 20), ("copy-20", 10)])
def test_a_loss_spike_is_recovered_from_on_every_rank_at_one_step(run_dir, tmp_path, mode,
                                                                  fork):
    """DDP on gloo, 2 ranks, a hand-written loop or Fabric's (``strategy="ddp"``) with
    ``recover=on``: three poisoned windows (steps 21-23) on each rank; rank 0's spike
    watch sends the recovery to every rank, and both go back to the state kept after
    step 20 at the same boundary (one ``branched`` event each) and end with bit-equal
    parameters (about 20 s each on 2 busy cores). Where rank 1's copy at step 20 failed
    (``copy-20``, the loop), both go back to step 10, the latest state every rank holds
    (rank 0 went back to 20 and rank 1 to 10 before: the replicas split)."""
    ranks = _recovery_job(tmp_path, mode)
    assert [len(saved["events"]) for saved in ranks] == [1, 1], [
        (saved["events"], saved["problems"]) for saved in ranks]
    [first], [second] = (saved["events"] for saved in ranks)
    assert first["after"] == second["after"] > 23  # the one boundary of the fan-out
    for event in (first, second):
        assert (event["branch"], event["parent"], event["step"], event["source"]) == (
            1, 0, fork, "recovery"), event
        assert "loss spike" in event["text"] and "steps 21-23" in event["text"], event
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.slow
def test_recover_on_failing_on_one_rank_stays_off_on_every_rank(run_dir, tmp_path):
    """DDP on gloo, 2 ranks: rank 1 cannot copy its state where ``recover=on`` applies
    (step 2): every rank refuses it, with rank 1's reason (before, rank 0 turned it on
    alone and would have gone back alone)."""
    ranks = _recovery_job(tmp_path, "copy-2")
    for saved in ranks:
        assert saved["recover"] == "off" and saved["events"] == []
        [failed] = [p for p in saved["problems"] if p["kind"] == "failed"]
        assert failed["knob"] == "recover", failed
        assert "rank 1: the state could not be kept at step 2 (MemoryError: injected" in (
            failed["text"]) and "no rank turns recover on" in failed["text"], failed
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.slow
def test_a_recovery_one_rank_cannot_make_is_made_by_no_rank(run_dir, tmp_path):
    """DDP on gloo, 2 ranks, ``recover=on``: rank 1's data position cannot be read where
    the recovery applies (``position``: its ``state_dict`` raises after step 20). No rank
    goes back: the job ends (within :data:`tests.jobs.JOB_TIMEOUT_S`), both ranks say so
    with rank 1's reason, and their parameters end bit-equal (about 13 s on 2 busy
    cores). Before, rank 1 alone refused and trained on while rank 0 put step 20's state
    back and waited for it in the load's collective, which crossed rank 1's DDP
    all-reduces until rank 1 ended and left rank 0 with step 20's state: the replicas
    split."""
    ranks = _recovery_job(tmp_path, "position")
    said = [[problem["text"] for problem in saved["problems"]] for saved in ranks]
    assert said[0] == said[1] and said[0], said  # the same decision, the same words
    for text in said[0]:
        assert "loss spike" in text and "not recovered: rank 1: the data position could " \
            "not be read (OSError: injected: rank 1's data position cannot be read); no " \
            "rank goes back" in text, text
    for saved in ranks:
        assert saved["events"] == [] and saved["recover"] == "on", saved["events"]
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.slow
def test_a_state_put_back_while_a_rank_is_gone_is_put_back_as_it_was(run_dir, tmp_path):
    """DDP on gloo, 2 ranks: rank 1 exits, then rank 0 puts step 4's state back. Its load
    goes well but the ranks' agreement raises (its peer is gone): rank 0 puts its own
    state back, bit for bit, and raises, its step and branch unchanged. Before, the
    agreement's error left rank 0 with step 4's weights at step 6, on no new branch."""
    run_job(str(JOBS / "ddp_peer_gone_job.py"), str(tmp_path))
    saved = torch.load(tmp_path / "rank0.pt")
    assert saved["raised"] is not None and saved["raised"].startswith(
        "RuntimeError: putting the state back failed on the agreement of the ranks ("), saved
    assert saved["step"] == 6 and saved["branch"] == 0
    for before, after in zip(saved["before"], saved["after"], strict=True):
        assert torch.equal(before, after)



@pytest.mark.slow
def test_a_put_back_that_fails_on_one_rank_stops_every_rank_at_that_boundary(run_dir,
                                                                             tmp_path):
    """DDP on gloo, 2 ranks: step 4's state is put back on both; on rank 1 the load and the
    put-back of the state as it was both fail, so rank 1 stops. Before, rank 0 put its own
    state back, raised and trained on, and waited for rank 1 in its next window's
    gradient all-reduce (a hang). Now both ranks learn of it at that boundary and stop
    with the same reason; the job ends."""
    run_job(str(JOBS / "ddp_put_back_fails_job.py"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    reason = ("the state as it was could not be put back either (rank 1: RuntimeError: "
              "test: rank 1 cannot put a state back): the training stops after step 6 on "
              "every rank")
    for rank, saved in enumerate(ranks):
        assert saved["stopping"] and saved["step"] == 6 and saved["branch"] == 0, saved
        assert saved["raised"] is not None, saved
        [error] = saved["errors"]
        assert reason in error, (rank, error)
    assert ranks[1]["raised"] == "RuntimeError: test: rank 1 cannot put a state back"
    assert ranks[0]["raised"].startswith("RuntimeError: putting the state back failed on "
                                         "rank 1: RuntimeError: test: rank 1 cannot put")
    for before, after in zip(ranks[0]["before"], ranks[0]["after"], strict=True):
        assert torch.equal(before, after)  # rank 0's own state: as it was
