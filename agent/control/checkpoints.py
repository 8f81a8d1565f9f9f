"""The ``checkpoint`` command (``gpuwatch set checkpoint=now``), and resuming from what it saved.

At the optimizer-step boundary the command applies at, the run saves itself through its
framework's own mechanism (Lightning's ``trainer.save_checkpoint``, Hugging Face's
``Trainer._save_checkpoint``, accelerate's ``save_state``) or ``torch.save`` (the
reference Trainer, hand-written loops), always with gpuwatch's knob values, and always
atomically (:func:`gpuopt.saving.write_atomically`: a private temporary folder in the
same directory, fsync, rename; a directory another user could write in or swap is
refused). The ``applied`` event says where, how large, and how long it
took.

Where: ``checkpoint_dir=`` given to :func:`agent.attach` / :func:`agent.session`, else the
run's own directory, :func:`default_checkpoint_dir` (``<run log dir>/checkpoints/<run
id>/``, so ``~/.local/share/gpuwatch/runs/checkpoints/<run id>/``; ``$GPUWATCH_LOG_DIR``
moves it with the run logs). Each checkpoint is named after the optimizer step it holds
(``step-00001234.pt``, or a directory ``checkpoint-1234`` for the frameworks that save
directories).

``rewind=<step or path>`` loads such a checkpoint back into the live run, as a new branch
(:meth:`agent.integrations.run.RunBase.rewind_state`; :meth:`Checkpoints.path` names
step N's).

.. note:: The training thread waits while the checkpoint is written, as for the
   framework's own checkpoints (about its size over the disk's write speed); nothing is
   written, read or synchronized at any other step.
"""

from __future__ import annotations

import json
import os
import re
import stat
import string
import time
from pathlib import Path
from typing import Any, Callable

import torch

from agent.step.core import Agent
from agent.wire.knobs import CHECKPOINT, Knob, KnobError, KnobSet, assignment
from agent.wire.protocol import MAX_NAME_CHARS, EventKind, printable
from agent.wire.runlog import log_dir, open_no_follow
from gpuopt.memory import format_bytes
from gpuopt.saving import writable_by_others as _writable_by_others
from gpuopt.saving import write_atomically

#: Saved with every checkpoint: what it is, for :func:`load_checkpoint`.
FORMAT = "gpuwatch-checkpoint"
#: Entries of a checkpoint directory read at most to tell which steps were saved.
MAX_LISTED_ENTRIES = 10_000
#: The knob values in a checkpoint that is a directory (Hugging Face, accelerate).
KNOBS_FILE = "gpuwatch.json"
#: In such a directory: the GradScaler that gpuwatch's precision knob made, which the
#: framework would not load into a run started without fp16 (it has no GradScaler).
GRAD_SCALER_FILE = "gpuwatch-grad-scaler.pt"
#: The largest :data:`KNOBS_FILE` read (bytes): knob values and a data position are a
#: few KiB; a larger file is refused, never read whole.
MAX_KNOBS_FILE_BYTES = 1 << 20


def default_checkpoint_dir(run_id: str) -> Path:
    """The directory a run's checkpoints go to when no ``checkpoint_dir=`` is given.

    ``checkpoints/<run id>`` in the run-log directory
    (:func:`agent.wire.runlog.log_dir`)."""
    return log_dir() / "checkpoints" / run_id


