"""Attach gpuwatch to a training loop on Lightning Fabric.

    python examples/fabric_attach.py             # then, in another terminal: gpuwatch
    python examples/fabric_attach.py --max-steps 200

An ordinary Fabric loop (``fabric.setup``, ``fabric.setup_dataloaders``,
``fabric.no_backward_sync``, ``fabric.backward``) with three gpuwatch lines:
``agent.attach(fabric, ...)`` after the setup, ``run.loader(...)`` around the data (it
times the data wait and keeps the data position for checkpoints) and
``run.optimizer_step()`` at each optimizer-step boundary, where live commands apply. The
window comes from ``run.is_accumulating`` and ``run.accum_steps``, so ``accum_steps`` is a
live knob; ``precision`` switches Fabric's own precision plugin; ``kernels``,
``checkpointing`` (the model's blocks), ``lr_scale``, ``weight_decay`` and
``max_grad_norm`` are live too, and ``checkpoint=now`` saves with ``fabric.save``
(``--resume PATH`` goes on from one, exactly).
"""

import argparse
import sys

import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

import agent


class Net(nn.Module):
    """A digits classifier with repeated residual blocks (what ``checkpointing`` takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 128),
                                                  nn.GELU()) for _ in range(3))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps to train (default: about an hour; Ctrl-C "
                             "stops it sooner)")
    parser.add_argument("--resume", default=None,
                        help="a checkpoint saved by `gpuwatch set checkpoint=now`")
    args = parser.parse_args()

    digits = load_digits()  # 1,797 real 8x8 handwritten digits, shipped with scikit-learn
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(digits.data, dtype=torch.float32) / 16.0,
        torch.tensor(digits.target, dtype=torch.long))
    fabric = Fabric(devices=1)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.999 ** step)
    model, optimizer = fabric.setup(model, optimizer)
    train_loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True))

    run = agent.attach(fabric, name="digits-fabric", lr_scheduler=scheduler, accum_steps=2,
                       max_grad_norm=1.0, resume_from=args.resume)
    print(f"run {run.agent.run_id}: watch it with `gpuwatch`", flush=True)
    for inputs, targets in run.loader(train_loader, epochs=None):  # epoch after epoch
        is_accumulating = run.is_accumulating                      # the live window
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.cross_entropy(model(inputs), targets)
            fabric.backward(loss / run.accum_steps)
        if not is_accumulating:
            optimizer.step()             # the run clips to max_grad_norm inside it
            scheduler.step()
            optimizer.zero_grad()
            run.optimizer_step()         # the boundary: commands apply here
            if run.step >= args.max_steps:
                break
    run.close()
    print(run.agent.ended_line(), flush=True)  # steps trained, final loss, the run log


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the agent has said bye; no traceback
        sys.exit(130)
