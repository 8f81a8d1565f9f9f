"""How much telemetry the dashboard takes.

The ingest rate of batched step records against a floor, and the running dashboard's CPU and
memory under load.

    python benchmarks/bench_stream.py [--records 400000] [--seconds 60]
    python benchmarks/bench_stream.py --short        # a quick check that it works

Step records travel as the agent sends them: ``steps`` batches of 100 rows (1,000
steps/s and 10 I/O wake-ups a second), the columns and common fields an agent on the host sends.

1. Ingest, in this process: the same encoded batches are (a) decoded with msgpack alone,
   the floor no reader can beat, and (b) decoded and folded into a ``RunState`` (what the
   dashboard's live source does with each message it receives), repeated and interleaved;
   the best of the repetitions of each, in records (steps) per second. Then the end-to-end
   figure: a publisher process sends ``--records`` rows over ipc as fast as it can and the
   dashboard's own ``LiveSource`` receives, decodes and folds them (both processes share
   this machine's CPUs).
2. Load: the real dashboard (Textual, headless driver, redrawing as usual) attached to a
   run fed by 8 simulated ranks at 1,000 steps/s each (one batch of 100 per rank every
   100 ms, and heartbeats) for ``--seconds``; its process's CPU (% of one core) and its RSS
   at the start and the end of the window (flat memory: the buffers are bounded).

Last line: ``RESULT ingest_records_per_s=<i> floor_records_per_s=<f>
dashboard_cpu_pct=<d> dashboard_rss_mb=<m>``: ``i`` is (b), decode and fold (target
>= 500,000), ``f`` the floor (a); ``d`` the dashboard at 8 x 1,000 steps/s (target < 10%
of one core), ``m`` its RSS at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import msgpack
import psutil
import zmq

from agent.wire import protocol
from agent.wire.runs import RunInfo
from gpuwatch.sources.live import LiveSource
from gpuwatch.state import RunState

RANKS = 8
BATCH_ROWS = 100
STEPS_PER_S = 1000

PUBLISHER = """
import sys, time, zmq
sys.path[:0] = [sys.argv[3]]
from bench_stream import batch_message
from agent.wire import protocol
endpoint, count = sys.argv[1], int(sys.argv[2])
pub = zmq.Context.instance().socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(endpoint)
time.sleep(1.0)  # let the subscriber connect (PUB/SUB slow joiner)
seq = 0
for first in range(1, count + 1, 100):
    seq += 1
    pub.send_multipart(protocol.encode(batch_message(0, first, seq)))
pub.send_multipart(protocol.encode(protocol.envelope("bye", {"reason": "done"}, run="bench",
                                                     seq=seq + 1)))
time.sleep(2.0)
"""

DASHBOARD = """
import sys
from agent.wire.runs import RunInfo
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
info = RunInfo(run_id="bench", rank=0, world_size=8, pid=0, pub_endpoint=sys.argv[1],
               cmd_endpoint="", token="", started_at=0.0, name="bench")
