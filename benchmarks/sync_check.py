"""Proof that the agent's hot path adds no device synchronization (CUDA only).

    python benchmarks/sync_check.py [--steps 200]

Trains the demo transformer on CUDA with the agent attached, under
``torch.cuda.set_sync_debug_mode("error")`` around the training thread's whole loop
except the optimizer step of fp16 (the GradScaler's inf check syncs by design). Any
synchronizing call on the training thread (``.item()``, ``.cpu()``, a blocking copy)
raises. Also switches precision to bf16 and kernels to triton live through commands.
Last line: ``RESULT sync_check=passed steps=<n>`` or the error.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sync_check needs a CUDA device; skipped")
        print("RESULT sync_check=skipped reason=no_cuda")
        return 0
    os.environ.setdefault("GPUWATCH_RUN_DIR", tempfile.mkdtemp(prefix="gw-sync-"))
    os.environ.setdefault("GPUWATCH_LOG_DIR", tempfile.mkdtemp(prefix="gw-sync-log-"))
    import agent
    from agent.wire import runs
    from gpuopt import Trainer
    from gpuopt.demo import build_demo
    from gpuwatch.client import send_command

    workload = build_demo("transformer")
    model = workload.model.cuda()
    loader = torch.utils.data.DataLoader(workload.train_dataset, batch_size=32,
                                         shuffle=True, drop_last=True, pin_memory=True)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=workload.lr),
                      workload.loss_fn, loader)
    agent.attach(trainer, name="sync-check")
    info = runs.find_run()

    class Switch:
        def on_optimizer_step(self, trainer, stats):
            if stats.step == 20:
                threading.Thread(target=lambda: [
                    print(send_command(info, "precision", "bf16")),
                    print(send_command(info, "kernels", "triton"))]).start()

    trainer.callbacks.append(Switch())
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = trainer.fit(max_steps=args.steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"precision={trainer.precision} kernels={trainer.kernels}")
    print(f"RESULT sync_check=passed steps={steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
