"""Shared fixtures and helpers: a private run directory, a fake agent with real sockets
for testing the dashboard alone, and the one wait of the tests (:func:`wait_until`, and
:func:`until` for a Textual app); test modules import the helpers from here."""

from __future__ import annotations

import compileall
import os
import queue
from collections import deque
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

#: One intra-op thread for torch in the tests and every child they start (inherited), set
#: before torch is first imported: the tests' kernels are tiny, and on a busy 2-core
#: machine OpenMP's spinning second thread made them many times slower (30 steps of the
#: demo transformer: 1.1 s of CPU on one thread, 21 s on two). Every comparison of the
#: tests runs both sides with it; a test of the ``cpu_threads`` knob sets another count.
#: An ``OMP_NUM_THREADS`` already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: No Textual animations in the tests (an animated scroll then jumps to where it ends):
#: a pilot's key waits for the animations it starts (the help's "end": about 1 s of
#: smooth scrolling, 1.6 s of wall of each size's test_help_scrolls...); what the tests
#: read is where the screen ends up, which animations do not change. Saves 18 s of the
#: dashboard's and snapshots' 2.4 min (and 10 s of their CPU). One already set is kept.
os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")

import torch  # noqa: E402
import textual._wait  # noqa: E402
import zmq  # noqa: E402
from textual._context import active_app  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through its interpreter, which works only when
    # Triton is first imported with this set: set it before any test module imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agent.wire import protocol
from agent.control.desk import CommandDesk
from agent.wire.knobs import STANDARD_KNOBS, Knob, KnobSet
from agent.control.ledger import ChangeLedger
from agent.search.tune import AutoTune
from agent.wire.runs import RunInfo, remove_run_file, write_run_file
from gpuwatch.app import screen_text  # noqa: F401  (the tests import it from here)


#: The project's packages, compiled once a session (:func:`pytest_sessionstart`).
_PACKAGES = ("agent", "gpuwatch", "gpuopt", "tests")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's packages to ``__pycache__`` once, before any test.

    With ``PYTHONDONTWRITEBYTECODE=1`` (this machine's environment; CI's too, probably) no
    process writes bytecode, so every child the tests start (the run log's writer,
    the gateways, the training jobs) compiled the modules it imports from source:
    the log writer's start took 0.13 s of CPU, 0.05 s with the bytecode there, at
    every agent started. Python still reads bytecode it finds. Costs about 1 s on a
    fresh checkout, 0.05 s after (only changed files are compiled again)."""
    root = Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        compileall.compile_dir(root / package, quiet=2)


def _app_cpu_time() -> float:
    """The clock Textual's pilot reads to tell that the app under test is idle (it waits
    after each key until 20 ms pass with under 1 ms of it, or 1 s): the CPU time (s) of
    the calling thread, the app's event loop, not the whole process's; while one of the
    app's thread workers runs (a command being sent and answered), the wall clock, so
    the wait goes on until the worker is done.

    Textual reads ``process_time``: in these tests other threads of the process work all
    the time (a :class:`FakeAgent` publishes every 20 ms; its dashboard's I/O thread
    reads it; threads left by earlier tests), so the process was never idle and every
    key waited the full 1 s, twice: 106 s of the fast suite's 10.5 min waited in
    test_dashboard. Free: one clock read a call."""
    app = active_app.get(None)
    if app is not None and any(getattr(worker, "_thread_worker", False) and worker.is_running
                               for worker in app.workers):
        return time.monotonic()
    return time.thread_time()


assert hasattr(textual._wait, "process_time"), (  # (Textual's internal: say it moved)
    "textual._wait.process_time is gone: the pilot's idle wait changed; see _app_cpu_time")
textual._wait.process_time = _app_cpu_time


T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, *, timeout_s: float = 60.0,
               poll_s: float = 0.05, alive: Sequence[Any] = (),
               detail: Callable[[], str] | None = None) -> T:
    """Call ``condition`` every ``poll_s`` seconds until it returns a true value, and
    return that value: the wait for what other processes or threads write (files, run
    files, sockets), where there is no event to await.

    Args:
        condition: reads the state awaited; a false value (None, empty) means "not yet".
        what: what is awaited, for the failure's message.
        timeout_s: the most it waits (s); a generous bound, never a measure of speed.
        poll_s: the pause between two calls (s).
        alive: processes (:class:`subprocess.Popen`, or anything with ``poll()``) that
            make what is awaited: one that ends first fails the wait at once, with its
            output when it has a readable ``stdout``.
        detail: called on a failure, its text added to the message (e.g. logs).

    Raises:
        AssertionError: ``timeout_s`` passed, or a process of ``alive`` ended.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        for process in alive:
            if process.poll() is not None:
                output = process.stdout.read() if getattr(process, "stdout", None) else ""
                extra = detail() if detail is not None else ""
                raise AssertionError(f"{what}: a process ended (status {process.returncode})"
                                     f" first: {output} {extra}")
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = detail() if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} {extra}")
        time.sleep(poll_s)


