"""A training job for the test of a checkpoint killed while it is written:
``python tests/checkpoint_job.py DIR``. A hand-written loop with the agent, checkpoints
into DIR, training until killed. Its first checkpoint is written as usual; at the second,
``os.fsync`` of the temporary file says ``writing <path>`` on stdout and then waits forever
(the test kills the process there: the data is written, not yet synced or renamed)."""

import os
import sys
import threading

import torch
from torch.nn import functional as F

import agent
from tests.training import digits_loader, model as make_model

_fsync = os.fsync
_temporaries: list[str] = []


def fsync(fd: int) -> None:
    name = os.readlink(f"/proc/self/fd/{fd}")
    if ".tmp-" in name and not os.path.isdir(name) and name not in _temporaries:
        _temporaries.append(name)
    if _temporaries[1:] and name == _temporaries[1]:
        print(f"writing {name}", flush=True)
        threading.Event().wait()  # held here until SIGKILL
    _fsync(fd)


def main() -> None:
    os.fsync = fsync
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = agent.session(model=model, optimizer=optimizer, checkpoint_dir=sys.argv[1],
                        name="checkpoint-job")
    print(f"run {run.agent.run_id}", flush=True)
    data = digits_loader()
    while True:
        x, y = data[run.step % len(data)]
        run.scaler.scale(F.cross_entropy(model(x), y)).backward()
        run.scaler.step(optimizer)
        optimizer.zero_grad()
        run.optimizer_step()


if __name__ == "__main__":
    main()
