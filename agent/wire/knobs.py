"""Knob schemas: the live-tunable settings of a run, and the validation of commands.

A knob has a wire name (``precision``, ``accum_steps``, ...), a kind (``choice``, ``int``,
``float``, ``bool``, ``weights`` for a list of weights such as ``mixture=0.7,0.3``;
``action`` for a command that is not a setting, such as ``checkpoint=now``; ``text`` for
such a command whose value is free text, such as ``rewind=<step or path>``) and bounds.
The agent publishes the schema of the knobs its trainer supports in ``hello``; a knob a
trainer cannot support is absent from the schema, so a command naming it is rejected
with "unknown knob" (or with the reason the trainer gave). Validation here is pure (no
torch): the trainer may add a device check (e.g. bf16 on a GPU without bf16) through
:attr:`Knob.check`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, cast


class KnobError(ValueError):
    """A command that names an unknown knob or gives a value its schema refuses."""


def assignment(knob: str, value: Any) -> str:
    """A knob setting as people type it: ``precision=bf16``, ``checkpointing=on``.

    Booleans as ``on`` / ``off``, the one spelling the dashboard, ``gpuwatch set``, ``tail``
    and the run's events use; not Python's ``True``."""
    return f"{knob}={('on' if value else 'off') if isinstance(value, bool) else value}"


def when_applied(apply_step: int, after_step: int | None = None) -> str:
    """When an accepted command applies, in people's words.

    A setting: ``applies at step 121`` (step 121 trains with it). A command that is not
    a setting (``stop``, ``checkpoint``, ``pause``...), given ``after_step`` (its
    ``apply_step`` - 1): ``at the boundary after step 120`` (it runs once step 120 has
    trained: ``stop`` ends the run with 120 trained), or ``before step 1``."""
    if after_step is None:
        return f"applies at step {apply_step}"
    return f"at the boundary after step {after_step}" if after_step else "before step 1"


#: The kinds of a command that is not a setting (no value to keep, absent from
#: :meth:`KnobSet.values`): ``action`` (one of its choices) and ``text`` (free text).
COMMAND_KINDS = frozenset({"action", "text"})
#: The longest value a ``text`` knob takes (characters).
TEXT_MAX_CHARS = 4096


#: :attr:`KnobSpec.tuning`: searched by default, searched only when allowed, never.
TUNED, TUNED_IF_ALLOWED, NOT_TUNED = "yes", "if allowed", "no"

#: :attr:`KnobSpec.group`: what a knob is about, for people (the dashboard's knobs panel
#: lists every knob under its group, in this order).
NUMERICS, KERNELS_MEMORY, DATA, OPTIMIZER, OTHER = (
    "numerics", "kernels & memory", "data", "optimizer", "other")
GROUPS = (NUMERICS, KERNELS_MEMORY, DATA, OPTIMIZER, OTHER)


@dataclass(frozen=True)
class KnobKey:
    """A dashboard key that changes one knob (the footer, ``?`` and the palette list it).

    Attributes:
        key: Textual's name of the key (``"p"``, ``"A"``). action: the dashboard's action
        (``cycle``, ``step``, ``toggle``, ``scale``, ``clip``, ``send``), called with the
        knob's name and then ``arguments``. description: the footer's word. tooltip: the
        line ``?`` and the palette show. id: the binding's id after the knob's name
        (``precision.cycle``). show: whether the footer shows it (else ``?`` and the
        palette only). question: for a command's key, what one press will do, by the
        value it sends (``(("on", "hold the training at the next step"), ...)``): the
        dashboard's question before it is sent (short: one line at 60 columns).
    """

    key: str
    action: str
    description: str
    tooltip: str
    id: str
    arguments: tuple[int | float | str, ...] = ()
    show: bool = True
    question: tuple[tuple[str, str], ...] = ()

    def question_of(self, value: object) -> str:
        """What a press that sends ``value`` will do (:attr:`question`); "" if not said."""
        return next((text for sent, text in self.question if sent == value), "")


@dataclass(frozen=True)
class KnobSpec:
    """The schema of one knob: every trait the agent, search, dashboard and README read from it.

    Attributes:
        name: wire name. kind: ``"choice"``, ``"int"``, ``"float"``, ``"bool"``,
        ``"weights"`` (numbers >= 0, not all 0, given as ``"0.7,0.3"`` or a list; the
        value is their canonical text, normalised to sum 1: :func:`weights_text`),
        ``"action"``: a command with no value to keep (``checkpoint=now``), absent from
        :meth:`KnobSet.values`, or ``"text"``: such a command whose value is free text
        (at most :data:`TEXT_MAX_CHARS` characters, no control characters).
        choices: allowed values for ``choice`` and ``action``.
        minimum / maximum: inclusive bounds for ``int`` and ``float``; for ``weights``,
        of how many weights (a run binds its own count as both). help: one line for people.
        tuning: what the in-run search (:mod:`agent.search.tune`) may do with it:
        :data:`TUNED` (a speed setting that leaves the training's results as they are:
        searched by default), :data:`TUNED_IF_ALLOWED` (it changes the numerics or the
        memory: searched only when the ``tune`` command allows it) or
        :data:`NOT_TUNED` (never: the optimizer's settings, actions, memory tools).
        group: one of :data:`GROUPS`, under which people see it (``group`` on the wire).
        unit: what a value counts (``"micro-batches"``), for the README's table; empty
        where the value is a word or a ratio. label: the knobs panel's name for it where
        the panel shows what the steps use rather than the value (``lr`` for
        ``lr_scale``); empty: its name. keys: its dashboard keys; key_group: the footer's
        word for several of them together (``aA accum``). guarded: a change is watched
        and rolled back when the steps after it go bad (:mod:`agent.control.guard`).
        search_rank: its place in the search's default order (lower first; None:
        after the ranked ones, in the run's order). trades_with: a knob drawing on the
        same resource, also searched as a trade with it (:data:`agent.search.coordinate.TRADES`).
        activation_memory: a change changes the memory a forward saves for backward
        (the next window measures it again). stops: the warning that a value stops the
        training, or nearly (:meth:`Knob.warning`); None where no value does.
        shifts_loss: a change moves the training loss's level by design (dropout's masks,
        another data mixture), so the loss-spike watch starts a new level after it
        (:meth:`agent.control.recovery.SpikeWatch.on_event`).
    """

    name: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    maximum: int | float | None = None
    tuning: str = NOT_TUNED
    group: str = OTHER
    unit: str = ""
    label: str = ""
    keys: tuple[KnobKey, ...] = ()
    key_group: str = ""
    guarded: bool = False
    search_rank: int | None = None
    trades_with: str = ""
    activation_memory: bool = False
    stops: Callable[[float], str | None] | None = None
    shifts_loss: bool = False

    @property
    def command(self) -> bool:
        """Whether it is a command rather than a setting (:data:`COMMAND_KINDS`)."""
        return self.kind in COMMAND_KINDS

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
        if self.kind == "text":
            wire["max_chars"] = TEXT_MAX_CHARS
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
        if self.kind == "text":
            return self._text(value)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _BOOL_WORDS:
                return _BOOL_WORDS[value.lower()]
            raise KnobError(f"{self.name}: {value!r} is not a boolean (true/false)")
        if self.kind == "weights":
            return self._coerce_weights(value)
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

    def _coerce_weights(self, value: Any) -> str:
        parts = value.split(",") if isinstance(value, str) else value
        if not isinstance(parts, (list, tuple)) or len(parts) > MAX_WEIGHTS:
            raise KnobError(f"{self.name}: {value!r} is not a list of weights "
                            f"(at most {MAX_WEIGHTS}, e.g. 0.7,0.3)")
        weights = [_as_float(part) for part in parts]
        if any(weight is None or weight < 0 for weight in weights):
            raise KnobError(f"{self.name}: {value!r} is not a list of numbers >= 0 "
                            "(e.g. 0.7,0.3)")
        low, high = self.minimum, self.maximum
        if (low is not None and len(weights) < low) or (high is not None
                                                         and len(weights) > high):
            wanted = f"{low}" if low == high else f"{low} to {high}"
            plural = "" if len(weights) == 1 else "s"
            raise KnobError(f"{self.name}: {len(weights)} weight{plural}, and this run's "
                            f"mixture has {wanted} datasets: one weight each")
        numbers = cast(list[float], weights)  # (None refused above)
        peak = max(numbers, default=0.0)
        if peak == 0:
            raise KnobError(f"{self.name}: {value!r}: the weights are all 0: no dataset "
                            "to draw from")
        ratios = [weight / peak for weight in numbers]  # in [0, 1]: a sum that never overflows
        total = math.fsum(ratios)
        return weights_text([ratio / total for ratio in ratios])


    def _text(self, value: Any) -> str:
        """A ``text`` knob's value: a string (an integer is taken as its digits) of 1 to
        :data:`TEXT_MAX_CHARS` characters without control characters, stripped of
        surrounding spaces."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise KnobError(f"{self.name}: {value!r} is not text")
        value = value.strip()
        if not value:
            raise KnobError(f"{self.name}: the value is empty")
        if len(value) > TEXT_MAX_CHARS:
            raise KnobError(f"{self.name}: the value has {len(value):,} characters, more "
                            f"than the {TEXT_MAX_CHARS:,} allowed")
        control = next((char for char in value if _is_control(char)), None)
        if control is not None:
            raise KnobError(f"{self.name}: the value has a control character "
                            f"(U+{ord(control):04X}), which no step or path here has")
        return value


