"""The history tools against the size of the run log: time and peak memory of each.

    python benchmarks/bench_history.py [--steps 10000000] [--dir DIR] [--keep]
    python benchmarks/bench_history.py --short       # a quick check that it works

Makes run logs with the real writer (:class:`agent.wire.runlog.RunLog`) in a temporary
directory (``--dir``; ``--keep`` leaves them there), then runs each tool on each log as
its own process, as a person would, and reads its peak memory (the child's maximum
resident set, from ``wait4``):

- ``runs``: ``gpuwatch runs --all --json`` (from the summary beside the log; for a log
  without one, one pass, kept for the next time: both are timed);
- ``replay``: the timeline of ``gpuwatch replay`` (:class:`gpuwatch.sources.timeline.
  Timeline`): the log read once, then 10 moves across the run;
- ``compare``, ``report`` (needs matplotlib), ``export --csv``, ``export --parquet``
  (pandas and pyarrow).

The logs:

- ``N steps``: a run of ``--steps`` optimizer steps as the agent logs one at 2,000
  steps/s: batches of 1,000 steps with the columns of a token model on a GPU (step and
  data-wait times, loss, learning rate, gradient norm, GPU time, throughput, ...), a
  heartbeat and a system sample a second, a knob change every million steps; and the
  same at a tenth and a hundredth of the steps, for the trend;
- ``1M changes``: a million steps, each with other knob values than the one before;
- ``1 MiB lines``: 200 events of 1 MiB of text each among 100,000 steps, in the JSON
  lines of earlier versions (lines of 1 MiB) and in the run log (records of 1 MiB,
  as a crafted log holds them: the agent cuts an event to 16 K characters);
- ``corrupt``: 1 million steps whose numbers are text, NaN, 1e308 or beyond 64 bits
  here and there, with damaged bytes in every 50th frame and a torn end.

Each line: the wall time, the CPU time (user and system, every thread: what the tool
costs whatever else runs; on a machine shared with other work the wall time grows with
the load, printed before and after), and the peak memory. Target, on this machine: on
the 10M-step log each tool under 500 MB and 60 s; on the adversarial logs, bounded as
well and a clear word (an exit status, no traceback). Last line: ``RESULT max_s=<s>
max_mb=<m> tracebacks=<t>`` over every tool on every log.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.wire import protocol
from agent.wire.runlog import RunLog, part_path, summary_path

RUN = "20260101-000000-bench"
BATCH = 1000
STEPS_PER_S = 2000.0
KNOBS = {"precision": "bf16", "accum_steps": 4, "num_workers": 4, "pin_memory": True,
         "prefetch_factor": 2, "kernels": "compile", "checkpointing": False,
         "lr_scale": 1.0, "max_grad_norm": 1.0, "weight_decay": 0.1}
MEMORY = {"host_rss_bytes": 12 << 30, "host_peak_rss_bytes": 13 << 30,
          "mem_allocated_bytes": 61 << 30, "mem_reserved_bytes": 70 << 30,
          "mem_peak_reserved_bytes": 72 << 30}
GPUS = [{"index": index, "name": "NVIDIA H100 80GB HBM3", "util_pct": 97.0,
         "mem_used_bytes": 71 << 30, "mem_total_bytes": 80 << 30, "power_w": 650.0,
         "temp_c": 71.0} for index in range(8)]

REPLAY = """
import sys, time
from gpuwatch import history
from gpuwatch.sources.timeline import Timeline
from gpuwatch.state import RunState
log = history.log_at(sys.argv[1])
timeline = Timeline(log, RunState())
last = timeline.last_index
for index in range(0, -1 if last is None else last + 1, max(1, (last or 0) // 10)):
    timeline.state_at(index)
print(f"{len(timeline.steps):,} steps, {len(timeline.marks):,} marks")
"""


def _envelope(kind, body, seq, t):
    return protocol.envelope(kind, body, run=RUN, seq=seq, t=t)


def _steps_body(first, n, rng, t, knobs):
    """A batch as the encoder makes it (:mod:`agent.step.encoder`): lists of Python values."""
    steps = np.arange(first, first + n)
    times = rng.lognormal(math.log(0.5e-3), 0.2, n)
    waits = times * rng.uniform(0.0, 0.05, n)
    tokens = 4 * 8 * 1024
    columns = {
        "step": steps.tolist(), "micro_batches": [4] * n, "samples": [32] * n,
        "step_time_s": times.tolist(), "data_wait_s": waits.tolist(),
        "data_wait_share": np.minimum(1.0, waits / times).tolist(),
        "samples_per_s": (32 / times).tolist(),
        "loss": (2.0 + 8.0 / np.sqrt(steps) + rng.normal(0, 0.05, n)).tolist(),
        "gpu_step_time_s": (times * 0.97).tolist(), "skipped_steps_total": [0] * n,
        "tokens": [tokens] * n, "lr": (3e-4 * np.cos(steps / 2e7)).tolist(),
        "grad_norm": rng.lognormal(0.0, 0.3, n).tolist(),
        "data_wait_share_window": np.minimum(1.0, waits / times).tolist(),
        "input_verdict": ["compute-bound"] * n,
        "tokens_per_s": (tokens / times).tolist(),
    }
    common = dict(MEMORY)
    if type(knobs) is list:
        columns["knobs"] = knobs
    else:
        common["knobs"] = knobs
    return protocol.steps_body(columns, common)


def write_run(path, steps, *, every_change=False, seed=0):
    """A run of ``steps`` optimizer steps, as the agent logs it (see the module)."""
    rng = np.random.default_rng(seed)
    log = RunLog(path, budget_bytes=1 << 40)
    seq, t = 0, 1.7e9
    seq += 1
    log.write(_envelope("hello", {"name": "bench", "device": "cuda:0", "world_size": 8,
                                  "started_at": t, "model": {"name": "gpt", "params": 7e9},
                                  "knobs": [], "env": {"torch": {"version": "2.13.0"}}},
                        seq, t))
    knobs = dict(KNOBS)
    next_second = t + 1.0
    for first in range(1, steps + 1, BATCH):
        n = min(BATCH, steps + 1 - first)
        if every_change:
            batch_knobs = [{**knobs, "lr_scale": 1.0 + (first + row) % 2} for row in range(n)]
        else:
            if first > 1 and (first - 1) % 1_000_000 < BATCH:
                knobs = {**knobs, "lr_scale": knobs["lr_scale"] * 0.5}
                seq += 1
                log.write(_envelope("event", {"level": "info", "kind": "applied",
                                              "knob": "lr_scale", "value": knobs["lr_scale"],
                                              "text": "lr_scale applied", "step": first}, seq, t))
            batch_knobs = knobs
        seq += 1
        t += n / STEPS_PER_S
        log.write(_envelope("steps", _steps_body(first, n, rng, t, batch_knobs), seq, t))
        while t >= next_second:
            seq += 1
            log.write(_envelope("heartbeat", {"step": first + n - 1, "ending": False,
                                              "records_dropped": 0, "errors": 0}, seq, t))
            seq += 1
            log.write(_envelope("system", {"cpu_pct": 12.5, "host_mem_used_bytes": 40 << 30,
                                           "host_mem_total_bytes": 2 << 40, "gpus": GPUS,
                                           "gpu_status": None}, seq, t))
            next_second += 1.0
    seq += 1
    log.write(_envelope("bye", {"reason": "finished", "steps": steps}, seq, t))
    log.close()


def write_big_records(path, *, legacy):
    """100,000 steps with 200 events of 1 MiB of text among them."""
    rng = np.random.default_rng(1)
    text = "B" * (1 << 20)
    messages = []
    seq, t = 0, 1.7e9
    for first in range(1, 100_001, BATCH):
        seq += 1
        messages.append(_envelope("steps", _steps_body(first, BATCH, rng, t, KNOBS), seq, t))
        if first % 500 == 1:
            seq += 1
            messages.append(_envelope("event", {"level": "info", "text": text}, seq, t))
    if legacy:  # the earlier format: a line a record, a step a line
        with open(path, "wb") as handle:
            for message in messages:
                for record in protocol.expand(message):
                    handle.write(protocol.to_json_line(record))
        return
    log = RunLog(path, budget_bytes=1 << 40)
    for message in messages:  # (just under the writer's bound of a record)
        if message["type"] == "event":
            message["body"]["text"] = text[:(1 << 20) - 200]
        log.write(message)
    log.close()


def write_corrupt(path, steps):
    """Numbers that are not numbers, damaged frames and a torn end (see the module)."""
    rng = np.random.default_rng(2)
    log = RunLog(path, budget_bytes=1 << 40)
    seq, t = 0, 1.7e9
    for first in range(1, steps + 1, BATCH):
        body = _steps_body(first, BATCH, rng, t, KNOBS)
        columns = body["columns"]
        for _ in range(5):
            row = random.randrange(BATCH)
            name = random.choice(list(columns))
            columns[name][row] = random.choice(["x", math.nan, math.inf, 1e308, 1 << 70,
                                                None, {"a": [1]}, True])
        columns["step"][random.randrange(BATCH)] = random.choice([1e308, -5, "7", 1 << 63])
        seq += 1
        log.write(_envelope("steps", body, seq, t))
        log._write_frame(time.monotonic())  # a frame a batch, to damage some
    log.close()
    data = bytearray(path.read_bytes())
    for offset in range(len(data) // 97, len(data), len(data) // 50):
        data[offset] ^= 0x5A  # every 50th frame or so
    path.write_bytes(bytes(data[:-7]))  # and a torn end
    summary_path(path).unlink(missing_ok=True)


#: Runs a command and prints its peak resident set (KiB) and exit status: forked from
#: this small process, not from the benchmark (a child's peak counts its parent's pages
#: until it executes).
MEASURE = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status))
"""


def measure(command, env):
    """Run ``command``; returns what it cost and how it ended.

    ``(seconds, CPU seconds, peak RSS in MiB, exit status, last stderr line, whether it
    printed a traceback)``."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], env=env,
                          capture_output=True, text=True)
    elapsed = time.monotonic() - started
    peak_kib, cpu_s, status = done.stdout.split()[-3:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return (elapsed, float(cpu_s), int(peak_kib) / 1024, int(status),
            lines[-1][:100] if lines else "", "Traceback" in done.stderr)


def tools(path, out):
    gpuwatch = [sys.executable, "-m", "gpuwatch"]
    return [
        ("runs", gpuwatch + ["runs", "--all", "--json"]),
        ("replay", [sys.executable, "-c", REPLAY, str(path)]),
        ("compare", gpuwatch + ["compare", str(path)]),
        ("report", gpuwatch + ["report", str(path), "-o", str(out / "report.html")]),
        ("export csv", gpuwatch + ["export", str(path), "--csv", "-o", str(out / "t")]),
        ("export parquet", gpuwatch + ["export", str(path), "--parquet", "-o",
                                       str(out / "t")]),
    ]


def size_of(path):
    total, index = 0, 0
    while part_path(path, index).exists():
        total += part_path(path, index).stat().st_size
        index += 1
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, help="where to write the logs")
    parser.add_argument("--keep", action="store_true", help="leave the logs there")
    parser.add_argument("--short", action="store_true", help="small logs: a quick check")
    parser.add_argument("--only", help="log names to run, separated by ; (default: all)")
    args = parser.parse_args()
    steps = 20_000 if args.short else args.steps
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-history-"))
    root.mkdir(parents=True, exist_ok=True)
    logs = [(f"{steps // 100:,} steps", lambda p: write_run(p, steps // 100)),
            (f"{steps // 10:,} steps", lambda p: write_run(p, steps // 10)),
            (f"{steps:,} steps", lambda p: write_run(p, steps)),
            ("1M changes", lambda p: write_run(p, steps // 10, every_change=True)),
            ("1 MiB lines (jsonl)", lambda p: write_big_records(p, legacy=True)),
            ("1 MiB records", lambda p: write_big_records(p, legacy=False)),
            ("corrupt", lambda p: write_corrupt(p, steps // 10))]
    if args.only:
        wanted = {name.strip() for name in args.only.split(";")}
        logs = [(name, make) for name, make in logs if name in wanted]
    worst_s = worst_mb = 0.0
    tracebacks = 0
    print(f"# load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'log':<22}{'size':>10}  {'tool':<18}{'time':>8}{'cpu':>8}{'peak':>9}  status")
    for name, make in logs:
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
        directory = root / slug  # (a log made once is measured again with --dir)
        directory.mkdir(exist_ok=True)
        legacy = "jsonl" in name
        path = directory / f"{RUN}-{slug[:30]}.rank0.{'jsonl' if legacy else 'runlog'}"
        if not path.exists():
            started = time.monotonic()
            make(path)
            print(f"# {name}: written in {time.monotonic() - started:.0f} s", flush=True)
        env = {**os.environ, "GPUWATCH_LOG_DIR": str(directory),
               "GPUWATCH_RUN_DIR": str(directory / "run")}
        os.makedirs(directory / "run", mode=0o700, exist_ok=True)
        out = directory / "out"
        out.mkdir(exist_ok=True)
        for tool, command in tools(path, out):
            if tool == "runs" and not legacy:  # the summary beside it, then without it
                runs = [("runs (summary)", command), ("runs (no summary)", command)]
            elif tool == "runs":
                runs = [("runs (one pass)", command), ("runs (kept)", command)]
            else:
                runs = [(tool, command)]
            for label, run in runs:
                if label == "runs (no summary)":
                    summary_path(path).unlink(missing_ok=True)
                elapsed, cpu_s, peak, status, last, traceback = measure(run, env)
                worst_s, worst_mb = max(worst_s, elapsed), max(worst_mb, peak)
                tracebacks += traceback
                said = f"exit {status}" + (f": {last}" if status or "skipped" in last
                                           or "damaged" in last else "")
                print(f"{name:<22}{size_of(path) / 2**20:>8.1f}MB  {label:<18}"
                      f"{elapsed:>7.1f}s{cpu_s:>7.1f}s{peak:>7.0f}MB  {said}"
                      + ("  TRACEBACK" if traceback else ""), flush=True)
    if not args.keep and not args.dir:
        shutil.rmtree(root)
    print(f"# load average after: {os.getloadavg()[0]:.1f}")
    print(f"RESULT max_s={worst_s:.1f} max_mb={worst_mb:.0f} tracebacks={tracebacks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