class Checkpoints:
    """The ``checkpoint`` command of one run.

    Args:
        agent: the run's agent (run id, rank, knob values).
        save: ``save(path, knobs)`` writes the checkpoint of the state now, with the knob
            values ``knobs``, at ``path`` (a file, or a directory for frameworks that save
            directories); training thread, at a boundary.
        step: the optimizer steps the state holds (names the checkpoint).
        directory: where checkpoints go (default: :func:`default_checkpoint_dir`).
        name: the checkpoint's name, formatted with ``step``.
        refusal: returns why no checkpoint can be saved now, or None (also asked when the
            command arrives, on the agent's I/O thread: keep it cheap).
        every_rank: ``save`` must run on every rank (it has a collective inside, as
            Lightning's, or every rank writes its part of a sharded model, as
            :func:`agent.integrations.sharded.save_sharded`): rank 0 saves atomically,
            the others call ``save`` at the final path (a ``save`` that writes into rank
            0's temporary asks rank 0 for it). Otherwise only rank 0 saves (data
            parallelism keeps the state identical on every rank).
        chosen: returns the knob values to save and a note for the event (or None);
            default: the values now (:meth:`agent.integrations.run.RunBase.chosen_knobs` leaves a
            search's trial out).
        warn: ``warn(value)`` returns why a resume from this checkpoint would not be
            exact, or None; said in the command's reply, before anything is saved.
        agree: with ``every_rank``, tells every rank of a failure on any
            (:func:`agent.integrations.ranks.agree`): ``agree(failure)``
            is a collective matching the first and the last of ``save``'s, which
            returns the first rank's failure (a text) or None. Rank 0 calls it in place
            of ``save`` when the checkpoint failed before ``save`` ran, and every rank
            once ``save`` returned (rank 0 after the rename), so that no rank waits at a
            collective another left, and every rank reports the failure.
    """

    def __init__(self, agent: Agent, save: Callable[[Path, dict[str, Any]], None], *,
                 step: Callable[[], int], directory: str | os.PathLike | None = None,
                 name: str = "step-{step:08d}.pt",
                 refusal: Callable[[], str | None] | None = None,
                 every_rank: bool = False,
                 chosen: Callable[[], tuple[dict[str, Any], str | None]] | None = None,
                 warn: Callable[[Any], str | None] | None = None,
                 agree: Callable[[str | None], str | None] | None = None) -> None:
        self.agent = agent
        self.save = save
        self.step = step
        self.directory = Path(directory) if directory is not None else None
        self.name = name
        self.refusal = refusal
        self.every_rank = every_rank
        self.chosen = chosen or (lambda: (agent.knobs.values(), None))
        self.warn = warn
        self.agree = agree if every_rank else None

    def bind(self, knobs: KnobSet) -> None:
        """Add the ``checkpoint`` command to ``knobs``."""
        knobs.add(Knob(CHECKPOINT, get=lambda: None, set=self.save_now,
                       check=lambda value: self._check(), warn=self._warning))

    def path(self, step: int) -> Path:
        """Where this run's checkpoint of optimizer step ``step`` goes (or went)."""
        directory = self.directory or default_checkpoint_dir(self.agent.run_id)
        return directory / self.name.format(step=step)

    def saved_steps(self) -> list[int]:
        """The steps this run's checkpoints in its directory were saved at, in order.

        From the names alone (:meth:`path`'s), among the directory's first
        :data:`MAX_LISTED_ENTRIES` entries; [] when it cannot be read."""
        directory = self.directory or default_checkpoint_dir(self.agent.run_id)
        name = re.compile("".join(
            re.escape(literal) + ("([0-9]+)" if field == "step" else "")
            for literal, field, _, _ in string.Formatter().parse(self.name)))
        steps = []
        try:
            with os.scandir(directory) as entries:
                for index, entry in enumerate(entries):
                    if index >= MAX_LISTED_ENTRIES:
                        break
                    found = name.fullmatch(entry.name)
                    if found is not None:
                        steps.append(int(found[1]))
        except OSError:
            return []
        return sorted(steps)

    def _warning(self, value: Any) -> str | None:
        reason = self.warn(value) if self.warn is not None else None
        return None if reason is None else f"a resume from it will not be exact: {reason}"

    def _check(self) -> None:
        reason = self.refusal() if self.refusal is not None else None
        if reason is not None:
            raise ValueError(reason)

    def save_now(self, value: str) -> dict[str, Any]:
        """Training thread, at a boundary: save a checkpoint of the state now.

        Returns:
            The ``applied`` event's additions: where it went, its size, how long it took.

        Raises:
            ValueError: the refusal's reason. OSError: it could not be written (nothing
                is left under its name, earlier checkpoints are as they were).
        """
        self._check()
        step = self.step()
        path = self.path(step)
        knobs, note = self.chosen()
        note = "" if note is None else f"; {note}"
        if self.agent.rank != 0:
            if not self.every_rank:
                return {"text": f"rank 0 saves the state after step {step}{note}",
                        "checkpoint_step": step}
            self.save(path, knobs)
            self._agree(None)
            return {"text": f"saved with rank 0 after step {step} to {path}{note}",
                    "path": str(path), "checkpoint_step": step}
        start = time.perf_counter()
        phase = "before"  # of save: "in" it, or "after" it returned

        def write(temporary: Path) -> None:
            nonlocal phase
            phase = "in"
            self.save(temporary, knobs)
            phase = "after"

        try:
            size = write_atomically(path, write)
        except Exception as exc:
            if phase != "in":  # (a failure in save told every rank there)
                self._agree(f"{type(exc).__name__}: {exc}")
            raise
        self._agree(None)
        elapsed_s = time.perf_counter() - start
        return {"text": f"saved after step {step} to {path} ({format_bytes(size)} in "
                        f"{elapsed_s:.2f} s){note}",
                "path": str(path), "knobs": knobs, "size_bytes": size, "save_s": elapsed_s,
                "checkpoint_step": step}


    def _agree(self, failure: str | None) -> None:
        """Every rank, with ``every_rank`` and ``agree``: learn whether the checkpoint
        failed on any rank (``failure``: on this one); raises OSError naming the rank
        when it failed on another."""
        if self.agree is None:
            return
        first = self.agree(failure)
        if failure is None and first is not None:
            raise OSError(f"the checkpoint failed on {first}")