#: The most weights a ``weights`` knob takes.
MAX_WEIGHTS = 64


def weights_text(weights: Any) -> str:
    """Weights as a ``weights`` knob's value: ``"0.7,0.3"``.

    6 significant digits each, comma-separated: what people type, what the panel and
    the events show."""
    return ",".join(f"{float(weight):.6g}" for weight in weights)


def _is_control(char: str) -> bool:
    """C0 and C1 control characters and DEL (a terminal would act on them)."""
    return ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0


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

def _lr_scale_stops(value: float) -> str | None:
    """0: no update at all; below 0.001: updates a thousand times smaller or less; from
    10: the usual cause of a diverging loss."""
    if value == 0:
        return ("lr_scale=0 makes every learning rate 0: the weights stop changing, so "
                "training stops learning (while costing as much) until it is set back")
    if value < 1e-3:
        return (f"lr_scale={value} divides every learning rate by {1 / value:,.0f}: "
                "training nearly stops learning")
    if value >= 10:
        return (f"lr_scale={value} multiplies every learning rate by {value:g}: the loss "
                "may diverge")
    return None


def _weight_decay_stops(value: float) -> str | None:
    """From 1: 10 to 10,000 times the usual 0.0001 to 0.1; the decay can outweigh the
    gradient and pull the weights to 0."""
    if value >= 1:
        return (f"weight_decay={value} is far above the usual 0.0001 to 0.1: the decay can "
                "outweigh the gradient and pull the weights to 0, so that training stops "
                "learning")
    return None


