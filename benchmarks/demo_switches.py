"""The demo job with live switches of precision, kernels and checkpointing, from a client.

    python benchmarks/demo_switches.py [--model transformer] [--device cuda]

Starts ``python -m agent.demo`` (no dashboard) on ``--device`` (default: CUDA where there
is one), and at fixed steps sends ``precision=bf16``, ``kernels=compile``,
``checkpointing=true``, ``kernels=triton`` (refused without CUDA), ``kernels=eager``,
``precision=fp16`` (a GradScaler from there), ``precision=fp32``, and on CUDA also
``memory_fraction=0.5`` and ``memory_snapshot_steps=3`` (a snapshot file of 3 steps'
allocations), printing each reply, the applied events and the step time and loss
around each switch, and the run's first GPU sample (NVML) as the dashboard receives it.
Works on CPU and CUDA.
Last line: ``RESULT switches_applied=<n> switches_refused=<m> final_loss=<x>
device=<d>``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from agent.wire import runs
from gpuwatch.client import Subscriber, send_command

SWITCHES = [("precision", "bf16"), ("kernels", "compile"), ("checkpointing", True),
            ("kernels", "triton"), ("kernels", "eager"), ("precision", "fp16"),
            ("precision", "fp32")]
#: What only a CUDA run can take (refused on a CPU, saying so).
CUDA_SWITCHES = [("memory_fraction", 0.5), ("memory_snapshot_steps", 3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--every", type=int, default=15, help="steps between switches")
    args = parser.parse_args()
    switches = SWITCHES + (CUDA_SWITCHES if args.device.startswith("cuda") else [])
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-switch-"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.Popen([sys.executable, "-m", "agent.demo", "--model", args.model,
                              "--compile-backend", "inductor", "--device", args.device], env=env,
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    info = next(r for r in runs.list_runs() if r.pid == child.pid)
    applied = refused = 0
    loss = None
    pending = list(switches)
    gpu_shown = False
    next_switch_at = args.every
    deadline = time.monotonic() + 150
    try:
        with Subscriber(info) as sub:
            while time.monotonic() < deadline and (pending or applied + refused < len(switches)):
                message = sub.recv(10.0)
                if message is None:
                    continue
                body = message["body"]
                if message["type"] == "system" and body.get("gpus") and not gpu_shown:
                    print(f"  GPU sample: {body['gpus'][0]}")
                    gpu_shown = True
                if message["type"] == "event" and body.get("kind") in (
                        "applied", "failed", "compiling", "compiled", "compile_note",
                        "memory_snapshot"):
                    print(f"  event: {body['text']}")
                    applied += body.get("kind") == "applied"
                if message["type"] != "step":
                    continue
                loss = body["loss"]
                if body["step"] % 5 == 0:
                    print(f"step {body['step']:4d}  {body['step_time_s'] * 1e3:8.1f} ms  "
                          f"loss {loss:.3f}  {body['knobs']}")
                if pending and body["step"] >= next_switch_at:
                    knob, value = pending.pop(0)
                    reply = send_command(info, knob, value)
                    print(f"{knob}={value}: {reply}")
                    refused += not reply["ok"]
                    next_switch_at = body["step"] + args.every
    finally:
        child.terminate()
        child.wait(30)
    print(f"RESULT switches_applied={applied} switches_refused={refused} final_loss={loss} "
          f"device={args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
