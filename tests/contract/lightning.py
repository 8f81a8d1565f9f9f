"""The contract's drivers for Lightning (``lightning.pytorch``): the task's Net in a
LightningModule, ``accumulate_grad_batches=2`` at the start, the agent attached in one
line, and a resume through Lightning's own ``trainer.fit(module, loader,
ckpt_path=...)``; the data a shuffling DataLoader (its position is gpuwatch's: the epoch
made again and the trained batches dropped) or a ReconfigurableLoader (its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import agent
from gpuopt.loader import ReconfigurableLoader
from tests.contract import (BATCH_SIZE, Driver, IndexedDigits, Net, Recorder, loss_fn,
                            optimizer_and_schedule, params_of, send_at_first_step)


class LightningDriver(Driver):
    rollback = True
    name = "lightning"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    # Lightning counts an epoch's batches once (trainer.num_training_batches)
    refused = {"micro_batch_size": "num_training_batches"}
    skips = "counts every batch"  # (its epoch loop's batch progress)

    def loader(self) -> Any:
        return DataLoader(IndexedDigits(), batch_size=BATCH_SIZE, shuffle=True)

    def val_loader(self) -> Any:
        """The validation data (None: the contract's run does not validate)."""
        return None

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        import lightning.pytorch as pl

        class Task(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = Net(seed=0 if resume_from is None else 1)  # the checkpoint's win

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(x)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y, index = batch
                recorder.micro_batch(index)
                return loss_fn(self(x), y)

            def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y, _ = batch
                return loss_fn(self(x), y)

            def configure_optimizers(self) -> Any:
                optimizer, scheduler = optimizer_and_schedule(self.net)
                return {"optimizer": optimizer,
                        "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, accumulate_grad_batches=2,
                             num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        monitor = agent.attach(trainer, name=f"contract-{self.name}",
                               checkpoint_dir=checkpoint_dir)
        send_at_first_step(monitor, commands, recorder)
        log_path = Path(monitor.info.log_path)
        module = Task()
        trainer.fit(module, self.loader(), self.val_loader(), ckpt_path=resume_from)
        return log_path, params_of(module.net)


class LightningReconfigurableDriver(LightningDriver):
    name = "lightning-reconfigurable"

    def loader(self) -> Any:
        return ReconfigurableLoader(IndexedDigits(), BATCH_SIZE, shuffle=True, seed=3)


DRIVERS = [LightningDriver, LightningReconfigurableDriver]
