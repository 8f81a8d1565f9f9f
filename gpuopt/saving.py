"""Training checkpoints on disk: written atomically, with the random number generators.

A checkpoint is written in a private temporary folder of its own directory (made new with
an unpredictable name, mode 0700: nothing another user planted is ever written through),
flushed to the disk (``fsync`` of every file, then of the directory), and only then
renamed to its name (``os.replace``, atomic on POSIX file systems), and the directory is
synced again so the rename itself survives a power loss. A process killed while writing
leaves the temporary folder (removed by the next write into that directory once its
writer is gone) and every earlier checkpoint as it was; a checkpoint under its final name
is always complete. A directory another user could write in or swap (theirs, or writable
by others without the sticky bit, or one on its way from ``/`` so) is refused.

A checkpoint holds the model and the data's position, as private as the run logs: its
files are made mode 0600 and its directories 0700 before the rename (whatever the
framework that wrote them chose), and the directories created to hold it are 0700.

Sources: the POSIX ``rename`` guarantee; "Files are hard" (Dan Luu, 2015) and
LWN's "ext4 and data loss" (2009) for why both the file and its directory are synced.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import random
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch

#: Temporary names: ``.<final name>.<random>.tmp-<pid>`` (a folder) next to the final
#: one (``.<final name>.tmp-<pid>`` from earlier versions).
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)$")
#: Where a directory checkpoint being replaced waits, in the temporary folder, between
#: the two renames.
_ASIDE = ".old"


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> int:
    """Have ``write(temporary)`` write a file or a directory, then make it ``path``.

    ``write`` gets a path that does not exist yet, in a private folder (mode 0700, made new
    with an unpredictable name) in ``path``'s directory, and writes there (``torch.save``
    to it, or a framework saving a directory of files into it): another local user who
    can write in that directory (a shared one with the sticky bit, as ``/tmp``) can plant
    no link it would be written through. The directories missing above it are created
    with mode 0700; the directory must be this user's or root's, and so every one on
    its way from ``/``, none of them writable by other users unless it has the sticky bit
    and what it holds on the way is this user's or root's (:func:`check_directory`).
    Then every file written is made owner-only (files 0600, directories 0700; links left
    as they are) and synced to disk, the temporary is renamed to ``path`` (replacing an
    earlier checkpoint of that name: a file in one atomic step; a directory is moved
    aside first and deleted after, so a crash between the two leaves it under its aside
    name, in the temporary folder), and the directory is synced.

    Returns:
        The checkpoint's size in bytes (every file of a directory).

    Raises:
        PermissionError: another user could write in the directory or swap it (see
            :func:`check_directory`); nothing is written.
        OSError: the directory cannot be written (nothing is left under ``path``); the
            temporary is removed. An exception from ``write`` propagates the same way.

    .. note:: Synchronous: the caller waits for the data to reach the disk (about the
       size over the disk's write speed, plus a few ms for the syncs).
    """
    path = Path(path)
    _make_directories(path.parent)
    directory = check_directory(path.parent)
    path = directory / path.name
    _remove_abandoned(directory)
    holder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=f".tmp-{os.getpid()}",
                                   dir=directory))
    temporary = holder / path.name
    try:
        write(temporary)
        size = _sync_tree(temporary)
        if temporary.is_dir() and path.is_dir():
            os.replace(path, holder / _ASIDE)
        os.replace(temporary, path)
        _sync(directory, flags=os.O_DIRECTORY)
    finally:
        _remove(holder)
    return size


def check_directory(directory: str | os.PathLike) -> Path:
    """``directory``, its links resolved, once no other user can write in it or swap it.

    It and every directory on its way from ``/`` must belong to this user or root and be
    writable by no one else, unless it has the sticky bit (as ``/tmp`` has) and what it
    holds on the way is this user's or root's. A directory writable by its group counts
    as writable by others unless the group is this user's own (its primary group, with no
    other member). Otherwise another local user could plant a link where a checkpoint
    is written, or swap the directory for one of theirs.

    Raises:
        PermissionError: why another user could write in it or swap it.
        OSError: a part of it cannot be examined.

    .. note:: An ``lstat`` per component of the path (about 0.3 ms for 8).
    """
    trusted = {os.getuid(), 0}
    way_out = "use a directory only you can write"
    given = Path(os.path.abspath(directory))
    for depth in range(1, len(given.parts)):  # a link of another user's points elsewhere
        link = Path(*given.parts[:depth + 1])
        link_status = os.lstat(link)
        if stat.S_ISLNK(link_status.st_mode) and link_status.st_uid not in trusted:
            raise PermissionError(f"{link} is a symlink of uid {link_status.st_uid}, "
                                  f"another user; refusing to write a checkpoint through "
                                  f"it: {way_out}")
    real = Path(os.path.realpath(given))
    at = Path(real.anchor)
    status = os.lstat(at)
    for name in (*real.parts[1:], None):
        if status.st_uid not in trusted:
            raise PermissionError(f"{at} belongs to uid {status.st_uid}, another user; "
                                  f"refusing to write a checkpoint in {real}: {way_out}")
        below = None if name is None else at / name
        below_status = None if below is None else os.lstat(below)
        if writable_by_others(status) and (
                not status.st_mode & stat.S_ISVTX
                or (below_status is not None and below_status.st_uid not in trusted)):
            raise PermissionError(
                f"other users can write in {at} (mode {stat.S_IMODE(status.st_mode):04o}) "
                f"and could swap {below or 'what is written there'}; refusing to write "
                f"a checkpoint in {real}: {way_out}")
        if below is None or below_status is None:
            break
        if stat.S_ISLNK(below_status.st_mode):
            raise PermissionError(f"{below} changed into a symlink while being checked")
        at, status = below, below_status
    return real


def writable_by_others(status: os.stat_result) -> bool:
    """Whether users other than the owner may write the file ``status`` describes.

    Its mode lets every user, or a group that is not this user's own (its primary
    group, with no other member)."""
    if status.st_mode & stat.S_IWOTH:
        return True
    if not status.st_mode & stat.S_IWGRP:
        return False
    if status.st_gid != os.getgid():
        return True
    try:
        members, me = grp.getgrgid(status.st_gid).gr_mem, pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return True
    return any(member != me for member in members)


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The state of every random number generator a training step may draw from.

    Torch's on the host, CUDA's on ``device``'s GPUs (when CUDA is in use), Python's
    ``random`` and NumPy's global one; only tensors and plain values (``torch.load(...,
    weights_only=True)`` reads it back).

    .. note:: Host work only: the CUDA generators' states are host-side (seed and offset).
    """
    # the legacy tuple: get_state() gives a dict only for a bit generator other than the
    # global RandomState's MT19937
    kind, keys, position, has_gauss, cached_gaussian = cast(
        tuple[str, np.ndarray, int, int, float], np.random.get_state())
    cuda = (torch.cuda.get_rng_state_all()
            if device is not None and device.type == "cuda" else None)
    return {"torch": torch.get_rng_state(), "cuda": cuda,
            "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.copy()), position, has_gauss,
                      cached_gaussian)}


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back every generator :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(_tuples(state["python"]))
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, cached_gaussian))


