"""The contract's driver for the reference :class:`gpuopt.Trainer`: with a
ReconfigurableLoader (every knob, ``micro_batch_size`` too) and with a plain shuffling
DataLoader (its data position is :class:`gpuopt.position.DataPosition`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

import agent
from gpuopt import Trainer
from gpuopt.loader import ReconfigurableLoader
from tests.contract import (BATCH_SIZE, Driver, IndexedDigits, Net, Recorder,
                            optimizer_and_schedule, params_of, send_at_first_step)
from tests.contract import loss_fn as task_loss


def collate(samples: list[Any]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(x, (y, index))``: the Trainer's ``(inputs, targets)``, the indices riding along
    with the targets to the loss function, which records them."""
    x, y, index = default_collate(samples)
    return x, (y, index)


class TrainerDriver(Driver):
    rollback = True
    name = "trainer"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("micro_batch_size", 4), ("dropout", 0.5))

    def loader(self) -> Any:
        return ReconfigurableLoader(IndexedDigits(), BATCH_SIZE, shuffle=True, seed=3,
                                    collate_fn=collate)

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        model = Net(seed=0 if resume_from is None else 1)  # the checkpoint's weights win
        optimizer, scheduler = optimizer_and_schedule(model)

        def loss_fn(logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]
                    ) -> torch.Tensor:
            y, index = target
            recorder.micro_batch(index)
            return task_loss(logits, y)

        trainer = Trainer(model, optimizer, loss_fn, self.loader(), accum_steps=2,
                          lr_scheduler=scheduler)
        monitor = agent.attach(trainer, name=f"contract-{self.name}",
                               checkpoint_dir=checkpoint_dir, resume_from=resume_from)
        send_at_first_step(monitor, commands, recorder)
        log_path = Path(monitor.info.log_path)
        trainer.fit(max_steps=steps)
        return log_path, params_of(model)


class TrainerDataLoaderDriver(TrainerDriver):
    name = "trainer-dataloader"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "ReconfigurableLoader"}

    def loader(self) -> Any:
        return DataLoader(IndexedDigits(), batch_size=BATCH_SIZE, shuffle=True,
                          collate_fn=collate)


DRIVERS = [TrainerDriver, TrainerDataLoaderDriver]