GpuwatchApp(LiveSource(info), readonly=True).run(headless=True, size=(120, 40))
"""


def batch_message(rank: int, first_step: int, seq: int, rows: int = BATCH_ROWS,
                  step_time_s: float = 0.001) -> dict:
    """A ``steps`` envelope of ``rows`` steps from ``first_step``, as an agent sends it."""
    steps = list(range(first_step, first_step + rows))
    times = [step_time_s * (1 + 0.01 * (step % 7)) for step in steps]
    waits = [0.0001] * rows
    columns = {
        "step": steps, "micro_batches": [1] * rows, "samples": [32] * rows,
        "step_time_s": times, "data_wait_s": waits,
        "data_wait_share": [w / t for w, t in zip(waits, times)],
        "samples_per_s": [32 / t for t in times],
        "loss": [2.0 + 1.0 / step for step in steps], "gpu_step_time_s": [None] * rows,
        "skipped_steps_total": [0] * rows,
        "data_wait_share_window": [0.1] * rows, "input_verdict": ["compute-bound"] * rows,
    }
    common = {"host_rss_bytes": 1 << 29, "host_peak_rss_bytes": 1 << 29,
              "knobs": {"precision": "fp32", "accum_steps": 1, "num_workers": 2}}
    return protocol.envelope(protocol.STEPS, protocol.steps_body(columns, common),
                             run="bench", rank=rank, seq=seq)


def _info(endpoint: str) -> RunInfo:
    return RunInfo(run_id="bench", rank=0, world_size=RANKS, pid=os.getpid(),
                   pub_endpoint=endpoint, cmd_endpoint="", token="", started_at=0.0)


def measure_fold(records: int, repeats: int = 5) -> tuple[float, float]:
    """``(decode and fold, msgpack decode alone)`` in records/s, best of ``repeats``."""
    frames = [protocol.encode(batch_message(0, first, seq))
              for seq, first in enumerate(range(1, records + 1, BATCH_ROWS), 1)]
    rows = len(frames) * BATCH_ROWS
    fold_s, floor_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _, payload in frames:
            msgpack.unpackb(payload, raw=False, strict_map_key=False)
        floor_s.append(time.perf_counter() - start)
        state = RunState(primary_rank=0)
        start = time.perf_counter()
        for frame in frames:
            state.ingest_frames(frame, 1.0)
        fold_s.append(time.perf_counter() - start)
        assert state.steps_total == rows and state.malformed == 0, state.malformed
    return rows / min(fold_s), rows / min(floor_s)


def measure_live(directory: str, records: int) -> float:
    endpoint = f"ipc://{directory}/ingest.pub"
    here = os.path.dirname(os.path.abspath(__file__))
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, endpoint, str(records),
                                  here])
    source = LiveSource(_info(endpoint))
    source.start()
    first_at = None
    while True:
        with source.lock:
            folded, ended = source.state.steps_total, source.state.ended
        if folded and first_at is None:
            first_at = time.perf_counter()
        if ended:
            break
        time.sleep(0.005)
    elapsed = time.perf_counter() - first_at
    with source.lock:
        folded, missed = source.state.steps_total, source.state.missed
    source.close()
    publisher.wait(30)
    print(f"end to end (publisher process -> ipc -> LiveSource): {folded} records folded "
          f"in {elapsed:.2f} s, {folded / elapsed:,.0f} records/s ({missed} batches "
          "dropped at the high-water mark)")
    return folded / elapsed


def measure_dashboard(directory: str, seconds: float) -> tuple[float, float, float]:
    endpoint = f"ipc://{directory}/load.pub"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    dashboard = subprocess.Popen([sys.executable, "-c", DASHBOARD, endpoint],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process = psutil.Process(dashboard.pid)
    seq = [0] * RANKS
    next_step = [1] * RANKS
    tick_s = BATCH_ROWS / STEPS_PER_S  # each rank's I/O thread wakes every 100 ms
    warmup_s = 3.0
    start = time.perf_counter()
    next_tick = start
    next_heartbeat = start
    measured_from = None
    cpu_start = rss_start = 0.0
    sent = 0
    while True:
        now = time.perf_counter()
        if measured_from is None and now - start >= warmup_s:
            measured_from = now
            times = process.cpu_times()
            cpu_start = times.user + times.system
            rss_start = process.memory_info().rss / 2**20
        if measured_from is not None and now - measured_from >= seconds:
            break
        for rank in range(RANKS):
            seq[rank] += 1
            pub.send_multipart(protocol.encode(batch_message(
                rank, next_step[rank], seq[rank], step_time_s=0.001 * (1 + 0.02 * rank))))
            next_step[rank] += BATCH_ROWS
            sent += BATCH_ROWS
        if now >= next_heartbeat:
            next_heartbeat += 1.0
            for rank in range(RANKS):
                seq[rank] += 1
                pub.send_multipart(protocol.encode(protocol.envelope(
                    "heartbeat", {"step": next_step[rank] - 1}, run="bench", rank=rank,
                    seq=seq[rank])))
        next_tick += tick_s
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    elapsed = time.perf_counter() - measured_from
    times = process.cpu_times()
    cpu_pct = (times.user + times.system - cpu_start) / elapsed * 100
    rss_end = process.memory_info().rss / 2**20
    dashboard.terminate()
    dashboard.wait(10)
    pub.close(linger=0)
    print(f"dashboard at {sent / (time.perf_counter() - start):,.0f} records/s from {RANKS} "
          f"ranks in batches of {BATCH_ROWS}: {cpu_pct:.1f}% of one core over "
          f"{elapsed:.0f} s; RSS {rss_start:.1f} -> {rss_end:.1f} MiB")
    return cpu_pct, rss_start, rss_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--short", action="store_true", help="100,000 records, 10 s")
    args = parser.parse_args()
    if args.short:
        args.records, args.seconds = 100_000, 10.0
    fold, floor = measure_fold(args.records)
    print(f"ingest in batches of {BATCH_ROWS}: decode + fold {fold:,.0f} records/s, msgpack "
          f"decode alone (the floor) {floor:,.0f} records/s: {fold / floor:.2f} of the floor")
    with tempfile.TemporaryDirectory(prefix="gw-stream-") as directory:
        measure_live(directory, args.records)
        cpu_pct, _, rss_end = measure_dashboard(directory, args.seconds)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"RESULT ingest_records_per_s={fold:.0f} floor_records_per_s={floor:.0f} "
          f"dashboard_cpu_pct={cpu_pct:.1f} dashboard_rss_mb={rss_end:.1f}")


if __name__ == "__main__":
    main()
