"""What each monitor adds to one optimizer step of a small real training loop (CPU).

In CPU time per thread and in wall-clock time.

    python benchmarks/bench_overhead.py [--steps 2000] [--rounds 15] [--all]
    python benchmarks/bench_overhead.py --short        # a quick check that it works
    python benchmarks/bench_overhead.py --device cuda  # the model loop on a GPU

With ``--device cuda`` the model loop's step is the launch of its kernels (about 0.1 ms
of CPU on a fast host, the GPU's work queued behind it): the step that a per-step
observer slows most, as a small model on a fast GPU is; the paced loop keeps that step.

One process, one loop (a 2-layer MLP on scikit-learn's digits, one torch thread, about
0.5 ms a step on a quiet core: 1,000+ steps/s), run under each monitor in turn,
interleaved (the order rotates each round) and repeated. Monitors:

- bare:            the loop alone
- tqdm:            a tqdm progress bar around the loader (the cheapest thing people add)
- agent:           gpuwatch's agent (``agent.session``), no dashboard connected
- agent+sub:       the agent with a subscriber process reading every record
- floor (on the paced loop only): the least per-step Python an observer that times the
  data wait and records each step can run (:func:`run_floor`): two frames, a tuple
  appended, no thread: what the agent's training-thread part would cost at best in
  Python
- naive_logger, torch_profiler (with ``--all``): psutil + memory stats each step on the
  training thread; torch.profiler with a wait/warmup/active schedule

Two loops: the model loop above, and a **paced loop** (:class:`PacedLoop`, run bare,
under tqdm and under the agent, ``--paced-pairs`` times a round, interleaved with the others): no
model, each step a GIL-free sleep to the bare model step's duration (measured before
the rounds), so the loop keeps the model loop's step rate and the agent's threads do
their real work a step, while the process's CPU carries no torch compute and its noise.

Measures, each per optimizer step:

- **The training process's CPU beyond the bare loop's** (``agent_cpu_us_per_step``): the
  whole process's CPU (``time.process_time``: every thread: the training thread's, the
  agent's I/O thread's, ZeroMQ's) over the loop, minus the training thread's CPU inside
  the steps (:class:`TimedStep`: the sleeps' system calls and timers, 5 to 30 us a step,
  which vary with the machine's load), minus the same for the bare paced loop in the
  same round; mean over the pairs with its 95% interval. It counts the agent's per-step
  code on the training thread as it runs between real steps (after a wait, its caches
  cold: several times its cost in a tight loop), the I/O thread's batches and wake-ups,
  ZeroMQ's threads, and the loop's last batch (the I/O thread is woken at the loop's
  end, as ``stop`` would). It leaves out the agent's start-up and end (once a run),
  its run-log writer (another process: ``ak`` below), and what the agent's threads
  might add to the model's own compute (caches or a core shared), which only the model
  loop's whole-process difference would show.
- **The same on the model loop, as a cross-check**: the whole process's CPU minus the
  bare loop's (``agent_model_cpu_us_per_step``: torch's step, about 590 us of CPU that
  varies between rounds, makes its interval tens of us wide), and that with each
  loop's steps' own CPU (the model's forward, backward and update) left out
  (``agent_model_ex_cpu_us_per_step``: the paced figure's meaning on the real loop; the
  step's CPU is read to the ns, so its noise goes, but the agent's code then runs
  after torch's, on caches torch used).
- **Per thread**: the per-thread CPU clock (``clock_gettime`` of each thread's CPU
  clock) of every thread the monitor starts (the agent's I/O thread and ZeroMQ's
  background threads; tqdm's monitor thread), read once the monitor has handled the
  last step; the training thread's own CPU time (``time.thread_time``) minus the bare
  loop's in the same round (noisy); and, measured alone without a model (a loop that
  only iterates, its caches warm), the CPU each monitor's per-step code adds to the
  training thread (the agent's loader wrapper and ``optimizer_step``; tqdm's
  iteration). The monitor threads' CPU is GIL time the training thread may have to
  wait for. And the CPU of the agent's run-log writer, a child process
  (``agent.io.logwriter``), from the loop's start until it has written the loop's last
  frame (its start-up and its end, once a run, not counted, as the agent's are not):
  machine CPU the agent costs outside the training process.
- **Wall clock**: the ratio of each round's step time under the monitor to the bare
  loop's in the same round; mean over rounds with a 95% confidence interval (Student t).
- **The training thread's time lost**: its wall time off its CPU (wall minus its CPU
  time) under the agent minus the bare loop's in the same round: its waits for the GIL
  while the agent's threads hold it, and for a core they took. CPython shows no GIL
  hold time; the agent's threads' CPU is its upper bound (they release the GIL in
  system calls and ZeroMQ's).

Last line: ``RESULT agent_cpu_us_per_step=<a> agent_cpu_ci95=<ac>
agent_train_cpu_us_per_step=<at> agent_threads_cpu_us_per_step=<ah>
agent_child_cpu_us_per_step=<ak> agent_overhead_ratio=<r> agent_overhead_ci95=<c>
agent_sub_overhead_ratio=<s> tqdm_cpu_us_per_step=<t> tqdm_overhead_ratio=<tr>
tqdm_overhead_ci95=<tc> agent_model_cpu_us_per_step=<m> agent_model_cpu_ci95=<mc>
agent_model_ex_cpu_us_per_step=<x> agent_model_ex_cpu_ci95=<xc>
tqdm_paced_cpu_us_per_step=<q> tqdm_paced_cpu_ci95=<qc> floor_paced_cpu_us_per_step=<f>
floor_paced_cpu_ci95=<fc> paced_step_us=<p>``:
``a`` is the training process's CPU a step beyond the bare loop's, all its threads, on
the paced loop (target <= 3 us at 1,000+ steps/s) and ``ac`` the half-width of its 95%
interval; ``q``/``qc`` the same for tqdm (a progress bar: the reference of what a
per-step observer costs between real steps), ``f``/``fc`` the floor's; ``m``/``mc`` and
``x``/``xc`` the model loop's cross-checks, ``p`` the paced loop's step (us); ``at`` the
training thread's share (its per-step code measured alone), ``ah`` the agent's own
threads'; ``ak`` its run-log writer process's (not in ``a``:
another process, but the machine's CPU all the same); ``r`` the mean wall-clock ratio
and ``c`` the half-width of its 95% interval (target: an interval that reaches 1.02 or
less), ``s`` the ratio with a subscriber reading; ``t`` tqdm's CPU a step (its per-step
code on the training thread, measured alone, and its monitor thread), ``tr`` and ``tc``
its wall-clock ratio and interval.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from itertools import repeat

import psutil
import torch
from sklearn.datasets import load_digits
from tqdm import tqdm

import agent
from agent.wire import runs

SUBSCRIBER = """
import sys
from agent.wire import runs
from gpuwatch.client import Subscriber
info = [r for r in runs.list_runs() if r.run_id == sys.argv[1]][0]
with Subscriber(info) as sub:
    print("ready", flush=True)
    while True:
        message = sub.recv(30)
        if message is None or message["type"] == "bye":
            break
