"""A Lightning Trainer job with ``ModelParallelStrategy`` (FSDP2, gloo, CPU) for the
tests of every knob on a sharded module:
``torchrun --nproc-per-node 2 tests/lightning_fsdp_job.py OUT knobs|resume``.

The module is :func:`tests.jobs.make_model`'s ``Sequential``, each block and the whole
of it ``fully_shard``-ed in ``configure_model`` on the strategy's data-parallel mesh;
the data a fixed random set that Lightning's sampler splits between the ranks.
``knobs``: rank 0 sends :data:`COMMANDS` one at a time, and a callback checks each
window on every rank: against the update of an unsharded copy
(:class:`tests.jobs.UnshardedCopy`), and that its gradients are reduced at its last
micro-batch only; ``checkpoint=now`` is Lightning's sharded checkpoint. ``resume``:
``fit(ckpt_path=)`` from it, on to the same step. Each rank saves
``OUT/<mode>-rank<N>.pt`` (each step's full parameters and knob values, the replies, the
refused knobs' reasons, how many blocks the checkpointing knob wraps and whether it is
on at the end)."""

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import agent
from agent.integrations.lightning import GpuwatchCallback
from tests.jobs import (BASE_LR, SHARDED_STEPS, UnshardedCopy, full_params, make_model,
                        send_listed)

COMMANDS = {2: ("accum_steps", 3), 4: ("lr_scale", 0.5), 6: ("weight_decay", 0.2),
            8: ("max_grad_norm", 0.05), 10: ("checkpointing", True),
            12: ("precision", "bf16"), 14: ("checkpoint", "now"), 15: ("precision", "fp16"),
            16: ("kernels", "compile")}


class Sharded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=BASE_LR, weight_decay=0.0)


class Check(L.Callback):
    """Each window against the unsharded copy, its gradients' reduction, the replies."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.reference = UnshardedCopy()
        self.micro_batches: list[Any] = []
        self.synced: list[bool] = []
        self.knobs: dict[str, Any] = {}
        self.steps: dict[int, dict[str, Any]] = {}
        self.replies: dict[str, Any] = {}
        self.agent: Any = None
        self.last_step = 0
        self.checkpointed: tuple[int, bool] | None = None

    def on_train_start(self, trainer: L.Trainer, module: Any) -> None:
        self.last_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        [watching] = [c for c in trainer.callbacks if isinstance(c, GpuwatchCallback)]
        checkpointing = watching._run.checkpointing  # (the run's: bound at train start)
        self.checkpointed = (len(checkpointing), checkpointing.enabled)

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any,
                             index: int) -> None:
        if not self.micro_batches:
            self.knobs = self.agent.knobs.values()
        self.micro_batches.append(batch)

    def on_after_backward(self, trainer: L.Trainer, module: Any) -> None:
        synced = {p.grad is not None for p in module.parameters()}
        assert len(synced) == 1, synced
        self.synced.append(synced.pop())

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any,
                           index: int) -> None:
        step = trainer.global_step
        if step == self.last_step:
            return  # (a window goes on)
        self.last_step = step
        assert self.synced == [False] * (len(self.synced) - 1) + [True], self.synced
        if self.mode == "knobs":
            self.reference.check(module, self.micro_batches, self.knobs, trainer.world_size)
        self.steps[step] = {"params": full_params(module), "knobs": self.knobs}
        self.micro_batches, self.synced = [], []
        if self.mode == "knobs" and trainer.global_rank == 0:
            send_listed(self.agent.info, COMMANDS, step, self.replies)


def main(out: Path, mode: str) -> None:
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4 * 2 * 60, 8), torch.randn(4 * 2 * 60, 8))
    check = Check(mode)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=SHARDED_STEPS,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
                        accumulate_grad_batches=2, callbacks=[check], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    check.agent = agent.attach(trainer, name=f"lightning-fsdp-{mode}",
                               checkpoint_dir=out / "checkpoints")
    saved = next((out / "checkpoints").glob("step-*")) if mode == "resume" else None
    trainer.fit(Sharded(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=saved)
    torch.save({"steps": check.steps, "replies": check.replies,
                "checkpointed": check.checkpointed,
                "unsupported": check.agent.knobs.unsupported},
               out / f"{mode}-rank{trainer.global_rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
