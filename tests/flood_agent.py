"""A hostile fake agent for the dashboard's bounds: a run file and an ipc PUB socket in
``$GPUWATCH_RUN_DIR``, a ``hello`` once a dashboard subscribes, then ``COUNT`` rounds as
fast as ZeroMQ takes them of an ``event`` whose text is ``SIZE`` characters and a ``step``
with a ``SIZE``-byte string field (and one message over the receive limit), then
heartbeats until stdin closes.

    python tests/flood_agent.py RUN_ID COUNT SIZE

Prints ``ready`` once its run file is written and ``flooded N`` after the rounds.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time

import zmq

from agent.wire import protocol
from agent.wire.runs import RunInfo, remove_run_file, run_dir, write_run_file


def main() -> int:
    run_id, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    directory = run_dir()
    pub = zmq.Context.instance().socket(zmq.XPUB)  # hears when a dashboard subscribes
    pub.setsockopt(zmq.SNDHWM, 16)  # this process stays small too
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{directory}/{run_id}.flood.pub"
    pub.bind(endpoint)
    info = RunInfo(run_id=run_id, rank=0, world_size=1, pid=os.getpid(),
                   pub_endpoint=endpoint, cmd_endpoint="", token=secrets.token_hex(16),
                   started_at=time.time(), name="flood")
    write_run_file(info, directory)
    seq = 0

    def send(msg_type: str, body: dict, block: bool = False) -> None:
        nonlocal seq
        seq += 1
        frames = protocol.encode(protocol.envelope(msg_type, body, run=run_id, seq=seq))
        try:
            pub.send_multipart(frames, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            pass

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    hello = {"name": "flood", "pid": os.getpid(), "device": "cpu", "world_size": 1,
             "knobs": [], "started_at": info.started_at}
    filler = "A" * size
    try:
        if not pub.poll(120_000):  # the flood starts when someone listens
            return 1
        pub.recv()
        sent = 0
        next_hello = 0.0
        for round_ in range(count):
            if stop.is_set():
                break
            if time.monotonic() >= next_hello:  # so a late subscriber knows the run
                next_hello = time.monotonic() + 0.5
                send(protocol.HELLO, hello, block=True)
            send(protocol.EVENT, {"level": "warning", "text": f"FLOOD {round_} {filler}"})
            send(protocol.STEP, {"step": round_, "step_time_s": 0.01, "loss": 1.0,
                                 "input_verdict": filler, "knobs": {}})
            send(protocol.HEARTBEAT, {"step": round_, "ending": False}, block=True)
            sent += 2
            if round_ % 100 == 0:  # one over the limit: never held, never shown
                pub.send_multipart([b"event", b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1)],
                                   flags=zmq.NOBLOCK)
        print(f"flooded {sent}", flush=True)
        while not stop.wait(0.2):
            send(protocol.HEARTBEAT, {"step": count, "ending": False})
    finally:
        remove_run_file(info)
        pub.close(linger=0)
        os.unlink(endpoint[len("ipc://"):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
