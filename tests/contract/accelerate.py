"""The contract's driver for a hand-written loop on an ``accelerate.Accelerator``
(``agent.attach(accelerator)``): the usual loop (``accelerator.accumulate``,
``accelerator.backward``, ``accelerator.clip_grad_norm_`` at the window's end, the
optimizer and scheduler stepped every micro-batch, accelerate skipping the steps inside
a window) that stops on ``run.step``: over a prepared shuffling DataLoader, and over a
ReconfigurableLoader (``micro_batch_size`` and the loader knobs live)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import agent
from gpuopt.loader import ReconfigurableLoader
from tests.contract import (BATCH_SIZE, Driver, IndexedDigits, Net, Recorder, loss_fn,
                            optimizer_and_schedule, params_of, send_at_first_step)

#: the threshold of the loop's own ``accelerator.clip_grad_norm_``
LOOP_MAX_NORM = 1.0


class AccelerateDriver(Driver):
    rollback = True
    name = "accelerate"
    clips_gradients = True
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "ReconfigurableLoader"}

    def data(self, accelerator: Any) -> Any:
        """The loop's data: accelerate's prepared DataLoader (a RandomSampler that draws
        each epoch's seed from torch's generator)."""
        return accelerator.prepare(DataLoader(IndexedDigits(), batch_size=BATCH_SIZE,
                                              shuffle=True))

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)  # accelerate's process-wide state: each run
        GradientState._reset_state()  # starts from none, as a fresh process would
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
        model = Net(seed=0 if resume_from is None else 1)  # the checkpoint's weights win
        optimizer, scheduler = optimizer_and_schedule(model)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        loader = self.data(accelerator)
        run = agent.attach(accelerator, name=f"contract-{self.name}",
                           checkpoint_dir=checkpoint_dir, resume_from=resume_from)
        send_at_first_step(run.agent, commands, recorder)
        log_path = Path(run.agent.info.log_path)
        while run.step < steps:  # epoch after epoch; a resumed run goes on in its epoch
            for x, y, index in run.loader(loader):
                recorder.micro_batch(index)
                with accelerator.accumulate(model):
                    loss = loss_fn(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), LOOP_MAX_NORM)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                run.micro_batch(loss)
                if run.step >= steps:
                    break
        run.close()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return log_path, params_of(model)


class AccelerateReconfigurableDriver(AccelerateDriver):
    name = "accelerate-reconfigurable"
    changes = (*AccelerateDriver.changes, ("micro_batch_size", 4))
    refused = {}

    def data(self, accelerator: Any) -> Any:
        """A ReconfigurableLoader (not prepared: it orders its epochs itself)."""
        return ReconfigurableLoader(IndexedDigits(), BATCH_SIZE, shuffle=True, seed=3)


DRIVERS = [AccelerateDriver, AccelerateReconfigurableDriver]
