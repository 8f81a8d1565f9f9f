"""The input-bound demo relieved live, in one run.

Data-wait share and samples/s at 0 workers, then after ``num_workers`` is raised through the
command path.

    python benchmarks/bench_input.py [--workers 1] [--steps 150]

Starts the CNN demo (real digits with CPU elastic/affine augmentation per sample) with
``num_workers=0``, measures ``--steps`` optimizer steps, sends ``num_workers=N`` live,
skips the steps of the switch, and measures ``--steps`` more. Medians of the per-step
data-wait share and the throughput over each phase.

Last line: ``RESULT input_speedup=<samples/s after / before> wait_share_before=<x>
wait_share_after=<y>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from agent.wire import runs
from gpuwatch.client import Subscriber, send_command


def collect(sub: Subscriber, count: int, after_step: int = 0) -> list[dict]:
    steps: list[dict] = []
    while len(steps) < count:
        message = sub.recv(30.0)
        if message is None:
            raise SystemExit("the demo stopped sending steps")
        body = message["body"]
        if message["type"] == "step" and body["step"] > after_step and body["step_time_s"]:
            steps.append(body)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-input-"))
    child = subprocess.Popen([sys.executable, "-m", "agent.demo", "--model", "cnn"],
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    info = next(r for r in runs.list_runs() if r.pid == child.pid)
    try:
        with Subscriber(info) as sub:
            collect(sub, 20)  # warm-up
            before = collect(sub, args.steps)
            reply = send_command(info, "num_workers", args.workers)
            assert reply["ok"], reply
            after = collect(sub, args.steps, after_step=reply["apply_step"] + 10)
    finally:
        child.terminate()
        child.wait(30)

    def summary(steps: list[dict]) -> tuple[float, float, str]:
        share = statistics.median(s["data_wait_share"] for s in steps)
        rate = statistics.median(s["samples_per_s"] for s in steps)
        return share, rate, steps[-1]["input_verdict"]

    share_0, rate_0, verdict_0 = summary(before)
    share_1, rate_1, verdict_1 = summary(after)
    print(f"num_workers=0: data wait {share_0:.0%} of the step, {rate_0:,.0f} samples/s "
          f"({verdict_0})")
    print(f"num_workers={args.workers} (switched live at step {reply['apply_step']}): data "
          f"wait {share_1:.0%}, {rate_1:,.0f} samples/s ({verdict_1})")
    print(f"RESULT input_speedup={rate_1 / rate_0:.2f} wait_share_before={share_0:.3f} "
          f"wait_share_after={share_1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
