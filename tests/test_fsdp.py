"""FSDP2 (``fully_shard``) in a hand-written loop: every knob exact against an unsharded
copy, commands at one step on every rank, refused everywhere when one rank refuses, and
a sharded checkpoint every rank writes its part of, resumed bit-identically (real
torchrun jobs, gloo on the CPU: :mod:`tests.fsdp_job`); the same under Lightning's
``ModelParallelStrategy``, in a Fabric loop (:mod:`tests.fabric_fsdp_job`) and a
Trainer's ``fit`` (:mod:`tests.lightning_fsdp_job`)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.jobs import run_job

JOB = Path(__file__).with_name("fsdp_job.py")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


CHANGED = ("accum_steps", "lr_scale", "weight_decay", "max_grad_norm", "checkpointing",
           "precision=bf16", "checkpoint")


def knobs_job(job: str, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """Run ``job`` in its ``knobs`` mode and check what every such job must show.

    Each of :data:`CHANGED` accepted on both ranks, the same knob values at every step on
    both, each new value first trained at its reply's ``apply_step``. Returns each rank's
    saved data, rank 0's replies and the step its checkpoint holds."""
    run_job(job, str(out), "knobs")
    ranks = [torch.load(out / f"knobs-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    replies = ranks[0]["replies"]
    for name in CHANGED:
        assert replies[name]["ok"] and replies[name]["ranks"] == [0, 1], replies[name]
    assert [{step: s["knobs"] for step, s in data["steps"].items()} for data in ranks][0] == {
        step: s["knobs"] for step, s in ranks[1]["steps"].items()}
    for name, value in ranks[0]["steps"][max(ranks[0]["steps"])]["knobs"].items():
        reply = replies.get(name) or replies.get(f"{name}={value}")
        if reply is not None and reply["ok"]:  # each new value first trained at its step
            assert min(step for step, s in ranks[0]["steps"].items()
                       if s["knobs"][name] == value) == reply["apply_step"], name
    return ranks, replies, replies["checkpoint"]["apply_step"] - 1


def resumes_bit_identically(job: str, out: Path, ranks: list[dict[str, Any]],
                            saved_step: int, resumed_from: Path | None = None) -> None:
    """Run ``job`` in its ``resume`` mode: each rank's steps after ``saved_step`` equal
    ``ranks``' (the ``knobs`` run's) bit for bit, with the same knob values; with
    ``resumed_from``, its ``resumed`` event names it."""
    run_job(job, str(out), "resume")
    for rank, data in enumerate(ranks):
        resumed = torch.load(out / f"resume-rank{rank}.pt", weights_only=False)
        if resumed_from is not None:
            [event] = [e for e in resumed["events"] if e["kind"] == "resumed"]
            assert f"resumed from {resumed_from} at step {saved_step}" in event["text"], event
        assert sorted(resumed["steps"]) == [step for step in sorted(data["steps"])
                                            if step > saved_step]
        for step, state in resumed["steps"].items():
            assert state["knobs"] == data["steps"][step]["knobs"]
            for mine, theirs in zip(state["params"], data["steps"][step]["params"], strict=True):
                assert torch.equal(mine, theirs), (rank, step)


@pytest.mark.slow
def test_the_fsdp_example_runs_as_it_is_and_cleans_up(run_dir):
    output = run_job(str(EXAMPLES / "fsdp_loop.py"), "--max-steps", "10")
    assert "(2 ranks): watch it with `gpuwatch`" in output
    assert list(Path(run_dir).glob("*.json")) == []  # both run files removed at exit


@pytest.mark.slow
def test_every_knob_of_a_sharded_loop_is_exact_and_its_checkpoint_resumes_bit_identically(
        run_dir, tmp_path):
    """The job checks each window against the unsharded copy itself (fp32 tolerances,
    both ranks; and that gradients are reduced at a window's last micro-batch only);
    here: every command applied at one step on both ranks, the refusals, the checkpoint
    written by both ranks, and the resume equal to the run it came from, bit for bit."""
    ranks, replies, saved_step = knobs_job(str(JOB), tmp_path)
    assert not replies["precision=fp16"]["ok"]
    assert "GradScaler would check each rank's shard" in replies["precision=fp16"]["reason"]
    assert not replies["label"]["ok"]  # rank 1 refused: neither rank has it
    assert replies["label"]["reason"] == "label=5: rank 1 keeps its label (rank 1)"
    assert [data["label"] for data in ranks] == [0, 0]
    last = ranks[0]["steps"][max(ranks[0]["steps"])]["knobs"]
    assert {name: last[name] for name in ("accum_steps", "lr_scale", "weight_decay",
                                          "max_grad_norm", "checkpointing", "precision")} == {
        "accum_steps": 3, "lr_scale": 0.5, "weight_decay": 0.2, "max_grad_norm": 0.05,
        "checkpointing": True, "precision": "bf16"}
    [directory] = (tmp_path / "checkpoints").iterdir()
    assert directory.name == f"step-{saved_step:08d}"
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in directory.iterdir()}
    for data in ranks:  # rank 0 saved it (and named it), rank 1 with it
        [saved] = [e for e in data["events"] if e["knob"] == "checkpoint"]
        assert f"saved {'after' if data is ranks[0] else 'with rank 0 after'} step " \
               f"{saved_step} to {directory}" in saved["text"], saved
    resumes_bit_identically(str(JOB), tmp_path, ranks, saved_step, directory)


@pytest.mark.slow
def test_every_knob_of_a_fabric_model_parallel_loop_is_exact_and_resumes_bit_identically(
        run_dir, tmp_path):
    """Fabric's ModelParallelStrategy (fully_shard on its data-parallel mesh): the job
    checks each window against the unsharded copy and the reduction at the window's
    last micro-batch only (``fabric.no_backward_sync``); here: each command at one step
    on both ranks, the refusals, and the sharded checkpoint resumed bit for bit."""
    job = str(JOB.with_name("fabric_fsdp_job.py"))
    ranks, replies, saved_step = knobs_job(job, tmp_path)
    assert not replies["precision=fp16"]["ok"]  # (Fabric has no fp16 AMP on a CPU)
    assert "choose bf16" in replies["precision=fp16"]["reason"]
    assert not replies["kernels"]["ok"]
    assert "compiling a model sharded by fully_shard" in replies["kernels"]["reason"]
    [directory] = (tmp_path / "checkpoints").iterdir()
    assert directory.name == f"step-{saved_step:08d}"
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in directory.iterdir()}
    resumes_bit_identically(job, tmp_path, ranks, saved_step, directory)