def _tuples(value: Any) -> Any:
    """``random.getstate()`` as saved, with the tuples it needs (a reader may give lists)."""
    return tuple(_tuples(item) for item in value) if isinstance(value, (list, tuple)) \
        else value


def _make_directories(directory: Path) -> None:
    """Create ``directory`` and the directories missing above it, each with mode 0700
    (those that exist are left as they are)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile (another rank)
            pass


def _sync_tree(path: Path) -> int:
    """Make every file under ``path`` (or ``path`` itself) mode 0600 and every
    directory in it 0700 (a link: synced, its target's mode left alone), and fsync
    them; returns the bytes of the files."""
    if not path.is_dir():
        _sync_file(path)
        return path.stat().st_size
    size = 0
    for root, _, files in os.walk(path):
        for name in files:
            file = Path(root) / name
            _sync_file(file)
            size += file.stat().st_size
        _sync(Path(root), flags=os.O_DIRECTORY, mode=0o700)
    return size


def _sync_file(path: Path) -> None:
    _sync(path, mode=None if path.is_symlink() else 0o600)


def _sync(path: Path, *, flags: int = 0, mode: int | None = None) -> None:
    """fsync ``path``, opened read-only with ``flags`` (``os.O_DIRECTORY`` for a
    directory); made ``mode`` first (:func:`_owner_only`) when one is given."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        if mode is not None:
            _owner_only(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _owner_only(fd: int, mode: int) -> None:
    """``fchmod``, where the file system allows it (one without modes, such as a CIFS
    or FAT mount, may refuse: the checkpoint is written all the same)."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, mode)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_abandoned(directory: Path) -> None:
    """Delete temporaries of writers that are gone (killed while writing).

    A writer killed between its two renames of a directory checkpoint left the earlier
    checkpoint aside in its temporary folder (``.old``) and none under its name: that one
    is put back under its name first (a folder's name is ``.<name>.<random>.tmp-<pid>``)."""
    for entry in directory.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match and not _alive(int(match["pid"])):
            aside = entry / _ASIDE
            final = directory / match["name"].rpartition(".")[0]
            if (not entry.is_symlink() and aside.is_dir() and not aside.is_symlink()
                    and final.name and not os.path.lexists(final)):
                os.replace(aside, final)
            _remove(entry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
