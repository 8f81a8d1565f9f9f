"""One contract for every integration: the same training, live changes, checkpoint and
resume, checked the same way (``tests/test_contract.py``).

Each integration has a driver module here (``tests/contract/<name>.py``) with a
``DRIVERS`` list of :class:`Driver` subclasses. A driver trains the contract's task (the
small dropout model below on :class:`IndexedDigits`, AdamW and a LambdaLR schedule, a
shuffling loader that runs past an epoch's end) through its framework, with the agent
attached, and reports through a :class:`Recorder`: the indices of the samples each
micro-batch trained on, and where each optimizer step ended.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from sklearn.datasets import load_digits
from torch.nn import functional as F

import agent.step.core
from gpuwatch.client import Subscriber
from gpuwatch.history import flat_records

#: Samples in the task's data set: 16 batches of 8, so that the runs cross an epoch.
SAMPLES = 128
BATCH_SIZE = 8


class IndexedDigits(torch.utils.data.Dataset):
    """The first :data:`SAMPLES` digits, each as ``(x, y, index)``: x (64,) float32,
    y () int64, index () int64 (which sample it is, for the data checks)."""

    def __init__(self) -> None:
        digits = load_digits()
        self.x = torch.tensor(digits.data[:SAMPLES], dtype=torch.float32) / 16.0
        self.y = torch.tensor(digits.target[:SAMPLES], dtype=torch.long)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index], torch.tensor(index)


#: Fault injection for the rollback check: while set, a forward under bf16 autocast
#: gives NaN logits (and so a NaN loss and NaN gradients).
NAN_UNDER_BF16 = threading.Event()


class Net(torch.nn.Module):
    """A small classifier with dropout (so a resume must restore the random numbers)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if (NAN_UNDER_BF16.is_set() and torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16):
            return out * float("nan")
        return out


@dataclass
class Poison:
    """Fault injection for the recovery check: while ``micro_batches`` is set, the
    training micro-batches (forwards with gradients, counted in training order from 1
    in :attr:`trained`) whose number is in it have poisoned labels: their one-hot
    labels scaled far out of range (x :data:`POISON_SCALE`, a squared error), which
    wrecks the weights and AdamW's moments for many steps."""

    micro_batches: range | None = None
    trained: int = 0


POISON = Poison()
POISON_SCALE = 1000.0


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if POISON.micro_batches is not None and torch.is_grad_enabled():
        POISON.trained += 1
        if POISON.trained in POISON.micro_batches:
            return F.mse_loss(logits.float(), F.one_hot(y, 10).float() * POISON_SCALE)
    return F.cross_entropy(logits.float(), y)


def optimizer_and_schedule(model: torch.nn.Module) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.95 ** s)


@dataclass
class Recorder:
    """What a driver's run trained: ``trained`` (each micro-batch's sample indices, in
    training order) and ``marks`` (optimizer step -> micro-batches trained by then)."""

    trained: list[tuple[int, ...]] = field(default_factory=list)
    marks: dict[int, int] = field(default_factory=dict)
    #: optimizer step -> its window's micro-batches (a step trained again, after a
    #: rollback, replaces its window)
    windows: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    #: the step at which the training thread waits for ``release`` (None: never)
    hold_at: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    #: the reply to each command sent (:func:`send_at_first_step`), by knob
    replies: dict[str, Any] = field(default_factory=dict)
    #: print ``step N <run log path>`` at the first step (for a parent process)
    announce: bool = False
    #: commands sent later, once each: ``(at_step, knob, value, apply_step)``, sent when
    #: step ``at_step`` is recorded (a ``rewind`` to a checkpoint saved by then)
    later: list[tuple[int, str, Any, int]] = field(default_factory=list)

    def micro_batch(self, index: torch.Tensor) -> None:
        """A micro-batch of samples ``index`` (a 1-d int tensor) is trained."""
        self.trained.append(tuple(int(i) for i in index))

    def window(self, step: int) -> list[tuple[int, ...]]:
        """The micro-batches of optimizer step ``step``'s window (its last training)."""
        return self.windows[step]


@dataclass
class Result:
    """A driver's run: its run log's records, what it trained, its final parameters, its log."""

    records: list[dict[str, Any]]
    recorder: Recorder
    params: list[torch.Tensor]
    log_path: Path

    def steps(self) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in self.records if r["type"] == "step"}

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == "event" and r.get("kind") == kind]


class Driver:
    """One integration's way of training the contract's task.

    Attributes:
        name: the test id. changes: the live changes it offers, as ``(knob, value)``
            in the order the contract applies them (those its framework refuses are
            left out, and ``refused`` names them with a word of the reason).
        refused: ``{knob: a word of the refusal reason}``.
        slow: its runs start a framework whose start-up is long.
        rollback: a rollback puts its training state back (not the knob values only).
        clips_gradients: its loop clips the gradient norm itself (a poisoned window
            then does little harm).
        skips: how a recovery skips data other than the windows trained since
            (``Recovery.skip_windows``): ``"any"`` count (drawn and dropped across
            epochs), only within the kept ``"epoch"``, or a word of the refusal.
    """

    name = ""
    changes: tuple[tuple[str, Any], ...] = ()
    refused: dict[str, str] = {}
    slow = False
    rollback = False
    clips_gradients = False
    skips = "any"

    def train(self, *, steps: int, commands: list[tuple[str, Any, int]],
              checkpoint_dir: Path, resume_from: Path | None,
              recorder: Recorder) -> tuple[Path, list[torch.Tensor]]:
        """Train until optimizer step ``steps`` (from a fresh model, or from
        ``resume_from``), sending ``commands`` (``(knob, value, apply_step)``) once the
        run's knobs are bound (:func:`send_at_first_step`), checkpoints into
        ``checkpoint_dir``; return the run log's path and the final parameters."""
        raise NotImplementedError


