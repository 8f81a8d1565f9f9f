"""A real training process for the security tests: a small model trained with the agent
attached until a line (or EOF) comes on stdin and it has trained ``MIN_STEPS`` steps
(default 20).

    python tests/victim_job.py [ipc|tcp] [MIN_STEPS]

Prints one JSON line when the agent has started (``{"pid", "run_file", "log_path"}``,
``run_file`` None when the agent found no safe run directory) and one when it ends
(``{"steps", "errors", "accum_steps", "open_errors"}``: every 10th step it opens a file, as
a training job opens its data and checkpoints, and counts the ones that failed, e.g. for
want of a file descriptor). A step takes a few milliseconds of real work;
the agent is never waited on, so what an attacker does shows in how the job fares.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from agent.step.core import Agent
from agent.wire.knobs import ACCUM_STEPS, Knob, KnobSet
from agent.step.record import StepRecord


def main() -> int:
    transport = sys.argv[1] if len(sys.argv) > 1 else "ipc"
    min_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    settings = {"accum_steps": 1}
    knobs = KnobSet()
    knobs.add(Knob(ACCUM_STEPS, lambda: settings["accum_steps"],
                   lambda value: settings.__setitem__("accum_steps", value)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Agent(knobs, name="victim", model=model, transport=transport).start()
    info = monitor.info
    print(json.dumps({"pid": os.getpid(), "run_file": info.path if info else None,
                      "log_path": info.log_path if info else None}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    step = open_errors = 0
    monitor.mark_start()
    while step < min_steps or not stop.is_set():
        for _ in range(settings["accum_steps"]):
            x = torch.randn(256, 32)
            loss = model(x).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            try:
                open(os.devnull, "rb").close()
            except OSError:
                open_errors += 1
        monitor.optimizer_step(StepRecord(step=step, micro_batches=settings["accum_steps"],
                                          samples=256, data_wait_s=0.0, loss=loss.detach()))
        stop.wait(0.002)  # the rest of a "step": the job's own pace, not a test's wait
    monitor.close()
    print(json.dumps({"steps": step, "errors": monitor.errors,
                      "accum_steps": settings["accum_steps"], "open_errors": open_errors}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
