"""Attach gpuwatch to a Lightning run: one line, ``agent.attach(trainer)``.

    python examples/lightning_attach.py          # then, in another terminal: gpuwatch
    python examples/lightning_attach.py --max-steps 300

An ordinary LightningModule (a small MLP on scikit-learn's 1,797 handwritten digits) and
``lightning.pytorch.Trainer``; ``agent.attach(trainer)`` before ``fit`` adds gpuwatch's
callback, which reports every optimizer step and takes the knobs Lightning can change
correctly mid-run (see the README's table). Needs ``pip install lightning``.
"""

import argparse

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

import agent


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr=1e-3):
        super().__init__()
        self.lr = lr
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 256), nn.GELU()),
                                     nn.Sequential(nn.Linear(256, 256), nn.GELU())])
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps (default: about an hour; Ctrl-C stops it)")
    args = parser.parse_args()
    digits = load_digits()
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(digits.data, dtype=torch.float32) / 16.0,
        torch.tensor(digits.target, dtype=torch.long))
    train, val = torch.utils.data.random_split(dataset, [1597, 200],
                                               generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(accelerator="cpu", max_steps=args.max_steps, max_epochs=-1,
                         val_check_interval=100, check_val_every_n_epoch=None,
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    monitor = agent.attach(trainer, name="lightning-digits")
    print(f"run {monitor.run_id}: watch it with `gpuwatch`", flush=True)
    trainer.fit(DigitsClassifier(),
                torch.utils.data.DataLoader(train, batch_size=32, shuffle=True),
                torch.utils.data.DataLoader(val, batch_size=100))
    print(monitor.ended_line(), flush=True)  # steps trained, final loss, the run log


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the agent has said bye; no traceback
        raise SystemExit(130)
