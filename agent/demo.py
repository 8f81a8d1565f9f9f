"""The demo training job behind ``gpuwatch demo``: a real model on real packaged data.

Trained by :class:`gpuopt.Trainer` with the agent attached.

Run as ``python -m agent.demo [--model transformer|cnn] [--max-steps N]``; with
``--resume CHECKPOINT`` (and the options it was started with) it continues exactly from a
checkpoint it saved (``checkpoint=now``: its state, loader position, random numbers and
knobs; see :mod:`agent.control.checkpoints`). SIGTERM, SIGHUP or
SIGINT stops it cleanly at the next optimizer-step boundary (``bye`` is published and
the run file removed); so does the end of the ``--parent-pid`` process, however it ends
(``gpuwatch demo`` passes its own pid: a dashboard killed or hung up on does not leave
the training running).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

import torch
from torch.utils.data import default_collate

import agent
from agent.wire.protocol import DEMO_ENDED, DEMO_QUIT_REASON, DEMO_QUIT_SIGNAL
from gpuopt import Trainer
from gpuopt.demo import DemoWorkload, build_demo
from gpuopt.loader import ReconfigurableLoader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.demo", description=__doc__)
    parser.add_argument("--model", choices=("transformer", "cnn"), default="transformer")
    parser.add_argument("--device", default=None,
                        help="where the model trains: cpu, cuda, cuda:1... (default: the "
                             "first CUDA device where there is one, else cpu)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many optimizer steps (default: until stopped)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--prefetch-factor", type=int, default=None,
                        help="batches in flight per worker (default: DataLoader's, 2)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's, one per core)")
    parser.add_argument("--kernels", choices=("eager", "compile", "triton"), default="eager")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend for kernels=compile (aot_eager compiles "
                             "in about a second on a small CPU; inductor can take a minute or "
                             "more there: the dashboard shows the time so far and the last "
                             "compile's)")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, metavar="PID",
                        help="stop when this process ends (gpuwatch demo passes its own)")
    parser.add_argument("--resume", metavar="CHECKPOINT",
                        help="continue from a checkpoint of this demo (checkpoint=now); the "
                             "other options must be those it was started with")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="where checkpoint=now saves (default: the run's directory)")
    parser.add_argument("--listen", metavar="ADDRESS",
                        help="listen on this address (e.g. 0.0.0.0) with tcp and CURVE "
                             "encryption, for a dashboard on another machine")
    args = parser.parse_args(argv)
    # (until the stop below is set: gpuwatch demo's quit stops the start-up as SIGINT does)
    signal.signal(DEMO_QUIT_SIGNAL, signal.default_int_handler)

    torch.manual_seed(args.seed)
    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
    try:
        device = demo_device(args.device)
    except ValueError as error:
        print(f"python -m agent.demo: {error}", file=sys.stderr)
        return 2
    workload = build_demo(args.model, seed=args.seed)
    workload.model.to(device)
    loader = ReconfigurableLoader(workload.train_dataset, workload.batch_size, shuffle=True,
                                  seed=args.seed, drop_last=True,
                                  num_workers=args.num_workers,
                                  prefetch_factor=args.prefetch_factor)
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=workload.lr)
    trainer = Trainer(workload.model, optimizer, workload.loss_fn, loader,
                      precision=args.precision, accum_steps=args.accum_steps,
                      max_grad_norm=1.0, kernels=args.kernels,
                      compile_backend=args.compile_backend)
    monitor = agent.attach(trainer, name=f"demo-{workload.name}",
                           transport="tcp" if args.listen else args.transport,
                           listen=args.listen, checkpoint_dir=args.checkpoint_dir,
                           resume_from=args.resume,
                           eval_fn=held_out_evaluation(workload, workload.batch_size))
    if monitor.info is not None:
        print(f"gpuwatch demo: run {monitor.run_id} ({workload.name}), "
              f"attach with: gpuwatch {monitor.run_id}", flush=True)

    def stop(signum: int, frame: object) -> None:
        monitor.mark_ending(DEMO_QUIT_REASON if signum == DEMO_QUIT_SIGNAL
                            else f"stopped by {signal.Signals(signum).name}")
        trainer.stop()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, DEMO_QUIT_SIGNAL):
        signal.signal(signum, stop)
    if args.parent_pid is not None:
        def parent_ended() -> None:
            monitor.mark_ending(f"its parent process {args.parent_pid} ended")
            trainer.stop()

        watch_parent(args.parent_pid, parent_ended)
    resumed_at = trainer.step  # (a resumed run's: the checkpoint's step)
    try:
        steps = trainer.fit(max_steps=args.max_steps)
    finally:
        loader.close()
    monitor.close()  # bye and the run file gone before the last line: `gpuwatch demo`
    # waits for either, and its own words would otherwise come after this line
    print(ended_line(steps, resumed_at, monitor.bye_reason), flush=True)
    return 0


def ended_line(step: int, resumed_at: int, reason: str | None) -> str:
    """The demo job's last line: the step it ended at, how, and the steps this job trained.

    ``gpuwatch demo: ended at step 163 (finished; 99 steps trained after the
    resume at step 64)``; ``reason``: what ``bye`` says (None: finished)."""
    after = f" after the resume at step {resumed_at:,}" if resumed_at else ""
    return (f"{DEMO_ENDED}{step:,} ({reason or 'finished'}; {step - resumed_at:,} "
            f"steps trained{after})")


def demo_device(name: str | None) -> torch.device:
    """The device the demo trains on: ``name``, else CUDA where there is one, else the CPU.

    ``name``: ``cpu``, ``cuda``, ``cuda:1``... (None: the default). Raises ValueError,
    saying why, for a name torch does not know, a device type other than cpu and cuda,
    or a CUDA device this machine does not have."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r}: {error}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: the demo trains on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else f"torch sees {count} CUDA device{'s' if count != 1 else ''} here")
        raise ValueError(f"--device {name}: {why}")
    return device


