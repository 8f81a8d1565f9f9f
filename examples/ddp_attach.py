"""Attach gpuwatch to every rank of a DistributedDataParallel run.

    torchrun --nproc-per-node 2 examples/ddp_attach.py     # then, in another terminal: gpuwatch
    torchrun --nproc-per-node 2 examples/ddp_attach.py --max-steps 200

Each rank attaches its own agent. Ranks started by the same torchrun share one run id
(derived from the launcher, or ``$GPUWATCH_RUN_ID``), so ``gpuwatch runs`` lists them as
one run, the dashboard shows rank 0, and every command (``p``, ``a``, ``gpuwatch set``)
reaches every rank and applies at the same optimizer step on each: no rank ever trains
with another rank's precision or accumulation window. Runs on CPU (gloo) or on GPUs
(nccl, one per rank).
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel

import agent
from gpuopt import Trainer
from gpuopt.loader import ReconfigurableLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps to train (default: about an hour; Ctrl-C "
                             "stops it sooner)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    device = device or torch.device("cpu")

    digits = load_digits()  # 1,797 real 8x8 handwritten digits, shipped with scikit-learn
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(digits.data, dtype=torch.float32) / 16.0,
        torch.tensor(digits.target, dtype=torch.long))
    # each rank trains on its own shard, as with a DistributedSampler; drop_last keeps
    # the number of optimizer steps equal on every rank
    loader = ReconfigurableLoader(dataset, batch_size=32, shuffle=True,
                                  num_replicas=world_size, rank=rank, drop_last=True)
    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, optimizer, torch.nn.functional.cross_entropy, loader,
                      device=device)

    monitor = agent.attach(trainer, name="digits-ddp")
    if rank == 0:
        print(f"run {monitor.run_id} ({world_size} ranks): watch it with `gpuwatch`",
              flush=True)
    try:
        trainer.fit(max_steps=args.max_steps)
        if rank == 0:
            print(monitor.ended_line(), flush=True)  # steps, final loss, the run log
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: a clean end
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the agent has said bye; no traceback
        sys.exit(130)
