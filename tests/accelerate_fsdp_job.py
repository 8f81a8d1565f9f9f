"""accelerate's FSDP2 plugin on a CPU (gloo), for the test of what gpuwatch meets there:
``torchrun --nproc-per-node 2 tests/accelerate_fsdp_job.py OUT plain|cpu``.

``plain``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``;
``cpu``: the same with ``cpu=True``. One optimizer step attached (``agent.attach``); each
rank saves ``OUT/<mode>-rank<N>.pt``: accelerate's distributed type and number of
processes, whether the prepared model's parameters are DTensors, the run's rank and
world size, the refused knobs' reasons and the run log's warnings.
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

import agent
from gpuwatch.history import flat_records


def main(out: Path, mode: str) -> None:
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


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
