"""The live source: a thread that reads a run's telemetry socket into a RunState."""

from __future__ import annotations

import threading
import time

import zmq

from agent.runs import RunInfo
from gpuwatch.client import Subscriber
from gpuwatch.sources import Source

#: How long the thread waits for a message before checking whether to stop (s).
POLL_S = 0.1
#: Messages folded per lock acquisition at most, so the app never waits long.
BATCH = 1000


class LiveSource(Source):
    """Telemetry of a live run, received on a SUB socket in a daemon thread.

    Args:
        info: the run (from :func:`agent.runs.find_run`); commands go to it too.
    """

    def __init__(self, info: RunInfo) -> None:
        super().__init__(info, f"run {info.run_id} at {info.pub_endpoint}")
        self._info = info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="gpuwatch-live",
                                        daemon=True)

    def start(self) -> None:
        """Start the receiving thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; returns within about :data:`POLL_S` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_S + 1.0)

    def _receive(self) -> None:
        try:
            subscriber = Subscriber(self._info)  # the socket lives in this thread
        except zmq.ZMQError as exc:  # e.g. a malformed endpoint in the run file
            with self.lock:
                self.state.log("error",
                               f"cannot subscribe to {self._info.pub_endpoint}: {exc}")
            return
        with subscriber:
            while not self._stop.is_set():
                frames = subscriber.recv_frames(POLL_S)
                if frames is None:
                    continue
                with self.lock:
                    now = time.monotonic()
                    self.state.ingest_frames(frames, now)
                    for _ in range(BATCH - 1):
                        frames = subscriber.recv_frames(0)
                        if frames is None:
                            break
                        self.state.ingest_frames(frames, now)