"""


def thread_cpu_s(tid: int) -> float | None:
    """CPU time (s) of thread ``tid`` of this process; None once the thread has ended.

    Linux's per-thread CPU clock, as ``pthread_getcpuclockid`` gives it."""
    try:
        return time.clock_gettime((~tid << 3) | 6)  # MAKE_THREAD_CPUCLOCK(tid, SCHED)
    except OSError:
        return None


def thread_ids() -> set[int]:
    """Native ids of this process's threads (Python's and native ones: ZeroMQ's)."""
    return {int(name) for name in os.listdir("/proc/self/task")}


def process_cpu_s(pid: int) -> float:
    """CPU time (s) of process ``pid``'s first thread so far (all of a one-thread process's).

    Linux's scheduler statistics, in ns (``ps`` and psutil count 10 ms ticks)."""
    with open(f"/proc/{pid}/schedstat") as stats:
        return int(stats.read().split()[0]) / 1e9


def settled_cpu_s(pid: int, quiet_s: float = 0.05, timeout_s: float = 30.0) -> float:
    """:func:`process_cpu_s` of ``pid`` once it has used no CPU for ``quiet_s`` (s).

    The agent no longer waits for its run-log writer's start-up (an interpreter and its
    imports, ~0.1 s of CPU): this waits it out, so that it is not counted as the loop's."""
    deadline = time.monotonic() + timeout_s
    cpu_s = process_cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        cpu_s, before = process_cpu_s(pid), cpu_s
        if cpu_s == before:
            break
    return cpu_s


