"""``gpuwatch export --prometheus HOST:PORT``: this user's live runs as Prometheus metrics.

Served at ``http://HOST:PORT/metrics`` (prometheus_client).

A thread follows every live run file (every rank) of this user, as the dashboard does:
it subscribes to each, folds what arrives into a :class:`~gpuwatch.state.RunState` per
rank, and forgets a rank once its run file is gone. A scrape reads those states: every
metric is named ``gpuwatch_*`` with ``run`` and ``rank`` labels (``knob`` and ``value``
for knob values, ``kind`` for memory, ``gpu`` for GPUs). Counters (``*_total``, the
``_sum`` and ``_count`` of the step time and data wait summaries) count what this
exporter saw since it started following the rank. Units are in the names (seconds,
bytes, per second, percent, watts, celsius) as Prometheus' conventions ask.

Who can read them: HTTP has no notion of users, so without a token every process that
can reach the address reads every metric (run names, losses, knob values): on
``127.0.0.1`` every user of the machine, on another address every host that reaches it.
With a token file (``--token-file PATH``) a scrape must carry ``Authorization: Bearer
<the file's content>`` (Prometheus: ``authorization: {credentials_file: PATH}``); any
other request is answered 401 without a metric.
"""

from __future__ import annotations

import hmac
import ipaddress
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import zmq
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, Metric,
                                    SummaryMetricFamily)
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from agent.wire.nodes import SecretError, create_secret, load_secret
from agent.wire.protocol import printable
from agent.wire.runs import list_runs
from gpuwatch.client import Subscriber
from gpuwatch.history import number
from gpuwatch.state import RunState
from gpuwatch.units import knob_text

#: How often the run files are looked at again (s).
RESCAN_S = 1.0
#: How long the thread waits for records before looking at the run files (s).
POLL_S = 0.1
#: Messages received from one rank per wake-up at most.
BATCH = 1000
#: Ranks followed at once at most (a run directory is this user's, but bounded anyway).
MAX_RANKS = 256
#: Memory fields of a step record and their ``kind`` label.
MEMORY_KINDS = (("host_rss", "host_rss_bytes"), ("cuda_allocated", "mem_allocated_bytes"),
                ("cuda_reserved", "mem_reserved_bytes"),
                ("cuda_peak_reserved", "mem_peak_reserved_bytes"))
#: Per-GPU fields of a system record, as (metric suffix, field, help).
GPU_FIELDS = (("gpu_utilization_percent", "util_pct", "GPU utilisation, percent"),
              ("gpu_memory_used_bytes", "mem_used_bytes", "GPU memory used, bytes"),
              ("gpu_power_watts", "power_w", "GPU power draw, watts"),
              ("gpu_temperature_celsius", "temp_c", "GPU temperature, degrees Celsius"))


@dataclass
class Followed:
    """One rank being followed: its state and what this exporter counted.

    Attributes:
        run_id, rank, name: the rank's identity (``name`` from its run file, until
            its hello says). subscriber: its telemetry socket (the follower's
            thread's). state: its records folded.
        steps_total, step_time_s_total, data_wait_s_total, samples_total,
        tokens_total, knob_changes_total: sums over what was seen (steps, s, samples,
            tokens, changes).
    """

    run_id: str
    rank: int
    name: str
    subscriber: Subscriber
    state: RunState = field(default_factory=RunState)
    steps_total: int = 0
    step_time_s_total: float = 0.0
    data_wait_s_total: float = 0.0
    samples_total: float = 0.0
    tokens_total: float = 0.0
    knob_changes_total: int = 0
    _counted: int = 0  # state.steps_total already summed
    _changes_counted: int = 0

    def fold(self, frames: list[bytes]) -> None:
        """Fold one received message and add its step (if it is one) to the sums."""
        self.state.ingest_frames(frames)
        new = self.state.steps_total - self._counted
        if new <= 0:
            return
        self._counted = self.state.steps_total
        for record in list(self.state.steps)[-new:]:
            self.steps_total += 1
            self.step_time_s_total += record.step_time_s or 0.0
            self.data_wait_s_total += record.data_wait_s or 0.0
        body = self.state.last_step  # the steps of one message are alike in size
        self.samples_total += (number(body.get("samples")) or 0.0) * new
        self.tokens_total += (number(body.get("tokens")) or 0.0) * new
        changes = len(self.state.knob_changes)
        self.knob_changes_total += max(0, changes - self._changes_counted)
        self._changes_counted = changes