def _max_grad_norm_stops(value: float) -> str | None:
    """Above 0 and below 0.001: every update clipped that small."""
    if 0 < value < 1e-3:
        return (f"max_grad_norm={value} clips every update to a gradient norm of {value}: "
                "training nearly stops learning (0 turns clipping off)")
    return None


def _dropout_stops(value: float) -> str | None:
    """1: every element through a dropout module is zeroed."""
    if value >= 1:
        return ("dropout=1 zeroes everything that passes a dropout module: the layers "
                "after them get no signal, so training stops learning")
    return None


#: The threshold the dashboard's ``g`` turns clipping on with when the run never had one
#: (a common default: HF's ``max_grad_norm``, nanoGPT's ``grad_clip``).
DEFAULT_MAX_GRAD_NORM = 1.0

#: The standard knobs (the README's knob table: ``python -m agent.wire.knobs --markdown``); a
#: trainer binds the ones it supports.
PRECISION = KnobSpec("precision", "choice", "autocast precision of forward/backward",
                     choices=("fp32", "bf16", "fp16"), tuning=TUNED_IF_ALLOWED,
                     group=NUMERICS, guarded=True, search_rank=7, activation_memory=True,
                     keys=(KnobKey("p", "cycle", "prec", "Cycle precision fp32 -> bf16 -> "
                                   "fp16 (the run's choices)", "cycle"),))
