"""Attach gpuwatch to a hand-written loop over a model sharded by FSDP2 (``fully_shard``).

    torchrun --nproc-per-node 2 examples/fsdp_loop.py    # then, in another terminal: gpuwatch
    torchrun --nproc-per-node 2 examples/fsdp_loop.py --max-steps 200

Each rank holds a shard of every parameter, gradient and optimizer state; each runs its
own agent, and the ranks share one run (``gpuwatch runs`` lists it once), so every
command applies at the same optimizer step on every rank, or on none. The loop is the
one of ``hand_written_loop.py``: ``precision`` (fp32, bf16), ``accum_steps`` (gradients
reduced at the window's last micro-batch only), ``lr_scale``, ``weight_decay``,
``max_grad_norm`` (the global norm over every shard), ``checkpointing`` (of the blocks
``fully_shard`` wrapped) are live, and ``gpuwatch set checkpoint=now`` writes a
``torch.distributed.checkpoint`` directory, every rank its part;
``--resume-from DIR`` goes on from one. Runs on CPU (gloo) or on GPUs (nccl, one per
rank).
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.fsdp import fully_shard

import agent
from gpuopt.loader import ReconfigurableLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps to train (default: about an hour; Ctrl-C "
                             "stops it sooner)")
    parser.add_argument("--resume-from", default=None,
                        help="a checkpoint directory `gpuwatch set checkpoint=now` wrote")
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
    # each rank trains on its own part of the data; drop_last keeps the number of
    # optimizer steps equal on every rank
    loader = ReconfigurableLoader(dataset, batch_size=32, shuffle=True,
                                  num_replicas=world_size, rank=rank, drop_last=True)
    torch.manual_seed(0)  # the same initial model on every rank, which then shards it
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU()),
        *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(2)],
        torch.nn.Linear(256, 10)).to(device)
    for block in model:
        fully_shard(block)  # one unit per block: gathered one at a time
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    run = agent.session(name="digits-fsdp", model=model, optimizer=optimizer,
                        precision="fp32", accum_steps=1, max_grad_norm=1.0,
                        resume_from=args.resume_from)
    if rank == 0:
        print(f"run {run.agent.run_id} ({world_size} ranks): watch it with `gpuwatch`",
              flush=True)
    batches = run.loader(loader, epochs=None)    # epoch after epoch
    try:
        while run.step < args.max_steps and not run.stopping:   # stop=now ends it too
            for _ in range(run.accum_steps):          # the live window size
                inputs, targets = next(batches)
                with run.autocast:                    # the live precision
                    loss = torch.nn.functional.cross_entropy(model(inputs.to(device)),
                                                             targets.to(device))
                run.scaler.scale(loss / run.accum_steps).backward()  # reduces at the last
            run.scaler.step(optimizer)                # clipped to max_grad_norm inside
            run.scaler.update()
            optimizer.zero_grad(set_to_none=True)
            run.optimizer_step()                      # the boundary: commands apply here
        run.close()
        if rank == 0:
            print(run.agent.ended_line(), flush=True)  # steps, final loss, the run log
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: a clean end
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the agent has said bye; no traceback
        sys.exit(130)
