"""An FSDP2 job (gloo, CPU) for the tests of every knob on a sharded model:
``torchrun --nproc-per-node 2 tests/fsdp_job.py OUT knobs|resume``.

Each rank trains a ``Sequential`` of three blocks, each block and the whole model
``fully_shard``-ed, with AdamW, in a hand-written loop (:func:`agent.session`), its
micro-batches drawn by ``run.timed`` from its own seeded random numbers.

``knobs``: rank 0's training thread sends, one at a time, ``accum_steps=3``,
``lr_scale=0.5``, ``weight_decay=0.2``, ``max_grad_norm=0.05``, ``checkpointing=true``,
``precision=bf16``, then ``checkpoint=now`` (every rank writes its shard into
``OUT/checkpoints``), ``precision=fp16`` (refused by both ranks) and ``label=5`` (a
knob of the job's own that rank 1 refuses). Every rank keeps an unsharded copy of the
model and, each window, computes the update by hand from both ranks' micro-batches
(gathered) with the knob values of the window (fp32 AdamW with the scaled learning rate
and the decay, the global norm clipped, the same autocast): after each window the full
parameters must equal the copy's (fp32 tolerances: the reduction sums in another
order). It also checks that a window's gradients are reduced at its last micro-batch
only (no sharded gradient before).

``resume``: resumes from the checkpoint ``knobs`` saved and trains on to the same step
(after checking that one rank's file of it is refused as a checkpoint).

``blocked``: ``OUT/checkpoints`` is a file, so rank 0 cannot make the checkpoint's
directory; rank 0 sends ``checkpoint=now`` for step 6 and both ranks train on to step
18 (a rank left waiting at a collective would hang the job).

``unreadable``: the same command, with rank 1's data position failing to be read (its
run's ``data_state`` raises from step 4 on): every rank learns of it at the save's first
collective, and both train on to step 18.

Each rank saves ``OUT/<mode>-rank<N>.pt``: each step's full parameters and knob values,
the command replies (rank 0) and the ``applied`` and ``resumed`` events of its run log.
"""

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import agent
from agent.integrations.sharded import load_sharded
from agent.wire.commands import send_command
from agent.wire.knobs import Knob, KnobSet, KnobSpec
from tests.jobs import (BASE_LR, SHARDED_STEPS, UnshardedCopy, full_params, logged_events,
                        make_model, send_listed)

COMMANDS = {2: ("accum_steps", 3), 4: ("lr_scale", 0.5), 6: ("weight_decay", 0.2),
            8: ("max_grad_norm", 0.05), 10: ("checkpointing", True),
            12: ("precision", "bf16"), 14: ("checkpoint", "now"), 15: ("precision", "fp16"),
            16: ("label", 5)}


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = UnshardedCopy()
    model = make_model()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.0)
    torch.manual_seed(100 + rank)  # each rank's data (a resume puts back where it was)
    label = {"value": 0}
    own = KnobSet()
    own.add(Knob(KnobSpec("label", "int", "test: a knob rank 1 refuses"),
                 get=lambda: label["value"], set=lambda value: label.update(value=value),
                 check=lambda value: (_ for _ in ()).throw(ValueError("rank 1 keeps its label"))
                 if rank == 1 else None))
    saved = next((out / "checkpoints").glob("step-*")) if mode == "resume" else None
    if saved is not None:  # one rank's file is no sharded checkpoint: refused, untouched
        try:
            load_sharded(saved / "rank-0.pt", model, optimizer)
        except ValueError as exc:
            assert "resumes from the directory its checkpoint command wrote" in str(exc)
        else:
            raise AssertionError("a sharded model resumed from one rank's file")
    run = agent.session(model=model, optimizer=optimizer, precision="fp32", accum_steps=2,
                        max_grad_norm=0.0, knobs=own, name=f"fsdp-{mode}",
                        checkpoint_dir=out / "checkpoints", resume_from=saved)
    assert run.checkpointing is not None and len(run.checkpointing) == 3
    assert run.agent.knobs.unsupported["kernels"] == (
        "compiling a model sharded by fully_shard is not verified")
    get_batch = run.timed(lambda: (torch.randn(4, 8), torch.randn(4, 8)))
    steps: dict[int, dict[str, Any]] = {}
    replies: dict[str, Any] = {}
    while run.step < SHARDED_STEPS:
        knobs = run.agent.knobs.values()
        micro_batches = []
        for micro_batch in range(run.accum_steps):
            x, y = get_batch()
            micro_batches.append((x, y))
            with run.autocast:
                loss = torch.nn.functional.mse_loss(model(x), y) / run.accum_steps
            run.scaler.scale(loss).backward()
            synced = [p.grad is not None for p in model.parameters()]
            assert all(synced) == (micro_batch == run.accum_steps - 1), (micro_batch, synced)
        run.scaler.step(optimizer)
        run.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if mode == "knobs":
            reference.check(model, micro_batches, knobs, world)
        run.optimizer_step()
        steps[run.step] = {"params": full_params(model), "knobs": knobs}
        if mode == "unreadable" and rank == 1 and run.step == 4:
            def unreadable() -> dict[str, Any]:
                raise RuntimeError("rank 1's data position cannot be read")
            run.data_state = unreadable  # type: ignore[method-assign]
        if mode in ("blocked", "unreadable") and rank == 0 and run.step == 4:
            replies["checkpoint"] = send_command(run.agent.info, "checkpoint", "now",
                                                 apply_step=6, timeout_s=30)
        if mode == "knobs" and rank == 0:  # (rank 1 waits in the next window's
            # collectives: the step after it is not reached yet)
            send_listed(run.agent.info, COMMANDS, run.step, replies)
    run.close()
    events = logged_events(run.agent.info.log_path, ("applied", "resumed", "failed"))
    torch.save({"steps": steps, "replies": replies, "label": label["value"],
                "events": events},
               out / f"{mode}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