class Clocks:
    """CPU time of the threads started since :meth:`start`, and of the training thread.

    ``start()`` before the monitor starts its threads (it notes the threads there are),
    ``begin()`` at the loop's start, ``end()`` once the monitor has handled the loop's
    last step, before it stops its threads. ``child_cpu_s``: the CPU (s) of the
    monitor's child process over the loop, where it has one (set by the monitor's run)."""

    child_cpu_s = 0.0

    def start(self) -> None:
        self._before = thread_ids()

    def begin(self) -> None:
        self._tids = thread_ids() - self._before
        self._cpu0 = {tid: thread_cpu_s(tid) or 0.0 for tid in self._tids}
        self._process0 = time.process_time()
        self._train_loop: float | None = None
        self._train0 = time.thread_time()
        self._wall0 = time.perf_counter()

    def end(self) -> tuple[float, float, float, float]:
        """``(wall s, training thread CPU s, monitor threads' CPU s, process CPU s)`` since begin().

        Process CPU: the process's (all its threads) without the training thread's after the
        loop, so a wait for the monitor's last step (a call of :meth:`end` after the loop's)
        is not counted."""
        wall = time.perf_counter() - self._wall0
        train = time.thread_time() - self._train0
        if self._train_loop is None:
            self._train_loop = train
        process = time.process_time() - self._process0 - (train - self._train_loop)
        threads = thread_ids() - self._before
        monitor = sum((thread_cpu_s(tid) or 0.0) - self._cpu0.get(tid, 0.0)
                      for tid in threads)
        return wall, self._train_loop, monitor, process


def make_loop(batch_size: int = 64, hidden: int = 512, device: str = "cpu"):
    """The model loop: ``(batch_stream(steps), step(inputs, targets) -> loss)``.

    A 2-layer MLP (64 -> ``hidden`` -> 10) trained by SGD on scikit-learn's digits in
    batches of ``batch_size``, model and batches on ``device``. On CUDA the stream
    synchronizes the device after its last batch, so that a loop's wall time counts the
    queued kernels' end, not their launch."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long, device=device)
    batches = list(zip(x.split(batch_size), y.split(batch_size)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10)).to(device)
    on_cuda = torch.device(device).type == "cuda"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.functional.cross_entropy

    def batch_stream(steps):
        for i in range(steps):
            yield batches[i % len(batches)]
        if on_cuda:
            torch.cuda.synchronize()

    def step(inputs, targets):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return batch_stream, step


class TimedStep:
    """A loop's step that sums the training thread's CPU inside it.

    ``step(inputs, targets)`` returns the loss; :attr:`cpu_s` sums ``time.thread_time``
    around each call (two reads a step, about 0.1 us each, in every loop alike), so that
    the model's compute, the same with or without a monitor, can be taken out of the
    process's CPU with its noise."""

    def __init__(self, step) -> None:
        self._step = step
        #: the training thread's CPU (s) inside the steps since it was last set to 0
        self.cpu_s = 0.0

    def __call__(self, inputs, targets):
        cpu0 = time.thread_time()
        loss = self._step(inputs, targets)
        self.cpu_s += time.thread_time() - cpu0
        return loss


class PacedLoop:
    """A loop without a model whose steps take ``step_s`` (s) of wall time, off the CPU.

    The bare model loop's step rate, without torch's compute. Each step's "compute" is
    a ``time.sleep`` (it releases the GIL, as torch's kernels do) until the step's due
    time (``step_s`` after the previous one's, so that the sleep's own lateness, tens of
    us, does not slow the rate); its loss, a 0-dim host tensor that requires grad, as a
    real step's. ``stream`` and ``step`` as :func:`make_loop`'s; the stream yields
    ``batch`` (the model loop's first ``(inputs, targets)``) at every step, so that a
    monitor reads a real batch's tensors as it does in the model loop."""

    def __init__(self, step_s: float, batch: tuple) -> None:
        self.step_s = step_s
        self.batch = batch
        self._loss = torch.tensor(0.5, requires_grad=True)
        self._due = 0.0

    def stream(self, steps: int):
        self._due = time.perf_counter()
        return repeat(self.batch, steps)

    def step(self, inputs, targets):
        self._due += self.step_s
        wait_s = self._due - time.perf_counter()
        if wait_s > 0:
            time.sleep(wait_s)
        else:  # late by more than the step (a busy machine): the next one from now
            self._due -= wait_s
        return self._loss