class RunFollower:
    """The thread that follows every live rank of this user (see the module)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.followed: dict[tuple[str, int], Followed] = {}
        """Ranks followed, by ``(run id, rank)``; read under :attr:`lock`."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="gpuwatch-prometheus")

    def start(self) -> None:
        """Start following (returns at once)."""
        self._thread.start()

    def close(self) -> None:
        """Stop following and close the sockets; returns within about a second."""
        self._stop.set()
        self._thread.join(timeout=2 * RESCAN_S + 1.0)

    def _rescan(self) -> None:
        try:
            live = {(info.run_id, info.rank): info for info in list_runs()}
        except OSError:
            return  # the run directory went away: keep what is followed
        with self.lock:
            for key in [key for key in self.followed if key not in live]:
                self.followed.pop(key).subscriber.close()
            for key, info in live.items():
                if key in self.followed or len(self.followed) >= MAX_RANKS:
                    continue
                try:
                    subscriber = Subscriber(info)
                except zmq.ZMQError:
                    continue  # a malformed endpoint: looked at again next time
                followed = Followed(info.run_id, info.rank, info.name, subscriber)
                followed.state.primary_rank = info.rank
                self.followed[key] = followed

    def _run(self) -> None:
        next_scan = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_scan:
                    self._rescan()
                    next_scan = time.monotonic() + RESCAN_S
                with self.lock:
                    sockets = {f.subscriber.socket: f for f in self.followed.values()}
                if not sockets:
                    self._stop.wait(POLL_S)
                    continue
                poller = zmq.Poller()
                for socket in sockets:
                    poller.register(socket, zmq.POLLIN)
                ready = dict(poller.poll(int(POLL_S * 1000)))
                with self.lock:
                    for socket in ready:
                        followed = sockets[socket]
                        for _ in range(BATCH):
                            frames = followed.subscriber.recv_frames(0)
                            if frames is None:
                                break
                            followed.fold(frames)
        finally:
            with self.lock:
                for followed in self.followed.values():
                    followed.subscriber.close()
                self.followed.clear()


