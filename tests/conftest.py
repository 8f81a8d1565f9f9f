"""Shared fixtures: a private run directory, and a fake agent with real sockets for
testing the dashboard alone."""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through its interpreter, which works only when
    # Triton is first imported with this set: set it before any test module imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from agent import protocol
from agent.knobs import KERNELS_MEMORY, STANDARD_KNOBS, KnobError, KnobSpec
from agent.runs import RunInfo, remove_run_file, write_run_file


#: Knobs a FakeAgent can offer: the standard ones, and those later issues add (until
#: agent.knobs has them).
FAKE_KNOB_SPECS = {
    "kernels": KnobSpec("kernels", "choice", "eager, torch.compile or fused Triton kernels",
                        choices=("eager", "compile", "triton"), group=KERNELS_MEMORY),
    "checkpointing": KnobSpec("checkpointing", "bool", "activation checkpointing",
                              group=KERNELS_MEMORY),
    **STANDARD_KNOBS,
}


class FakeAgent:
    """A stand-in for the in-process agent: PUB and ROUTER on tcp 127.0.0.1 with CURVE
    (as the agent's tcp; its keys in the run file, any client key accepted), a run file,
    and a thread that publishes a training step every ``step_s`` seconds (with heartbeat,
    and hello/system every 10 steps) and applies accepted commands at their step. With
    ``gpus`` (``system`` GPU maps) it also reports CUDA memory in each step; ``knobs``
    (knob names of :data:`FAKE_KNOB_SPECS` and start values) is its schema;
    ``step_fields`` are added to (or replace fields of) every step body. ``run_id`` and
    ``ports`` (PUB, ROUTER) restart a run: the same id, and the same endpoints if given.
    ``rank`` and ``world_size`` go in its run file; with ``refuse`` every command that
    is not a dry run is refused with that reason (a rank that refuses the second phase
    of a command to several ranks); with ``stall_s`` it answers such a command that
    late (a rank whose agent is held up). It answers dry runs and cancels as the agent
    does.

    Attributes:
        commands: command bodies received, in order (a queue tests can wait on).
        knobs: current knob values. info: the run file's contents.
    """

    def __init__(self, directory: os.PathLike, *, step_s: float = 0.02,
                 gpus: list[dict[str, Any]] | None = None,
                 knobs: dict[str, Any] | None = None,
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
        self._scheduled: list[tuple[int, str, Any, Any]] = []  # (step, knob, value, id)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._seq = 0
        self._step = 0
        self.info: RunInfo
        self._thread = threading.Thread(target=self._run, daemon=True)

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
            write_run_file(self.info, self._directory)
            self._ready.set()
            while not self._stop.is_set():
                if router.poll(int(self.step_s * 1000)):
                    self._answer(pub, router, router.recv_multipart())
                self._tick(pub)
                while not self._outbox.empty():
                    self._send(pub, *self._outbox.get())

    def _answer(self, pub: zmq.Socket, router: zmq.Socket, frames: list[bytes]) -> None:
        body = protocol.decode_frames(frames)["body"]
        self.commands.put(body)
        reply: dict[str, Any] = {"id": body.get("id"), "knob": body.get("knob")}
        if body.get("dry_run"):
            reply["dry_run"] = True  # as the agent: every reply names its phase
        if body.get("cancel") and body.get("token") == self.info.token:
            found = [s for s in self._scheduled if s[3] == body.get("id")]
            for scheduled in found:
                self._scheduled.remove(scheduled)
            reply.update(ok=bool(found), cancel=True)
            router.send_multipart([frames[0], *protocol.encode(
                protocol.envelope(protocol.REPLY, reply, run=self.info.run_id))])
            return
        try:
            if body.get("token") != self.info.token:
                raise KnobError("bad token")
            if body.get("knob") not in self.knobs:
                raise KnobError(f"unknown knob {body.get('knob')!r}")
            value = FAKE_KNOB_SPECS[body["knob"]].coerce(body.get("value"))
        except KnobError as exc:
            reply.update(ok=False, reason=str(exc))
        else:
            apply_step = body.get("apply_step", self._step + 2)
            if body.get("dry_run"):
                reply.update(ok=True, value=value, apply_step=apply_step, dry_run=True,
                             step_time_s=self.step_s)
            elif self.refuse:
                reply.update(ok=False, reason=self.refuse)
            else:
                if self.stall_s:  # a rank busy elsewhere: it answers late
                    time.sleep(self.stall_s)
                reply.update(ok=True, value=value, apply_step=apply_step)
                self._scheduled.append((apply_step, body["knob"], value, body.get("id")))
        if reply.get("ok") and not body.get("dry_run"):
            self._send(pub, protocol.EVENT, {
                "level": "info", "kind": "accepted", "knob": body["knob"], "value": value,
                "step": apply_step, "id": body.get("id"),
                "text": f"{body['knob']}={value} accepted, applies at step {apply_step}"})
        router.send_multipart([frames[0], *protocol.encode(
            protocol.envelope(protocol.REPLY, reply, run=self.info.run_id))])

    def _tick(self, pub: zmq.Socket) -> None:
        self._step += 1
        for due in [s for s in self._scheduled if s[0] <= self._step]:
            self._scheduled.remove(due)
            _, knob, value, _ = due
            self.knobs[knob] = value
            self._send(pub, protocol.EVENT, {
                "level": "info", "kind": "applied", "knob": knob, "value": value,
                "step": self._step, "text": f"{knob}={value} applied at step {self._step}"})
        if self._step % 10 == 1:
            self._send(pub, protocol.HELLO, {
                "name": "fake-train", "pid": self.info.pid, "world_size": self.world_size,
                "started_at": self.info.started_at,
                "device": "cpu", "model": {"name": "tiny", "params": 1234},
                "knobs": [FAKE_KNOB_SPECS[name].to_wire() for name in self.knobs]})
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