def send_at_first_step(monitor: Any, commands: list[tuple[str, Any, int]],
                       recorder: Recorder) -> None:
    """Mark each step's end in ``recorder``, and at the first step recorded send
    ``commands`` through real sockets (their replies in ``recorder.replies``)."""
    from agent.wire.commands import send_command

    pending = list(commands)
    ended = [0]  # micro-batches trained when the latest step ended

    def listener(record: dict[str, Any]) -> None:
        if record["type"] != "step":
            return
        step = record["step"]
        recorder.marks[step] = len(recorder.trained)
        recorder.windows[step] = recorder.trained[ended[0]:]
        ended[0] = len(recorder.trained)
        if step == recorder.hold_at:
            recorder.hold_at = None  # (once: a step trained again does not wait)
            assert recorder.release.wait(60), "not released"
        if recorder.announce and len(recorder.marks) == 1:
            print(f"step {record['step']} {monitor.info.log_path}", flush=True)
        while pending:
            knob, value, step = pending.pop(0)
            recorder.replies[knob] = send_command(monitor.info, knob, value,
                                                  apply_step=step, timeout_s=10)
        for entry in [entry for entry in recorder.later if entry[0] == record["step"]]:
            recorder.later.remove(entry)
            _, knob, value, apply_step = entry
            recorder.replies[knob] = send_command(monitor.info, knob, value,
                                                  apply_step=apply_step, timeout_s=10)

    monitor.add_listener(listener)


def run(driver: Driver, *, steps: int, commands: list[tuple[str, Any, int]],
        checkpoint_dir: Path, resume_from: Path | None = None,
        recorder: Recorder | None = None) -> Result:
    """One run of ``driver`` (see :meth:`Driver.train`)."""
    recorder = recorder or Recorder()
    log_path, params = driver.train(steps=steps, commands=commands,
                                    checkpoint_dir=checkpoint_dir, resume_from=resume_from,
                                    recorder=recorder)
    return Result(list(flat_records(log_path)), recorder, params, log_path)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().float() for p in model.parameters()]


def all_drivers() -> list[Driver]:
    """Every driver of every module in this package."""
    drivers: list[Driver] = []
    for module in pkgutil.iter_modules(__path__):
        if module.name == "__main__":
            continue
        drivers.extend(cls() for cls in importlib.import_module(
            f"{__name__}.{module.name}").DRIVERS)
    return drivers


def run_diverging(driver: Driver, checkpoint_dir: Path,
                  also: tuple[tuple[str, Any], ...] = ()) -> Result:
    """A run of ``driver`` to step 14 with ``precision=bf16`` (and the changes ``also``,
    ``(knob, value)``) at step 7 under the fault :data:`NAN_UNDER_BF16` (the loss NaN
    from there): the guard rolls the changes back; the training waits at step 12 until
    its ``rollback`` event is published (the guard decides on the I/O thread, from the
    published steps)."""
    recorder = Recorder(hold_at=12)
    decided = threading.Event()

    def watch(info: Any) -> None:
        with Subscriber(info) as sub:
            while not decided.is_set():
                message = sub.recv(timeout_s=0.5)
                if message and message["type"] == "event" and message["body"].get(
                        "kind") == "rollback":
                    decided.set()
                    recorder.release.set()

    started = agent.step.core.Agent.start  # the watcher subscribes as the run starts

    def start_and_watch(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = started(self, *args, **kwargs)
        threading.Thread(target=watch, args=(self.info,), daemon=True).start()
        return result

    agent.step.core.Agent.start = start_and_watch
    NAN_UNDER_BF16.set()
    try:
        return run(driver, steps=14, commands=[("precision", "bf16", 7)] + [
            (knob, value, 7) for knob, value in also],
                   checkpoint_dir=checkpoint_dir, recorder=recorder)
    finally:
        agent.step.core.Agent.start = started
        NAN_UNDER_BF16.clear()
        decided.set()


def run_poisoned(driver: Driver, checkpoint_dir: Path, *, steps: int, poisoned: range | None,
                 policy: Any = None, hold_at: int | None = None,
                 commands: Sequence[tuple[str, Any, int]] = ()) -> Result:
    """A run of ``driver`` to step ``steps`` whose micro-batches ``poisoned`` (their
    numbers in training order, from 1; None: none) have poisoned labels (:class:`Poison`);
    with ``policy`` (an :class:`agent.control.recovery.Recovery`) the run has it and
    ``recover=on`` from step 3. With ``hold_at``, the training waits at that step until
    rank 0's spike watch found the spike (it decides on the I/O thread, from the
    published steps, and the kept state from before the spike must still be in the
    ring when the recovery applies). ``commands``: sent as well (:func:`run`'s)."""
    import time

    recorder = Recorder(hold_at=hold_at)
    made = agent.step.core.Agent.__init__
    agents: list[Any] = []

    def with_policy(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, recover=policy, **kwargs)
        agents.append(self)

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not recorder.release.is_set():
            if agents and agents[0].spikes.waiting_since is not None:
                recorder.release.set()
            time.sleep(0.01)

    agent.step.core.Agent.__init__ = with_policy  # type: ignore[method-assign]
    POISON.micro_batches, POISON.trained = poisoned or range(0), 0
    watcher = threading.Thread(target=watch, daemon=True)
    if hold_at is not None:
        watcher.start()
    try:
        return run(driver, steps=steps,
                   commands=([("recover", "on", 3)] if policy else []) + list(commands),
                   checkpoint_dir=checkpoint_dir, recorder=recorder)
    finally:
        agent.step.core.Agent.__init__ = made  # type: ignore[method-assign]
        POISON.micro_batches = None
        recorder.release.set()