class RunsCollector(Collector):
    """The metrics of every rank a :class:`RunFollower` follows, at each scrape."""

    def __init__(self, follower: RunFollower) -> None:
        self.follower = follower

    def collect(self) -> Iterator[Metric]:
        """The ``gpuwatch_*`` metric families (see the module)."""
        labels = ["run", "rank"]
        info = GaugeMetricFamily("gpuwatch_run_info", "A run's rank being followed (1), "
                                 "with its name and device",
                                 labels=[*labels, "name", "device"])
        up = GaugeMetricFamily("gpuwatch_run_up", "1 while the rank is live "
                               "(training, compiling, stalled or paused), 0 once gone or ended",
                               labels=labels)
        step = GaugeMetricFamily("gpuwatch_optimizer_step",
                                 "The last optimizer step completed", labels=labels)
        steps = CounterMetricFamily("gpuwatch_steps", "Optimizer steps seen",
                                    labels=labels)
        step_time = SummaryMetricFamily("gpuwatch_step_time_seconds",
                                        "Time of an optimizer step, seconds",
                                        labels=labels)
        data_wait = SummaryMetricFamily("gpuwatch_data_wait_seconds",
                                        "Time an optimizer step waited for data, seconds",
                                        labels=labels)
        samples = CounterMetricFamily("gpuwatch_samples", "Samples trained on",
                                      labels=labels)
        tokens = CounterMetricFamily("gpuwatch_tokens", "Tokens trained on (token "
                                     "models)", labels=labels)
        gauges = {name: GaugeMetricFamily(f"gpuwatch_{name}", doc, labels=labels)
                  for name, doc in (
                      ("last_step_time_seconds", "The last step's time, seconds"),
                      ("samples_per_second", "The last step's throughput, samples/s"),
                      ("tokens_per_second", "The last step's throughput, tokens/s"),
                      ("loss", "The last step's loss"),
                      ("data_wait_share", "Share of step time waiting for data over the "
                                          "agent's window (0..1)"),
                      ("host_cpu_percent", "Host CPU, percent of all cores"))}
        memory = GaugeMetricFamily("gpuwatch_memory_bytes", "Memory of the training "
                                   "process (kind: host_rss, cuda_allocated, "
                                   "cuda_reserved, cuda_peak_reserved, activation), bytes",
                                   labels=[*labels, "kind"])
        knob = GaugeMetricFamily("gpuwatch_knob_info", "A knob's current value (1)",
                                 labels=[*labels, "knob", "value"])
        changes = CounterMetricFamily("gpuwatch_knob_changes", "Knob value changes seen",
                                      labels=labels)
        missed = CounterMetricFamily("gpuwatch_records_missed", "Records lost between "
                                     "the run and this exporter", labels=labels)
        gpus = {suffix: GaugeMetricFamily(f"gpuwatch_{suffix}", doc,
                                          labels=[*labels, "gpu"])
                for suffix, _, doc in GPU_FIELDS}
        now = time.monotonic()
        with self.follower.lock:
            for followed in self.follower.followed.values():
                state = followed.state
                if state.first_seen_at is None:
                    continue  # nothing heard yet
                key = [printable(followed.run_id, 100), str(followed.rank)]
                info.add_metric([*key, printable(state.hello.get("name") or followed.name,
                                                 100),
                                 printable(state.hello.get("device", ""), 100)], 1)
                up.add_metric(key, state.status_at(now) in ("live", "compiling",
                                                            "stalled", "paused",
                                                            "evaluating", "saving"))
                if state.step is not None:
                    step.add_metric(key, state.step)
                steps.add_metric(key, followed.steps_total)
                step_time.add_metric(key, followed.steps_total, followed.step_time_s_total)
                data_wait.add_metric(key, followed.steps_total, followed.data_wait_s_total)
                samples.add_metric(key, followed.samples_total)
                if followed.tokens_total:
                    tokens.add_metric(key, followed.tokens_total)
                body = state.last_step
                for name, value in (
                        ("last_step_time_seconds", body.get("step_time_s")),
                        ("samples_per_second", body.get("samples_per_s")),
                        ("tokens_per_second", body.get("tokens_per_s")),
                        ("loss", body.get("loss")),
                        ("data_wait_share", body.get("data_wait_share_window",
                                                     body.get("data_wait_share"))),
                        ("host_cpu_percent", (state.system or {}).get("cpu_pct"))):
                    if (figure := number(value)) is not None:
                        gauges[name].add_metric(key, figure)
                for kind, name in MEMORY_KINDS:
                    if (figure := number(body.get(name))) is not None:
                        memory.add_metric([*key, kind], figure)
                if state.activation_bytes is not None:
                    memory.add_metric([*key, "activation"], state.activation_bytes)
                for name, value in state.knobs.items():
                    knob.add_metric([*key, printable(name, 100), printable(knob_text(value), 100)],
                                    1)
                changes.add_metric(key, followed.knob_changes_total)
                missed.add_metric(key, state.missed)
                for gpu in (state.system or {}).get("gpus") or ():
                    if not isinstance(gpu, dict):
                        continue
                    for suffix, name, _ in GPU_FIELDS:
                        if (figure := number(gpu.get(name))) is not None:
                            gpus[suffix].add_metric(
                                [*key, printable(gpu.get("index", "?"), 20)], figure)
        yield from (info, up, step, steps, step_time, data_wait, samples, tokens,
                    *gauges.values(), memory, knob, changes, missed, *gpus.values())


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: no port, or a port outside 0..65535.
    """
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def bearer_only(app: WsgiApp, token: bytes) -> WsgiApp:
    """``app``, answering only requests that carry ``Authorization: Bearer <token>``.

    The token is compared in constant time; any other request gets 401 and no metric."""
    expected = b"Bearer " + token

    def checked(environ: dict[str, Any], start_response: Callable[..., Any]
                ) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", 'Bearer realm="gpuwatch"')])
        return [b"a bearer token is required (gpuwatch export --token-file)\n"]

    return checked


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """No line per request on stderr."""


def start_server(host: str, port: int, registry: CollectorRegistry,
                 token: bytes | None) -> tuple[WSGIServer, threading.Thread]:
    """An HTTP server of ``registry``'s metrics on ``host:port`` (IPv4 or IPv6).

    A thread per request, requiring ``token`` (:func:`bearer_only`) from its first request
    when one is given; serving in a daemon thread when this returns.

    Raises:
        OSError: it cannot listen there.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    app: WsgiApp = make_wsgi_app(registry)
    server = make_server(str(address[0]), port, bearer_only(app, token) if token else app,
                         Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True,
                              name="gpuwatch-prometheus-http")
    thread.start()
    return server, thread