ACCUM_STEPS = KnobSpec("accum_steps", "int", "micro-batches per optimizer step",
                       minimum=1, maximum=1024, tuning=TUNED_IF_ALLOWED, group=NUMERICS,
                       unit="micro-batches", guarded=True, search_rank=6, key_group="accum",
                       keys=(KnobKey("a", "step", "accum-", "accum_steps - 1 (micro-batches "
                                     "per optimizer step)", "decrease", (-1,)),
                             KnobKey("A", "step", "accum+", "accum_steps + 1 (micro-batches "
                                     "per optimizer step)", "increase", (1,))))
MICRO_BATCH_SIZE = KnobSpec("micro_batch_size", "int",
                            "samples per micro-batch; accum_steps follows, so that the "
                            "effective batch (micro-batch size x accum_steps) stays",
                            minimum=1, maximum=1 << 20, tuning=TUNED_IF_ALLOWED,
                            group=NUMERICS, unit="samples", guarded=True, search_rank=5)

NUM_WORKERS = KnobSpec("num_workers", "int", "DataLoader worker processes",
                       minimum=0, maximum=64, tuning=TUNED, group=DATA, unit="processes",
                       search_rank=1, trades_with="cpu_threads", key_group="work",
                       keys=(KnobKey("w", "step", "workers-", "num_workers - 1 (DataLoader "
                                     "worker processes)", "decrease", (-1,)),
                             KnobKey("W", "step", "workers+", "num_workers + 1 (DataLoader "
                                     "worker processes)", "increase", (1,))))
PIN_MEMORY = KnobSpec("pin_memory", "bool", "page-locked host batches (faster H2D copies)",
                      tuning=TUNED, group=DATA, search_rank=3,
                      keys=(KnobKey("m", "toggle", "pin", "pin_memory on/off (page-locked "
                                    "host batches, faster copies to the GPU)", "toggle"),))
PREFETCH_FACTOR = KnobSpec("prefetch_factor", "int", "batches prefetched per worker",
                           minimum=1, maximum=64, tuning=TUNED, group=DATA,
                           unit="batches per worker", search_rank=2)
# first in the search: it sets the pace of every later measurement
CPU_THREADS = KnobSpec("cpu_threads", "int",
                       "torch intra-op CPU threads of the training process "
                       "(torch.set_num_threads)", minimum=1, maximum=1024, tuning=TUNED,
                       group=DATA, unit="threads", search_rank=0)

# searched only when allowed: fused code reorders float ops and inductor draws its own
# dropout masks, and compiling is a long warm-up (gpuopt.compile)
KERNELS = KnobSpec("kernels", "choice", "forward implementation: eager, torch.compile, "
                   "or fused Triton kernels", choices=("eager", "compile", "triton"),
                   tuning=TUNED_IF_ALLOWED, group=KERNELS_MEMORY, guarded=True,
                   search_rank=4, activation_memory=True,
                   keys=(KnobKey("k", "cycle", "kern", "Cycle kernels eager -> compile -> "
                                 "triton (the run's choices)", "cycle"),))
CHECKPOINTING = KnobSpec("checkpointing", "bool",
                         "activation checkpointing of the repeated blocks",
                         tuning=TUNED_IF_ALLOWED, group=KERNELS_MEMORY, search_rank=8,
                         activation_memory=True,
                         keys=(KnobKey("c", "toggle", "ckpt", "Activation checkpointing "
                                       "on/off (less memory, more compute)", "toggle"),))
