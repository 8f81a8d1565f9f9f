"""What each monitor adds to one optimizer step of a small real training loop (CPU).

    python benchmarks/bench_overhead.py [--steps 2000] [--rounds 7]

One process, one loop (a 2-layer MLP on scikit-learn's digits, about 0.5 ms a step on a
2-core CPU), run under each monitor in turn, interleaved and repeated; the median over
rounds is compared with the bare loop measured in the same rounds. Monitors:

- bare:            the loop alone
- tqdm:            a tqdm progress bar around the loader (the cheapest thing people add)
- agent:           gpuwatch's agent (``agent.session``), no dashboard connected
- agent+sub:       the agent with a subscriber process reading every record
- naive_logger:    psutil + torch memory stats on the training thread every step
- torch_profiler:  torch.profiler with a wait/warmup/active schedule

Last line: ``RESULT agent_overhead_ratio=<r> agent_us_per_step=<u> tqdm_us_per_step=<t>
naive_overhead_ratio=<n>`` (ratios are step time under the monitor / bare step time).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from sklearn.datasets import load_digits
from tqdm import tqdm

import agent
from agent import runs

SUBSCRIBER = """
import sys
from agent import runs
from gpuwatch.client import Subscriber
info = [r for r in runs.list_runs() if r.run_id == sys.argv[1]][0]
with Subscriber(info) as sub:
    print("ready", flush=True)
    while True:
        message = sub.recv(30)
        if message is None or message["type"] == "bye":
            break
"""


def make_loop(batch_size: int = 64, hidden: int = 512):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    batches = list(zip(x.split(batch_size), y.split(batch_size)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.functional.cross_entropy

    def batch_stream(steps):
        for i in range(steps):
            yield batches[i % len(batches)]

    def step(inputs, targets):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return batch_stream, step


def run_bare(stream, step, steps):
    start = time.perf_counter()
    for inputs, targets in stream(steps):
        step(inputs, targets)
    return time.perf_counter() - start


def run_tqdm(stream, step, steps):
    with open(os.devnull, "w") as devnull:
        start = time.perf_counter()
        for inputs, targets in tqdm(stream(steps), total=steps, file=devnull):
            step(inputs, targets)
        return time.perf_counter() - start


def run_agent(stream, step, steps, subscriber=False):
    with agent.session(name="bench-overhead") as run:
        reader = None
        if subscriber:
            reader = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, run.agent.run_id],
                                      stdout=subprocess.PIPE, text=True)
            assert reader.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        for inputs, targets in run.loader(stream(steps)):
            loss = step(inputs, targets)
            run.optimizer_step(loss)
        elapsed = time.perf_counter() - start
    if reader is not None:
        reader.wait(30)
    return elapsed


def run_naive_logger(stream, step, steps):
    process = psutil.Process()
    log = []
    start = time.perf_counter()
    for inputs, targets in stream(steps):
        loss = step(inputs, targets)
        log.append((loss.item(), process.memory_info().rss, psutil.cpu_percent(),
                    torch.cuda.memory_allocated() if torch.cuda.is_available() else 0))
    return time.perf_counter() - start


def run_profiler(stream, step, steps):
    schedule = torch.profiler.schedule(wait=50, warmup=10, active=20, repeat=0)
    with contextlib.ExitStack() as stack:
        profiler = stack.enter_context(torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
            on_trace_ready=lambda p: None))
        start = time.perf_counter()
        for inputs, targets in stream(steps):
            step(inputs, targets)
            profiler.step()
        return time.perf_counter() - start


MONITORS = {
    "bare": run_bare,
    "tqdm": run_tqdm,
    "agent": run_agent,
    "agent+sub": lambda stream, step, steps: run_agent(stream, step, steps, subscriber=True),
    "naive_logger": run_naive_logger,
    "torch_profiler": run_profiler,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-bench-"))
    stream, step = make_loop()
    run_bare(stream, step, 200)  # warm up
    per_step_us: dict[str, list[float]] = {name: [] for name in MONITORS}
    for round_index in range(args.rounds):
        order = list(MONITORS)
        order = order[round_index % len(order):] + order[:round_index % len(order)]
        for name in order:
            per_step_us[name].append(MONITORS[name](stream, step, args.steps) / args.steps * 1e6)
    bare = statistics.median(per_step_us["bare"])
    print(f"step of the bare loop: {bare:.1f} us (median of {args.rounds} rounds of "
          f"{args.steps} steps; torch threads {torch.get_num_threads()})")
    print(f"{'monitor':<16}{'us/step':>10}{'added us':>10}{'ratio':>8}")
    added = {}
    for name, samples in per_step_us.items():
        median = statistics.median(samples)
        added[name] = median - bare
        print(f"{name:<16}{median:>10.1f}{added[name]:>10.1f}{median / bare:>8.3f}")
    agent_median = statistics.median(per_step_us["agent"])
    naive_median = statistics.median(per_step_us["naive_logger"])
    print(f"RESULT agent_overhead_ratio={agent_median / bare:.4f} "
          f"agent_us_per_step={added['agent']:.2f} tqdm_us_per_step={added['tqdm']:.2f} "
          f"naive_overhead_ratio={naive_median / bare:.4f}")


if __name__ == "__main__":
    main()
