"""What the agent keeps alive in the training process beyond what its loop keeps.

    python benchmarks/bench_held.py [--steps 3000] [--rounds 3]
    python benchmarks/bench_held.py --short        # a quick check that it works

Each figure against the loop without the agent, measured in the same run:

1. **Autograd graphs.** A 0-dim float32 or float64 host loss is read from memory at the
   boundary (no call), so its record keeps a number; any other host loss (bfloat16 here)
   is handed to the agent as the tensor and read on the agent's thread, so its record
   keeps the loss's autograd graph until the step is published. A 4-layer transformer
   encoder (width 64, batches of 8 x 16 tokens, one torch thread, CPU) trains ``--steps``
   steps in a fresh process each: bare; under ``agent.session`` with
   ``run.optimizer_step(loss)`` for a float32 loss (``agent``) and for the same loss cast
   to bfloat16 (``agent_bf16``); and under the agent with the loss read by the loop
   (``run.optimizer_step(loss.item())``: the agent's own memory, no graph kept). Peak RSS
   growth (``ru_maxrss``) from after a warm-up to the end, the median of ``--rounds``; the
   graphs' cost is each of the first two agent figures minus the third.
2. **Graphs kept while the agent's thread lags.** An agent whose I/O thread has not
   started (nothing drains its queue) records the same model's steps: how many of their
   losses are still alive (weak references) after ``LOSSES_HELD_MAX`` + 100 steps, for
   bfloat16 losses (the bound: :data:`agent.step.core.LOSSES_HELD_MAX`; before it, the
   whole queue, 8,192) and for float32 ones (none: read at the boundary).
3. **Batches.** A loop over ``run.loader(DataLoader)`` (a new tensor each batch): the most
   batches alive at a fetch, against the bare loop's (the one it holds).

Last line: ``RESULT graphs_rss_mb=<g> bf16_graphs_rss_mb=<g16> agent_rss_mb=<a>
agent_bf16_rss_mb=<a16> agent_read_rss_mb=<r> bare_rss_mb=<b> lagging_graphs_kept=<k>
lagging_float32_graphs_kept=<k32> batches_alive=<n> bare_batches_alive=<nb>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import weakref

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import agent  # noqa: E402
from agent.step.core import LOSSES_HELD_MAX  # noqa: E402
from agent.step.record import StepRecord  # noqa: E402


def transformer_step(loss_dtype: torch.dtype = torch.float32):
    """One optimizer step of the 4-layer encoder, as a function returning its loss.

    The loss (a 0-dim host tensor) is cast to ``loss_dtype`` before its backward."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(8, 16, 64)

    def step():
        loss = model(inputs).pow(2).mean().to(loss_dtype)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def peak_rss_growth_mb(mode: str, steps: int) -> float:
    """The peak RSS growth (MiB) of ``steps`` steps under ``mode``, in this process.

    ``mode``: bare, agent, agent_bf16, agent_read; from after 30 warm-up steps (the agent
    started before them)."""
    step = transformer_step(torch.bfloat16 if mode == "agent_bf16" else torch.float32)
    run = agent.session(name=f"bench-held-{mode}") if mode != "bare" else None
    for _ in range(30):
        step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        loss = step()
        if run is not None:
            run.optimizer_step(loss.item() if mode == "agent_read" else loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if run is not None:
        run.close()
    return (peak - start) / 1024


def lagging_graphs_kept(loss_dtype: torch.dtype) -> int:
    """How many losses are still alive after LOSSES_HELD_MAX + 100 steps, nothing drained.

    The steps, their losses of ``loss_dtype``, are recorded by an agent whose I/O thread
    has not started."""
    step = transformer_step(loss_dtype)
    monitor = agent.Agent(name="bench-held-lagging")  # (not started: nothing drains)
    held = []
    for number in range(1, LOSSES_HELD_MAX + 101):
        loss = step()
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, step=number))
        held.append(weakref.ref(loss))
    del loss
    return sum(ref() is not None for ref in held)


def batches_alive(with_agent: bool, steps: int = 40) -> int:
    """The most batches alive at a fetch of a loop over a DataLoader."""
    from torch.utils.data import DataLoader, TensorDataset

    model = torch.nn.Linear(16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32 * steps, 16),
                                      torch.randint(0, 2, (32 * steps,))), batch_size=32)
    run = agent.session(name="bench-held-batches", model=model) if with_agent else None
    fetched: list[weakref.ref] = []
    most = 0
    for x, y in (run.loader(loader) if run is not None else loader):
        fetched.append(weakref.ref(x))
        most = max(most, sum(ref() is not None for ref in fetched))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if run is not None:
            run.optimizer_step(loss)
    if run is not None:
        run.close()
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", action="store_true", help="a quick check that it works")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(peak_rss_growth_mb(args.child, args.steps)))
        return
    steps, rounds = (200, 1) if args.short else (args.steps, args.rounds)
    growth: dict[str, list[float]] = {"bare": [], "agent": [], "agent_bf16": [],
                                      "agent_read": []}
    for _ in range(rounds):  # interleaved, a fresh process each (peak RSS is per process)
        for mode in growth:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps",
                                  str(steps)], check=True, capture_output=True, text=True)
            growth[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rss = {mode: statistics.median(values) for mode, values in growth.items()}
    graphs = rss["agent"] - rss["agent_read"]
    bf16_graphs = rss["agent_bf16"] - rss["agent_read"]
    print(f"{steps} steps of a 4-layer transformer encoder (width 64, 8 x 16 tokens), "
          f"median of {rounds}: peak RSS growth bare {rss['bare']:.1f} MiB, agent "
          f"{rss['agent']:.1f} (float32 loss, read at the boundary), "
          f"{rss['agent_bf16']:.1f} (bfloat16 loss, held until published), agent with the "
          f"loss read by the loop {rss['agent_read']:.1f}: the graphs kept cost "
          f"{graphs:.1f} MiB (float32) and {bf16_graphs:.1f} MiB (bfloat16)")
    kept = lagging_graphs_kept(torch.bfloat16)
    kept32 = lagging_graphs_kept(torch.float32)
    print(f"an agent whose I/O thread lags: {kept} bfloat16 losses' graphs kept after "
          f"{LOSSES_HELD_MAX + 100} steps (bound {LOSSES_HELD_MAX}), {kept32} float32 ones")
    alive, bare_alive = batches_alive(True), batches_alive(False)
    print(f"a loop over run.loader(DataLoader): at most {alive} batches alive at a fetch "
          f"(bare loop: {bare_alive})")
    print(f"RESULT graphs_rss_mb={graphs:.1f} bf16_graphs_rss_mb={bf16_graphs:.1f} "
          f"agent_rss_mb={rss['agent']:.1f} agent_bf16_rss_mb={rss['agent_bf16']:.1f} "
          f"agent_read_rss_mb={rss['agent_read']:.1f} bare_rss_mb={rss['bare']:.1f} "
          f"lagging_graphs_kept={kept} lagging_float32_graphs_kept={kept32} "
          f"batches_alive={alive} bare_batches_alive={bare_alive}")


if __name__ == "__main__":
    main()