LR_SCALE = KnobSpec("lr_scale", "float", "multiplier on the learning rate the schedule "
                    "sets, in every param group (the schedule keeps its shape)",
                    minimum=0.0, maximum=100.0, group=OPTIMIZER, label="lr", guarded=True,
                    stops=_lr_scale_stops, key_group="lr",
                    keys=(KnobKey("l", "scale", "lr/2", "lr_scale x0.5: half the learning "
                                  "rate the schedule sets, from the next step (the "
                                  "schedule keeps its shape)", "halve", (0.5,)),
                          KnobKey("L", "scale", "lr*2", "lr_scale x2: twice the learning "
                                  "rate the schedule sets, from the next step", "double",
                                  (2,))))
WEIGHT_DECAY = KnobSpec("weight_decay", "float", "weight decay of the param groups that "
                        "decay (groups at 0, such as biases and norms, stay 0)",
                        minimum=0.0, maximum=10.0, group=OPTIMIZER, guarded=True,
                        stops=_weight_decay_stops)
MAX_GRAD_NORM = KnobSpec("max_grad_norm", "float", "clip the global gradient norm to this "
                         "before each optimizer step (0: no clipping)",
                         minimum=0.0, maximum=1e6, group=OPTIMIZER, label="clip",
                         guarded=True, stops=_max_grad_norm_stops,
                         keys=(KnobKey("g", "clip", "clip", "Gradient clipping off "
                                       "(max_grad_norm=0) / on again at the last threshold "
                                       f"({DEFAULT_MAX_GRAD_NORM:g} if it never had one)",
                                       "toggle"),))
DROPOUT = KnobSpec("dropout", "float", "p of every nn.Dropout module of the model and "
                   "its attention's rate, from the next forward (a plain number in a "
                   "forward is out of reach)",
                   minimum=0.0, maximum=1.0, group=OPTIMIZER, guarded=True,
                   stops=_dropout_stops, shifts_loss=True)
MIXTURE = KnobSpec("mixture", "weights", "weights of the datasets a "
                   "gpuopt.mixture.MixtureLoader draws from, one per dataset (normalised "
                   "to sum 1), from the next sample it draws",
                   minimum=1, maximum=MAX_WEIGHTS, group=DATA, unit="weights",
                   shifts_loss=True)
CHECKPOINT = KnobSpec("checkpoint", "action", "save a checkpoint (model, optimizer, "
                      "scheduler, GradScaler, knobs) at the next step boundary",
                      choices=("now",), group=OTHER,
                      keys=(KnobKey("s", "send", "save", "Save a checkpoint at the next step "
                                    "(the training waits while it is written)", "now",
                                    ("now",), show=False,
                                    question=(("now", "save a checkpoint at the next "
                                               "step"),)),))
PAUSE = KnobSpec("pause", "action", "on: hold the training at the next optimizer-step "
                 "boundary, waiting without using the CPU or GPU; off: go on from there",
                 choices=("on", "off"), group=OTHER,
                 keys=(KnobKey("P", "pause", "pause", "Pause the training at the next step "
                               "boundary (it waits there, asleep, and takes commands), or "
                               "let a paused run go on: pause=on / pause=off", "toggle",
                               show=False,
                               question=(("on", "hold the training at the next step"),
                                         ("off", "let the paused training go on"))),))
STOP = KnobSpec("stop", "action", "end the training cleanly at the next optimizer-step "
                "boundary (the framework's end hooks run); checkpoint: save one first",
                choices=("now", "checkpoint"), group=OTHER,
                keys=(KnobKey("X", "send", "stop", "Save a checkpoint, then end the training "
                              "at the next step boundary as the framework ends it: "
                              "stop=checkpoint (`:stop=now` ends it without one)",
                              "checkpoint", ("checkpoint",), show=False,
                              question=(("checkpoint", "save a checkpoint and end the "
                                         "training"),)),))