@pytest.mark.slow
def test_a_fabric_model_parallel_mesh_with_tensor_parallelism_refuses_every_knob(
        run_dir, tmp_path):
    """ModelParallelStrategy's 'auto' sizes give both devices to tensor parallelism: a
    module fully_shard-ed on its (one-rank) data-parallel mesh is then not what the
    knobs were verified on, and each rank refuses them with the mesh in the reason."""
    run_job(str(JOB.with_name("fabric_fsdp_job.py")), str(tmp_path), "auto")
    for rank in (0, 1):
        unsupported = torch.load(tmp_path / f"auto-rank{rank}.pt", weights_only=False)
        for name in ("accum_steps", "precision", "checkpointing", "lr_scale", "weight_decay",
                     "max_grad_norm", "dropout", "micro_batch_size", "checkpoint"):
            assert "a tensor-parallel dimension of 2 ranks (its mesh: data_parallel=1, " \
                   "tensor_parallel=2;" in unsupported[name], (rank, name)


@pytest.mark.slow
def test_every_knob_of_a_lightning_model_parallel_fit_is_exact_and_resumes_bit_identically(
        run_dir, tmp_path):
    """Lightning's ModelParallelStrategy (fully_shard in configure_model): the job's
    callback checks each window against the unsharded copy and that its gradients are
    reduced at its last micro-batch only (Lightning's own block_backward_sync blocks
    DDP's only: without gpuwatch every micro-batch is reduced); here: each command at
    one step on both ranks, the refusals with their reasons, and Lightning's sharded
    checkpoint, resumed by ``fit(ckpt_path=)``, equal to the run bit for bit."""
    job = str(JOB.with_name("lightning_fsdp_job.py"))
    ranks, replies, saved_step = knobs_job(job, tmp_path)
    assert "GradScaler would check each rank's shard" in replies["precision=fp16"]["reason"]
    assert "compiling a model sharded by fully_shard" in replies["kernels"]["reason"]
    assert not any(replies[name]["ok"] for name in ("precision=fp16", "kernels"))
    assert sorted(ranks[0]["steps"]) == list(range(1, 19))
    assert [data["checkpointed"] for data in ranks] == [(3, True)] * 2  # the fully_shard blocks
    [directory] = (tmp_path / "checkpoints").iterdir()  # every rank's shards, rank 0's rest
    assert directory.name == f"step-{saved_step:08d}.ckpt"
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in directory.iterdir()}
    resumes_bit_identically(job, tmp_path, ranks, saved_step)


