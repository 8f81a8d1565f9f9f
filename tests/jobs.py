"""What the tests' torchrun jobs share, on both sides of the launch.

The tests' side: :func:`torchrun` starts a script under ``torchrun --nproc-per-node 2``
(gloo, CPU), :func:`finish` waits for jobs to end well, :func:`run_job` does both.

The jobs' side (inside each rank's process):

- the contract's task (:mod:`tests.contract`: its Net, AdamW and LambdaLR, windows of 2
  micro-batches) in DDP (or sharded) over a DistributedSampler's shard, in a
  hand-written loop (``tests/ddp_*_job.py``): :class:`ContractLoop`; in Fabric's loop
  under ``strategy="ddp"``: :class:`ContractFabricLoop`;
- a ``Sequential`` of three blocks, sharded (``tests/*fsdp_job.py``): :func:`make_model`,
  :func:`full_params`, each window checked against an unsharded copy updated by hand
  (:class:`UnshardedCopy`), the knob changes rank 0 sends (:func:`send_listed`) and the
  events of the run log (:func:`logged_events`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import agent
from agent.wire.commands import send_command
from gpuwatch.history import flat_records
from tests.contract import (BATCH_SIZE, IndexedDigits, Net, loss_fn, optimizer_and_schedule,
                            params_of)
from tests.contract.loop import step

ROOT = Path(__file__).resolve().parent.parent
#: How long a job may take before :func:`finish` kills it (s).
JOB_TIMEOUT_S = 300

# ------------------------------------------------------------------ the tests' side


def torchrun(*args: str) -> subprocess.Popen:
    """Start ``args`` (a script and its arguments) under ``torchrun --nproc-per-node 2``.

    Standalone rendezvous, one CPU thread a rank, this repository importable; its output
    (stdout and stderr) on a pipe; in a session of its own, so that :func:`finish` can
    kill it with its ranks."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        start_new_session=True)


def finish(*jobs: subprocess.Popen) -> list[str]:
    """Wait for each of ``jobs`` to end with exit status 0; their outputs, in order.

    A job still running when this returns or raises is killed with its ranks.

    Raises:
        AssertionError: a job failed (its arguments and output in the message).
        subprocess.TimeoutExpired: one ran past :data:`JOB_TIMEOUT_S`."""
    try:
        outputs = []
        for job in jobs:
            output = job.communicate(timeout=JOB_TIMEOUT_S)[0]
            assert job.returncode == 0, (job.args, output)
            outputs.append(output)
        return outputs
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def run_job(*args: str) -> str:
    """``args`` under ``torchrun --nproc-per-node 2``, to its end (:func:`finish`); its output."""
    return finish(torchrun(*args))[0]


# ------------------------------------------------------------------ the contract's task


