"""The dashboard on a live demo run, its screen as text, without a terminal.

    python benchmarks/dashboard_screen.py [--device cuda] [--size 120x40 --size 80x24]

Starts ``python -m agent.demo`` on ``--device`` (default: CUDA where there is one), opens
the dashboard on it headless (Textual's ``run_test``, read-only) at each ``--size``,
waits until it has drawn step ``--steps`` or later and a host & GPU sample, and prints
the screen as a person reads it: the README's pictures of a run on a GPU, taken where
no terminal is (a machine reached by a batch job). Last line: ``RESULT screens=<n>
device=<d> step=<s>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import torch

from agent.wire import runs
from gpuwatch.app import CHART_REDRAW_S, GpuwatchApp, screen_text
from gpuwatch.sources.live import LiveSource


async def capture(info: runs.RunInfo, size: tuple[int, int], steps: int,
                  timeout_s: float = 120.0) -> tuple[str, int]:
    """``(screen text, step drawn)`` of a read-only dashboard on ``info`` at ``size``.

    ``size``: (columns, rows). Taken once the dashboard has step ``steps`` and a system
    sample with its GPUs, and its charts have been drawn since.

    Raises TimeoutError after ``timeout_s`` (s)."""
    app = GpuwatchApp(LiveSource(info), readonly=True)
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + timeout_s
        state = app.source.state
        while state.step < steps or state.system is None or "gpus" not in state.system:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step {steps} with a system sample in {timeout_s} s")
            await pilot.pause(0.1)
            state = app.source.state
        await pilot.pause(2.5 * CHART_REDRAW_S)  # the charts redraw at most this often
        app.redraw()
        await pilot.pause()
        return screen_text(app), state.step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--size", action="append", metavar="COLSxROWS",
                        help="a terminal size (again for more; default 120x40 and 80x24)")
    parser.add_argument("--steps", type=int, default=60, help="the step to wait for")
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in size.split("x")) for size in args.size or ["120x40",
                                                                              "80x24"]]
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-screen-"))
    child = subprocess.Popen([sys.executable, "-m", "agent.demo", "--model", args.model,
                              "--device", args.device], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    info = next(r for r in runs.list_runs() if r.pid == child.pid)
    step = 0
    try:
        for columns, rows in sizes:
            text, step = asyncio.run(capture(info, (columns, rows), args.steps))
            print(f"== {columns}x{rows}, step {step}, {args.device}")
            print(text, end="")
    finally:
        child.terminate()
        child.wait(30)
    print(f"RESULT screens={len(sizes)} device={args.device} step={step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
