"""Steer a live run from a script: halve ``lr_scale`` each time the loss plateaus.

    python examples/steer.py [RUN] [--window 20] [--min-improvement 0.01] [--max-halvings 3]

It follows the run's step records through :class:`gpuwatch.client.RunClient` (no torch
needed, any machine that can reach the run) and, when the mean loss of the last
``window`` steps is not at least ``min_improvement`` (a fraction) below the mean of the
``window`` steps before, sets ``lr_scale`` to half its value and waits until the run
applied it. It ends when the run ends, with a line of what it did (the steps it followed,
the halvings). An LLM agent steers a run the same way.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from agent.wire.protocol import printable
from gpuwatch.client import CommandError, RunClient


def plateaued(losses: list[float], window: int, min_improvement: float) -> bool:
    """Whether the loss has plateaued over the last ``2 * window`` losses.

    True when the mean of the last ``window`` losses is not ``min_improvement`` (a fraction)
    below the mean of the ``window`` before them; False with fewer than ``2 * window``
    losses."""
    if len(losses) < 2 * window:
        return False
    before = sum(losses[-2 * window:-window]) / window
    recent = sum(losses[-window:]) / window
    return recent > before * (1 - min_improvement)


def steer(client: RunClient, *, window: int, min_improvement: float, max_halvings: int,
          say: Callable[[str], Any] = print) -> tuple[list[int], list[dict[str, Any]]]:
    """Follow ``client``'s run to its end, halving ``lr_scale`` at each plateau.

    At most ``max_halvings`` times; the losses of the steps before a halving applied are
    left out of the next comparison. Returns the numbers of the steps it followed and
    the ``applied`` events of the halvings.

    Raises:
        LookupError: the run has no ``lr_scale`` knob (its framework refuses it, or it
            has no optimizer), said at its first step.
    """
    losses: list[float] = []  # the last 2 * window: what plateaued() compares
    applied: list[dict[str, Any]] = []
    since = 0  # the step the last halving applied at: steps before it trained without it
    followed: list[int] = []
    for step in client.steps():
        followed.append(step["step"])
        scale = (step.get("knobs") or {}).get("lr_scale")
        if not isinstance(scale, (int, float)):
            raise LookupError(f"run {client.info.run_id} has no lr_scale knob to halve")
        loss = step.get("loss")
        if step["step"] < since or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            continue
        losses.append(float(loss))
        del losses[:-2 * window]
        if len(applied) < max_halvings and plateaued(losses, window, min_improvement):
            try:
                event = client.set("lr_scale", scale / 2)
            except CommandError as exc:
                say(f"not applied: {exc}")
                break
            say(printable(str(event["text"])))  # (the run's text: no escape reaches a terminal)
            applied.append(event)
            losses.clear()
            since = event["step"]
    return followed, applied


def ended_line(run_id: str, followed: list[int], applied: list[dict[str, Any]]) -> str:
    """The script's last line: the run it followed, its steps and the halvings.

    E.g. ``steer: followed run <id> for 40 steps (1..40); lr_scale halved 2 times, to
    0.25`` (``never halved`` without a halving)."""
    steps = (f"{len(followed):,} steps ({followed[0]:,}..{followed[-1]:,})" if followed
             else "no step")
    halved = (f"halved {len(applied)} times, to {applied[-1]['value']:g}" if applied
              else "never halved")
    return f"steer: followed run {run_id} for {steps}; lr_scale {halved}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", help="run id or name (default: the only or newest)")
    parser.add_argument("--window", type=int, default=20, help="steps a mean is over")
    parser.add_argument("--min-improvement", type=float, default=0.01,
                        help="fraction the loss must fall by from one window to the next")
    parser.add_argument("--max-halvings", type=int, default=3)
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be at least 1, got {args.window}")
    try:
        client = RunClient(args.run)
    except (LookupError, TimeoutError) as exc:
        print(f"steer: {exc}", file=sys.stderr)
        return 1
    with client:
        print(f"following {client.info.run_id}", flush=True)
        try:
            followed, applied = steer(client, window=args.window,
                                      min_improvement=args.min_improvement,
                                      max_halvings=args.max_halvings,
                                      say=lambda text: print(text, flush=True))
        except LookupError as exc:
            print(f"steer: {exc}", file=sys.stderr)
            return 1
        print(ended_line(client.info.run_id, followed, applied))
    return 0


if __name__ == "__main__":
    sys.exit(main())