class ContractLoop:
    """The contract's task on this rank: its process group (gloo), a :class:`Net` in DDP
    (``wrap="ddp"``) or sharded by ``fully_shard`` (``"fsdp"``), and a hand-written loop's
    run (``agent.session`` with the contract's optimizer and schedule, fp32, windows of 2,
    no clipping, ``name`` and ``options``).

    Attributes:
        rank: this rank. net: the model (``model``: it wrapped). run, optimizer,
        scheduler: the loop's.
    """

    def __init__(self, name: str, *, seed: int = 0, wrap: str = "ddp",
                 **options: Any) -> None:
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()
        self.net = Net(seed=seed)
        self.model = (fully_shard(self.net) if wrap == "fsdp"
                      else torch.nn.parallel.DistributedDataParallel(self.net))
        self.optimizer, self.scheduler = optimizer_and_schedule(self.model)
        self.run = agent.session(model=self.model, optimizer=self.optimizer,
                                 lr_scheduler=self.scheduler, precision="fp32",
                                 accum_steps=2, max_grad_norm=0.0, name=name, **options)
        self._batches: Iterator[Any] | None = None

    def train_window(self) -> tuple[int, float]:
        """Train one window of ``run.accum_steps`` micro-batches, then its boundary.

        The micro-batches are this rank's shard's (a DistributedSampler's), through
        ``run.loader``, endless; made at the first window. Returns ``(the step trained,
        its window loss)``: the step is read before the boundary, where a rewind, a
        rollback or a recovery moves ``run.step``."""
        if self._batches is None:
            data = DataLoader(IndexedDigits(), batch_size=BATCH_SIZE,
                              sampler=DistributedSampler(IndexedDigits(), shuffle=True,
                                                         seed=3))
            self._batches = iter(self.run.loader(data, epochs=None))
        window = 0.0
        for _ in range(self.run.accum_steps):
            x, y, _index = next(self._batches)
            with self.run.autocast:
                loss = loss_fn(self.model(x), y) / self.run.accum_steps
            self.run.scaler.scale(loss).backward()
            window += loss.item()
        trained = self.run.step + 1
        step(self.run, self.optimizer, self.scheduler)
        return trained, window

    def params(self) -> list[torch.Tensor]:
        """The model's parameters, whole (a sharded one's gathered from every rank)."""
        return [p.full_tensor() if isinstance(p, DTensor) else p for p in params_of(self.net)]

    def snapshot_at_step_4_then_train_to_6(self) -> dict[str, Any]:
        """Train to step 4, keep the state (``run.state_snapshot()``), train to step 6.

        Returns the state kept at step 4, for a rewind to it."""
        for _ in range(4):
            self.train_window()
        snapshot = self.run.state_snapshot()
        for _ in range(2):
            self.train_window()
        return snapshot

    def rewind_to_step_4(self, snapshot: dict[str, Any], cause: str) -> dict[str, Any]:
        """``run.rewind_state(snapshot, 4)`` on this rank, and what came of it.

        Returns ``raised`` (None, or ``"<type>: <text>"`` of what it raised), ``step``,
        ``branch`` and ``stopping`` after it, and the parameters ``before`` and ``after``
        (clones)."""
        before = [p.detach().clone() for p in self.params()]
        try:
            self.run.rewind_state(snapshot, 4, source="test", cause=cause)
            raised = None
        except Exception as exc:  # noqa: BLE001 -- what the tests check
            raised = f"{type(exc).__name__}: {exc}"
        return {"raised": raised, "step": self.run.step, "branch": self.run.branch,
                "stopping": self.run.stopping, "before": before,
                "after": [p.detach().clone() for p in self.params()]}

    def close(self, saved: dict[str, Any], path: Path) -> None:
        """Close the run, save ``saved`` to ``path`` and leave the process group."""
        self.run.close()
        torch.save(saved, path)
        dist.destroy_process_group()


class ContractFabricLoop:
    """The contract's task on this rank in Lightning Fabric's loop: ``Fabric(strategy="ddp",
    devices=2)`` on the CPU (gloo, under torchrun), the :class:`Net` and optimizer through
    ``fabric.setup``, a shuffling DataLoader through ``fabric.setup_dataloaders`` (its
    DistributedSampler), and ``agent.attach`` of the Fabric (the contract's schedule,
    windows of 2, no clipping, ``name`` and ``options``). Attributes and methods as
    :class:`ContractLoop`'s (:meth:`train_window` returns the step only)."""

    def __init__(self, name: str, **options: Any) -> None:
        from lightning.fabric import Fabric

        self.fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        self.fabric.launch()
        self.rank = self.fabric.global_rank
        self.net = Net(seed=0)
        optimizer, self.scheduler = optimizer_and_schedule(self.net)
        self.model, self.optimizer = self.fabric.setup(self.net, optimizer)
        self.run = agent.attach(self.fabric, lr_scheduler=self.scheduler, accum_steps=2,
                                max_grad_norm=0.0, name=name, **options)
        self._batches: Iterator[Any] | None = None

    def train_window(self) -> int:
        """Train one window as Fabric's loop does (``no_backward_sync`` while
        ``run.is_accumulating``, ``fabric.backward``), then its boundary; returns the step
        trained (read before the boundary)."""
        if self._batches is None:
            data = self.fabric.setup_dataloaders(DataLoader(
                IndexedDigits(), batch_size=BATCH_SIZE, shuffle=True))
            self._batches = iter(self.run.loader(data, epochs=None))
        accumulating = True
        while accumulating:
            x, y, _index = next(self._batches)
            accumulating = self.run.is_accumulating
            with self.fabric.no_backward_sync(self.model, enabled=accumulating):
                self.fabric.backward(loss_fn(self.model(x), y) / self.run.accum_steps)
        trained = self.run.step + 1
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.run.optimizer_step()
        return trained

    def params(self) -> list[torch.Tensor]:
        """The model's parameters."""
        return params_of(self.net)

    def close(self, saved: dict[str, Any], path: Path) -> None:
        """Close the run, save ``saved`` to ``path`` and leave the process group."""
        self.run.close()
        torch.save(saved, path)
        dist.destroy_process_group()


