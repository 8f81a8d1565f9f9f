"""A DDP job (gloo, CPU) for the test of a rewind on every rank:
``torchrun --nproc-per-node 2 tests/ddp_rewind_job.py OUT rewind|refused|resume``.

Each rank trains the contract's task (:mod:`tests.contract`: its Net, AdamW and
LambdaLR, windows of 2 micro-batches) in a hand-written loop (:func:`agent.session`) in
DistributedDataParallel over a DistributedSampler's shard, to step 10, checkpoints in
``OUT/checkpoints``. ``rewind``: rank 0 sends ``checkpoint=now`` for the boundary after
step 3 at its first step, and at its step 5 ``rewind=3`` to every rank for the boundary
after step 7 and ``accum_steps=2`` (the value it has) for the boundary after step 9,
which the rewind moves to the one after step 5 (it keeps its distance). ``refused``: the
same, with rank 1's read of the checkpoint failing (a fault injected here): no rank
rewinds. ``resume``: a fresh job resumed from the checkpoint of step 3. Each rank saves
``OUT/<mode>-rank<N>.pt``: each step's window loss (a step trained again overwrites),
the final parameters, its ``branched``, ``failed``, ``rescheduled`` and ``accum_steps``
``applied`` events, and the steps in the order trained."""

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import agent
from agent.wire.commands import send_command
from tests.contract import (BATCH_SIZE, IndexedDigits, Net, loss_fn, optimizer_and_schedule,
                            params_of)

STEPS = 10


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net(seed=0 if mode != "resume" else 1)
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer, scheduler = optimizer_and_schedule(model)
    run = agent.session(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                        precision="fp32", accum_steps=2, max_grad_norm=0.0,
                        checkpoint_dir=out / "checkpoints", name=f"ddp-rewind-{mode}",
                        resume_from=(out / "checkpoints" / "step-00000003.pt"
                                     if mode == "resume" else None))
    if mode == "refused" and rank == 1:
        def cannot_read(path: Path) -> Any:
            raise OSError(f"injected: rank 1 cannot read {path}")
        run.read_checkpoint = cannot_read  # type: ignore[method-assign]
    events: list[dict] = []
    order: list[int] = []

    def listener(record: dict) -> None:
        if record["type"] == "event" and (
                record.get("kind") in ("branched", "failed", "rescheduled")
                or record.get("knob") == "accum_steps"):
            events.append({key: record.get(key) for key in (
                "kind", "step", "text", "branch", "parent", "source", "previous_step")})
        if record["type"] == "step":
            order.append(record["step"])
        if mode == "resume" or rank != 0 or record["type"] != "step" or len(order) > 5:
            return
        for at, knob, value, apply_step in ((1, "checkpoint", "now", 4),
                                            (5, "rewind", "3", 8), (5, "accum_steps", 2, 10)):
            if record["step"] == at:
                reply = send_command(run.agent.info, knob, value, apply_step=apply_step,
                                     timeout_s=30)
                assert reply["ok"], reply

    run.agent.add_listener(listener)
    data = DataLoader(IndexedDigits(), batch_size=BATCH_SIZE,
                      sampler=DistributedSampler(IndexedDigits(), shuffle=True, seed=3))
    batches = iter(run.loader(data, epochs=None))
    losses: dict[int, float] = {}
    while run.step < STEPS:
        window = 0.0
        for _ in range(run.accum_steps):
            x, y, _index = next(batches)
            with run.autocast:
                loss = loss_fn(model(x), y) / run.accum_steps
            run.scaler.scale(loss).backward()
            window += loss.item()
        run.scaler.step(optimizer)
        run.scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses[run.step + 1] = window  # (a rewind at this boundary moves run.step)
        run.optimizer_step()
    run.close()
    torch.save({"losses": losses, "params": params_of(net), "events": events,
                "order": order}, out / f"{mode}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
