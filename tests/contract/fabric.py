"""The contract's drivers for Lightning Fabric (:func:`agent.attach` of a ``Fabric``): the
model and optimizer through ``fabric.setup``, Fabric's accumulation loop
(``no_backward_sync``, ``fabric.backward``) with the window from ``run.is_accumulating``,
clipping by the run's ``max_grad_norm``; the data a shuffling DataLoader through
``fabric.setup_dataloaders``, or a ReconfigurableLoader (every knob, ``micro_batch_size``
too), each through ``run.loader``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import agent
from gpuopt.loader import ReconfigurableLoader
from tests.contract import (BATCH_SIZE, Driver, IndexedDigits, Net, Recorder, loss_fn,
                            optimizer_and_schedule, params_of, send_at_first_step)


class FabricDriver(Driver):
    rollback = True
    name = "fabric"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "ReconfigurableLoader"}

    def data(self, fabric: Fabric) -> Any:
        """The loop's data, as the script gives it to ``run.loader``."""
        return fabric.setup_dataloaders(DataLoader(IndexedDigits(), batch_size=BATCH_SIZE,
                                                   shuffle=True))

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        fabric = Fabric(accelerator="cpu", devices=1)
        model = Net(seed=0 if resume_from is None else 1)  # the checkpoint's weights win
        optimizer, scheduler = optimizer_and_schedule(model)
        model, optimizer = fabric.setup(model, optimizer)
        train_loader = self.data(fabric)
        run = agent.attach(fabric, lr_scheduler=scheduler, accum_steps=2, max_grad_norm=0.0,
                           checkpoint_dir=checkpoint_dir, resume_from=resume_from,
                           name=f"contract-{self.name}")
        send_at_first_step(run.agent, commands, recorder)
        log_path = Path(run.agent.info.log_path)
        for x, y, index in run.loader(train_loader, epochs=None):
            recorder.micro_batch(index)
            is_accumulating = run.is_accumulating
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                fabric.backward(loss_fn(model(x), y) / run.accum_steps)
            if not is_accumulating:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                run.optimizer_step()
                if run.step >= steps:
                    break
        run.close()
        return log_path, params_of(model)


class FabricReconfigurableDriver(FabricDriver):
    """A ReconfigurableLoader is no DataLoader for ``fabric.setup_dataloaders``: the loop
    gives it to ``run.loader`` itself (which moves its batches to ``fabric.device``)."""

    name = "fabric-reconfigurable"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("micro_batch_size", 4), ("dropout", 0.5))
    refused: dict[str, str] = {}

    def data(self, fabric: Fabric) -> Any:
        return ReconfigurableLoader(IndexedDigits(), BATCH_SIZE, shuffle=True, seed=3)


DRIVERS = [FabricDriver, FabricReconfigurableDriver]