EVALUATE = KnobSpec("evaluate", "action", "run the framework's evaluation (or the "
                    "eval_fn given to attach / session) at the next optimizer-step "
                    "boundary; its metrics go to the event log", choices=("now",),
                    group=OTHER,
                    keys=(KnobKey("E", "send", "eval", "Run the framework's evaluation (or "
                                  "the run's eval_fn) at the next step boundary: "
                                  "evaluate=now; its metrics go to the event log", "now",
                                  ("now",), show=False,
                                  question=(("now", "run the evaluation at the next "
                                             "step"),)),))
REWIND = KnobSpec("rewind", "text", "put the training state back to a checkpoint at the "
                  "next optimizer-step boundary and go on from it as a new branch: a step "
                  "the checkpoint command saved (rewind=120), or a checkpoint's path; its "
                  "knob values come back with it", group=OTHER)
RECOVER = KnobSpec("recover", "choice", "on: keep host copies of the state and, after a "
                   "loss spike, go back to the last one before it, skip the data since "
                   "and scale the lr a while (the run's Recovery settings)",
                   choices=("off", "on"), group=OTHER)
MEMORY_FRACTION = KnobSpec("memory_fraction", "float",
                           "cap of this process's CUDA memory, as a fraction of the device",
                           minimum=0.01, maximum=1.0, group=KERNELS_MEMORY)
MEMORY_SNAPSHOT_STEPS = KnobSpec("memory_snapshot_steps", "int",
                                 "record CUDA allocations for this many steps, then dump a "
                                 "snapshot (0: none running)", minimum=1, maximum=1000,
                                 group=KERNELS_MEMORY, unit="optimizer steps")

#: The knobs of a rebuildable DataLoader (:class:`gpuopt.loader.ReconfigurableLoader`).
LOADER_KNOBS = (NUM_WORKERS, PIN_MEMORY, PREFETCH_FACTOR)
#: The optimizer's knobs (:class:`gpuopt.optim.OptimizerSettings`, or the framework's).
OPTIMIZER_KNOBS = (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM)

