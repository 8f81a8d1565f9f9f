"""Attach gpuwatch to a hand-written training loop.

    python examples/hand_written_loop.py         # then, in another terminal: gpuwatch

``agent.session(...)`` is a context manager: ``run.loader(loader)`` times the data wait
of each ``next()``, and ``run.optimizer_step(loss)`` marks each optimizer-step boundary,
where live commands apply. Passing a ``gpuopt.MixedPrecision`` makes ``precision`` a live
knob; the loop uses it for autocast, backward and the optimizer step.
"""

import argparse
import signal
import sys

import torch
from sklearn.datasets import load_digits

import agent
from gpuopt import MixedPrecision


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps to train (default: about an hour; Ctrl-C "
                             "stops it sooner)")
    args = parser.parse_args()

    digits = load_digits()
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(digits.data, dtype=torch.float32) / 16.0,
        torch.tensor(digits.target, dtype=torch.long))
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precision = MixedPrecision("cpu")

    with agent.session(name="digits-manual", model=model, mixed_precision=precision) as run:
        print(f"run {run.agent.run_id}: watch it with `gpuwatch`", flush=True)
        while run.step < args.max_steps:
            for inputs, targets in run.loader(loader):
                with precision.autocast():
                    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
                precision.backward(loss)
                skipped = precision.step(optimizer)  # fp16: did the GradScaler skip it?
                optimizer.zero_grad(set_to_none=True)
                run.optimizer_step(loss, skipped=skipped)
                if run.step >= args.max_steps:
                    break


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: a clean end
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the agent has said bye; no traceback
        sys.exit(130)
