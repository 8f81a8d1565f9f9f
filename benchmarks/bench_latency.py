"""Command latency: send -> reply, and send -> applied, for a run at 100 optimizer steps/s.

    python benchmarks/bench_latency.py [--commands 200]

A real training loop (the agent attached through ``agent.session``, a small MLP on
scikit-learn's digits, each step padded to 10 ms) runs in a child process. This process
is the client: it sends ``precision`` commands (fp32 <-> bf16) one at a time, measuring
the round trip to the reply and, in optimizer steps of the run's own counter, how long
until the command applied: the step of its ``applied`` event (the first step that ran
with the new value) minus the ``step`` in its reply (the last step the run had completed
when it accepted the command). The client's view of the telemetry plays no part: steps
travel in batches, up to one I/O wake-up (100 ms, 10 steps here) behind the run.

Last line: ``RESULT reply_ms_p50=<a> reply_ms_p99=<b> applied_steps_max=<c>``
(targets: reply p99 under 20 ms; applied at the next optimizer-step boundary, i.e. the
step after the one running when the command arrived: ``applied_steps_max <= 2``).

    python benchmarks/bench_latency.py --short    # 20 commands, a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from agent.wire import runs
from gpuwatch.client import Subscriber, send_command

TRAINING = """
import time, torch
from sklearn.datasets import load_digits
import agent
from gpuopt import MixedPrecision
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
batches = list(zip(x.split(32), y.split(32)))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
precision = MixedPrecision("cpu")

def forever():
    while True:
        yield from batches

with agent.session(name="bench-latency", model=model, mixed_precision=precision) as run:
    print("ready", flush=True)
    deadline = time.perf_counter()
    for inputs, targets in run.loader(forever()):
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad()
        deadline += 0.010  # 100 steps/s: pad the step to 10 ms
        time.sleep(max(0.0, deadline - time.perf_counter()))
        run.optimizer_step(loss)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--short", action="store_true", help="20 commands")
    args = parser.parse_args()
    if args.short:
        args.commands = 20
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-lat-"))
    child = subprocess.Popen([sys.executable, "-c", TRAINING], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "ready"
    info = next(r for r in runs.list_runs() if r.pid == child.pid)
    reply_ms, applied_steps = [], []
    try:
        with Subscriber(info) as sub:
            while True:  # the run's start-up (its environment report) is not a reply's time
                message = sub.recv(30.0)
                assert message is not None, "no hello from the run"
                if message["type"] == "hello":
                    break
            value = "fp32"
            for _ in range(args.commands):
                value = "bf16" if value == "fp32" else "fp32"
                start = time.perf_counter()
                reply = send_command(info, "precision", value)
                reply_ms.append((time.perf_counter() - start) * 1e3)
                assert reply["ok"], reply
                while True:
                    message = sub.recv(5.0)
                    assert message is not None, "no applied event"
                    body = message["body"]
                    if (message["type"] == "event" and body.get("kind") == "applied"
                            and body.get("id") == reply["id"]):
                        applied_steps.append(body["step"] - reply["step"])
                        break
    finally:
        child.terminate()
        child.wait(10)
    print(f"{len(reply_ms)} commands to a run at 100 steps/s")
    print(f"reply ms: p50 {statistics.median(reply_ms):.2f}, p99 {percentile(reply_ms, 99):.2f},"
          f" max {max(reply_ms):.2f}")
    print(f"applied after (steps): max {max(applied_steps)}, "
          f"mean {statistics.mean(applied_steps):.2f}")
    print(f"RESULT reply_ms_p50={statistics.median(reply_ms):.2f} "
          f"reply_ms_p99={percentile(reply_ms, 99):.2f} applied_steps_max={max(applied_steps)}")


if __name__ == "__main__":
    main()
