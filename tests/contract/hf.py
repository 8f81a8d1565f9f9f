"""The contract's driver for Hugging Face's ``transformers.Trainer``: the task's model as
HF calls a model (keyword inputs, a loss in its outputs), the samples as dicts through
HF's own shuffling sampler, the task's AdamW and LambdaLR given to the Trainer, and a
resume through ``trainer.train(resume_from_checkpoint=PATH)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import agent  # noqa: E402
from tests.contract import (BATCH_SIZE, Driver, IndexedDigits, Net, Recorder,  # noqa: E402
                            loss_fn, optimizer_and_schedule, params_of, send_at_first_step)


class DigitDicts(IndexedDigits):
    """The task's samples as HF's collator wants them: ``{"x", "labels", "index"}``."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x, y, i = super().__getitem__(index)
        return {"x": x, "labels": y, "index": i}


class Classifier(torch.nn.Module):
    """The task's :class:`tests.contract.Net` as HF calls it: ``forward(x=, labels=,
    index=)`` returns ``{"loss": ...}``; each training micro-batch's sample indices go to
    the recorder."""

    def __init__(self, seed: int, recorder: Recorder) -> None:
        super().__init__()
        self.net = Net(seed)
        self.recorder = recorder

    def forward(self, x: torch.Tensor, labels: torch.Tensor,
                index: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.recorder.micro_batch(index)
        return {"loss": loss_fn(self.net(x), labels)}


class HFDriver(Driver):
    rollback = True
    name = "hf"
    changes = (("accum_steps", 3), ("lr_scale", 0.5), ("max_grad_norm", 0.3),
               ("precision", "bf16"), ("dropout", 0.5))
    refused = {"micro_batch_size": "per_device_train_batch_size"}
    skips = "epoch"  # HF makes an epoch's order only when it starts it

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        from transformers import Trainer, TrainingArguments

        model = Classifier(0 if resume_from is None else 1, recorder)  # HF's checkpoint wins
        args = TrainingArguments(
            output_dir=str(checkpoint_dir / "hf-output"), use_cpu=True, report_to=[],
            logging_strategy="no", save_strategy="no", disable_tqdm=True, max_steps=steps,
            per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=2,
            dataloader_num_workers=0, remove_unused_columns=False, max_grad_norm=0.0,
            seed=3)
        trainer = Trainer(model=model, args=args, train_dataset=DigitDicts(),
                          optimizers=optimizer_and_schedule(model))
        monitor = agent.attach(trainer, name=f"contract-{self.name}",
                               checkpoint_dir=checkpoint_dir)
        send_at_first_step(monitor, commands, recorder)
        log_path = Path(monitor.info.log_path)
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
        return log_path, params_of(model)


DRIVERS = [HFDriver]