def read_token(path: Path) -> tuple[bytes, bool]:
    """The token in ``path``, and whether it was made.

    It is made first (random, mode 0600) when there is none.

    Raises:
        agent.wire.nodes.SecretError: the file is refused (a link, another user's, readable
            or writable by others, too short or long; the message says why).
        OSError: it cannot be made.
    """
    made = False
    try:
        create_secret(path)
        made = True
    except FileExistsError:
        pass
    return load_secret(path), made


def serve_forever(address: str, token_file: str | None = None) -> int:
    """Serve the metrics at ``address`` until SIGINT or SIGTERM; returns the exit status.

    ``address`` is ``HOST:PORT`` (port 0 picks a free one); prints the URL first. With
    ``token_file``, a scrape must carry its token (:func:`read_token`, :func:`bearer_only`).
    Returns the exit status (2: a bad address or token file, 1: it cannot listen there)."""
    try:
        host, port = parse_address(address)
        token, made = read_token(Path(token_file)) if token_file else (None, False)
    except (ValueError, SecretError) as exc:
        print(f"gpuwatch export --prometheus: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print("gpuwatch export --prometheus: cannot make the token file "
              f"{printable(token_file, 200)}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    registry = CollectorRegistry(auto_describe=False)
    follower = RunFollower()
    registry.register(RunsCollector(follower))
    try:
        server, thread = start_server(host, port, registry, token)
    except OSError as exc:
        print(f"gpuwatch export --prometheus: cannot listen on {host}:{port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    follower.start()
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    bound = server.server_address
    address = str(bound[0])  # an IP address: a TCP server's is a str (bytes only for others)
    shown = f"[{address}]" if ":" in address else address
    print(f"serving gpuwatch_* metrics of this user's live runs at "
          f"http://{shown}:{bound[1]}/metrics (Ctrl-C stops)", flush=True)
    if token_file:
        print(f"scrapes need the bearer token in {printable(token_file, 200)}"
              + (" (made now, mode 0600)" if made else ""), flush=True)
    else:
        print("note: no --token-file: every " + (
            "user of this machine" if _loopback(address) else "host that reaches it")
            + " can read these metrics", file=sys.stderr, flush=True)
    stopped.wait()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    follower.close()
    return 0
