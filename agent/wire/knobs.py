"""Knob schemas: the live-tunable settings of a run, and the validation of commands.

A knob has a wire name (``precision``, ``accum_steps``, ...), a kind (``choice``, ``int``,
``float``, ``bool``, or ``action`` for a command that is not a setting, such as
``checkpoint=now``) and bounds. The agent publishes the schema of the knobs its trainer supports in
``hello``; a knob a trainer cannot support is absent from the schema, so a command naming
it is rejected with "unknown knob". Validation here is pure (no torch): the trainer may
add a device check (e.g. bf16 on a GPU without bf16) through :attr:`Knob.check`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable


class KnobError(ValueError):
    """A command that names an unknown knob or gives a value its schema refuses."""


def assignment(knob: str, value: Any) -> str:
    """A knob setting as people type it: ``precision=bf16``, ``checkpointing=on``
    (booleans as ``on`` / ``off``, the one spelling the dashboard, ``gpuwatch set``,
    ``tail`` and the run's events use; not Python's ``True``)."""
    return f"{knob}={('on' if value else 'off') if isinstance(value, bool) else value}"


#: :attr:`KnobSpec.tuning`: searched by default, searched only when allowed, never.
TUNED, TUNED_IF_ALLOWED, NOT_TUNED = "yes", "if allowed", "no"

#: :attr:`KnobSpec.group`: what a knob is about, for people (the dashboard's knobs panel
#: lists every knob under its group, in this order).
NUMERICS, KERNELS_MEMORY, DATA, OPTIMIZER, OTHER = (
    "numerics", "kernels & memory", "data", "optimizer", "other")
GROUPS = (NUMERICS, KERNELS_MEMORY, DATA, OPTIMIZER, OTHER)


@dataclass(frozen=True)
class KnobSpec:
    """The schema of one knob.

    Attributes:
        name: wire name. kind: ``"choice"``, ``"int"``, ``"float"``, ``"bool"``, or
        ``"action"``: a command with no value to keep (``checkpoint=now``), absent from
        :meth:`KnobSet.values`. choices: allowed values for ``choice`` and ``action``.
        minimum / maximum: inclusive bounds for ``int`` and ``float``. help: one line for people.
        tuning: what the in-run search (:mod:`agent.search.tune`) may do with it:
        :data:`TUNED` (a speed setting that leaves the training's results as they are:
        searched by default), :data:`TUNED_IF_ALLOWED` (it changes the numerics or the
        memory: searched only when the ``tune`` command allows it) or
        :data:`NOT_TUNED` (never: the optimizer's settings, actions, memory tools).
        group: one of :data:`GROUPS`, under which people see it (``group`` on the wire).
    """

    name: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    maximum: int | float | None = None
    tuning: str = NOT_TUNED
    group: str = OTHER

    def to_wire(self) -> dict[str, Any]:
        """The schema as a msgpack-ready map."""
        wire: dict[str, Any] = {"name": self.name, "kind": self.kind, "help": self.help,
                                "group": self.group}
        if self.choices:
            wire["choices"] = list(self.choices)
        if self.minimum is not None:
            wire["min"] = self.minimum
        if self.maximum is not None:
            wire["max"] = self.maximum
        return wire

    def coerce(self, value: Any) -> Any:
        """Return ``value`` as this knob's type.

        Strings are parsed (``"4"`` -> 4, ``"true"`` -> True) so that CLI input and wire
        input share one path.

        Raises:
            KnobError: a value of the wrong type, not among the choices, or out of range;
                the message names the knob and the value.
        """
        try:
            return self._coerce(value)
        except KnobError as exc:
            raise KnobError(_shorten(str(exc))) from None

    def _coerce(self, value: Any) -> Any:
        if self.kind in ("choice", "action"):
            if not isinstance(value, str) or value not in self.choices:
                raise KnobError(
                    f"{self.name}: {value!r} is not one of {', '.join(self.choices)}")
            return value
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOL_WORDS:
                return _BOOL_WORDS[value.lower()]
            raise KnobError(f"{self.name}: {value!r} is not a boolean (true/false)")
        if self.kind in _NUMBER_PARSERS:
            parse, expected = _NUMBER_PARSERS[self.kind]
            number = parse(value)
            if number is None:
                raise KnobError(f"{self.name}: {value!r} is not {expected}")
            if self.minimum is not None and number < self.minimum:
                raise KnobError(f"{self.name}: {number} is below the minimum {self.minimum}")
            if self.maximum is not None and number > self.maximum:
                raise KnobError(f"{self.name}: {number} is above the maximum {self.maximum}")
            return number
        raise KnobError(f"{self.name}: unknown knob kind {self.kind!r}")


def _shorten(text: str, limit: int = 200) -> str:
    """Error messages quote the bad value: keep a huge one from filling logs."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


_BOOL_WORDS = {"true": True, "on": True, "1": True, "yes": True,
               "false": False, "off": False, "0": False, "no": False}


_DECIMAL = re.compile(r"[+-]?[0-9]{1,18}")


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return int(value.strip())  # ASCII digits only: no "1_0", no other scripts' digits
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


_NUMBER_PARSERS = {"int": (_as_int, "an integer"), "float": (_as_float, "a finite number")}

#: The standard knobs (the README's knob table); a trainer binds the ones it supports.
PRECISION = KnobSpec("precision", "choice", "autocast precision of forward/backward",
                     choices=("fp32", "bf16", "fp16"), tuning=TUNED_IF_ALLOWED,
                     group=NUMERICS)
ACCUM_STEPS = KnobSpec("accum_steps", "int", "micro-batches per optimizer step",
                       minimum=1, maximum=1024, tuning=TUNED_IF_ALLOWED, group=NUMERICS)
MICRO_BATCH_SIZE = KnobSpec("micro_batch_size", "int",
                            "samples per micro-batch; accum_steps follows, so that the "
                            "effective batch (micro-batch size x accum_steps) stays",
                            minimum=1, maximum=1 << 20, tuning=TUNED_IF_ALLOWED,
                            group=NUMERICS)

NUM_WORKERS = KnobSpec("num_workers", "int", "DataLoader worker processes",
                       minimum=0, maximum=64, tuning=TUNED, group=DATA)
PIN_MEMORY = KnobSpec("pin_memory", "bool", "page-locked host batches (faster H2D copies)",
                      tuning=TUNED, group=DATA)
PREFETCH_FACTOR = KnobSpec("prefetch_factor", "int", "batches prefetched per worker",
                           minimum=1, maximum=64, tuning=TUNED, group=DATA)
CPU_THREADS = KnobSpec("cpu_threads", "int",
                       "torch intra-op CPU threads of the training process "
                       "(torch.set_num_threads)", minimum=1, maximum=1024, tuning=TUNED,
                       group=DATA)

# searched only when allowed: fused code reorders float ops and inductor draws its own
# dropout masks, and compiling is a long warm-up (gpuopt.compile)
KERNELS = KnobSpec("kernels", "choice", "forward implementation: eager, torch.compile, "
                   "or fused Triton kernels", choices=("eager", "compile", "triton"),
                   tuning=TUNED_IF_ALLOWED, group=KERNELS_MEMORY)
CHECKPOINTING = KnobSpec("checkpointing", "bool",
                         "activation checkpointing of the repeated blocks",
                         tuning=TUNED_IF_ALLOWED, group=KERNELS_MEMORY)
LR_SCALE = KnobSpec("lr_scale", "float", "multiplier on the learning rate the schedule "
                    "sets, in every param group (the schedule keeps its shape)",
                    minimum=0.0, maximum=100.0, group=OPTIMIZER)
WEIGHT_DECAY = KnobSpec("weight_decay", "float", "weight decay of the param groups that "
                        "decay (groups at 0, such as biases and norms, stay 0)",
                        minimum=0.0, maximum=10.0, group=OPTIMIZER)
MAX_GRAD_NORM = KnobSpec("max_grad_norm", "float", "clip the global gradient norm to this "
                         "before each optimizer step (0: no clipping)",
                         minimum=0.0, maximum=1e6, group=OPTIMIZER)
CHECKPOINT = KnobSpec("checkpoint", "action", "save a checkpoint (model, optimizer, "
                      "scheduler, GradScaler, knobs) at the next step boundary",
                      choices=("now",), group=OTHER)
PAUSE = KnobSpec("pause", "action", "on: hold the training at the next optimizer-step "
                 "boundary, waiting without using the CPU or GPU; off: go on from there",
                 choices=("on", "off"), group=OTHER)
STOP = KnobSpec("stop", "action", "end the training cleanly at the next optimizer-step "
                "boundary (the framework's end hooks run); checkpoint: save one first",
                choices=("now", "checkpoint"), group=OTHER)
EVALUATE = KnobSpec("evaluate", "action", "run the framework's evaluation (or the "
                    "eval_fn given to attach / session) at the next optimizer-step "
                    "boundary; its metrics go to the event log", choices=("now",),
                    group=OTHER)
MEMORY_FRACTION = KnobSpec("memory_fraction", "float",
                           "cap of this process's CUDA memory, as a fraction of the device",
                           minimum=0.01, maximum=1.0, group=KERNELS_MEMORY)
MEMORY_SNAPSHOT_STEPS = KnobSpec("memory_snapshot_steps", "int",
                                 "record CUDA allocations for this many steps, then dump a "
                                 "snapshot (0: none running)", minimum=1, maximum=1000,
                                 group=KERNELS_MEMORY)

#: The knobs of a rebuildable DataLoader (:class:`gpuopt.loader.ReconfigurableLoader`).
LOADER_KNOBS = (NUM_WORKERS, PIN_MEMORY, PREFETCH_FACTOR)
#: The optimizer's knobs (:class:`gpuopt.optim.OptimizerSettings`, or the framework's).
OPTIMIZER_KNOBS = (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM)

#: Every standard knob by name (a dashboard reads a knob's group from its schema, and
#: from here for a run whose schema has none).
STANDARD_KNOBS = {spec.name: spec for spec in
                  (PRECISION, ACCUM_STEPS, MICRO_BATCH_SIZE, NUM_WORKERS, PIN_MEMORY,
                   PREFETCH_FACTOR, CPU_THREADS, KERNELS, CHECKPOINTING, MEMORY_FRACTION,
                   MEMORY_SNAPSHOT_STEPS, *OPTIMIZER_KNOBS, CHECKPOINT, PAUSE, STOP,
                   EVALUATE)}


@dataclass
class Knob:
    """A knob bound to a trainer.

    Attributes:
        spec: its schema. get: returns the current value (any thread; must be cheap; an
            ``action`` knob's is not read).
        set: applies a value; called only on the training thread at an optimizer-step
            boundary; raises to refuse (the previous value must then still hold). It
            returns None, or a dict of what to add to the ``applied`` event (``text``: a
            clause for people, e.g. where a checkpoint went; other keys: event fields).
        check: optional device check run on the agent's I/O thread when the command
            arrives; raises ``ValueError`` with the reason (e.g. "this GPU has no bf16").
        warn: optional; returns a performance warning for an accepted value (e.g. fp16
            on a CPU), shown in the reply and the event log (see :meth:`warning`).
    """

    spec: KnobSpec
    get: Callable[[], Any]
    set: Callable[[Any], dict[str, Any] | None]
    check: Callable[[Any], None] | None = None
    warn: Callable[[Any], str | None] | None = None

    def warning(self, value: Any) -> str | None:
        """What a person should know about an accepted ``value`` (the reply's and the
        event log's warning): that it stops the training, or nearly
        (:func:`stops_training`), and this knob's own :attr:`warn`; None when nothing."""
        found = [text for text in (stops_training(self.spec.name, value),
                                   self.warn(value) if self.warn is not None else None)
                 if text]
        return "; ".join(found) or None


def stops_training(name: str, value: Any) -> str | None:
    """Why ``name=value`` of an optimizer's knob stops the training, or nearly, or makes
    it diverge, or None. Accepted all the same (a person may mean it): the warning says
    so. From the value alone (the optimizer and its learning rate are the run's):

    - ``lr_scale`` 0: no update at all; below 0.001: updates a thousand times smaller
      or less; from 10: the usual cause of a diverging loss.
    - ``weight_decay`` from 1: 10 to 10,000 times the usual 0.0001 to 0.1; the decay
      can outweigh the gradient and pull the weights to 0.
    - ``max_grad_norm`` above 0 and below 0.001: every update clipped that small.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name == LR_SCALE.name and value == 0:
        return ("lr_scale=0 makes every learning rate 0: the weights stop changing, so "
                "training stops learning (while costing as much) until it is set back")
    if name == LR_SCALE.name and value < 1e-3:
        return (f"lr_scale={value} divides every learning rate by {1 / value:,.0f}: "
                "training nearly stops learning")
    if name == LR_SCALE.name and value >= 10:
        return (f"lr_scale={value} multiplies every learning rate by {value:g}: the loss "
                "may diverge")
    if name == WEIGHT_DECAY.name and value >= 1:
        return (f"weight_decay={value} is far above the usual 0.0001 to 0.1: the decay can "
                "outweigh the gradient and pull the weights to 0, so that training stops "
                "learning")
    if name == MAX_GRAD_NORM.name and 0 < value < 1e-3:
        return (f"max_grad_norm={value} clips every update to a gradient norm of {value}: "
                "training nearly stops learning (0 turns clipping off)")
    return None


@dataclass
class KnobSet:
    """The knobs of one run, by wire name."""

    knobs: dict[str, Knob] = field(default_factory=dict)
    #: Knobs this run cannot have, by name, with the reason (e.g. CUDA-only knobs on a
    #: CPU run): absent from the schema, and a command for one is refused with it.
    unsupported: dict[str, str] = field(default_factory=dict)

    def add(self, knob: Knob) -> None:
        """Bind ``knob``; its name must be new."""
        if knob.spec.name in self.knobs:
            raise ValueError(f"knob {knob.spec.name!r} bound twice")
        # a new dict, swapped in whole: the agent's I/O thread may be reading the old one
        self.knobs = {**self.knobs, knob.spec.name: knob}
        if knob.spec.name in self.unsupported:
            self.unsupported = {name: reason for name, reason in self.unsupported.items()
                                if name != knob.spec.name}

    def schema(self) -> list[dict[str, Any]]:
        """The wire schema of every bound knob, for ``hello``. A choice knob's values
        that its device check refuses are listed in ``unavailable`` ({value: reason}),
        so that a dashboard cycling through the choices skips them."""
        schema = []
        for knob in self.knobs.values():
            wire = knob.spec.to_wire()
            if knob.spec.kind == "choice" and knob.check is not None:
                unavailable = {}
                for choice in knob.spec.choices:
                    try:
                        knob.check(choice)
                    except ValueError as exc:
                        unavailable[choice] = str(exc)
                if unavailable:
                    wire["unavailable"] = unavailable
            schema.append(wire)
        return schema

    def values(self) -> dict[str, Any]:
        """Current values of every knob that is a setting (``action`` knobs have none)."""
        return {name: knob.get() for name, knob in self.knobs.items()
                if knob.spec.kind != "action"}

    def validate(self, name: Any, value: Any) -> Any:
        """Validate a command; return the coerced value.

        Raises:
            KnobError: unknown or unsupported knob, bad value, or a device check that
                refuses it.
        """
        if isinstance(name, str) and name in self.unsupported:
            raise KnobError(f"{name}: {self.unsupported[name]}")  # our own text, whole
        if not isinstance(name, str) or name not in self.knobs:
            known = ", ".join(self.knobs) or "none"
            raise KnobError(f"unknown knob {_shorten(repr(name), 80)} (this run has: {known})")
        knob = self.knobs[name]
        coerced = knob.spec.coerce(value)
        if knob.check is not None:
            try:
                knob.check(coerced)
            except ValueError as exc:
                raise KnobError(f"{name}={coerced}: {exc}") from None
        return coerced
