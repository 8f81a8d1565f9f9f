"""A Lightning Fabric job with ``ModelParallelStrategy`` (FSDP2, gloo, CPU) for the tests
of every knob on a sharded module:
``torchrun --nproc-per-node 2 tests/fabric_fsdp_job.py OUT knobs|resume|auto``.

The module is :func:`tests.jobs.make_model`'s (each block and the whole ``Sequential``
``fully_shard``-ed, here by the strategy's parallelize function on its data-parallel
mesh); the loop is Fabric's: ``fabric.no_backward_sync`` while ``run.is_accumulating``,
``fabric.backward``, the optimizer Fabric wrapped, and ``agent.attach(fabric, ...)``.
``knobs``: rank 0 sends :data:`COMMANDS`, one at a time; every rank checks each window
against an unsharded copy (:class:`tests.jobs.UnshardedCopy`) and that a window's
gradients are reduced at its last micro-batch only. ``resume``: resumes from the
checkpoint ``knobs`` saved and trains on to the same step. Each rank saves
``OUT/<mode>-rank<N>.pt`` as :mod:`tests.fsdp_job`. ``auto``: the strategy's default
mesh (every device to tensor parallelism), attached only: each rank saves the refused
knobs' reasons."""

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import agent
from tests.jobs import (BASE_LR, SHARDED_STEPS, UnshardedCopy, full_params, logged_events,
                        make_model, send_listed)

COMMANDS = {2: ("accum_steps", 3), 4: ("lr_scale", 0.5), 6: ("weight_decay", 0.2),
            8: ("max_grad_norm", 0.05), 10: ("checkpointing", True),
            12: ("precision", "bf16"), 14: ("checkpoint", "now"), 15: ("precision", "fp16"),
            16: ("kernels", "compile")}


def parallelize(model: torch.nn.Sequential, mesh: Any) -> torch.nn.Sequential:
    for block in model:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def main(out: Path, mode: str) -> None:
    strategy = (ModelParallelStrategy(parallelize) if mode == "auto" else
                ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    if mode == "auto":  # ('auto': 1 x 2, the devices to tensor parallelism): refused
        model = fabric.setup_module(make_model())
        fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=BASE_LR))
        run = agent.attach(fabric, accum_steps=2, max_grad_norm=0.0, name="fabric-fsdp-auto")
        torch.save(run.agent.knobs.unsupported, out / f"auto-rank{fabric.global_rank}.pt")
        run.close()
        dist.destroy_process_group()
        return
    rank, world = fabric.global_rank, fabric.world_size
    reference = UnshardedCopy()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.0))
    torch.manual_seed(100 + rank)  # each rank's data (a resume puts back where it was)
    saved = next((out / "checkpoints").glob("step-*")) if mode == "resume" else None
    run = agent.attach(fabric, accum_steps=2, max_grad_norm=0.0, name=f"fabric-fsdp-{mode}",
                       checkpoint_dir=out / "checkpoints", resume_from=saved)
    get_batch = run.timed(lambda: (torch.randn(4, 8), torch.randn(4, 8)))
    steps: dict[int, dict[str, Any]] = {}
    replies: dict[str, Any] = {}
    while run.step < SHARDED_STEPS:
        knobs = run.agent.knobs.values()
        micro_batches = []
        while True:
            x, y = get_batch()
            micro_batches.append((x, y))
            accumulating = run.is_accumulating
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss / run.accum_steps)
            synced = [p.grad is not None for p in model.parameters()]
            assert all(synced) == (not accumulating), (len(micro_batches), synced)
            if not accumulating:
                break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "knobs":
            reference.check(model, micro_batches, knobs, world)
        run.optimizer_step()
        steps[run.step] = {"params": full_params(model), "knobs": knobs}
        if mode == "knobs" and rank == 0:
            send_listed(run.agent.info, COMMANDS, run.step, replies)
    run.close()
    events = logged_events(run.agent.info.log_path, ("applied", "resumed"))
    torch.save({"steps": steps, "replies": replies, "events": events},
               out / f"{mode}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
