"""The in-run tune against an offline grid search over the same knob space.

    python benchmarks/bench_tune.py [--models cnn,transformer] [--grid-precision 0.02]
                                    [--grid-max-steps 100] [--grid-max-s 45]

For each demo workload (``python -m agent.demo``, real training):

1. The in-run tune: a fresh run in its default configuration gets the ``tune`` command
   (the default knob set, as ``T`` sends it); the search's ``tune`` records give the
   steps it spent, the configuration it ended in, and its knob space (each knob's
   ladder of values).
2. The grid: every combination of that space, each in a fresh run started in that
   configuration, each measured the same way, with the tuner's own measure
   (:class:`agent.search.stats.Series`: the warm-up cut off by MSER), until its throughput's
   95% half-width is within ``--grid-precision`` of the mean, or
   ``--grid-max-steps`` measured steps, or ``--grid-max-s`` seconds of them. A
   combination that differs from another only in a setting without effect
   (``prefetch_factor`` with ``num_workers=0``, ``pin_memory`` without CUDA) is
   measured once. Grid steps are all the steps its runs trained, from their first.
3. If the tune ended elsewhere than the grid's best, the two configurations are measured
   again, in pairs of fresh runs in alternating order (``--rounds`` pairs), and the
   ratio is the geometric mean of the pairs': not the luck of the machine's load during
   the grid (on a shared host one configuration's throughput moved 2.4x within minutes).

Throughput is samples/s (tokens/s for the transformer) from the runs' own step records.
The machine's load moves the numbers (on a shared host, a lot): compare the ratios.

Last lines: ``RESULT[<model>] ...`` per workload, then ``RESULT tune_vs_best=<worst
ratio> tune_steps_share=<largest share> grid_best=<model:config;...>
tuned=<model:config;...>``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

from agent.wire import protocol, runs
from agent.wire.knobs import assignment
from agent.search.stats import Series
from gpuwatch.client import Subscriber, send_command

#: The demo's command-line flag for each knob a grid configuration sets.
DEMO_FLAGS = {"num_workers": "--num-workers", "prefetch_factor": "--prefetch-factor",
              "cpu_threads": "--cpu-threads", "kernels": "--kernels",
              "precision": "--precision", "accum_steps": "--accum-steps"}
#: Measured steps of a grid configuration at least.
GRID_MIN_STEPS = 8
#: Settings the demo has and no flag sets.
DEMO_DEFAULTS = {"pin_memory": False}
#: Longest wait for a run's next message (s): a step under heavy load can take seconds.
SILENCE_S = 120.0


class Demo:
    """A fresh ``python -m agent.demo`` run with its dashboard-side subscriber."""

    def __init__(self, model: str, config: dict[str, Any]) -> None:
        command = [sys.executable, "-m", "agent.demo", "--model", model]
        for knob, value in config.items():
            if knob in DEMO_FLAGS:
                command += [DEMO_FLAGS[knob], str(value)]
            elif value != DEMO_DEFAULTS.get(knob):
                raise SystemExit(f"bench_tune: the demo has no flag for {knob}={value}")
        self.child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.child.stdout.readline()  # the demo prints its run id once attached
        self.info = next(r for r in runs.list_runs() if r.pid == self.child.pid)
        self.subscriber = Subscriber(self.info)

    def next_message(self) -> dict[str, Any]:
        message = self.subscriber.recv(SILENCE_S)
        if message is None:
            raise SystemExit(f"bench_tune: the demo was silent for {SILENCE_S:.0f} s")
        return message

    def close(self) -> None:
        self.subscriber.close()
        self.child.terminate()
        self.child.wait(60)


def units_of(body: dict[str, Any]) -> int:
    return body.get("tokens") or body.get("samples") or 0


def measure(model: str, config: dict[str, Any], precision: float, max_steps: int,
            max_s: float) -> tuple[float, float, int]:
    """A fresh run in ``config``: ``(units/s, its 95% half-width, steps trained)``."""
    demo = Demo(model, config)
    try:
        series, last_step = Series(), 0
        while True:
            message = demo.next_message()
            body = message["body"]
            if message["type"] != protocol.STEP:
                continue
            last_step = body["step"]
            step_time_s, units = body.get("step_time_s"), units_of(body)
            if not step_time_s or not units:
                continue  # the first step has no time: it is warm-up anyway
            series.add(step_time_s, units)
            if len(series) <= GRID_MIN_STEPS:
                continue
            block = series.block()
            rate, spread = block.rate()
            if (block.n >= GRID_MIN_STEPS and spread <= precision * rate
                    or block.n >= max_steps or block.seconds >= max_s):
                return rate, spread, last_step
    finally:
        demo.close()


def in_run_tune(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tune from the demo's default configuration.

    Returns its last ``tune`` record, and the run's ``hello``."""
    demo = Demo(model, {})
    try:
        hello = None
        while (message := demo.next_message())["type"] != protocol.STEP:
            if message["type"] == protocol.HELLO:
                hello = message["body"]
        reply = send_command(demo.info, protocol.TUNE, {}, timeout_s=SILENCE_S)
        if not reply.get("ok"):
            raise SystemExit(f"bench_tune: tune refused: {reply.get('reason')}")
        while True:
            message = demo.next_message()
            body = message["body"]
            if message["type"] == protocol.EVENT and body.get("kind") in ("tune", "tuned"):
                print(f"  {body.get('text')}", flush=True)
            if message["type"] == protocol.TUNE and body.get("status") != "running":
                return body, hello or {}
    finally:
        demo.close()


