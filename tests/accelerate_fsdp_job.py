"""accelerate's FSDP2 plugin on a CPU (gloo), for the test of what gpuwatch meets there:
``torchrun --nproc-per-node 2 tests/accelerate_fsdp_job.py OUT plain|cpu|hf``.

``plain``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``;
``cpu``: the same with ``cpu=True``. One optimizer step attached (``agent.attach``); each
rank saves ``OUT/<mode>-rank<N>.pt``: accelerate's distributed type and number of
processes, whether the prepared model's parameters are DTensors, the run's rank and
world size, the refused knobs' reasons and the run log's warnings. ``hf``: the HF
Trainer with ``fsdp=True`` (version 2) and ``use_cpu=True``, through that plugin
(its refused knobs too).
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

import agent
from gpuwatch.history import flat_records


def main(out: Path, mode: str) -> None:
    if mode == "hf":
        return hf(out)
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                              cpu=mode == "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    run = agent.attach(accelerator, name=f"accelerate-fsdp-{mode}")
    for x in run.loader([torch.randn(4, 8)]):
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    run.close()
    torch.save({
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "dtensors": any(isinstance(p, DTensor) for p in model.parameters()),
        "rank": run.agent.rank, "world_size": run.agent.world_size,
        "unsupported": run.agent.knobs.unsupported,
        "warnings": [record["text"] for record in flat_records(run.agent.info.log_path)
                     if record["type"] == "event" and record.get("kind") == "warning"]},
        out / f"{mode}-rank{run.agent.rank}.pt")


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


def hf(out: Path) -> None:
    """The HF Trainer with ``fsdp=`` (FSDP2 through accelerate's plugin), ``use_cpu``."""
    from transformers import Trainer, TrainingArguments
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(16)]
    args = TrainingArguments(output_dir=str(out / "hf"), fsdp=True, fsdp_config={"version": 2},
                             use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=data)
    watched = agent.attach(trainer, name="hf-fsdp")
    trainer.train()
    torch.save({
        "distributed_type": trainer.accelerator.distributed_type.value,
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "dtensors": any(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "unsupported": watched.knobs.unsupported,
        "warnings": [record["text"] for record in flat_records(watched.info.log_path)
                     if record["type"] == "event" and record.get("kind") == "warning"]},
        out / f"hf-rank{watched.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
