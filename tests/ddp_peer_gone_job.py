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
    snapshot = loop.snapshot_at_step_4_then_train_to_6()
    if loop.rank == 1:
        run.close()
        os._exit(0)
    torch.save(loop.rewind_to_step_4(snapshot, "a rank gone"), out / "rank0.pt")
    run.agent.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
