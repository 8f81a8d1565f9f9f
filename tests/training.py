"""Shared pieces of the tests that train for real: digits data, small models (one with
repeated blocks, one that refuses saved-tensor hooks), a gate that pauses the training
thread, and a message collector."""

import threading

import torch
from sklearn.datasets import load_digits

from gpuwatch.client import Subscriber, send_command


def digits_loader(batch_size=16, n=1024):
    digits = load_digits()
    x = torch.tensor(digits.data[:n], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:n], dtype=torch.long)
    return list(zip(x.split(batch_size), y.split(batch_size)))


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))


class BlockNet(torch.nn.Module):
    """The digits classifier with repeated residual ``blocks`` (for checkpointing),
    without dropout: a window's update is a function of its micro-batches alone."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        super().__init__()
        self.embed = torch.nn.Linear(64, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class FuncInForward(torch.nn.Module):
    """:func:`model` behind BatchNorm, dropout and a ``torch.func.grad`` in ``forward``:
    torch.func refuses saved-tensor hooks, so the Trainer's activation meter must step
    aside, after the BatchNorm statistics moved and dropout drew its mask."""

    def __init__(self, seed=0):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(64)
        self.dropout = torch.nn.Dropout(0.2)
        self.net = model(seed)

    def forward(self, x):
        x = self.dropout(self.norm(x))
        smooth = torch.func.grad(lambda t: torch.nn.functional.softplus(t).sum())(x)
        return self.net(x + 0.1 * smooth)


class Gate:
    """Trainer callback that lets the test pace the training: the loop blocks at step
    ``hold_at`` until released, so commands can be sent at a known point."""

    def __init__(self, hold_at):
        self.hold_at = hold_at
        self.reached = threading.Event()
        self.release = threading.Event()

    def on_optimizer_step(self, trainer, stats):
        if stats.step == self.hold_at:
            self.reached.set()
            assert self.release.wait(30)


def start(trainer, **fit):
    thread = threading.Thread(target=trainer.fit, kwargs=fit, daemon=True)
    thread.start()
    return thread


def greeted(sub, timeout_s=10):
    """The first message ``sub`` gets (the run greets each new subscriber with its hello):
    once it has come, the subscription has reached the run and nothing it publishes after
    is missed (ZeroMQ drops what a publisher sends before a subscription arrives)."""
    message = sub.recv(timeout_s)
    assert message is not None, f"no greeting within {timeout_s} s"
    return message


def messages(sub, until, timeout_s=30):
    seen = []
    while True:
        message = sub.recv(timeout_s)
        assert message is not None, f"no message within {timeout_s} s; saw {seen[-5:]}"
        seen.append(message)
        if until(message):
            return seen


def resume_when_paused(info):
    """A thread that sends pause=off once the run ``info`` says pause=on applied; the
    thread and the list its reply goes to."""
    subscriber = Subscriber(info)  # connected before the pause can apply
    replies = []

    def resume():
        with subscriber as sub:
            for message in sub:
                body = message.get("body") or {}
                if (message["type"] == "event" and body.get("kind") == "applied"
                        and body.get("knob") == "pause"):
                    replies.append(send_command(info, "pause", "off"))
                    return

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread, replies