async def until(pilot: Any, predicate: Callable[[], Any], timeout_s: float = 20.0) -> None:
    """Let the app of ``pilot`` (Textual's) run until ``predicate()`` holds: the wait of
    the dashboard's tests, whose records arrive from another thread.

    Raises:
        AssertionError: ``timeout_s`` (s) passed first.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the dashboard"
        await pilot.pause(0.05)


async def redrawn(app: Any, pilot: Any) -> None:
    """Redraw the dashboard ``app`` now (at the size its panels are laid out at) and let
    Textual render it: what a test reads next is what a person sees after the next
    redraw, with no fixed pause."""
    app.redraw()
    await pilot.pause()


def text_of(app: Any, selector: str) -> str:
    """The content of the app's widget ``selector`` (a CSS selector), as text."""
    return str(app.query_one(selector).content)


def knows(app: Any, knob: str) -> bool:
    """Whether the dashboard has the knob's schema and current value."""
    with app.source.lock:
        return knob in app.source.state.schema and knob in app.source.state.knobs


def log_texts(app: Any) -> list[str]:
    """The texts of the dashboard's event log, oldest first."""
    with app.source.lock:
        return [entry.text for entry in app.source.state.events]


class FakeAgent:
    """A stand-in for the in-process agent: PUB and ROUTER on tcp 127.0.0.1 with CURVE
    (as the agent's tcp; its keys in the run file, any client key accepted), a run file,
    and a thread that publishes a training step every ``step_s`` seconds (with heartbeat,
    and hello/system every 10 steps) and applies accepted commands at their step. With
    ``gpus`` (``system`` GPU maps) it also reports CUDA memory in each step; ``knobs``
    (names of :data:`~agent.wire.knobs.STANDARD_KNOBS` and start values; an ``action`` knob
    such as ``checkpoint`` with any value, which is not kept) is its schema, and
    ``unavailable`` ({knob: {value: reason}}) the values its device checks refuse;
    ``step_fields`` are added to (or replace fields of) every step body. ``run_id`` and
    ``ports`` (PUB, ROUTER) restart a run: the same id, and the same endpoints if given.
    ``rank`` and ``world_size`` go in its run file; with ``refuse`` every command that
    is not a dry run is refused with that reason (a rank that refuses the second phase
    of a command to several ranks); with ``stall_s`` it answers such a command that
    late (a rank whose agent is held up). Commands are answered, scheduled and applied
    by the agent's own :class:`~agent.control.desk.CommandDesk`.

    Attributes:
        commands: command bodies received, in order (a queue tests can wait on).
        knobs: current knob values. info: the run file's contents.
    """

    def __init__(self, directory: os.PathLike, *, step_s: float = 0.02,
                 gpus: list[dict[str, Any]] | None = None,
                 knobs: dict[str, Any] | None = None,
                 unavailable: dict[str, dict[str, str]] | None = None,
                 step_fields: dict[str, Any] | None = None,
                 run_id: str | None = None,
                 ports: tuple[int, int] | None = None, rank: int = 0,
                 world_size: int = 1, refuse: str | None = None,
                 stall_s: float = 0.0) -> None:
        self.step_s = step_s
        self.rank, self.world_size, self.refuse = rank, world_size, refuse
        self.stall_s = stall_s
        self.gpus = gpus or []
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.knobs = dict(knobs or {"precision": "fp32", "accum_steps": 1})
        self.step_fields = dict(step_fields or {})
        self.run_id = run_id or f"20250101-000000-{secrets.token_hex(2)}"
        self.ports = ports
        self._directory = Path(directory)
        self._outbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        #: events raised by the desk, sent in order at the next tick
        self._events: deque[dict[str, Any]] = deque()
        self._knob_set = KnobSet()
        for name in list(self.knobs):
            spec = STANDARD_KNOBS[name]
            if spec.command:  # a command, not a setting: nothing to keep
                del self.knobs[name]
            refused = (unavailable or {}).get(name, {})
            self._knob_set.add(Knob(
                spec, get=lambda name=name: self.knobs.get(name),
                set=lambda value, name=name: self._set(name, value),
                check=(lambda value, refused=refused: _refuse(value, refused))
                if refused else None))
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._seq = 0
        self._step = 0
        self.info: RunInfo
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _set(self, name: str, value: Any) -> None:
        if not self._knob_set.knobs[name].spec.command:
            self.knobs[name] = value

    @property
    def pending(self) -> list[Any]:
        """The commands accepted and not yet applied (the desk's)."""
        return self._desk.pending

    def start(self) -> FakeAgent:
        self._thread.start()
        assert self._ready.wait(5), "fake agent did not start"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        remove_run_file(self.info)

    def publish(self, msg_type: str, body: dict[str, Any]) -> None:
        """Publish one extra message from the agent's thread (at its next tick)."""
        self._outbox.put((msg_type, body))

    def _send(self, pub: zmq.Socket, msg_type: str, body: dict[str, Any]) -> None:
        self._seq += 1
        pub.send_multipart(protocol.encode(protocol.envelope(
            msg_type, body, run=self.info.run_id, rank=self.rank, seq=self._seq)))

    def _run(self) -> None:
        context = zmq.Context.instance()
        server_public, server_secret = FAKE_SERVER_KEYS
        client_public, client_secret = zmq.curve_keypair()
        with context.socket(zmq.PUB) as pub, context.socket(zmq.ROUTER) as router:
            for socket in (pub, router):
                socket.curve_secretkey, socket.curve_publickey = server_secret, server_public
                socket.curve_server = True
            pub_port, cmd_port = (_bind(socket, port) for socket, port in
                                  zip((pub, router), self.ports or (None, None)))
            self.info = RunInfo(
                run_id=self.run_id, rank=self.rank, world_size=self.world_size,
                pid=os.getpid(), pub_endpoint=f"tcp://127.0.0.1:{pub_port}",
                cmd_endpoint=f"tcp://127.0.0.1:{cmd_port}", token=secrets.token_hex(16),
                started_at=time.time(), name="fake-train",
                curve_server_key=server_public.decode(),
                curve_client_public_key=client_public.decode(),
                curve_client_secret_key=client_secret.decode())
            self._desk = CommandDesk(
                self._knob_set, token=self.info.token, ledger=ChangeLedger(),
                tune=AutoTune(self._knob_set, self.rank, lambda *_: None, lambda: self.info,
                              1, lambda *_: None),
                publish=lambda msg_type, body: self._send(pub, msg_type, body),
                event=lambda level, text, **fields: self._events.append(
                    {"level": level, "text": text, **fields}),
                step_now=lambda: self._step, ending=lambda: False,
                step_time_s=lambda: self.step_s, rank=self.rank, world_size=self.world_size)
            write_run_file(self.info, self._directory)
            self._ready.set()
            while not self._stop.is_set():
                if router.poll(int(self.step_s * 1000)):
                    self._answer(pub, router, router.recv_multipart())
                self._tick(pub)
                while not self._outbox.empty():
                    self._send(pub, *self._outbox.get())

    def _answer(self, pub: zmq.Socket, router: zmq.Socket, frames: list[bytes]) -> None:
        """Answer one command with the agent's own command desk (the protocol is the
        agent's); ``refuse`` and ``stall_s`` are the faults a test injects."""
        body = protocol.decode_frames(frames)["body"]
        self.commands.put(body)
        reply: dict[str, Any]
        second_phase = not body.get("dry_run") and not body.get("cancel")
        if self.refuse and second_phase:
            reply = {"id": body.get("id"), "ok": False, "knob": body.get("knob"),
                     "reason": self.refuse}
        else:
            if self.stall_s and second_phase:  # a rank busy elsewhere: it answers late
                time.sleep(self.stall_s)
            reply = dict(self._desk.answer(body))
        router.send_multipart([frames[0], *protocol.encode(
            protocol.envelope(protocol.REPLY, reply, run=self.info.run_id))])

    def _tick(self, pub: zmq.Socket) -> None:
        if self._desk.pending:  # the agent's boundary: after step N, before N + 1
            self._desk.apply_due(self._step)
        self._step += 1
        while self._events:
            self._send(pub, protocol.EVENT, self._events.popleft())
        if self._step % 10 == 1:
            self._send(pub, protocol.HELLO, {
                "name": "fake-train", "pid": self.info.pid, "world_size": self.world_size,
                "started_at": self.info.started_at,
                "device": "cpu", "model": {"name": "tiny", "params": 1234},
                "knobs": self._knob_set.schema()})
            self._send(pub, protocol.SYSTEM, {
                "cpu_pct": 12.5, "process_cpu_pct": 98.0, "host_mem_used_bytes": 3 << 30,
                "host_mem_total_bytes": 16 << 30, "gpus": self.gpus,
                "gpu_status": None if self.gpus else "no NVIDIA GPU (NVML not found)"})
        cuda = {"mem_allocated_bytes": 5 << 30, "mem_reserved_bytes": 6 << 30,
                "mem_peak_reserved_bytes": 7 << 30} if self.gpus else {}
        self._send(pub, protocol.STEP, {
            "step": self._step, "micro_batches": self.knobs.get("accum_steps", 1),
            "samples": 32, "step_time_s": 0.02 + 0.005 * (self._step % 7),
            "data_wait_s": 0.002, "data_wait_share": 0.1, "data_wait_share_window": 0.1,
            "input_verdict": "compute-bound", "samples_per_s": 1600.0 - self._step % 13,
            "loss": 2.0 / (1 + 0.01 * self._step), "knobs": dict(self.knobs),
            "host_rss_bytes": 700 << 20, **cuda, **self.step_fields})
        self._send(pub, protocol.HEARTBEAT, {"step": self._step, "ending": False,
                                             "records_dropped": 0, "errors": 0})