#: Every standard knob by name, in the order the dashboard lists them (in their group)
#: and binds their keys (a dashboard reads a knob's group from its schema, and from here
#: for a run whose schema has none).
STANDARD_KNOBS = {spec.name: spec for spec in
                  (PRECISION, ACCUM_STEPS, MICRO_BATCH_SIZE, NUM_WORKERS, PIN_MEMORY,
                   PREFETCH_FACTOR, CPU_THREADS, MIXTURE, KERNELS, CHECKPOINTING,
                   MEMORY_FRACTION,
                   MEMORY_SNAPSHOT_STEPS, *OPTIMIZER_KNOBS, DROPOUT, CHECKPOINT, PAUSE,
                   STOP, EVALUATE, REWIND, RECOVER)}


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
        detail: optional; the run's settings behind the value in a few words (the
            ``recover`` knob's policy), sent in the schema as ``detail`` and shown by
            the knobs panel after a value other than ``off``.
    """

    spec: KnobSpec
    get: Callable[[], Any]
    set: Callable[[Any], dict[str, Any] | None]
    check: Callable[[Any], None] | None = None
    warn: Callable[[Any], str | None] | None = None
    detail: str = ""

    @classmethod
    def attribute(cls, spec: KnobSpec, owner: Any, name: str = "", *,
                  check: Callable[[Any], None] | None = None,
                  warn: Callable[[Any], str | None] | None = None) -> "Knob":
        """A knob that reads and writes the attribute ``name`` of ``owner``.

        ``name`` defaults to the spec's name. The attribute may be a property that applies the
        value when set."""
        attribute = name or spec.name
        return cls(spec, get=lambda: getattr(owner, attribute),
                   set=lambda value: setattr(owner, attribute, value), check=check, warn=warn)

    def warning(self, value: Any) -> str | None:
        """What a person should know about an accepted ``value``; None when nothing.

        The reply's and the event log's warning: that it stops the training, or nearly (the
        spec's :attr:`KnobSpec.stops`; accepted all the same, as a person may mean it), and
        this knob's own :attr:`warn`."""
        stops = self.spec.stops
        found = [text for text in (
            stops(value) if stops is not None and isinstance(value, (int, float))
            and not isinstance(value, bool) else None,
            self.warn(value) if self.warn is not None else None) if text]
        return "; ".join(found) or None


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

    def bind(self, spec: KnobSpec, bound: Knob | str) -> None:
        """Take what an integration's binder gave for ``spec``: the live knob, or why it is absent.

        The live knob is bound, as :meth:`add`; with the reason this run cannot have it, the
        knob is absent from the schema and a command for it is refused with the reason.

        Raises:
            ValueError: a knob of another spec's name, or bound twice.
        """
        if isinstance(bound, str):
            self.unsupported = {**self.unsupported, spec.name: bound}
            return
        if bound.spec.name != spec.name:
            raise ValueError(f"a {bound.spec.name!r} knob bound as {spec.name!r}")
        self.add(bound)

    def schema(self) -> list[dict[str, Any]]:
        """The wire schema of every bound knob, for ``hello``.

        A choice knob's values that its device check refuses are listed in ``unavailable``
        ({value: reason}), so that a dashboard cycling through the choices skips them."""
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
            if knob.detail:
                wire["detail"] = knob.detail
            schema.append(wire)
        return schema

    def values(self) -> dict[str, Any]:
        """Current values of every knob that is a setting (commands have none)."""
        return {name: knob.get() for name, knob in self.knobs.items()
                if not knob.spec.command}

    def validate(self, name: Any, value: Any) -> Any:
        """Validate a command; return the coerced value.

        Raises:
            KnobError: unknown or unsupported knob, bad value, or a device check that
                refuses it.
        """
        if isinstance(name, str) and name in self.unsupported:
            raise KnobError(refusal(name, self.unsupported[name]))  # our own text, whole
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


def refusal(name: str, reason: str) -> str:
    """Why a knob this run cannot have is refused: ``<name>: <reason>``.

    The reason is its :attr:`KnobSet.unsupported` entry (what the loop would declare to
    have it). The run's reply to a command for it, and the dashboard's words for a key
    of it (from the hello's ``absent``, without sending)."""
    return f"{name}: {reason}"


def _values_text(spec: KnobSpec) -> str:
    """A knob's values for the README: its choices, on / off, or its bounds and unit."""
    if spec.choices:
        return " / ".join(f"`{choice}`" for choice in spec.choices)
    if spec.kind == "text":
        return f"text (at most {TEXT_MAX_CHARS:,} characters)"
    if spec.kind == "bool":
        return "on / off"
    bounds = " to ".join(f"{int(bound):,}" if float(bound).is_integer() else f"{bound:g}"
                         for bound in (spec.minimum, spec.maximum) if bound is not None)
    return f"{bounds} {spec.unit}".strip()


def markdown_table() -> str:
    """The README's knob table, one row per standard knob.

    Its values, group, keys, guarded, its role in the search, whether it changes activation
    memory, and its help line. ``python -m agent.wire.knobs --markdown`` prints it; a test
    checks that the README holds it as printed."""
    rows = ["| knob | values | group | keys | guarded | searched | activation memory "
            "| what it does |",
            "|---|---|---|---|---|---|---|---|"]
    for spec in STANDARD_KNOBS.values():
        search = {TUNED: "yes", TUNED_IF_ALLOWED: "if allowed"}.get(spec.tuning, "")
        if search and spec.search_rank is not None:
            search += f", #{spec.search_rank + 1}"
        if spec.trades_with:
            search += f", traded with `{spec.trades_with}`"
        rows.append(" | ".join((
            f"| `{spec.name}`", _values_text(spec), spec.group,
            " / ".join(f"`{key.key}`" for key in spec.keys), "yes" if spec.guarded else "",
            search, "yes" if spec.activation_memory else "", spec.help + " |")))
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m agent.wire.knobs --markdown  (the README's knob table)")
    print(markdown_table())
