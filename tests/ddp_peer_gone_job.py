"""A DDP job (gloo, CPU) for the test of a state put back while a rank is gone:
``torchrun --nproc-per-node 2 tests/ddp_peer_gone_job.py OUT``.

Each rank trains the contract's task (:class:`tests.jobs.ContractLoop`) for 4 windows,
copies its state (``run.state_snapshot``), and trains 2 more. Then rank 1 leaves (it
exits, as a crashed or killed rank does) and rank 0 puts step 4's state back
(``run.rewind_state``): its load goes well, but the ranks' agreement cannot be made.
Rank 0 saves ``OUT/rank0.pt``: what the rewind raised, its step and branch after, its
parameters before the rewind and after; then exits without the collectives of a
close (its peer is gone)."""

import os
import sys
from pathlib import Path

import torch

from tests.jobs import ContractLoop


def main(out: Path) -> None:
    loop = ContractLoop("ddp-peer-gone")
    run = loop.run
    for _ in range(4):
        loop.train_window()
    snapshot = run.state_snapshot()
    for _ in range(2):
        loop.train_window()
    if loop.rank == 1:
        run.close()
        os._exit(0)
    before = [p.detach().clone() for p in loop.params()]
    try:
        run.rewind_state(snapshot, 4, source="test", cause="a rank gone")
        raised = None
    except Exception as exc:  # noqa: BLE001 -- what the test checks
        raised = f"{type(exc).__name__}: {exc}"
    torch.save({"raised": raised, "step": run.step, "branch": run.branch, "before": before,
                "after": [p.detach().clone() for p in loop.params()]}, out / "rank0.pt")
    run.agent.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
