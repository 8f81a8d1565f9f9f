"""The contract's drivers for hand-written loops (:func:`agent.session`): data through
``run.loader`` (a ReconfigurableLoader, or a plain shuffling DataLoader), and a
nanoGPT-style loop whose ``get_batch()`` draws random samples and is called for the next
window before the boundary (fetch-ahead) through ``run.timed``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

import agent
from gpuopt.loader import ReconfigurableLoader
from tests.contract import (BATCH_SIZE, SAMPLES, Driver, IndexedDigits, Net, Recorder,
                            loss_fn, optimizer_and_schedule, params_of, send_at_first_step)


def step(run: Any, optimizer: Any, scheduler: Any) -> None:
    """The window's end as such loops write it: the optimizer and schedule step through
    the run's GradScaler, then the boundary."""
    run.scaler.step(optimizer)
    run.scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    run.optimizer_step()


class LoopDriver(Driver):
    rollback = True
    name = "loop"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("micro_batch_size", 4), ("dropout", 0.5))

    def batches(self, run: Any) -> Iterator[Any]:
        return iter(run.loader(ReconfigurableLoader(IndexedDigits(), BATCH_SIZE,
                                                    shuffle=True, seed=3), epochs=None))

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        model = Net(seed=0 if resume_from is None else 1)
        optimizer, scheduler = optimizer_and_schedule(model)
        run = agent.session(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                            precision="fp32", accum_steps=2, max_grad_norm=0.0,
                            checkpoint_dir=checkpoint_dir, resume_from=resume_from,
                            name=f"contract-{self.name}")
        send_at_first_step(run.agent, commands, recorder)
        log_path = Path(run.agent.info.log_path)
        self.loop(run, model, optimizer, scheduler, steps, recorder)
        run.close()
        return log_path, params_of(model)

    def loop(self, run: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any,
             steps: int, recorder: Recorder) -> None:
        batches = self.batches(run)
        while run.step < steps:
            for _ in range(run.accum_steps):
                x, y, index = next(batches)
                recorder.micro_batch(index)
                with run.autocast:
                    loss = loss_fn(model(x), y) / run.accum_steps
                run.scaler.scale(loss).backward()
            step(run, optimizer, scheduler)


class LoopDataLoaderDriver(LoopDriver):
    name = "loop-dataloader"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "ReconfigurableLoader"}

    def batches(self, run: Any) -> Iterator[Any]:
        return iter(run.loader(DataLoader(IndexedDigits(), batch_size=BATCH_SIZE,
                                          shuffle=True), epochs=None))


class LoopFetchAheadDriver(LoopDriver):
    """nanoGPT's shape: ``X, Y = get_batch()`` before the loop and again inside the
    micro-step loop, after the forward: at each boundary the next window's first batch
    has been fetched (and its random indices drawn) already."""

    name = "loop-fetch-ahead"
    rollback = False  # the loop holds the batch it fetched ahead: the event says so
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "ReconfigurableLoader"}

    def loop(self, run: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any,
             steps: int, recorder: Recorder) -> None:
        data = IndexedDigits()

        def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            index = torch.randint(SAMPLES, (BATCH_SIZE,))
            return data.x[index], data.y[index], index

        get_batch = run.timed(get_batch)
        x, y, index = get_batch("train")
        while run.step < steps:
            for _ in range(run.accum_steps):
                recorder.micro_batch(index)
                with run.autocast:
                    loss = loss_fn(model(x), y) / run.accum_steps
                x, y, index = get_batch("train")
                run.scaler.scale(loss).backward()
            step(run, optimizer, scheduler)


DRIVERS = [LoopDriver, LoopDataLoaderDriver, LoopFetchAheadDriver]