# ------------------------------------------------------------------ a sharded model

#: The sharded jobs' optimizer steps, and their AdamW's learning rate.
SHARDED_STEPS = 18
BASE_LR = 0.01


def make_model() -> torch.nn.Sequential:
    """Three ``Linear(8, 8)`` and ``Tanh`` blocks, the same weights on every call (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                 for _ in range(3)])


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The sharded ``model``'s parameters, whole (gathered from every rank), copied."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def by_hand(reference: torch.nn.Module, optimizer: torch.optim.Optimizer,
            micro_batches: list[tuple[torch.Tensor, torch.Tensor]], knobs: dict[str, Any],
            world: int) -> None:
    """One window's update of the unsharded ``reference``: every rank's micro-batches
    (gathered), each rank's loss divided by the window and by the ranks (FSDP2 averages
    the reduced gradients), the knob values of the window set by hand."""
    accum = len(micro_batches)
    for x, y in micro_batches:
        gathered = [[torch.empty_like(x) for _ in range(world)] for _ in range(2)]
        dist.all_gather(gathered[0], x)
        dist.all_gather(gathered[1], y)
        for rank_x, rank_y in zip(*gathered, strict=True):
            dtype = torch.bfloat16 if knobs["precision"] == "bf16" else torch.float32
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = torch.nn.functional.mse_loss(reference(rank_x), rank_y)
            (loss / accum / world).backward()
    params = list(reference.parameters())
    if knobs["max_grad_norm"] > 0:
        norm = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in params]))
        coefficient = torch.clamp(knobs["max_grad_norm"] / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coefficient)
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * knobs["lr_scale"]
        group["weight_decay"] = knobs["weight_decay"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class UnshardedCopy:
    """:func:`make_model` unsharded, with AdamW (:data:`BASE_LR`, no decay), that each
    window updates by hand (:meth:`check`) to compare a sharded model with."""

    def __init__(self) -> None:
        self.model = make_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=BASE_LR,
                                           weight_decay=0.0)

    def check(self, model: torch.nn.Module,
              micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
              knobs: dict[str, Any], world: int) -> None:
        """Update the copy by hand for the window (:func:`by_hand`) and check that the
        sharded ``model``'s full parameters equal its (fp32 tolerances: the reduction
        sums in another order).

        Raises:
            AssertionError: a parameter differs."""
        by_hand(self.model, self.optimizer, micro_batches, knobs, world)
        for mine, theirs in zip(full_params(model), self.model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs.detach(), rtol=2e-5, atol=2e-6)


def send_listed(info: Any, commands: dict[int, tuple[str, Any]], step_now: int,
                replies: dict[str, Any]) -> None:
    """Send the command ``commands`` lists at step ``step_now`` (if any), to every rank for
    2 steps later; its reply goes to ``replies`` by knob (``precision=<value>`` for
    precision, which is sent more than once)."""
    if step_now not in commands:
        return
    name, value = commands[step_now]
    replies[name if name != "precision" else f"precision={value}"] = send_command(
        info, name, value, apply_step=step_now + 2, timeout_s=30)


def logged_events(log_path: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """The ``kind``, ``knob``, ``step`` and ``text`` of the run log's events of ``kinds``."""
    return [{key: record.get(key) for key in ("kind", "knob", "step", "text")}
            for record in flat_records(log_path)
            if record["type"] == "event" and record.get("kind") in kinds]
