"""gpuwatch's measurements and knob changes in the framework's own loggers.

A Lightning or Hugging Face run attached with gpuwatch also logs what gpuwatch measures
to the loggers it already uses (TensorBoard, CSV, W&B, MLflow, ...), next to its own
metrics, under ``gpuwatch/``:

- ``gpuwatch/step_time_s``, ``gpuwatch/data_wait_s`` (means over the optimizer steps
  since the last log, s), ``gpuwatch/data_wait_share`` (their ratio, 0..1),
  ``gpuwatch/samples_per_s`` and ``gpuwatch/tokens_per_s`` (means), the memory of the
  latest step (``gpuwatch/host_rss_bytes``, on CUDA ``gpuwatch/mem_allocated_bytes``,
  ``gpuwatch/mem_reserved_bytes``, ``gpuwatch/mem_peak_reserved_bytes``) and
  ``gpuwatch/activation_bytes`` (the latest measurement);
- the knobs as numbers, ``gpuwatch/knob/<name>``: integers as they are, booleans 0/1, a
  choice by its index in the run's schema (``precision`` fp32 = 0, bf16 = 1, fp16 = 2),
  so a change is a step in a chart; and where the logger takes text (TensorBoard), each
  change as a line of ``gpuwatch/knob_changes`` at its step (``step 412:
  precision=bf16``).

::

    from agent.integrations.lightning_loggers import GpuwatchLoggers
    trainer = lightning.pytorch.Trainer(logger=TensorBoardLogger("tb"), ...)
    agent.attach(trainer)
    trainer.callbacks.append(GpuwatchLoggers())           # Lightning

    from agent.integrations.hf_loggers import GpuwatchHFLoggers
    agent.attach(hf_trainer)
    hf_trainer.add_callback(GpuwatchHFLoggers(hf_trainer))  # transformers.Trainer

This module holds what both share and imports no framework; each callback lives in the
module named for its framework, which imports that framework.

Where the records come from: the agent's own telemetry, read back in this process by a
ZeroMQ subscriber of its ``step`` and ``event`` topics (:class:`RecordTap`), so nothing
changes in the agent or its integrations. They are read on the training thread only when
the framework logs (Lightning: every ``log_every_n_steps`` optimizer steps; HF: at its
``on_log``): one msgpack decode per ``steps`` batch and a fold per step record, paid
on the training thread at each log (an agent that handed its published records to a
listener directly would save the decode). The agent publishes the steps of each I/O
wake-up (10 a second) as one batch, each once its step time is known (its CUDA event
completed), so a log holds the steps completed up to about 100 ms before it; a log
with nothing new since the last one logs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zmq

from agent import protocol
from agent.core import Agent
from agent.runs import RunInfo

#: Prefix of every name this module logs.
PREFIX = "gpuwatch/"
#: Step fields logged as the mean over the steps since the last log.
MEAN_FIELDS = ("step_time_s", "data_wait_s", "samples_per_s", "tokens_per_s")
#: Step fields logged as the latest value.
LATEST_FIELDS = ("host_rss_bytes", "mem_allocated_bytes", "mem_reserved_bytes",
                 "mem_peak_reserved_bytes", "activation_bytes")
#: Event kinds that change a knob's value (the agent's).
CHANGE_KINDS = protocol.EventKind.CHANGED
#: Records a subscriber queues before the agent's socket drops more (per log interval).
RECEIVE_HIGH_WATER_MARK = 100_000


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value else None


class RecordTap:
    """The ``step`` and ``event`` records an agent publishes, read back in its own
    process from its telemetry endpoint (with its CURVE keys when it has them).

    Args:
        info: the agent's run file (:attr:`agent.Agent.info`).

    Raises:
        zmq.ZMQError: the endpoint cannot be connected (a malformed one).
    """

    def __init__(self, info: RunInfo) -> None:
        self.malformed = 0
        """Frames dropped because they were not envelopes."""
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HIGH_WATER_MARK)
        for topic in (protocol.STEPS, protocol.STEP, protocol.EVENT):
            self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode("ascii"))
        if info.curve_server_key:
            self._socket.curve_serverkey = info.curve_server_key.encode()
            self._socket.curve_publickey = info.curve_client_public_key.encode()
            self._socket.curve_secretkey = info.curve_client_secret_key.encode()
        self._socket.connect(info.pub_endpoint)

    def drain(self, limit: int = RECEIVE_HIGH_WATER_MARK) -> list[dict[str, Any]]:
        """The records received since the last call (at most ``limit``), decoded;
        never blocks."""
        records = []
        while len(records) < limit:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:  # a steps batch as one step record a row
                records.extend(protocol.expand(protocol.decode_frames(frames)))
            except protocol.ProtocolError:
                self.malformed += 1
        return records

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._socket.close(linger=0)


class Measurements:
    """Step records and knob-change events folded into what one log call logs.

    Args:
        choices: each choice knob's values in schema order, for its number.
    """

    def __init__(self, choices: Mapping[str, list[Any]]) -> None:
        self.choices = dict(choices)
        self.step: int | None = None
        """The latest optimizer step of a record folded."""
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._latest: dict[str, float] = {}
        self._knobs: dict[str, float] = {}
        self._changes: list[tuple[int, str]] = []

    def add(self, record: Mapping[str, Any]) -> None:
        """Fold one envelope (a ``step``, or an ``event`` that changed a knob)."""
        body = record.get("body") or {}
        if record.get("type") == protocol.STEP:
            step = body.get("step")
            if type(step) is int:
                self.step = step
            for name in MEAN_FIELDS:
                value = _number(body.get(name))
                if value is not None:
                    self._sums[name] = self._sums.get(name, 0.0) + value
                    self._counts[name] = self._counts.get(name, 0) + 1
            for name in LATEST_FIELDS:
                value = _number(body.get(name))
                if value is not None:
                    self._latest[name] = value
            knobs = body.get("knobs")
            if isinstance(knobs, Mapping):
                for name, value in knobs.items():
                    number = self.knob_number(str(name), value)
                    if number is not None:
                        self._knobs[str(name)] = number
        elif (record.get("type") == protocol.EVENT and body.get("kind") in CHANGE_KINDS
              and isinstance(body.get("knob"), str) and type(body.get("step")) is int):
            self._changes.append((body["step"], f"step {body['step']}: "
                                  f"{body['knob']}={_text(body.get('value'))}"
                                  + (" (rolled back)" if body["kind"] == protocol.EventKind.ROLLED_BACK
                                     else "")))

    def knob_number(self, name: str, value: Any) -> float | None:
        """A knob value as a number: booleans 0/1, numbers as they are, a choice by
        its index in the schema; None for what has no number."""
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)):
            return float(value)
        choices = self.choices.get(name) or []
        return float(choices.index(value)) if value in choices else None

    def take(self) -> tuple[dict[str, float], list[tuple[int, str]]]:
        """The metrics to log (``gpuwatch/...`` names, see the module) and the knob
        changes as ``(step, text)``, both since the last call; then a fresh start."""
        metrics = {f"{PREFIX}{name}": self._sums[name] / self._counts[name]
                   for name in self._sums}
        wait, step = metrics.get(f"{PREFIX}data_wait_s"), metrics.get(f"{PREFIX}step_time_s")
        if wait is not None and step:
            metrics[f"{PREFIX}data_wait_share"] = wait / step
        metrics.update((f"{PREFIX}{name}", value) for name, value in self._latest.items())
        metrics.update((f"{PREFIX}knob/{name}", value) for name, value in self._knobs.items())
        changes = self._changes
        self._sums, self._counts, self._changes = {}, {}, []
        return metrics, changes


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Bridge:
    """An agent's tap and measurements (one per ``fit`` / ``train``).

    Args:
        agent: the started gpuwatch agent of the run.

    Raises:
        RuntimeError: the agent has no telemetry endpoint (it could not start one).
        zmq.ZMQError: as :class:`RecordTap`.
    """

    def __init__(self, agent: Agent) -> None:
        if agent.info is None:
            raise RuntimeError("the gpuwatch agent has no telemetry endpoint")
        self.agent = agent
        self.tap = RecordTap(agent.info)
        self.measurements = Measurements({})

    def collect(self) -> tuple[int | None, dict[str, float], list[tuple[int, str]]]:
        """``(latest step, metrics, changes)`` of the records received so far (the knob
        choices as the agent's schema has them now: knobs are bound as training
        starts)."""
        self.measurements.choices = {
            spec["name"]: list(spec.get("choices") or ())
            for spec in self.agent.knobs.schema() if spec.get("kind") == "choice"}
        for record in self.tap.drain():
            self.measurements.add(record)
        return (self.measurements.step, *self.measurements.take())


def agent_of(callbacks: Any) -> Agent | None:
    """The agent of the gpuwatch callback among a framework's callbacks, if any."""
    for callback in callbacks:
        agent = getattr(callback, "agent", None)
        if isinstance(agent, Agent):
            return agent
    return None
