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

Where the records come from: the agent hands each optimizer step's host facts and each
event to a listener (:meth:`agent.Agent.add_listener`) as it records them, on the
training thread, and the listener appends them to a deque: a dict and an append per step,
nothing published is decoded and no socket is read. They are folded on the training thread
only when the framework logs (Lightning: every ``log_every_n_steps`` optimizer steps; HF:
at its ``on_log``), a few microseconds a step, so a log holds every step up to the one it is
made at. Memory is the agent's latest reading (:attr:`agent.Agent.latest_memory`, taken
on its I/O thread as it publishes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from agent.wire import protocol
from agent.wire.protocol import EventKind
from agent.step.core import Agent

#: Prefix of every name this module logs.
PREFIX = "gpuwatch/"
#: Memory readings logged as they are at the log.
MEMORY_FIELDS = ("host_rss_bytes", "mem_allocated_bytes", "mem_reserved_bytes",
                 "mem_peak_reserved_bytes")
#: Records kept between two logs; beyond, the oldest go (a log interval of more steps
#: than this averages over its latest steps only). Full, they hold about 36 MB of the
#: training process's memory (about 360 bytes a step record, its knob map shared): what
#: a framework that never calls its loggers leaves held.
MAX_RECORDS_PER_LOG = 100_000


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value else None


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
        """Fold one listener record.

        A step's host facts, or an event that changed a knob
        (:meth:`agent.Agent.add_listener`)."""
        if record.get("type") == protocol.STEP:
            step = record.get("step")
            if type(step) is int:
                self.step = step
            step_time_s = _number(record.get("step_time_s"))
            if step_time_s:
                for name, count in (("samples_per_s", record.get("samples")),
                                    ("tokens_per_s", record.get("tokens"))):
                    count = _number(count)
                    if count is not None:
                        self._fold(name, count / step_time_s)
            for name in ("step_time_s", "data_wait_s"):
                value = _number(record.get(name))
                if value is not None:
                    self._fold(name, value)
            activation = _number(record.get("activation_bytes"))
            if activation is not None:
                self._latest["activation_bytes"] = activation
            knobs = record.get("knobs")
            if isinstance(knobs, Mapping):
                for name, value in knobs.items():
                    number = self.knob_number(str(name), value)
                    if number is not None:
                        self._knobs[str(name)] = number
        elif (record.get("type") == protocol.EVENT and record.get("kind") in EventKind.CHANGED
              and isinstance(record.get("knob"), str) and type(record.get("step")) is int):
            self._changes.append((record["step"], f"step {record['step']}: "
                                  f"{record['knob']}={_text(record.get('value'))}"
                                  + (" (rolled back)" if record["kind"] == EventKind.ROLLED_BACK
                                     else "")))

    def add_memory(self, memory: Mapping[str, Any]) -> None:
        """Take the latest memory readings (:attr:`agent.Agent.latest_memory`)."""
        for name in MEMORY_FIELDS:
            value = _number(memory.get(name))
            if value is not None:
                self._latest[name] = value

    def _fold(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + value
        self._counts[name] = self._counts.get(name, 0) + 1

    def knob_number(self, name: str, value: Any) -> float | None:
        """A knob value as a number, or None.

        Booleans 0/1, numbers as they are, a choice by its index in the schema; None for
        what has no number."""
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)):
            return float(value)
        choices = self.choices.get(name) or []
        return float(choices.index(value)) if value in choices else None

    def take(self) -> tuple[dict[str, float], list[tuple[int, str]]]:
        """The metrics to log and the knob changes, both since the last call.

        Metrics by ``gpuwatch/...`` names (see the module), changes as ``(step, text)``;
        then a fresh start."""
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
    """An agent's listener and measurements (one per ``fit`` / ``train``).

    Args:
        agent: the gpuwatch agent of the run (started or not: nothing here needs its
            sockets).
    """

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.measurements = Measurements({})
        self._records: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS_PER_LOG)
        self._open = True
        agent.add_listener(self._listen)

    def _listen(self, record: dict[str, Any]) -> None:
        if self._open:  # the agent may outlive this fit: then a closed bridge keeps nothing
            self._records.append(record)

    def collect(self) -> tuple[int | None, dict[str, float], list[tuple[int, str]]]:
        """``(latest step, metrics, changes)`` of the records since the last call.

        The knob choices as the agent's schema has them now: knobs are bound as training
        starts). Training thread; never blocks, never synchronizes the device."""
        self.measurements.choices = {
            spec["name"]: list(spec.get("choices") or ())
            for spec in self.agent.knobs.schema() if spec.get("kind") == "choice"}
        records = self._records
        while records:
            self.measurements.add(records.popleft())
        self.measurements.add_memory(self.agent.latest_memory)
        return (self.measurements.step, *self.measurements.take())

    def close(self) -> None:
        """Keep nothing more. Idempotent."""
        self._open = False
        self._records.clear()


def agent_of(callbacks: Any) -> Agent | None:
    """The agent of the gpuwatch callback among a framework's callbacks, if any."""
    for callback in callbacks:
        agent = getattr(callback, "agent", None)
        if isinstance(agent, Agent):
            return agent
    return None
