"""A DDP job (gloo, CPU) for the test of a state put-back that fails on one rank:
``torchrun --nproc-per-node 2 tests/ddp_put_back_fails_job.py OUT``.

Each rank trains the contract's task (:class:`tests.jobs.ContractLoop`) for 4 windows,
copies its state (``run.state_snapshot``), and trains 2 more. Then every rank puts step
4's state back (``run.rewind_state``); on rank 1 every ``load_snapshot`` raises (the
load, then the put-back of the state as it was), so rank 1 cannot train on. Each rank
saves ``OUT/rank<N>.pt``: what the rewind raised, whether the run stops, its step and
branch, its parameters before the rewind and after, and the error events of its log;
then, if it does not stop, it trains one more window (where rank 1, stopped, would
leave it waiting), and closes.
"""

import sys
from pathlib import Path

import torch

from gpuwatch.history import flat_records
from tests.jobs import ContractLoop


def main(out: Path) -> None:
    loop = ContractLoop("ddp-put-back-fails")
    run = loop.run
    snapshot = loop.snapshot_at_step_4_then_train_to_6()
    if loop.rank == 1:
        def fails(snapshot):
            raise RuntimeError("test: rank 1 cannot put a state back")
        run.load_snapshot = fails
    saved = loop.rewind_to_step_4(snapshot, "a put-back that fails")
    if not run.stopping:
        loop.train_window()
    log_path = run.agent.info.log_path
    run.close()
    saved["errors"] = [record["text"] for record in flat_records(log_path)
                       if record["type"] == "event" and record.get("level") == "error"]
    torch.save(saved, out / f"rank{loop.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