def run_bare(stream, step, steps, clocks):
    clocks.start()
    clocks.begin()
    for inputs, targets in stream(steps):
        step(inputs, targets)
    return clocks.end()


def run_tqdm(stream, step, steps, clocks):
    with open(os.devnull, "w") as devnull:
        clocks.start()
        bar = tqdm(stream(steps), total=steps, file=devnull)  # starts its monitor thread
        clocks.begin()
        for inputs, targets in bar:
            step(inputs, targets)
        return clocks.end()


def _handled(run, step: int, timeout_s: float = 10.0) -> None:
    """Wake the agent's I/O thread (as :meth:`agent.io.ioloop.IOLoop.stop` does) and wait
    until it has published step ``step`` (plus one poll, for the batch's send), so its CPU
    for the loop is all counted: the wake-up that would have come anyway, without the
    wait of up to a quiet poll (0.5 s) with its 1 Hz samples, which are not the loop's."""
    os.write(run.agent._io._wake[1], b"\0")
    deadline = time.monotonic() + timeout_s
    while (run.agent._encoder.expected_step or 0) <= step and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.06)


#: The run log's writer writes a frame at most this long after its first record (s).
WRITER_FLUSH_S = 0.6


def run_agent(stream, step, steps, clocks, subscriber=False):
    clocks.start()
    with agent.session(name="bench-overhead") as run:
        deadline = time.monotonic() + 30  # its start-up (hello, with the environment
        while run.agent._io.seq < 1 and time.monotonic() < deadline:  # report) is not a step's
            time.sleep(0.005)
        writer = run.agent._io._log.pid  # the run log's writer process (one thread)
        reader = None
        if subscriber:
            reader = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, run.agent.run_id],
                                      stdout=subprocess.PIPE, text=True)
            assert reader.stdout.readline().strip() == "ready"
        writer_started = settled_cpu_s(writer)  # (its start-up is not a step's)
        clocks.begin()
        for inputs, targets in run.loader(stream(steps)):
            loss = step(inputs, targets)
            run.optimizer_step(loss)
        wall, train, _, _ = clocks.end()
        _handled(run, steps)
        _, _, monitor, process = clocks.end()
        time.sleep(WRITER_FLUSH_S)  # the writer has read the last step and written its frame
        clocks.child_cpu_s = process_cpu_s(writer) - writer_started
    if reader is not None:
        reader.wait(30)
    return wall, train, monitor, process


def timed_batches(batches, window: list[float]):
    """``batches``, each ``next()`` timed and its wait added to ``window[0]`` (s).

    The least a loader wrapper does (:func:`run_floor`'s)."""
    now = time.perf_counter
    iterator = iter(batches)
    while True:
        start = now()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        window[0] += now() - start
        yield batch


def run_floor(stream, step, steps, clocks):
    """The floor: the least per-step Python that times the data wait and records each step.

    What an observer can run on the training thread, with no thread of its own: a
    generator that times each ``next()``, and after each step a clock read, a tuple of
    the step's numbers appended to a bounded deque and a pending-command check. What
    the agent's training-thread part would cost were it all in two frames; its I/O
    thread's work (reading, encoding, publishing) is not in it."""
    records: deque = deque(maxlen=8192)
    pending: list = []
    window = [0.0]
    clocks.start()
    clocks.begin()
    last = time.perf_counter()
    for number, (inputs, targets) in enumerate(timed_batches(stream(steps), window), 1):
        loss = step(inputs, targets)
        now = time.perf_counter()
        records.append((number, 1, 64, window[0], loss, now - last))
        last, window[0] = now, 0.0
        if pending:
            pending.clear()
    return clocks.end()


