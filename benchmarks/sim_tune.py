"""The in-run search (agent.search.tuner.Tuner) on a simulated run.

How many steps it spends and how often it ends within 5% of the best configuration, at three
levels of noise.

    python benchmarks/sim_tune.py [--runs 200] [--seed 0]

The simulated run is the CNN demo on this project's 2-core machine, as measured live
(samples/s of each cpu_threads / num_workers setting, alternated in one run): a worker
with both compute threads is slower than none, one thread alone is slower, a worker with
one thread is the fastest. Each step's time has multiplicative noise, the host's load
drifts as a random walk, a few steps are bursts (another process takes the core), and a
DataLoader worker restarts at each epoch (every 22 steps: the demo's loader has no
persistent workers) and at each switch. ``prefetch_factor`` changes nothing. A command
applies ``--latency-steps`` after the step record it was decided on (the agent's I/O
thread reads records in batches, and a command applies two boundaries after the last
step it has seen).

It runs the real Tuner (its statistics, sub-blocks, futility rules, the trade of a
worker for a thread), fed step records directly: no process, no clock, a second per
level. Use it to see what a change of the search's constants costs and buys before
measuring it for real with bench_tune.py. Last line: ``RESULT steps=<mean at each level>
within_5pct=<share at each level>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.wire.knobs import CPU_THREADS, NUM_WORKERS, PREFETCH_FACTOR, Knob, KnobSet  # noqa: E402
from agent.search.request import TuneRequest  # noqa: E402
from agent.search.tuner import Tuner  # noqa: E402

#: samples/s at (num_workers, cpu_threads), measured live on the CNN demo here.
RATE = {(0, 2): 1500, (1, 2): 1230, (1, 1): 1900, (0, 1): 1250, (2, 1): 1850, (2, 2): 1300}
SAMPLES = 64  # the demo's micro-batch
EPOCH_STEPS = 22
WORKER_START_S = 0.18
#: (name, per-step noise (sd of a half-normal factor), load drift, share of bursts)
LEVELS = (("quiet", 0.15, 0.3, 0.0), ("busy", 0.25, 0.6, 0.02), ("heavy", 0.3, 1.0, 0.05))


def one_search(seed: int, noise: float, drift: float, bursts: float, latency_steps: int
               ) -> tuple[int, float]:
    """One search from the demo's default: (steps spent, best's rate over the best's)."""
    rng = random.Random(seed)
    values = {"cpu_threads": 2, "num_workers": 0, "prefetch_factor": 2}
    knobs = KnobSet()
    for spec in (CPU_THREADS, NUM_WORKERS, PREFETCH_FACTOR):
        knobs.add(Knob(spec, get=lambda name=spec.name: values[name], set=lambda _: None))
    sent: list[tuple[int, str, str, object]] = []  # (step it applies at, command)
    step, since_epoch, load = 0, 0, 1.0
    tuner = Tuner(TuneRequest({"knobs": list(values)}, knobs), knobs, 1,
                  send=lambda *command: sent.append((step + latency_steps, *command)),
                  publish=lambda *_: None, cpus=2)
    while tuner.status == "running" and step < 10_000:
        step += 1
        restarted = False
        due = [command for command in sent if command[0] <= step]
        sent[:] = [command for command in sent if command[0] > step]
        for _, command_id, knob, value in due:
            previous, values[knob] = values[knob], value
            tuner.on_event({"kind": "applied", "id": command_id, "knob": knob,
                            "value": value, "previous": previous, "step": step})
            if knob == "num_workers":
                restarted, since_epoch = True, 0
        load = max(0.5, load + rng.gauss(0, 0.02) * drift)
        seconds = SAMPLES / RATE[values["num_workers"], values["cpu_threads"]] * load \
            * (1 + noise * abs(rng.gauss(0, 1)))
        if rng.random() < bursts:
            seconds *= 3
        since_epoch += 1
        if values["num_workers"] and (restarted or since_epoch % EPOCH_STEPS == 0):
            seconds += WORKER_START_S
        tuner.on_step(step, seconds, SAMPLES, None, 1.0, False)
    best = tuner.best["num_workers"], tuner.best["cpu_threads"]
    return tuner.steps, RATE[best] / max(RATE.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="searches per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-steps", type=int, default=4,
                        help="steps from a step record to the command decided on it")
    args = parser.parse_args()
    steps_means, shares = [], []
    for name, noise, drift, bursts in LEVELS:
        results = [one_search(args.seed + run, noise, drift, bursts, args.latency_steps)
                   for run in range(args.runs)]
        steps = sorted(spent for spent, _ in results)
        share = sum(ratio >= 0.95 for _, ratio in results) / len(results)
        steps_means.append(statistics.mean(steps))
        shares.append(share)
        print(f"{name:>6}: {statistics.mean(steps):.0f} steps (p90 "
              f"{steps[int(0.9 * len(steps))]}), within 5% of the best in {share:.0%}",
              flush=True)
    print("RESULT steps=" + ",".join(f"{mean:.0f}" for mean in steps_means)
          + " within_5pct=" + ",".join(f"{share:.2f}" for share in shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