def held_out_evaluation(workload: DemoWorkload, batch_size: int
                        ) -> Callable[[], dict[str, float]] | None:
    """The demo's ``eval_fn`` (``evaluate=now``, ``E``): loss and accuracy on the held-out split.

    The mean loss over the workload's held-out split (``val_loss``; per token for the
    transformer) and, for a classifier (logits ``[B, K]``), the share classified right
    (``val_accuracy``), in batches of ``batch_size``; None when the workload has no held-out
    split.

    The model runs in eval mode under ``no_grad`` in fp32 on its device (the run puts
    its train mode back); the batches are stacked by hand, not by a DataLoader, so no
    random number is drawn and the training goes on as it would have. About 0.1-0.5 s
    on a CPU for the demo's 360 held-out samples.
    """
    dataset = workload.val_dataset
    if dataset is None:
        return None
    size = len(dataset)  # type: ignore[arg-type]  # (the demo's datasets are sized)

    def evaluate() -> dict[str, float]:
        model = workload.model
        device = next(model.parameters()).device
        model.eval()
        loss_sum = correct = 0.0
        classifier = False
        with torch.no_grad():
            for start in range(0, size, batch_size):
                inputs, targets = default_collate(
                    [dataset[index] for index in range(start, min(start + batch_size, size))])
                inputs, targets = inputs.to(device), targets.to(device)
                output = model(inputs)
                loss_sum += float(workload.loss_fn(output, targets)) * len(targets)
                classifier = output.dim() == 2
                if classifier:
                    correct += float((output.argmax(dim=-1) == targets).sum())
        metrics = {"val_loss": loss_sum / size}
        if classifier:
            metrics["val_accuracy"] = correct / size
        return metrics

    return evaluate


def watch_parent(pid: int, on_exit: Callable[[], None]) -> None:
    """Call ``on_exit`` from a daemon thread once process ``pid`` (the parent) ends.

    Woken by a pidfd (Linux 5.3+) when there is one, else by checking ``os.getppid()`` each
    second; at once if it has ended already."""
    def watch() -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here, or the process is gone
            while os.getppid() == pid:
                time.sleep(1.0)
        else:
            with os.fdopen(pidfd, "rb", buffering=0):
                select.select([pidfd], [], [])  # readable once the process has ended
        on_exit()

    threading.Thread(target=watch, name="gpuwatch-demo-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
