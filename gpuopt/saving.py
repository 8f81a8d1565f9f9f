"""Training checkpoints on disk: written atomically, with the random number generators.

A checkpoint is written under a temporary name in its own directory, flushed to the
disk (``fsync`` of every file, then of the directory), and only then renamed to its name
(``os.replace``, atomic on POSIX file systems), and the directory is synced again so the
rename itself survives a power loss. A process killed while writing leaves the temporary
file (removed by the next write into that directory once its writer is gone) and every
earlier checkpoint as it was; a checkpoint under its final name is always complete.

A checkpoint holds the model and the data's position, as private as the run logs: its
files are made mode 0600 and its directories 0700 before the rename (whatever the
framework that wrote them chose), and the directories created to hold it are 0700.

Sources: the POSIX ``rename`` guarantee; "Files are hard" (Dan Luu, 2015) and
LWN's "ext4 and data loss" (2009) for why both the file and its directory are synced.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch

#: Temporary names: ``.<final name>.tmp-<pid>`` next to the final one.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)$")


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> int:
    """Have ``write(temporary)`` write a file or a directory, then make it ``path``.

    ``write`` gets a path in ``path``'s directory that does not exist yet and writes there
    (``torch.save`` to it, or a framework saving a directory of files into it); the
    directories missing above it are created with mode 0700. Then every file written
    is made owner-only (files 0600, directories 0700; links left as they are) and
    synced to disk, the temporary is renamed to ``path`` (replacing an
    earlier checkpoint of that name: a file in one atomic step; a directory is moved
    aside first and deleted after, so a crash between the two leaves it under its aside
    name), and the directory is synced.

    Returns:
        The checkpoint's size in bytes (every file of a directory).

    Raises:
        OSError: the directory cannot be written (nothing is left under ``path``); the
            temporary is removed. An exception from ``write`` propagates the same way.

    .. note:: Synchronous: the caller waits for the data to reach the disk (about the
       size over the disk's write speed, plus a few ms for the syncs).
    """
    path = Path(path)
    directory = path.parent
    _make_directories(directory)
    _remove_abandoned(directory)
    temporary = directory / f".{path.name}.tmp-{os.getpid()}"
    _remove(temporary)
    try:
        write(temporary)
        size = _sync_tree(temporary)
        if temporary.is_dir() and path.is_dir():
            aside = directory / f".{path.name}.old-{os.getpid()}"
            _remove(aside)
            os.replace(path, aside)
            os.replace(temporary, path)
            _remove(aside)
        else:
            os.replace(temporary, path)
        _sync(directory, flags=os.O_DIRECTORY)
    except BaseException:
        _remove(temporary)
        raise
    return size


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
    """Delete temporaries of writers that are gone (killed while writing)."""
    for entry in directory.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match and not _alive(int(match["pid"])):
            _remove(entry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
