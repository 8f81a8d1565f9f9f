"""A run under a hostile dashboard side, against the same disturbance aimed at a decoy.

Killed dashboards, a stalled subscriber and a command flood, in one run.

    python benchmarks/bench_faults.py [--phase-s 20] [--kills 50]

The demo transformer trains in a child process (agent attached). Phases:

- quiet:    nothing else runs;
- decoy:    the disturbance below, aimed at a decoy agent in this process (the same
            CPU load on the machine, nothing reaching the run);
- attacked: the same disturbance aimed at the run.

Disturbance: ``--kills`` dashboards (``gpuwatch tail``) started and killed with SIGKILL
once they receive a record, one subscriber connected that never reads, a flood of
1,000 commands a second with a wrong token, and the attacks of another local user who
knows the ports but not the keys (``tests/tcp_attack.py``, as ``nobody`` when this runs
as root: a 4 MB subscription, 300 connections of 64 x 64 KB messages, 1,200 raw
connections held open; the run is on tcp, behind its CURVE gateway). The decoy is an
agent on tcp in this process, with its own gateway and keys, that trains nothing: the
same sockets, handshakes and clients.
Throughput is read from the run's own log (every step is there). The verdict compares
attacked with decoy: on a 2-core machine the clients' own CPU use slows any process, so
the quiet phase is reported but is not the reference.

The decoy and attacked phases alternate ``--rounds`` times; means are compared.

Last line: ``RESULT attacked_vs_decoy=<ratio> attacked_vs_quiet=<ratio> steps_logged=<n>
steps_expected=<n> attacker_messages=<n>`` (what reached the keyless attacker: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from agent.wire import protocol, runs
from agent.step.core import Agent


ATTACK = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests",
                      "tcp_attack.py")


def disturb(pub_endpoint: str, cmd_endpoint: str, seconds: float, kills: int,
            run_dir: str) -> tuple[int, dict]:
    """Run the disturbance against the endpoints for ``seconds``.

    Returns the kills done and what the keyless attacker got (``tests/tcp_attack.py``'s
    result)."""
    command = [sys.executable, ATTACK, pub_endpoint, cmd_endpoint, run_dir]
    env = None
    if os.geteuid() == 0 and shutil.which("setpriv"):  # as another local user: nobody
        # (the gateway shares connections out per user: a same-user attacker would take
        # the owner's share, and could read the run file anyway)
        command = [shutil.which("setpriv"), "--reuid=nobody", "--regid=nogroup",
                   "--clear-groups", *command]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/",
               "PYTHONPATH": os.path.join(os.path.dirname(ATTACK), os.pardir)}
    attacker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env, cwd="/" if env else None)
    if attacker.stdout.readline().strip() != "ready":
        raise RuntimeError("the attacker did not start")
    context = zmq.Context.instance()
    stalled = context.socket(zmq.SUB)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.connect(pub_endpoint)
    stop = threading.Event()

    def flood() -> None:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 100)
        dealer.connect(cmd_endpoint)
        frames = protocol.encode(protocol.envelope("command", {
            "id": 1, "knob": "precision", "value": "fp16", "token": "wrong"}, run="x"))
        while not stop.is_set():
            for _ in range(10):
                try:
                    dealer.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            try:
                while True:
                    dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.01)  # 1,000 commands a second
        dealer.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    deadline = time.monotonic() + seconds
    done = 0
    while time.monotonic() < deadline and done < kills:
        client = subprocess.Popen([sys.executable, "-m", "gpuwatch", "tail", "--json",
                                   "--run", pub_endpoint], stdout=subprocess.PIPE)
        client.stdout.readline()  # attached and reading
        client.send_signal(signal.SIGKILL)
        client.wait()
        done += 1
    while time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    flooder.join()
    stalled.close()
    attacker.stdin.close()
    got = json.loads(attacker.stdout.readline())
    attacker.wait(60)
    return done, got


def steps_between(log_path: str, start: float, end: float) -> int:
    count = 0
    with open(log_path, "rb") as log:
        for line in log:
            record = json.loads(line)
            if record["type"] == "step" and start <= record["t"] < end:
                count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--kills", type=int, default=50, help="in all, over the rounds")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="gw-faults-")
    os.environ[runs.RUN_DIR_ENV] = directory
    os.environ["GPUWATCH_LOG_DIR"] = os.path.join(directory, "logs")
    child = subprocess.Popen([sys.executable, "-m", "agent.demo", "--model", "transformer",
                              "--transport", "tcp"], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    info = next(r for r in runs.list_runs() if r.pid == child.pid)
    decoy = Agent(name="decoy", transport="tcp").start()
    rates: dict[str, list[float]] = {"quiet": [], "decoy": [], "attacked": []}
    killed = leaked = 0
    try:
        time.sleep(3.0)  # warm-up steps
        for phase in ["quiet"] + ["decoy", "attacked"] * args.rounds:
            start = time.time()
            note = ""
            if phase == "quiet":
                time.sleep(args.phase_s)
            else:
                target = decoy.info if phase == "decoy" else info
                done, got = disturb(target.pub_endpoint, target.cmd_endpoint, args.phase_s,
                                    -(-args.kills // args.rounds), directory)
                if phase == "attacked":
                    killed += done
                    leaked += got["received"] + got["replies"]
                note = (f"  ({done} dashboards killed; the keyless attacker held "
                        f"{got['raw_connections']} raw connections, got "
                        f"{got['received'] + got['replies']} messages)")
            end = time.time()
            time.sleep(1.0)  # the log is flushed every 0.5 s
            rates[phase].append(steps_between(info.log_path, start, end) / (end - start))
            print(f"{phase:<9} {rates[phase][-1]:6.1f} steps/s{note}")
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(30)
        decoy.close()
    mean = {phase: sum(values) / len(values) for phase, values in rates.items()}
    with open(info.log_path, "rb") as log:
        records = [json.loads(line) for line in log]
    steps = [r["step"] for r in records if r["type"] == "step"]
    bye = [r for r in records if r["type"] == "bye"]
    expected = bye[-1]["steps"] if bye else max(steps)
    print(f"run log: {len(steps)} step records for {expected} optimizer steps; "
          f"{killed} dashboards killed while attached to the run; "
          f"{leaked} messages reached the keyless attacker")
    print(f"RESULT attacked_vs_decoy={mean['attacked'] / mean['decoy']:.3f} "
          f"attacked_vs_quiet={mean['attacked'] / mean['quiet']:.3f} "
          f"steps_logged={len(steps)} steps_expected={expected} "
          f"attacker_messages={leaked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