def torch_checkpoint(agent: Agent, knobs: dict[str, Any], step: int,
                     state: dict[str, Any]) -> dict[str, Any]:
    """The contents of a ``torch.save`` checkpoint: ``state`` with what it is, run, step and knobs.

    ``state`` with what it is, the run, its step and the knob values."""
    return {"format": FORMAT, "version": 1, "run": agent.run_id, "step": step,
            "knobs": knobs, **state}


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``torch.save`` checkpoint the ``checkpoint`` command wrote, running no code from it.

    Tensors on the CPU; ``weights_only``, so it runs no code from the file.

    Raises:
        ValueError: ``path`` is not such a checkpoint. OSError: it cannot be read, or
            is a symlink (not followed) or not a regular file.
    """
    state = load_tensors(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint of gpuwatch's checkpoint command")
    return state


def load_tensors(path: str | os.PathLike) -> Any:
    """``torch.load`` of the file at ``path``, never through a symlink, running no code from it.

    Tensors on the CPU; ``weights_only``. For the files gpuwatch writes in a checkpoint
    (random numbers, data position, GradScaler): a checkpoint's directory is untrusted.

    Raises:
        OSError: it cannot be opened, is a symlink (``ELOOP``) or not a regular file.
        Exception: what ``torch.load`` raises for a file that is not its format.
    """
    with os.fdopen(open_no_follow(path), "rb") as file:
        return torch.load(file, map_location="cpu", weights_only=True)


#: The most entries a checkpoint directory may hold for :func:`own_checkpoint` to check.
MAX_CHECKPOINT_ENTRIES = 10_000


def own_checkpoint(path: Path, *, whole: bool = True) -> Path:
    """``path``, its parents' links resolved, once no other user can have written or swap it.

    What ``rewind`` reads must be this user's (or root's) from ``/`` down: every
    directory on the way belongs to this user or root and no one else may write in it,
    unless it has the sticky bit (as ``/tmp`` has) and what it holds on the way is this
    user's or root's; the checkpoint too, and for a directory everything in it (at most
    :data:`MAX_CHECKPOINT_ENTRIES` entries, no symlink). Otherwise another local user
    could have planted it, or swap it between this check and the read. A directory
    writable by its group counts as writable by others unless the group is this user's
    own (its primary group, with no other member).

    Args:
        path: an absolute path whose last component is not a symlink (checked before).
        whole: all of the above (before the read). False: the checkpoint and the
            directory holding it only, as given (a command's check on the I/O thread,
            which a flood of commands must not make costly).

    Returns:
        The path to read: the same file, its parents' symlinks resolved (read through it,
        a link swapped later changes nothing); ``path`` itself when not ``whole``.

    Raises:
        ValueError: why another user could have written or could swap it.
        OSError: a part of it cannot be examined.

    .. note:: ``whole``: an ``lstat`` a path component (each of them resolving the path
       so far) and one an entry of a directory: about 0.3 ms for 8 components, 2.5 ms
       for 64, 130 ms for 10,000 entries. Not ``whole``: two ``stat`` calls.
    """
    trusted = {os.getuid(), 0}
    way_out = "copy it to a directory only you can write, and rewind to the copy"
    if not whole:
        status = os.lstat(path)
        _may_hold(path.parent, os.stat(path.parent), path, status, trusted, way_out)
        _own_entry(path, status, trusted, way_out)
        return path
    real = (Path(os.path.realpath(path)) if path.name in ("", "..")
            else Path(os.path.realpath(path.parent)) / path.name)
    at = Path(real.anchor)
    status = os.lstat(at)
    for name in real.parts[1:]:
        below = at / name
        below_status = os.lstat(below)
        _may_hold(at, status, below, below_status, trusted, way_out)
        if stat.S_ISLNK(below_status.st_mode):
            raise ValueError(f"{below} changed into a symlink while being checked")
        at, status = below, below_status
    _own_entry(real, status, trusted, way_out)
    if stat.S_ISDIR(status.st_mode):
        entries = 0
        for folder, names, files in os.walk(real):  # (never follows a link)
            for name in (*names, *files):
                entries += 1
                if entries > MAX_CHECKPOINT_ENTRIES:
                    raise ValueError(f"{real} holds more than {MAX_CHECKPOINT_ENTRIES:,} "
                                     "entries, more than a checkpoint has")
                entry = Path(folder) / name
                entry_status = os.lstat(entry)
                if stat.S_ISLNK(entry_status.st_mode):
                    raise ValueError(f"{entry} is a symlink, which is not followed: "
                                     f"{way_out}")
                _own_entry(entry, entry_status, trusted, way_out)
    return real


def _may_hold(folder: Path, status: os.stat_result, below: Path, below_status: os.stat_result,
              trusted: set[int], way_out: str) -> None:
    """Raises ValueError unless no other user can swap ``below`` in ``folder`` (their
    ``lstat`` s): ``folder`` is a trusted user's, and writable by no one else unless it
    has the sticky bit and ``below`` is a trusted user's."""
    if status.st_uid not in trusted:
        raise ValueError(f"{folder} belongs to uid {status.st_uid}, another user, who "
                         f"could swap {below}: {way_out}")
    if _writable_by_others(status):
        if not status.st_mode & stat.S_ISVTX:
            raise ValueError(f"other users can write in {folder} (mode "
                             f"{stat.S_IMODE(status.st_mode):04o}), so {below} could "
                             f"be theirs or be swapped: {way_out}")
        _trusted_owner(below, below_status, trusted, way_out)  # (sticky: ours stay ours)


