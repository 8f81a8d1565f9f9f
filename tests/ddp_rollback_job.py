"""A DDP or FSDP2 job (gloo, CPU) for the test of a rollback on every rank:
``torchrun --nproc-per-node 2 tests/ddp_rollback_job.py OUT twin|change|no-copy
[ddp|fsdp]``.

Each rank trains the contract's task (:mod:`tests.contract`: its Net, AdamW and
LambdaLR, windows of 2 micro-batches) in a hand-written loop (:func:`agent.session`)
over a DistributedSampler's shard, the model in DistributedDataParallel (``ddp``, the
default) or sharded by ``fully_shard`` (``fsdp``: each rank snapshots and puts back its
own shards). ``twin``
trains 20 optimizer steps. ``change``: the loss is NaN under bf16 (the contract's
fault), and rank 0 sends ``precision=bf16`` to every rank for step 7 at its first step;
rank 0's guard then rolls it back on every rank, and the job trains on until the state
was restored and step 20 is reached. ``no-copy``: ``change`` where rank 1 cannot copy its
state when the change applies (a fault injected here). Each rank saves
``OUT/<mode>-rank<N>.pt``: each step's window loss (a step trained again overwrites), the
final (full) parameters and its ``rolled_back`` and ``state_restored`` events."""

import sys
import threading
from pathlib import Path

from agent.wire.commands import send_command
from tests.contract import NAN_UNDER_BF16
from tests.jobs import ContractLoop

STEPS = 20


def main(out: Path, mode: str, wrap: str) -> None:
    loop = ContractLoop(f"ddp-rollback-{mode}", wrap=wrap)
    run, rank = loop.run, loop.rank
    restored = threading.Event()
    events: list[dict] = []

    def listener(record: dict) -> None:
        if record["type"] == "event" and record.get("kind") in ("rolled_back",
                                                               "state_restored"):
            events.append({key: record[key] for key in ("kind", "step", "text")})
            if record["kind"] == "state_restored":
                restored.set()
        if (mode != "twin" and rank == 0 and record["type"] == "step"
                and record["step"] == 1):
            reply = send_command(run.agent.info, "precision", "bf16", apply_step=7,
                                 timeout_s=30)
            assert reply["ok"], reply

    if mode == "no-copy" and rank == 1:
        snapshot = run.state_snapshot

        def state_snapshot(*args, **kwargs):
            if run.step == 6:
                raise MemoryError("injected: host memory short on rank 1")
            return snapshot(*args, **kwargs)

        run.state_snapshot = state_snapshot
    run.agent.add_listener(listener)
    if mode != "twin":
        NAN_UNDER_BF16.set()
    losses: dict[int, float] = {}
    while not (run.step >= STEPS and (mode == "twin" or restored.is_set())):
        trained, window = loop.train_window()
        losses[trained] = window  # (a step trained again overwrites)
    loop.close({"losses": losses, "params": loop.params(), "events": events},
               out / f"{mode}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "ddp")
