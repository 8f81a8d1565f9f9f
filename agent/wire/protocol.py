"""The gpuwatch wire protocol: envelope, codec and message types.

Every message is a two-frame ZeroMQ multipart ``[topic, payload]`` where ``topic`` is the
message type as ASCII bytes (so a SUB socket can filter on it) and ``payload`` is a
msgpack map, the *envelope*::

    {"v": PROTOCOL_VERSION, "type": str, "run": str, "rank": int, "seq": int,
     "t": float (unix time, s), "body": {...}}

Rules (after the Jupyter messaging spec): unknown message types and extra fields are
ignored by both sides, never errors. Field names in bodies carry their units
(``step_time_s``, ``mem_reserved_bytes``). The protocol version is separate from the
package version and changes only when a field changes meaning.

Message types and their bodies:

``hello``      run metadata (:class:`Hello`): ``name``, ``pid``, ``host``, ``rank``,
               ``world_size``, ``device``, ``model`` (``params``, ``name``), ``env``
               (environment report), ``knobs`` (the knob schema, see
               :mod:`agent.wire.knobs`), ``started_at``,
               ``training`` (``framework``: gpuopt.Trainer, lightning, transformers,
               accelerate or loop; ``loss_normalization`` where known: how a window's
               loss and gradient are averaged, e.g. micro_batch_mean or samples),
               ``errors`` (the agent's latest internal errors, e.g. why the run has no
               log: training goes on).
``steps``      (wire, since version 2) every optimizer step the agent's I/O thread found
               queued since its last wake-up, in columns (one encode and one send for
               all of them): ``n`` (rows), ``columns`` (field name -> a list of ``n``
               values, one per step, oldest first) and ``common`` (field name -> the
               value every row of the batch shares: the memory fields, read once a
               batch, and ``knobs`` while it did not change within the batch). Row ``i``
               is the ``step`` body ``{**common, name: column[i] for each column}``, where
               a None of a field outside :data:`STEP_FIELDS` means the field is absent
               from that step (e.g. ``activation_bytes`` on steps that did not measure
               it). :func:`step_bodies` and :func:`expand` turn a batch into rows; every
               reader folds or prints rows, so ``gpuwatch tail --json`` prints one object
               per step. At most :data:`MAX_BATCH_STEPS` rows a message. A lost ``steps``
               message is one ``seq`` gap however many steps it held. Events and every
               other message keep their order with the steps: a batch is sent before
               any other message that follows its steps.
``step``       one optimizer step (the rows of ``steps``, as ``gpuwatch tail --json``
               prints them, each with its batch's ``seq`` and ``t``; version 1 agents
               sent one ``step`` message per step, which readers still fold):
               ``step``, ``micro_batches``, ``samples``,
               ``step_time_s``, ``data_wait_s``, ``data_wait_share``, ``samples_per_s``,
               ``loss`` (float or None), ``gpu_step_time_s`` (CUDA), ``knobs`` (current
               values), ``data_wait_share_window`` and ``input_verdict`` (input-bound |
               partly input-bound | compute-bound, over the last 20 steps), memory fields
               ``host_rss_bytes`` and on CUDA ``mem_allocated_bytes``,
               ``mem_reserved_bytes``, ``mem_peak_reserved_bytes``; on the steps that
               measured it, ``activation_bytes`` (saved for backward by a micro-batch);
               when known, ``tokens`` and ``tokens_per_s`` (token models), ``lr`` (the
               learning rate param group 0 used in the step, ``lr_scale`` included),
               ``lr_groups`` (that of every param group, None where unread) and
               ``grad_norm`` (global gradient norm before clipping).
``system``     about 1 Hz: ``cpu_pct``, ``host_mem_used_bytes``, ``host_mem_total_bytes``,
               ``gpus`` (list of per-GPU maps) and ``gpu_status`` (None or a reason such
               as "no NVIDIA GPU").
``state``      current knob values: ``knobs``, ``step`` (:class:`State`).
``event``      ``level`` (info | warning | error), ``text``, optional ``kind``
               (applied | rejected | warning | resumed | ...), ``knob``, ``value``,
               ``step``; ``checkpoint=now`` applied adds ``path``, ``size_bytes``,
               ``save_s`` and ``checkpoint_step`` (the steps the checkpoint holds).
``command``    client -> agent: ``id``, ``knob``, ``value``, ``token``, optional
               ``apply_step``; with ``checkpoint: true`` a checkpoint is saved at the same
               boundary first (with one rank the change is not applied if that fails; the
               reply and ``accepted`` event say so); with ``dry_run: true`` it is only
               checked (the reply gives the earliest ``apply_step``, the rank's
               ``step_time_s`` and ``held: true`` on a paused rank); with
               ``cancel: true`` (and ``id``, ``token``, optional ``reason``) the pending
               command ``id`` is withdrawn. Several ranks: dry run on all, then the
               command at one common ``apply_step`` on all, then cancel where needed;
               the command names the ``branch`` its ``apply_step`` is counted on (the
               dry runs' replies say it): a rank that went back since (a rewind) moves
               it as it moves its pending commands (``rescheduled``: each keeps its
               distance from the rewind's boundary).
               Commands that are not settings name no knob of the schema: ``tune``
               (:data:`TUNE`, value a map: ``knobs`` (names to search; default every
               knob whose spec says it is tuned), ``budget_steps`` (int),
               ``allow`` (names of knobs that change numerics or memory, searched only
               when listed here); or ``{"stop": true}``, which ends a search and keeps
               the best configuration). It is answered and fanned out like any
               command; rank 0 runs the search, and the commands the search sends have
               ids starting with :data:`TUNE_ID_PREFIX`. A command whose id starts with
               :data:`ROLLBACK_ID_PREFIX` and that has a ``reason`` (string) is a
               rollback: rank 0's guard sends it to every rank of a run of several,
               and each applies it as its own guard's rollback (``rolled_back`` with
               the reason, the training state put back: ``state_restored``). One
               whose id is :data:`RECOVERY_ID_PREFIX` ``<step>-...`` with
               ``recover=on`` is a loss-spike recovery (:mod:`agent.control.recovery`):
               each rank puts back its latest state kept before optimizer step
               ``<step>`` (``branched``), instead of setting the knob.
``reply``      agent -> client (every field: :class:`Reply`): ``id``, ``ok``, ``knob``,
               ``value``, ``apply_step`` or ``reason``; an accepted command's reply also
               has ``step``, the last optimizer step the run had completed when it
               accepted it (the run's own counter: the command applies
               ``apply_step - step`` steps later, 2 with the default ``apply_step``).
``tune``       the in-run search (rank 0), at each change of its state: ``status``
               (running | done | stopped), ``started_step``, ``step``, ``steps``
               (spent so far), ``budget_steps``, ``unit`` (samples | tokens), ``knobs``
               (searched), ``baseline`` and ``best`` ({knob: value}), ``gain`` (best over
               baseline throughput, minus 1), ``candidates`` (list of maps:
               ``setting`` ({knob: value}: one knob, or two moved as a trade),
               ``state`` (measuring | kept | reverted | skipped), ``reason``,
               ``per_s`` and ``per_s_spread`` (throughput in units/s and its 95%
               half-width), ``gain`` and ``gain_spread`` (against the best so far, as
               fractions), ``steps``), and once ended ``text`` (the one-line result).
``heartbeat``  about 1 Hz (:class:`Heartbeat`): ``step`` (last completed optimizer step),
               ``ending``, ``records_dropped``, ``errors``, ``commands_refused``,
               ``commands_rejected`` (bad token, knob or value).
``bye``        the run ends: ``reason``, ``steps`` (:class:`Bye`).
``node``       about 1 Hz, from a node's relay in a multi-node job (:mod:`agent.io.relay`):
               ``node``, ``host``, ``expected`` (the node's global ranks), ``ranks`` (a
               list of maps: ``rank``, ``step``, ``step_time_s`` and
               ``data_wait_share`` smoothed over about 20 steps, ``heard_s_ago``),
               ``events_dropped``. The relay also forwards every message of global
               rank 0 and the events and ``bye`` of every rank of its node. Its command
               replies (to a ``command`` with the relay's token) carry ``relay: true``,
               ``node`` and ``replies`` (each rank's reply, with its ``rank``).
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import msgpack
import orjson

#: 2: step records travel in batches (``steps``, columnar); 1: one ``step`` message each.
PROTOCOL_VERSION = 2

HELLO = "hello"
STEP = "step"
STEPS = "steps"
SYSTEM = "system"
STATE = "state"
EVENT = "event"
COMMAND = "command"
REPLY = "reply"
HEARTBEAT = "heartbeat"
BYE = "bye"
TUNE = "tune"
NODE = "node"
MESSAGE_TYPES = (HELLO, STEPS, STEP, SYSTEM, STATE, EVENT, COMMAND, REPLY, HEARTBEAT, BYE,
                 TUNE, NODE)

#: Ids of the commands the agent's tuner sends start with this.
TUNE_ID_PREFIX = "tune-"
#: Ids of the commands that roll a guarded change back on every rank start with this
#: (rank 0's guard sends them, with the ``reason``).
ROLLBACK_ID_PREFIX = "rollback-"
#: Ids of the commands of a loss-spike recovery start with this, then the spike's first
#: step and ``-`` (rank 0 sends them to every rank, with the ``reason``).
RECOVERY_ID_PREFIX = "recovery-"
#: The demo training job's last line starts with this, then the step and how it ended
#: (``80 (finished; 80 steps trained)``): :mod:`agent.demo` prints it,
#: ``gpuwatch demo`` looks for it at the end of the job's output.
DEMO_ENDED = "gpuwatch demo: ended at step "
#: The signal ``gpuwatch demo`` stops its training job with when its dashboard closes
#: (``q``): the job's last line, its ``bye`` and its log then say so ("dashboard quit"),
#: not the SIGINT a Ctrl-C sends (a newcomer read "stopped by SIGINT" after a ``q`` as a
#: Ctrl-C of their own).
DEMO_QUIT_SIGNAL = signal.SIGUSR1
DEMO_QUIT_REASON = "dashboard quit"


class EventKind:
    """The ``kind`` of an ``event`` body, declared once for everyone who sends or reads events.

    For the agent, the dashboard, the loggers bridge and the tests. Plain strings on the
    wire: a peer may send kinds not listed here, which readers show and otherwise ignore."""

    #: a command was accepted for a later step (``step``: the step it applies at)
    ACCEPTED = "accepted"
    #: a knob was set at an optimizer-step boundary (``previous``: the value before; a
    #: setting to the value it had sets nothing: :func:`applied_unchanged`)
    APPLIED = "applied"
    #: setting a knob failed; the previous value stays
    FAILED = "failed"
    #: a command was refused (bad token, knob or value; at most one event a second)
    REJECTED = "rejected"
    #: a pending command was withdrawn before its step
    CANCELLED = "cancelled"
    #: the run went back (a ``branched`` event) and a pending command keeps its distance
    #: from now: ``step`` (the step it applies at now), ``previous_step`` (the one it was
    #: accepted for), ``branch``, ``id``, ``knob``, ``value``
    RESCHEDULED = "rescheduled"
    #: a guarded change is being undone (announced), and the knob set back (applied)
    ROLLBACK = "rollback"
    ROLLED_BACK = "rolled_back"
    #: with a rollback, the training state went back to the boundary where the change
    #: applied (``step``: the boundary it applies at; its text: what it cost), or could
    #: not (level warning / error, and why)
    STATE_RESTORED = "state_restored"
    #: something a person should know (a value that may hurt, a step not rolled back)
    WARNING = "warning"
    #: an internal error of the agent's; training goes on
    AGENT_ERROR = "agent_error"
    #: the model is being compiled (steps are slow, not stalled), and it is done
    COMPILING = "compiling"
    COMPILED = "compiled"
    #: knob values came back from a checkpoint
    RESUMED = "resumed"
    #: the training state was put back to an earlier (or other) point and the run goes
    #: on as a new branch: ``branch`` (its id), ``parent`` (the branch left), ``step``
    #: (the fork: the last optimizer step kept; the next step record is ``step + 1``),
    #: ``source`` (a checkpoint's path, ``rollback``, ``recovery``), ``cause`` (what
    #: asked for it, e.g. ``rewind=120``) and ``knobs`` (the values that came back with a
    #: checkpoint). Published before any step record of the new branch: readers assign
    #: every step record after it, in order, to its branch (records carry none).
    BRANCHED = "branched"
    #: the framework's own moments: its evaluation started and ended (``metrics``), it
    #: saved a checkpoint of its own, an epoch ended, it logged numbers (``logs``)
    EVALUATION_START = "evaluation_start"
    EVALUATION = "evaluation"
    CHECKPOINT_SAVED = "checkpoint"
    EPOCH_END = "epoch_end"
    LOG = "log"
    #: how the run trains differs from what a person may assume (a plan beyond the
    #: planned epochs, the loss normalisation a loop uses)
    PLAN = "plan"
    LOSS_NORMALIZATION = "loss_normalization"
    #: a CUDA memory snapshot was written (``path``)
    MEMORY_SNAPSHOT = "memory_snapshot"

    #: kinds that settle a pending command (it applied, failed or was withdrawn)
    SETTLING = frozenset({APPLIED, FAILED, ROLLED_BACK, CANCELLED})
    #: kinds after which a knob holds a new value
    CHANGED = frozenset({APPLIED, ROLLED_BACK})
    #: kinds that end a compiling phase (besides the first step record after it)
    COMPILE_ENDED = frozenset({COMPILED, FAILED})



def applied_unchanged(event: dict[str, Any]) -> bool:
    """Whether ``event`` applied a setting to the value it had (nothing was set).

    An ``applied`` event whose ``previous`` equals its ``value``: the command desk sets
    nothing then (its text says "(no change)"), so no step after it trains otherwise
    than before: not a change for those who watch changes (the in-run search's
    measurement, the spike watch's level)."""
    return (event.get("kind") == EventKind.APPLIED and "previous" in event
            and event["previous"] == event.get("value"))


class Reply(TypedDict, total=False):
    """The body of a ``reply`` (agent -> client), declared once for every sender and reader.

    For the agent's command desk, the fan-out to several ranks (:mod:`agent.wire.commands`)
    and the clients; extra fields are ignored, as everywhere on the wire."""

    #: the command's ``id`` (None when the command's own id was unusable)
    id: Any
    #: accepted (or, for ``cancel``, withdrawn)
    ok: bool
    #: why not, for people (``ok`` false)
    reason: str
    #: the knob named, and its value as validated (or as sent, for ``tune``)
    knob: Any
    value: Any
    #: the optimizer step it applies at (1-based)
    apply_step: int
    #: a command that is not a setting (``stop``, ``checkpoint``...): the optimizer step
    #: it runs after (``apply_step`` - 1), for people's words
    #: (:func:`agent.wire.knobs.when_applied`)
    after_step: int
    #: the setting is the value the knob will have by then: nothing changes
    no_change: bool
    #: the branch ``apply_step`` is counted on, once the rank has left branch 0 (a
    #: rewind); absent: 0
    branch: int
    #: the last optimizer step the rank had completed when it accepted the command
    step: int
    #: the phase answered: a check only, a withdrawal, a change after a checkpoint
    dry_run: bool
    cancel: bool
    checkpoint: bool
    #: a cancel that came late: the step the command had applied at
    applied_step: int
    #: a dry run's answer: the rank's latest step time (s), or None
    step_time_s: float | None
    #: a dry run's answer: the rank is held at a boundary (paused); its ``apply_step`` is
    #: that boundary's step, where a command applies at once
    held: bool
    #: what a person should know about the value (it may be slow here, or stop the
    #: training), and what the ``tune`` command started or a running search did with
    #: the command (it leaves the knob to the person)
    warning: str
    note: str
    #: the fan-out's: the ranks reached, whether any rank answered at all, whether a
    #: refused command could not be withdrawn everywhere
    ranks: list[int]
    answered: bool
    ranks_differ: bool
    #: a node relay's: ``relay`` true, its ``node`` and each rank's ``replies`` (with
    #: their ``rank``)
    relay: bool
    node: int
    replies: list[Reply]
    rank: int


class Hello(TypedDict):
    """The body of ``hello`` (agent -> readers): the run's facts.

    Sent at once to a new subscriber and every 30 heartbeats. Readers take each field with
    ``.get``: an older or newer agent may lack one."""

    name: str
    pid: int
    host: str
    rank: int
    world_size: int
    #: unix time (s) the agent was made
    started_at: float
    #: the model's device, e.g. ``cuda:0`` or ``cpu``
    device: str
    #: ``name`` and ``params`` (a count, or None)
    model: dict[str, Any]
    #: the environment report (versions, devices)
    env: dict[str, Any] | None
    #: the knob schema: one spec a knob (see :meth:`agent.wire.knobs.KnobSet.schema`)
    knobs: list[dict[str, Any]]
    #: knobs this run cannot have, by name, with why and what the loop would declare to
    #: have them (:attr:`agent.wire.knobs.KnobSet.unsupported`)
    absent: dict[str, str]
    #: the run log's path, "" when the run has none
    log_path: str
    #: current knob values
    knob_values: dict[str, Any]
    #: facts of the training loop: ``framework``, ``loss_normalization``
    training: dict[str, Any]
    #: the agent's latest internal errors (at most 10)
    errors: list[str]


class Heartbeat(TypedDict):
    """The body of ``heartbeat`` (about 1 Hz)."""

    #: the last completed optimizer step
    step: int
    #: the run is ending: commands are rejected
    ending: bool
    #: step records the agent's queue lost (its I/O thread fell behind)
    records_dropped: int
    #: the agent's internal errors so far
    errors: int
    #: commands refused (a valid command the run cannot take) and rejected (bad token,
    #: knob or value)
    commands_refused: int
    commands_rejected: int


class State(TypedDict):
    """The body of ``state``: the current knob values at the last completed step."""

    knobs: dict[str, Any]
    step: int


class Bye(TypedDict):
    """The body of ``bye``: why the run ended, and its last completed step."""

    reason: str
    steps: int

#: Largest payload either side decodes; larger frames are dropped as malformed.
MAX_MESSAGE_BYTES = 1 << 20
#: Most rows in one ``steps`` message (a batch of about 150 kB at most); the agent sends a
#: longer backlog as several.
MAX_BATCH_STEPS = 1024
#: Fields of a ``step`` present in every row (None where unknown: ``loss`` None is "no
#: loss"); a None of any other column means the field is absent from that row.
STEP_FIELDS = frozenset({
    "step", "micro_batches", "samples", "step_time_s", "data_wait_s", "data_wait_share",
    "samples_per_s", "loss", "gpu_step_time_s", "knobs", "skipped_steps_total"})
#: The envelope's fields in a flat record (:func:`flatten`); every other field is the
#: body's, and a body field of one of these names is dropped from flat records.
ENVELOPE_KEYS = ("type", "run", "rank", "seq", "t")


#: Longest text (characters) kept of a string from the wire or a log where it is shown
#: or stored to be shown (an event's text, a reason); longer ones are cut with "…".
MAX_TEXT_CHARS = 1000
#: Longest name (a knob's, a run's, a model's, a device's) shown or echoed back.
MAX_NAME_CHARS = 100
#: Longest ``text`` of an ``event`` sent and logged (characters); a longer one is cut,
#: with a note of its length (:func:`bounded_event`).
MAX_EVENT_TEXT_CHARS = 16_384
#: Fields of an ``event`` sent and logged at most.
MAX_EVENT_FIELDS = 32
#: Largest value of an event's other fields (packed bytes); a larger one is sent as its
#: ``repr``, cut to :data:`MAX_TEXT_CHARS`.
MAX_EVENT_VALUE_BYTES = 4096


def _picture_table() -> dict[int, int]:
    """Character -> its visible stand-in, for :func:`printable`."""
    table = {code: 0x2400 + code for code in range(0x20)}  # C0: ESC -> U+241B "␛"
    table[0x7F] = 0x2421  # DEL -> "␡"
    replacement = 0xFFFD  # "�": C1, bidi controls, line separators, lone surrogates
    for code in [*range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                 *range(0x2066, 0x206A), 0x2028, 0x2029, *range(0xD800, 0xE000)]:
        table[code] = replacement
    return table


_PICTURES = _picture_table()
_PICTURES_KEEPING_NEWLINES = {**_PICTURES, 0x0A: 0x0A}


#: What :func:`terminal_json` writes as JSON escapes: DEL, C1 controls, bidirectional
#: controls and line separators (JSON escapes C0 itself; lone surrogates never reach it:
#: :func:`to_json_line` escapes them).
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in [
    0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
    *range(0x2066, 0x206A), 0x2028, 0x2029]}


