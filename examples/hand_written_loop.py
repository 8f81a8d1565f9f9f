"""Attach gpuwatch to a hand-written training loop.

    python examples/hand_written_loop.py         # then, in another terminal: gpuwatch

``agent.session(...)`` starts the agent (it ends at exit, Ctrl-C or SIGTERM):
``run.loader(loader)`` times the data wait of each ``next()``, and
``run.optimizer_step()`` marks each optimizer-step boundary, where live commands apply.
The loop takes its autocast context, GradScaler and window size from the run, so
``precision``, ``accum_steps``, ``kernels`` and ``checkpointing`` are live knobs; its data
comes from a ``gpuopt.loader.ReconfigurableLoader``, so ``num_workers``, ``pin_memory``
and ``prefetch_factor`` are too. For a GPT-style loop with its own ``get_batch()``, see
``gpt_loop.py``.
"""

import argparse
import sys

import torch
from sklearn.datasets import load_digits

import agent
from gpuopt.loader import ReconfigurableLoader


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
    loader = ReconfigurableLoader(dataset, batch_size=64, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    run = agent.session(name="digits-manual", model=model, optimizer=optimizer,
                        precision="fp32", accum_steps=1, checkpoint_blocks=[torch.nn.Linear])
    print(f"run {run.agent.run_id}: watch it with `gpuwatch`", flush=True)
    batches = run.loader(loader, epochs=None)    # epoch after epoch
    while run.step < args.max_steps and not run.stopping:   # stop=now ends it too
        for _ in range(run.accum_steps):          # the live window size
            inputs, targets = next(batches)
            with run.autocast:                    # the live precision
                loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            run.scaler.scale(loss / run.accum_steps).backward()
        run.scaler.step(optimizer)                # a real GradScaler in fp16
        run.scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()                      # the boundary: commands apply here
    run.close()
    print(run.agent.ended_line(), flush=True)    # steps trained, final loss, the run log


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the agent has said bye; no traceback
        sys.exit(130)