def grid_configs(space: dict[str, list[Any]], defaults: dict[str, Any], cuda: bool
                 ) -> list[dict[str, Any]]:
    """Every combination of ``space``, once per effective configuration.

    As the loader normalises its settings: ``prefetch_factor`` without workers,
    ``pin_memory`` without CUDA, change nothing)."""
    configs, seen = [], set()
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values))
        if config.get("num_workers") == 0 and "prefetch_factor" in config:
            config["prefetch_factor"] = defaults["prefetch_factor"]
        if not cuda and "pin_memory" in config:
            config["pin_memory"] = defaults["pin_memory"]
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen.add(key)
            configs.append(config)
    return configs


def head_to_head(model: str, tuned: dict[str, Any], best: dict[str, Any],
                 args: argparse.Namespace) -> float:
    """Tuned over grid best, as the geometric mean of ``args.rounds`` pairs' ratios.

    Pairs of fresh runs in the order tuned-best, best-tuned, tuned-best, ... (a drift of the
    load cancels), as the geometric mean of the pairs' ratios."""
    ratios = []
    for round_ in range(args.rounds):
        order = (tuned, best) if round_ % 2 == 0 else (best, tuned)
        rates = {text(config): measure(model, config, args.grid_precision,
                                       args.grid_max_steps, args.grid_max_s)[0]
                 for config in order}
        ratios.append(rates[text(tuned)] / rates[text(best)])
        print(f"  head to head {round_ + 1}: tuned {rates[text(tuned)]:,.0f}/s, grid best "
              f"{rates[text(best)]:,.0f}/s", flush=True)
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def text(config: dict[str, Any]) -> str:
    return ",".join(assignment(knob, value) for knob, value in config.items())


def bench(model: str, args: argparse.Namespace) -> tuple[float, float, str, str]:
    print(f"{model}: in-run tune from the default configuration", flush=True)
    tuned, hello = in_run_tune(model)
    tuned_config, space = tuned["best"], tuned["space"]
    cuda = bool(((hello.get("env") or {}).get("cuda") or {}).get("available"))
    configs = grid_configs(space, tuned["baseline"], cuda)
    print(f"{model}: tune spent {tuned['steps']} steps; grid over {len(configs)} "
          f"configurations of {', '.join(f'{k} {v}' for k, v in space.items())}", flush=True)
    grid: dict[str, tuple[float, float, int]] = {}
    for config in configs:
        grid[text(config)] = result = measure(model, config, args.grid_precision,
                                              args.grid_max_steps, args.grid_max_s)
        print(f"  {text(config)}: {result[0]:,.0f} ± {result[1]:,.0f}/s, {result[2]} steps",
              flush=True)
    grid_steps = sum(steps for _, _, steps in grid.values())
    best = max(grid, key=lambda key: grid[key][0])
    best_config = next(config for config in configs if text(config) == best)
    tuned_key = text(tuned_config)
    if tuned_key == best:
        ratio = 1.0
    else:
        ratio = head_to_head(model, tuned_config, best_config, args)
    share = tuned["steps"] / grid_steps
    print(f"RESULT[{model}] tune_vs_best={ratio:.3f} tune_steps_share={share:.3f} "
          f"grid_best={best} tuned={tuned_key} tune_steps={tuned['steps']} "
          f"grid_steps={grid_steps} ({tuned.get('text', '')})", flush=True)
    return ratio, share, best, tuned_key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--grid-precision", type=float, default=0.02,
                        help="stop measuring a grid configuration at this 95%% half-width "
                             "over its mean (default: %(default).3f)")
    parser.add_argument("--grid-max-steps", type=int, default=100)
    parser.add_argument("--grid-max-s", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=4,
                        help="pairs of fresh runs of the tuned and the grid's best "
                             "configuration, when they differ (default 4)")
    args = parser.parse_args()
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-tune-"))
    results = {model: bench(model, args) for model in args.models.split(",")}
    print(f"RESULT tune_vs_best={min(r[0] for r in results.values()):.3f} "
          f"tune_steps_share={max(r[1] for r in results.values()):.3f} "
          f"grid_best={';'.join(f'{m}:{r[2]}' for m, r in results.items())} "
          f"tuned={';'.join(f'{m}:{r[3]}' for m, r in results.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