#: The fake agents' CURVE server key pair (one for all: a restarted fake on the same
#: ports is the same "run" to a dashboard that kept its run file's key).
FAKE_SERVER_KEYS = zmq.curve_keypair()


def _refuse(value: Any, refused: dict[str, str]) -> None:
    """A fake device check: raises ValueError with the reason for a refused value."""
    if value in refused:
        raise ValueError(refused[value])


def _bind(socket: zmq.Socket, port: int | None) -> int:
    """Bind to ``port`` on 127.0.0.1 (a random one if None); a port just released by a
    stopped agent may take a moment to be free again."""
    if port is None:
        return socket.bind_to_random_port("tcp://127.0.0.1")
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return port
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def run_dir(monkeypatch):
    """A private, short run directory (ipc socket paths must stay under ~100 bytes), with
    the run logs in its ``logs/``."""
    path = tempfile.mkdtemp(prefix="gw-")
    monkeypatch.setenv("GPUWATCH_RUN_DIR", path)
    monkeypatch.setenv("GPUWATCH_LOG_DIR", os.path.join(path, "logs"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_agent(run_dir):
    """Start :class:`FakeAgent` s (keyword options as its own) in ``run_dir``; all are
    stopped at the end of the test."""
    agents: list[FakeAgent] = []

    def make(**options: Any) -> FakeAgent:
        agents.append(FakeAgent(run_dir, **options).start())
        return agents[-1]

    yield make
    for agent in agents:
        agent.stop()


@pytest.fixture
def fake_agent(make_agent):
    """A running :class:`FakeAgent` with the standard knobs."""
    return make_agent()