def _trusted_owner(path: Path, status: os.stat_result, trusted: set[int],
                   way_out: str) -> None:
    """Raises ValueError unless ``path`` (``status``: its ``lstat``) is a trusted user's."""
    if status.st_uid not in trusted:
        raise ValueError(f"{path} belongs to uid {status.st_uid}, another user, so it is "
                         f"not read: {way_out}")


def _own_entry(path: Path, status: os.stat_result, trusted: set[int], way_out: str) -> None:
    """Raises ValueError unless ``path`` (``status``: its ``lstat``) is a trusted user's
    and no one else may write it."""
    _trusted_owner(path, status, trusted, way_out)
    if _writable_by_others(status):
        raise ValueError(f"other users can write {path} (mode "
                         f"{stat.S_IMODE(status.st_mode):04o}), so it is not read: {way_out}")


def write_knobs_file(directory: Path, agent: Agent, knobs: dict[str, Any],
                     step: int, data: dict[str, Any] | None = None) -> None:
    """The knob values of a checkpoint that is a directory, as :data:`KNOBS_FILE`, with ``data``.

    ``data``: the data position (plain JSON values), when the integration keeps one there
    (:meth:`agent.integrations.run.RunBase.data_state`)."""
    record = {"format": FORMAT, "version": 1, "run": agent.run_id, "step": step,
              "knobs": knobs}
    if data is not None:
        record["data"] = data
    (directory / KNOBS_FILE).write_text(json.dumps(record, indent=1))


def read_knobs_file(directory: str | os.PathLike) -> dict[str, Any]:
    """What :func:`write_knobs_file` saved in a checkpoint directory, or {} when it has none.

    ``knobs``, ``step``, ``run``, and ``data`` when given; {} for a checkpoint the framework
    saved on its own. Opened without following a symlink, at most
    :data:`MAX_KNOBS_FILE_BYTES` read.

    Raises:
        ValueError: the file is larger than :data:`MAX_KNOBS_FILE_BYTES`, or is not a
            JSON object. OSError: it is a symlink, not a regular file, or unreadable.
    """
    path = Path(directory) / KNOBS_FILE
    try:
        fd = open_no_follow(path)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as file:
        text = file.read(MAX_KNOBS_FILE_BYTES + 1)
    if len(text) > MAX_KNOBS_FILE_BYTES:
        raise ValueError(f"{path} is larger than the {format_bytes(MAX_KNOBS_FILE_BYTES)} "
                         "a checkpoint's knob values take: not read")
    saved = json.loads(text)
    if not isinstance(saved, dict):
        raise ValueError(f"{path} does not hold gpuwatch's knob values")
    return saved


