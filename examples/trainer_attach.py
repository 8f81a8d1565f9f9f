"""Attach gpuwatch to the reference gpuopt.Trainer.

    python examples/trainer_attach.py            # then, in another terminal: gpuwatch
    python examples/trainer_attach.py --max-steps 200

The model, optimizer, loss and DataLoader are ordinary PyTorch; the one gpuwatch line is
``agent.attach(trainer)``. From the dashboard, ``p`` changes the precision and ``a``/``A``
the gradient accumulation while this runs.
"""

import argparse
import signal
import sys

import torch
from sklearn.datasets import load_digits

import agent
from gpuopt import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=1_000_000,
                        help="optimizer steps to train (default: about an hour; Ctrl-C "
                             "stops it sooner)")
    args = parser.parse_args()

    digits = load_digits()  # 1,797 real 8x8 handwritten digits, shipped with scikit-learn
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(digits.data, dtype=torch.float32) / 16.0,
        torch.tensor(digits.target, dtype=torch.long))
    loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, optimizer, torch.nn.functional.cross_entropy, loader)

    monitor = agent.attach(trainer, name="digits-mlp")
    print(f"run {monitor.run_id}: watch it with `gpuwatch`", flush=True)
    trainer.fit(max_steps=args.max_steps)
    print(monitor.ended_line(), flush=True)  # steps trained, final loss, the run log


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: a clean end
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the agent has said bye; no traceback
        sys.exit(130)
