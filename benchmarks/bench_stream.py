"""How much telemetry the dashboard takes: ingest rate, and CPU and memory under load.

    python benchmarks/bench_stream.py [--records 200000] [--rate 8000] [--seconds 30]

1. Ingest: a publisher process sends ``--records`` step records over ipc as fast as it
   can; this process receives them through the dashboard's own live source (receive,
   decode, fold into RunState; no drawing) and reports records folded per second.
2. Load: the real dashboard (Textual, headless driver, redrawing as usual) attached to a
   run fed ``--rate`` step records a second from 8 simulated ranks for ``--seconds``;
   reports the dashboard process's CPU (% of one core) and RSS at the start and the end
   of the window (flat memory: the buffers are bounded).

Last line: ``RESULT ingest_records_per_s=<x> dashboard_cpu_pct=<y> dashboard_rss_mb=<z>``
(targets: >= 50,000 records/s; < 25% of one core at 8,000 records/s; flat memory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil
import zmq

from agent import protocol
from agent.runs import RunInfo
from gpuwatch.sources.live import LiveSource

RANKS = 8

PUBLISHER = """
import sys, time, zmq
from agent import protocol
endpoint, count = sys.argv[1], int(sys.argv[2])
pub = zmq.Context.instance().socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(endpoint)
time.sleep(1.0)  # let the subscriber connect (PUB/SUB slow joiner)
body = {"step": 0, "micro_batches": 1, "samples": 32, "step_time_s": 0.01,
        "data_wait_s": 0.001, "data_wait_share": 0.1, "samples_per_s": 3200.0,
        "loss": 2.3, "knobs": {"precision": "fp32", "accum_steps": 1},
        "host_rss_bytes": 1 << 29}
frames = []
for seq in range(1, count + 1):
    body["step"] = seq
    pub.send_multipart(protocol.encode(protocol.envelope("step", body, run="bench", seq=seq)))
pub.send_multipart(protocol.encode(protocol.envelope("bye", {"reason": "done"}, run="bench",
                                                     seq=count + 1)))
time.sleep(2.0)
"""

DASHBOARD = """
import sys
from agent.runs import RunInfo
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
info = RunInfo(run_id="bench", rank=0, world_size=8, pid=0, pub_endpoint=sys.argv[1],
               cmd_endpoint="", token="", started_at=0.0, name="bench")
GpuwatchApp(LiveSource(info), readonly=True).run(headless=True, size=(120, 40))
"""


def _info(endpoint: str) -> RunInfo:
    return RunInfo(run_id="bench", rank=0, world_size=RANKS, pid=os.getpid(),
                   pub_endpoint=endpoint, cmd_endpoint="", token="", started_at=0.0)


def measure_ingest(directory: str, records: int) -> float:
    endpoint = f"ipc://{directory}/ingest.pub"
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, endpoint, str(records)])
    source = LiveSource(_info(endpoint))
    source.start()
    first_at = None
    while True:
        with source.lock:
            folded, ended = source.state.records, source.state.ended
        if folded and first_at is None:
            first_at = time.perf_counter()
        if ended:
            break
        time.sleep(0.005)
    elapsed = time.perf_counter() - first_at
    with source.lock:
        folded, missed = source.state.records, source.state.missed
    source.close()
    publisher.wait(30)
    print(f"ingest: {folded} records folded in {elapsed:.2f} s "
          f"({missed} dropped at the high-water mark)")
    return folded / elapsed


def measure_dashboard(directory: str, rate: int, seconds: float) -> tuple[float, float, float]:
    endpoint = f"ipc://{directory}/load.pub"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    dashboard = subprocess.Popen([sys.executable, "-c", DASHBOARD, endpoint],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process = psutil.Process(dashboard.pid)
    seq = [0] * RANKS
    tick_s = 0.01
    per_tick = max(1, int(rate * tick_s))
    warmup_s = 3.0
    start = time.perf_counter()
    next_tick = start
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
        for _ in range(per_tick):
            rank = sent % RANKS
            seq[rank] += 1
            sent += 1
            body = {"step": seq[rank], "micro_batches": 1, "samples": 32,
                    "step_time_s": 0.001 * (1 + rank), "data_wait_s": 0.0001,
                    "data_wait_share": 0.1, "samples_per_s": 32000.0, "loss": 2.0,
                    "knobs": {"precision": "fp32", "accum_steps": 1},
                    "host_rss_bytes": 1 << 29}
            pub.send_multipart(protocol.encode(protocol.envelope(
                "step", body, run="bench", rank=rank, seq=seq[rank])))
            if sent % RANKS == 0:
                pub.send_multipart(protocol.encode(protocol.envelope(
                    "heartbeat", {"step": seq[0]}, run="bench", rank=0, seq=0)))
        next_tick += tick_s
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    elapsed = time.perf_counter() - measured_from
    times = process.cpu_times()
    cpu_pct = (times.user + times.system - cpu_start) / elapsed * 100
    rss_end = process.memory_info().rss / 2**20
    dashboard.terminate()
    dashboard.wait(10)
    pub.close(linger=0)
    print(f"dashboard at {sent / (time.perf_counter() - start):.0f} records/s from {RANKS} "
          f"ranks: {cpu_pct:.1f}% of one core over {elapsed:.0f} s; RSS {rss_start:.1f} -> "
          f"{rss_end:.1f} MiB")
    return cpu_pct, rss_start, rss_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=8000)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gw-stream-") as directory:
        ingest = measure_ingest(directory, args.records)
        cpu_pct, _, rss_end = measure_dashboard(directory, args.rate, args.seconds)
    print(f"RESULT ingest_records_per_s={ingest:.0f} dashboard_cpu_pct={cpu_pct:.1f} "
          f"dashboard_rss_mb={rss_end:.1f}")


if __name__ == "__main__":
    main()