def restore_knobs(agent: Agent, knobs: dict[str, Any], source: str, step: int, *,
                  unbound: str = "not in this run", differs: str | None = None,
                  from_run: Any = None) -> dict[str, Any]:
    """Set each knob of ``knobs`` (a checkpoint's) that this run has and that differs.

    On the training thread before training goes on; one ``resumed`` event lists every knob
    value restored (those already at their saved value too), what could not be set (with the
    reason), what this run does not have (``unbound`` says how it is told) and ``differs``:
    what will not be as in the saved run. ``from_run``: the run id the checkpoint names
    (its ``run``; a file's value, untrusted: the event carries it only when it is a
    string), so that the run's log says which run it continues.

    A knob whose setting moves another (``micro_batch_size`` adjusts ``accum_steps`` to
    keep the effective batch) is set first, then every knob that is not at its saved
    value is set again, so the run resumes with the saved values of all of them.

    Returns:
        The knobs of ``knobs`` this run does not have (yet), by name.
    """
    restored, failed, absent = set_knobs(agent, knobs)
    text = f"resumed from {source} at step {step}" + knobs_text(restored, failed, absent,
                                                               unbound)
    if differs:
        text += f"; not as in the saved run: {differs}"
    origin = ({"from_run": printable(from_run, MAX_NAME_CHARS)}
              if isinstance(from_run, str) and from_run else {})
    agent.event("warning" if failed or differs else "info", text, kind=EventKind.RESUMED,
                path=source, step=step, knobs=knobs, **origin)
    return absent


def set_knobs(agent: Agent, knobs: dict[str, Any]
              ) -> tuple[list[str], list[str], dict[str, Any]]:
    """Training thread: set each knob of ``knobs`` (a checkpoint's) that this run has.

    See :func:`restore_knobs`. Each value is checked against its knob's declaration
    first (type, choices, range: a file is untrusted): a bad one is not set, and is
    among ``failed`` with the reason; a knob
    that is a command (``stop``, ``rewind``, ``checkpoint``...) is never run from a
    file, and is among ``failed`` too. Returns ``(restored, failed, absent)``: the
    values now as saved (``knob=value`` each), those that could not be set (with the
    reason), and the knobs this run does not have, by name."""
    restored: list[str] = []
    failed: list[str] = []
    absent = {name: value for name, value in knobs.items() if name not in agent.knobs.knobs}
    present = [name for name in knobs if name not in absent]
    present.sort(key=lambda name: name != "micro_batch_size")
    valid: dict[str, Any] = {}
    for name in list(present):
        if agent.knobs.knobs[name].spec.command:
            failed.append(f"{assignment(name, knobs[name])} (a command, never run from a "
                          "checkpoint)")
            present.remove(name)
            continue
        # the value's type, choices and range; the run's own checks are the set's (a
        # command's would refuse some before a framework's loop has started: a resume)
        try:
            valid[name] = agent.knobs.knobs[name].spec.coerce(knobs[name])
        except KnobError as exc:
            failed.append(f"{assignment(name, knobs[name])} ({exc})")
            present.remove(name)
    for _ in range(2):  # the second pass puts back what a first-pass side effect moved
        for name in present:
            knob, value = agent.knobs.knobs[name], valid[name]
            if any(line.startswith(f"{name}=") for line in failed):
                continue
            if knob.get() == value:
                if assignment(name, value) not in restored:
                    restored.append(assignment(name, value))
                continue
            try:
                knob.set(value)
            except Exception as exc:  # noqa: BLE001 -- said in the event, training goes on
                failed.append(f"{assignment(name, value)} ({exc})")
            else:
                if assignment(name, value) not in restored:
                    restored.append(assignment(name, value))
    agent.refresh_knobs()
    return restored, failed, absent


def knobs_text(restored: list[str], failed: list[str], absent: dict[str, Any],
               unbound: str = "not in this run") -> str:
    """:func:`set_knobs`'s outcome as an event's text (empty when there is nothing to say).

    Of the form ``" with a=1, b=2; not restored: ...; <unbound>: ..."``."""
    text = " with " + ", ".join(restored) if restored else ""
    if failed:
        text += "; not restored: " + "; ".join(failed)
    if absent:
        text += f"; {unbound}: " + ", ".join(assignment(k, v) for k, v in absent.items())
    return text
