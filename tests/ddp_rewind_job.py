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

from agent.wire.commands import send_command
from tests.jobs import ContractLoop

STEPS = 10


def main(out: Path, mode: str) -> None:
    loop = ContractLoop(f"ddp-rewind-{mode}", seed=0 if mode != "resume" else 1,
                        checkpoint_dir=out / "checkpoints",
                        resume_from=(out / "checkpoints" / "step-00000003.pt"
                                     if mode == "resume" else None))
    run, rank = loop.run, loop.rank
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
    losses: dict[int, float] = {}
    while run.step < STEPS:
        trained, window = loop.train_window()
        losses[trained] = window  # (a step trained again overwrites)
    loop.close({"losses": losses, "params": loop.params(), "events": events,
                "order": order}, out / f"{mode}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