def run_naive_logger(stream, step, steps, clocks):
    process = psutil.Process()
    log = []
    clocks.start()
    clocks.begin()
    for inputs, targets in stream(steps):
        loss = step(inputs, targets)
        log.append((loss.item(), process.memory_info().rss, psutil.cpu_percent(),
                    torch.cuda.memory_allocated() if torch.cuda.is_available() else 0))
    return clocks.end()


def run_profiler(stream, step, steps, clocks):
    schedule = torch.profiler.schedule(wait=50, warmup=10, active=20, repeat=0)
    with contextlib.ExitStack() as stack:
        clocks.start()
        profiler = stack.enter_context(torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
            on_trace_ready=lambda p: None))
        clocks.begin()
        for inputs, targets in stream(steps):
            step(inputs, targets)
            profiler.step()
        return clocks.end()


MONITORS = {
    "bare": run_bare,
    "tqdm": run_tqdm,
    "agent": run_agent,
    "agent+sub": lambda stream, step, steps, clocks: run_agent(stream, step, steps, clocks,
                                                               subscriber=True),
}
EXTRA = {"naive_logger": run_naive_logger, "torch_profiler": run_profiler}
#: Run on the paced loop (:func:`make_paced_loop`), interleaved with the others.
PACED = {"paced bare": run_bare, "paced tqdm": run_tqdm, "paced agent": run_agent,
         "paced floor": run_floor}


def hot_path_cpu_us(steps: int, repeats: int = 5) -> dict[str, float]:
    """The training thread's CPU a step that each monitor's per-step code adds, in us a step.

    Measured without a model (so torch's noise is absent): a loop that only iterates, bare,
    under tqdm and through the agent's loader and ``optimizer_step``; the best of
    ``repeats`` minus the bare loop's, in us a step."""
    loss = torch.tensor(0.5, requires_grad=True)  # (as a step's loss: it requires grad)
    batches = [(torch.zeros(64, 64), torch.zeros(64, dtype=torch.long))] * steps  # (as the loop's)

    def bare():
        start = time.thread_time()
        for _ in iter(batches):
            pass
        return time.thread_time() - start

    def with_tqdm():
        with open(os.devnull, "w") as devnull:
            bar = tqdm(batches, total=steps, file=devnull)
            start = time.thread_time()
            for _ in bar:
                pass
            return time.thread_time() - start

    def with_agent():
        with agent.session(name="bench-hot-path") as run:
            start = time.thread_time()
            for _ in run.loader(batches):
                run.optimizer_step(loss)
            return time.thread_time() - start

    best = {name: min(f() for _ in range(repeats))
            for name, f in (("bare", bare), ("tqdm", with_tqdm), ("agent", with_agent))}
    return {name: (cpu - best["bare"]) / steps * 1e6 for name, cpu in best.items()}