def terminal_json(line: bytes) -> bytes:
    """A JSON line (:func:`to_json_line`'s) that a terminal shows as text, raw controls escaped.

    The characters that JSON leaves raw but a terminal obeys (a C1 CSI, a right-to-left
    override) become ``\\uXXXX`` escapes. Exact: a JSON reader gets the same strings back
    (outside strings a JSON line is ASCII). About 0.1 us for an ASCII line (the common case:
    no copy)."""
    if line.isascii() and b"\x7f" not in line:
        return line
    return line.decode("utf-8", "surrogatepass").translate(_JSON_ESCAPES).encode(
        "utf-8", "surrogatepass")


def shorten(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, the last one "…" when cut."""
    return text if len(text) <= limit else text[:max(0, limit - 1)] + "…"


def bounded_event(body: dict[str, Any]) -> dict[str, Any]:
    """An ``event`` body as it is sent and logged: small whatever a caller put in it.

    An event of 1 MB, 20 a second, would fill the dashboards' receive queues and the run
    log, and a frame over :data:`MAX_MESSAGE_BYTES` is dropped by every reader. The ``text``
    is cut to :data:`MAX_EVENT_TEXT_CHARS` with a note of its length
    (``… [cut: 1,048,576 characters in all]``), other strings to :data:`MAX_TEXT_CHARS`,
    other values packed larger than :data:`MAX_EVENT_VALUE_BYTES` become their cut ``repr``,
    and fields past :data:`MAX_EVENT_FIELDS` go. Returns ``body`` itself when nothing is cut
    (the usual case: a type and length check a field)."""
    scalars = (int, float, bool, type(None))
    for key, value in body.items():
        if type(value) is str:
            if len(value) > (MAX_EVENT_TEXT_CHARS if key == "text" else MAX_TEXT_CHARS):
                break
        elif type(value) not in scalars:
            try:
                if len(msgpack.packb(value, use_bin_type=True)) > MAX_EVENT_VALUE_BYTES:
                    break
            except Exception:  # msgpack raises several unrelated types
                break
    else:
        if len(body) <= MAX_EVENT_FIELDS:
            return body
    cut: dict[str, Any] = {}
    for key, value in list(body.items())[:MAX_EVENT_FIELDS]:
        if key == "text" and isinstance(value, str) and len(value) > MAX_EVENT_TEXT_CHARS:
            value = (value[:MAX_EVENT_TEXT_CHARS]
                     + f"… [cut: {len(value):,} characters in all]")
        elif isinstance(value, str):
            value = shorten(value)
        elif type(value) not in scalars:
            try:
                small = len(msgpack.packb(value, use_bin_type=True)) <= MAX_EVENT_VALUE_BYTES
            except Exception:  # msgpack raises several unrelated types
                small = False
            if not small:
                value = shorten(repr(value))
        cut[key if isinstance(key, str) else shorten(repr(key), MAX_NAME_CHARS)] = value
    return cut


def short_name(value: Any) -> Any:
    """A name from a command (knob, id) as echoed in replies and events; cut when too long.

    As it is when it is not a string or is at most :data:`MAX_NAME_CHARS` long (every real
    one), else cut."""
    if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        return shorten(value, MAX_NAME_CHARS)
    return value


def printable(text: object, limit: int | None = None, *, newlines: bool = False) -> str:
    """``text`` as a terminal may show it: as text, never as control sequences.

    The one sanitizer of everything gpuwatch prints or draws that came from the wire, a
    run log or a run file. Every C0 control character (tab and newline included, unless
    ``newlines``), DEL and every C1 control is replaced by a visible character (C0 and
    DEL by their Unicode control pictures, so ESC shows as "␛"; C1 by "�"), and so are
    the Unicode bidirectional controls (which reorder what a terminal shows), line and
    paragraph separators and lone surrogates (which a terminal's UTF-8 cannot carry).
    One character for one: styles over ranges of the text stay where they were.
    About 0.1 us for text without such characters (a ``str.isprintable`` check).

    Args:
        text: the string (anything else is shown as ``str(text)``).
        limit: cut to at most this many characters (see :func:`shorten`); None: not cut.
        newlines: keep newlines (a panel's own line breaks).

    Returns:
        The text, safe to write to a terminal.
    """
    if not isinstance(text, str):
        text = str(text)
    if limit is not None:
        text = shorten(text, limit)
    if text.isprintable():
        return text
    return text.translate(_PICTURES_KEEPING_NEWLINES if newlines else _PICTURES)


class ProtocolError(ValueError):
    """A frame that is not a gpuwatch envelope (bad msgpack, wrong shape, too large)."""


class PackedBody:
    """A body that packs its envelope itself, for :func:`encode`.

    ``pack(head) -> bytes`` gives what ``msgpack.packb({**head, "body": body},
    use_bin_type=True)`` would of the body it stands for (the agent's ``steps`` batches,
    packed in C as their steps came: :class:`agent.step._hot.StepsBatch`). Packed once:
    :func:`encode` it once. ``plain() -> dict`` gives the body as a map of Python
    values (for the run log, when it cannot be packed)."""

    __slots__ = ("pack", "plain")

    def __init__(self, pack: Callable[[dict[str, Any]], bytes],
                 plain: Callable[[], dict[str, Any]]) -> None:
        self.pack = pack
        self.plain = plain

    def __repr__(self) -> str:
        return "PackedBody(...)"


def envelope(
    msg_type: str, body: Mapping[str, Any] | PackedBody, *, run: str, rank: int = 0,
    seq: int = 0, t: float | None = None,
) -> dict[str, Any]:
    """Build an envelope map.

    Args:
        msg_type: one of :data:`MESSAGE_TYPES` (others are allowed and ignored by peers).
        body: the type's fields; values must be msgpack-serialisable (or a
            :class:`PackedBody`, which :func:`encode` has pack the envelope).
        run: run id. rank: the sender's rank. seq: per-sender sequence number.
        t: unix time in seconds; now when omitted.
    """
    return {
        "v": PROTOCOL_VERSION, "type": msg_type, "run": run, "rank": rank, "seq": seq,
        "t": time.time() if t is None else t, "body": body,
    }


def encode(message: dict[str, Any]) -> list[bytes]:
    """Encode an envelope as the two frames ``[topic, payload]``.

    A :class:`PackedBody` body packs the envelope itself.

    Raises:
        TypeError: a body value that msgpack cannot serialise (e.g. a tensor).
    """
    body = message["body"]
    if type(body) is PackedBody:
        return [message["type"].encode("ascii"),
                body.pack({key: value for key, value in message.items() if key != "body"})]
    return [message["type"].encode("ascii"), msgpack.packb(message, use_bin_type=True)]


def decode(payload: bytes) -> dict[str, Any]:
    """Decode one payload frame into an envelope map.

    Extra fields are kept (and ignored by readers); a missing ``body`` becomes ``{}``.

    Raises:
        ProtocolError: the frame is larger than :data:`MAX_MESSAGE_BYTES`, is not valid
            msgpack, is not a map, or lacks a string ``type``.
    """
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"envelope must be a map, got {type(message).__name__}")
    if not isinstance(message.get("type"), str):
        raise ProtocolError("envelope has no string 'type'")
    body = message.get("body")
    if body is None:
        message["body"] = {}
    elif not isinstance(body, dict):
        raise ProtocolError(f"body must be a map, got {type(body).__name__}")
    return message


def decode_frames(frames: list[bytes]) -> dict[str, Any]:
    """Decode a received multipart message (``[topic, payload]`` or ``[payload]``).

    Raises:
        ProtocolError: as :func:`decode`, or no frames.
    """
    if not frames:
        raise ProtocolError("empty multipart message")
    return decode(frames[-1])


def flatten(message: dict[str, Any]) -> dict[str, Any]:
    """An envelope as one flat record: ``{"type", "run", "rank", "seq", "t", **body}``.

    This is the format of ``gpuwatch tail --json`` (see :func:`to_json_line`) and of
    the run logs of earlier versions (JSON lines). Envelope keys win over body keys of
    the same name.
    """
    head = {key: message.get(key) for key in ENVELOPE_KEYS}
    body = message.get("body") or {}
    record = {**head, **body}
    if len(record) != len(head) + len(body):  # a body key shadowed an envelope key
        record.update(head)
    return record


def to_json_line(message: dict[str, Any]) -> bytes:
    """:func:`flatten` as one line of JSON, UTF-8, with its trailing newline.

    One JSON object per line (``gpuwatch tail --json``: ``pandas.read_json(path,
    lines=True)`` reads its output as a table). Non-finite floats (a diverged loss)
    become ``null``, so the line stays valid JSON; values JSON cannot hold are written
    as their ``repr``. About 1 us a record (orjson).
    """
    record = flatten(message)
    try:
        return orjson.dumps(record, default=repr,
                            option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, RecursionError):  # e.g. an int beyond 64 bits
        return (json.dumps(_finite(record), default=repr, separators=(",", ":"))
                + "\n").encode()


def steps_body(columns: dict[str, list[Any]], common: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """The body of a ``steps`` message.

    Args:
        columns: field name -> one value per step, oldest first; every list as long as
            ``columns["step"]`` (at most :data:`MAX_BATCH_STEPS`).
        common: fields every row shares (memory read once a batch, unchanged knobs).
    """
    return {"n": len(columns["step"]), "columns": columns, "common": common or {}}


def step_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a ``steps`` body, each a ``step`` body (see the module docstring).

    Raises:
        ProtocolError: the body is not a batch: ``columns`` is not a map of lists of
            ``n`` values each, ``common`` is not a map, or ``n`` is out of range.
    """
    columns, common, n = body.get("columns"), body.get("common", {}), body.get("n")
    if (not isinstance(columns, dict) or not isinstance(common, dict)
            or type(n) is not int or not 0 <= n <= MAX_BATCH_STEPS):
        raise ProtocolError("a steps body needs n, columns and common")
    for values in columns.values():
        if type(values) is not list or len(values) != n:
            raise ProtocolError(f"every column of a steps body must hold {n} values")
    names = list(columns)
    sparse = [name for name in names if name not in STEP_FIELDS and None in columns[name]]
    rows = []
    for values in zip(*columns.values()):
        row = {**common, **dict(zip(names, values))}
        for name in sparse:
            if row[name] is None:
                del row[name]
        rows.append(row)
    if not names:  # a batch of columns-less rows: n bodies of common fields alone
        rows = [dict(common) for _ in range(n)]
    return rows


def expand(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A received envelope as the records readers handle: a ``steps`` batch as one per row.

    A ``steps`` batch as one ``step`` envelope per row (each with the batch's ``run``,
    ``rank``, ``seq`` and ``t``), any other envelope as itself.

    Raises:
        ProtocolError: a ``steps`` message whose body is not a batch.
    """
    if message.get("type") != STEPS:
        return [message]
    head = {key: message.get(key) for key in ("v", "run", "rank", "seq", "t")}
    return [{**head, "type": STEP, "body": row} for row in step_bodies(message["body"])]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