@pytest.mark.slow
def test_accelerate_and_hf_fsdp_on_a_cpu_is_no_fsdp_and_gpuwatch_says_so(run_dir, tmp_path):
    """accelerate makes its FSDP plugin FSDP only from a GPU-like distributed type
    (accelerate/state.py, AcceleratorState): on a CPU, ``cpu=True`` gives DDP
    (MULTI_CPU: its knobs and refusals), and without it each torchrun rank is a
    one-process run (NO) that never reduces with the others: gpuwatch warns on every
    rank, and refuses the checkpoint, which would be rank 0's model for all. The HF
    Trainer's ``fsdp=`` with ``use_cpu`` is that DDP: gpuwatch warns that it is, and
    refuses ``rewind`` (HF loads a checkpoint in place on each process alone)."""
    job = str(JOB.with_name("accelerate_fsdp_job.py"))
    run_job(job, str(tmp_path), "plain")
    run_job(job, str(tmp_path), "cpu")
    run_job(job, str(tmp_path), "hf")
    for rank in (0, 1):
        plain = torch.load(tmp_path / f"plain-rank{rank}.pt", weights_only=False)
        assert (plain["distributed_type"], plain["num_processes"], plain["dtensors"]) == (
            "NO", 1, False)
        assert (plain["rank"], plain["world_size"]) == (rank, 2)
        apart = ("the launcher started 2 ranks and accelerate runs each as a run of its own "
                 "(distributed_type NO: no GPU, and no Accelerator(cpu=True)): they train "
                 "apart, their gradients never reduced, and an FSDP plugin is not used")
        assert plain["warnings"] == [apart]
        assert plain["unsupported"]["checkpoint"] == (
            f"{apart}; rank 0's checkpoint would not hold the other ranks' models")
        cpu = torch.load(tmp_path / f"cpu-rank{rank}.pt", weights_only=False)
        assert (cpu["distributed_type"], cpu["num_processes"], cpu["dtensors"]) == (
            "MULTI_CPU", 2, False)
        assert cpu["warnings"] == []
        assert "save_state writes from together" in cpu["unsupported"]["checkpoint"]
        for name in ("accum_steps", "precision", "lr_scale", "max_grad_norm"):
            assert name not in cpu["unsupported"], name  # (DDP's, as its column says)
        hf = torch.load(tmp_path / f"hf-rank{rank}.pt", weights_only=False)
        assert (hf["distributed_type"], hf["is_fsdp_enabled"], hf["dtensors"]) == (
            "MULTI_CPU", False, False)
        assert hf["warnings"] == [
            "fsdp=True is not FSDP here: accelerate runs MULTI_CPU (its FSDP plugin only on "
            "a GPU-like device), so the model is not sharded and the knobs are that run's"]
        # each process would load a checkpoint in place, alone (as accelerate's would)
        assert hf["unsupported"]["rewind"] == (
            "this run has 2 processes, and HF's _load_from_checkpoint loads in place, on "
            "each alone, and a checkpoint holds one process's random numbers: resume with "
            "trainer.train(resume_from_checkpoint=...)")


@pytest.mark.slow
def test_a_rank_state_failing_on_rank_1_fails_the_sharded_checkpoint_on_every_rank(
        run_dir, tmp_path):
    """Rank 1's data position cannot be read when the checkpoint is saved: it says so
    at the save's first collective (rank 0 does not wait there for ever: the job ends
    within run_job's timeout), no rank writes a shard, both report the failure naming
    rank 1 and train on to the end."""
    run_job(str(JOB), str(tmp_path), "unreadable")
    ranks = [torch.load(tmp_path / f"unreadable-rank{rank}.pt", weights_only=False)
             for rank in (0, 1)]
    reply = ranks[0]["replies"]["checkpoint"]
    assert reply["ok"] and reply["ranks"] == [0, 1], reply
    assert list((tmp_path / "checkpoints").glob("step-*")) == []
    for rank, data in enumerate(ranks):
        assert max(data["steps"]) == 18, rank
        [failed] = [event for event in data["events"] if event["kind"] == "failed"]
        assert failed["knob"] == "checkpoint" and failed["step"] == 6, failed
        assert ("the sharded checkpoint failed on rank 1: RuntimeError: rank 1's data "
                "position cannot be read") in failed["text"], failed


@pytest.mark.slow
def test_a_sharded_checkpoint_failing_on_rank_0_is_reported_on_every_rank(run_dir, tmp_path):
    """A file where rank 0 makes the checkpoint's directory: rank 0 fails before its
    shards are written, the other rank learns of it at its first collective of the
    save (no wait for the process group's timeout), and both report the failure and
    train on to the end."""
    (tmp_path / "checkpoints").write_text("in the way")
    run_job(str(JOB), str(tmp_path), "blocked")
    ranks = [torch.load(tmp_path / f"blocked-rank{rank}.pt", weights_only=False)
             for rank in (0, 1)]
    reply = ranks[0]["replies"]["checkpoint"]
    assert reply["ok"] and reply["ranks"] == [0, 1], reply
    for rank, data in enumerate(ranks):
        assert max(data["steps"]) == 18, rank
        [failed] = [event for event in data["events"] if event["kind"] == "failed"]
        assert failed["knob"] == "checkpoint" and failed["step"] == 6, failed
        assert "Not a directory" in failed["text"]
        assert ("failed on rank 0: NotADirectoryError" in failed["text"]) == (rank == 1)
        assert not [event for event in data["events"] if event["kind"] == "applied"
                    and event["knob"] == "checkpoint"]
    assert (tmp_path / "checkpoints").read_text() == "in the way"