def t_95(df: int) -> float:
    """Two-sided 95% Student t quantile for ``df`` degrees of freedom."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:  # a table is enough here
        table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31,
                 9: 2.26, 10: 2.23, 14: 2.14, 19: 2.09, 29: 2.05}
        return table.get(df, table[min(table, key=lambda k: abs(k - df))])


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.inf
    return mean, t_95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--paced-pairs", type=int, default=3,
                        help="paced bare/agent pairs a round (each about 2 x 1.5 s)")
    parser.add_argument("--paced-step-us", type=float, default=None,
                        help="the paced loop's step (us; default: the bare model step, "
                             "measured once, which a busy machine can make several times "
                             "longer: give one value to compare runs)")
    parser.add_argument("--device", default="cpu",
                        help="the model loop's device (cuda: its step is kernel launches, "
                             "the GPU's work queued behind them)")
    parser.add_argument("--all", action="store_true", help="also naive_logger, torch_profiler")
    parser.add_argument("--short", action="store_true", help="500 steps x 4 rounds")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads (1: a shared machine's other load does not "
                             "stall the loop's OpenMP barriers)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.short:
        args.steps, args.rounds = 500, 4
    os.environ.setdefault(runs.RUN_DIR_ENV, tempfile.mkdtemp(prefix="gw-bench-"))
    os.environ.setdefault("GPUWATCH_LOG_DIR", tempfile.mkdtemp(prefix="gw-bench-logs-"))
    monitors = {**MONITORS, **(EXTRA if args.all else {})}
    stream, step = make_loop(device=args.device)
    run_bare(stream, step, 200, Clocks())  # warm up
    calibration = min(args.steps, 1000)
    paced_step_s = (args.paced_step_us / 1e6 if args.paced_step_us
                    else run_bare(stream, step, calibration, Clocks())[0] / calibration)
    model_step = TimedStep(step)
    loops = {name: (stream, model_step) for name in monitors}
    paced = PacedLoop(paced_step_s, next(iter(stream(1))))
    paced_step = TimedStep(paced.step)
    loops.update((name, (paced.stream, paced_step)) for name in PACED)
    monitors.update(PACED)
    samples: dict[str, list[tuple[float, float, float, float, float, float]]] = {
        name: [] for name in monitors}
    for round_index in range(args.rounds):
        order = list(monitors) + list(PACED) * (args.paced_pairs - 1)
        order = order[round_index % len(order):] + order[:round_index % len(order)]
        for name in order:
            clocks = Clocks()
            timed = loops[name][1]
            timed.cpu_s = 0.0
            row = monitors[name](*loops[name], args.steps, clocks)
            samples[name].append((*row, clocks.child_cpu_s, timed.cpu_s))
    n = args.steps
    bare_wall = [row[0] / n * 1e6 for row in samples["bare"]]
    bare_train = [row[1] / n * 1e6 for row in samples["bare"]]
    bare_process = [row[3] / n * 1e6 for row in samples["bare"]]
    print(f"bare loop: {statistics.median(bare_wall):.1f} us a step "
          f"({1e6 / statistics.median(bare_wall):.0f} steps/s), {args.rounds} interleaved "
          f"rounds of {n} steps, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, model on "
          f"{args.device}")
    print(f"{'monitor':<15}{'wall us':>9}{'ratio':>8}{'95% CI':>9}"
          f"{'process +cpu us':>17}{'95% CI':>8}{'train +cpu us':>15}{'threads cpu us':>16}"
          f"{'child cpu us':>14}")
    figures = {}
    for name, rows in samples.items():
        if name in PACED:
            continue
        wall = [row[0] / n * 1e6 for row in rows]
        ratio, ci = mean_ci([w / b for w, b in zip(wall, bare_wall)])
        process, process_ci = mean_ci([row[3] / n * 1e6 - b
                                       for row, b in zip(rows, bare_process)])
        train_added = statistics.median(row[1] / n * 1e6 - b
                                        for row, b in zip(rows, bare_train))
        threads = statistics.median(row[2] / n * 1e6 for row in rows)
        child = statistics.median(row[4] / n * 1e6 for row in rows)
        figures[name] = (ratio, ci, process, process_ci, threads, child)
        print(f"{name:<15}{statistics.median(wall):>9.1f}{ratio:>8.4f}"
              f"{'±' + format(ci, '.4f'):>9}{process:>17.2f}{'±' + format(process_ci, '.2f'):>8}"
              f"{train_added:>15.2f}{threads:>16.2f}{child:>14.2f}")
    print("'process +cpu': the process's CPU (all its threads) minus the bare loop's in the "
          "same round, mean; 'train +cpu': the training thread's alone (median); 'threads': "
          "the monitor's own threads (the agent's I/O thread and ZeroMQ's; median); 'child': "
          "its child process, the agent's run-log writer (median; not in 'process'); the "
          "differences carry torch's noise")
    beyond = {}  # the process's CPU a step beyond the bare loop's, the steps' own left out
    for label, bare_name, agent_name in (("model loop", "bare", "agent"),
                                         ("paced loop", "paced bare", "paced agent"),
                                         ("paced loop, tqdm", "paced bare", "paced tqdm"),
                                         ("paced loop, floor", "paced bare", "paced floor")):
        bare_rows, agent_rows = samples[bare_name], samples[agent_name]
        beyond[label] = mean_ci([((row[3] - row[5]) - (bare[3] - bare[5])) / n * 1e6
                                 for row, bare in zip(agent_rows, bare_rows)])
        train, train_ci = mean_ci([((row[1] - row[5]) - (bare[1] - bare[5])) / n * 1e6
                                   for row, bare in zip(agent_rows, bare_rows)])
        print(f"{label}, the steps' own CPU left out: bare "
              f"{statistics.median(r[3] - r[5] for r in bare_rows) / n * 1e6:.2f} us a step "
              f"(its steps {statistics.median(r[5] for r in bare_rows) / n * 1e6:.1f}); "
              f"{agent_name.split()[-1]} adds {beyond[label][0]:.2f} ± "
              f"{beyond[label][1]:.2f} us (training thread "
              f"{train:.2f} ± {train_ci:.2f}, its threads "
              f"{statistics.median(r[2] for r in agent_rows) / n * 1e6:.2f}) at "
              f"{statistics.median(n / r[0] for r in agent_rows):.0f} steps/s")
    agent_process, agent_process_ci = beyond["paced loop"]
    hot = hot_path_cpu_us(min(args.steps, 2000))
    agent_ratio, agent_ci, model_process, model_process_ci, agent_threads, agent_child = \
        figures["agent"]
    tqdm_cpu = hot["tqdm"] + figures["tqdm"][4]
    print(f"training thread's per-step code alone (no model, best of 5): agent "
          f"{hot['agent']:.2f} us a step (loader wrapper, clock reads, marker, record, "
          f"deque append, pending-command check), tqdm {hot['tqdm']:.2f} us")
    print(f"agent, all its work a step: {agent_threads + hot['agent'] + agent_child:.2f} us "
          f"of CPU ({agent_threads:.2f} on its threads, {hot['agent']:.2f} on the training "
          f"thread, {agent_child:.2f} in its run-log writer process); the training "
          f"process's CPU beyond the bare loop's: {agent_process:.2f} "
          f"± {agent_process_ci:.2f} us on the paced loop; on the model loop "
          f"{model_process:.2f} ± {model_process_ci:.2f} (tqdm {figures['tqdm'][2]:.2f} "
          f"± {figures['tqdm'][3]:.2f}: torch's noise)")
    lost, lost_ci = mean_ci([((row[0] - row[1]) - (bare[0] - bare[1])) / n * 1e6
                             for row, bare in zip(samples["agent"], samples["bare"])])
    print(f"the training thread's time lost to the agent (off its CPU beyond the bare "
          f"loop's: GIL waits, a core taken): {lost:.2f} ± {lost_ci:.2f} us a step")
    print(f"RESULT agent_cpu_us_per_step={agent_process:.2f} "
          f"agent_cpu_ci95={agent_process_ci:.2f} "
          f"agent_train_cpu_us_per_step={hot['agent']:.2f} "
          f"agent_threads_cpu_us_per_step={agent_threads:.2f} "
          f"agent_child_cpu_us_per_step={agent_child:.2f} "
          f"agent_overhead_ratio={agent_ratio:.4f} agent_overhead_ci95={agent_ci:.4f} "
          f"agent_sub_overhead_ratio={figures['agent+sub'][0]:.4f} "
          f"tqdm_cpu_us_per_step={tqdm_cpu:.2f} tqdm_overhead_ratio={figures['tqdm'][0]:.4f} "
          f"tqdm_overhead_ci95={figures['tqdm'][1]:.4f} "
          f"agent_model_cpu_us_per_step={model_process:.2f} "
          f"agent_model_cpu_ci95={model_process_ci:.2f} "
          f"agent_model_ex_cpu_us_per_step={beyond['model loop'][0]:.2f} "
          f"agent_model_ex_cpu_ci95={beyond['model loop'][1]:.2f} "
          f"tqdm_paced_cpu_us_per_step={beyond['paced loop, tqdm'][0]:.2f} "
          f"tqdm_paced_cpu_ci95={beyond['paced loop, tqdm'][1]:.2f} "
          f"floor_paced_cpu_us_per_step={beyond['paced loop, floor'][0]:.2f} "
          f"floor_paced_cpu_ci95={beyond['paced loop, floor'][1]:.2f} "
          f"paced_step_us={paced_step_s * 1e6:.1f}")


if __name__ == "__main__":
    main()
