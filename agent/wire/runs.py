"""Run files: how a dashboard finds the live runs of this user on this machine.

Each rank of a run writes ``<run_id>.rank<r>.json`` (mode 0600) in :func:`run_dir`
(mode 0700) with its pid, endpoints, start time and secret token, and removes it at exit.
A file whose pid no longer lives is stale and is skipped (and removed when possible).
This module has no torch and no zmq import: the dashboard uses it too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Environment variable that overrides the run directory (tests, several users' setups).
RUN_DIR_ENV = "GPUWATCH_RUN_DIR"


class UnsafeDirectoryError(PermissionError):
    """A run or log directory that gpuwatch refuses to use: a link, another user's, or writable.

    A symbolic link (or not a directory), owned by another user, or writable by other users
    (so another local user could plant links or files in it, or read what is written
    there)."""


def private_dir(path: os.PathLike | str, setting: str = RUN_DIR_ENV) -> Path:
    """The directory ``path``, created with mode 0700 if missing, once checked as safe.

    Checked first that nobody else can use it against this user.

    The last component is never followed through a symbolic link (it is created with
    ``mkdir`` and opened with ``O_NOFOLLOW``); it must be a directory owned by this user
    and not writable by its group or others (one that is ours but readable by others,
    e.g. 0755, is made 0700). Its parent may be a link (``/tmp`` is one on some
    systems) but must not be writable by every user unless it has the sticky bit (as
    ``/tmp`` has), where another user could swap the directory for a link after the
    check. Missing parents are created with mode 0700.

    Args:
        path: the directory. setting: the environment variable that moves it, named in
            the error so that a person knows the way out.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UnsafeDirectoryError: ``path`` is a symbolic link or not a directory, belongs to
            another user, is writable by its group or others, or its parent is writable
            by every user without the sticky bit.
        OSError: it cannot be created or opened (e.g. a read-only or missing parent that
            cannot be created).
    """
    path = Path(path)
    way_out = f"set ${setting} to a directory of your own with mode 0700"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # never follows a link: an existing one gives EEXIST
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectoryError(
                f"{path} is a symbolic link or not a directory; refusing to use it "
                f"({way_out})") from None
        raise
    try:
        status = os.fstat(fd)
        if status.st_uid != os.getuid():
            raise UnsafeDirectoryError(
                f"{path} belongs to uid {status.st_uid}, not to this user (uid "
                f"{os.getuid()}); refusing to use it ({way_out})")
        if status.st_mode & 0o022:
            raise UnsafeDirectoryError(
                f"{path} is writable by other users (mode "
                f"{stat.S_IMODE(status.st_mode):04o}); refusing to use it ({way_out})")
        if stat.S_IMODE(status.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # the directory itself, never what a link points at
        parent = os.stat(path.parent)
        if parent.st_mode & 0o002 and not parent.st_mode & stat.S_ISVTX:
            raise UnsafeDirectoryError(
                f"{path.parent} (the parent of {path}) is writable by every user and "
                f"has no sticky bit, so {path} could be replaced; refusing to use it "
                f"({way_out})")
    finally:
        os.close(fd)
    return path


def run_dir() -> Path:
    """The per-user directory for run files and ipc sockets, created with mode 0700.

    ``$GPUWATCH_RUN_DIR`` if set; else ``$XDG_RUNTIME_DIR/gpuwatch`` when that
    directory exists and is writable; else ``<tmp>/gpuwatch-<uid>``. ipc socket paths
    must stay short (about 100 bytes), which these are. Checked as
    :func:`private_dir` checks: a link planted at ``<tmp>/gpuwatch-<uid>`` by another
    user is refused, never followed.

    Raises:
        UnsafeDirectoryError: the directory is a symbolic link, belongs to another user
            or is writable by others (see :func:`private_dir`).
        OSError: it cannot be created.
    """
    override = os.environ.get(RUN_DIR_ENV)
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if override:
        path = Path(override)
    elif runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        path = Path(runtime) / "gpuwatch"
    else:
        path = Path(tempfile.gettempdir()) / f"gpuwatch-{os.getuid()}"
    return private_dir(path, RUN_DIR_ENV)


def new_run_id() -> str:
    """A short unique run id: ``YYYYmmdd-HHMMSS-xxxx``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


#: Environment variable that names the run (every rank of one job must give the same).
RUN_ID_ENV = "GPUWATCH_RUN_ID"


def shared_run_id(world_size: int) -> str:
    """The run id of this process: the one all ranks of a job on this machine share.

    ``$GPUWATCH_RUN_ID`` when set. Else, with ``world_size > 1``, an id that every rank
    of one job derives alike, without talking to the others: under ``torchrun`` with a
    rendezvous id (``TORCHELASTIC_RUN_ID``, a fresh uuid with ``--standalone``),
    ``torchrun-xxxxxxxx`` from a hash of it, ``MASTER_ADDR`` and ``MASTER_PORT`` (so a
    wrapper script between torchrun and Python changes nothing), and so too for a job of
    several nodes (``GROUP_WORLD_SIZE`` > 1) without a rendezvous id, whose ranks on
    every node share the store's address and port; otherwise
    ``YYYYmmdd-HHMMSS-xxxxxxxx`` from the start time of the launcher process (the
    parent: ``mp.spawn``'s, ``torchrun``'s agent) and a hash of its pid and those
    variables. Else :func:`new_run_id`. Ranks on other machines write their run files
    there; a dashboard reaches the ranks of its own machine. (Two jobs that derive the
    same id are told apart when the second writes its run file: see
    :func:`rank_taken`.)
    """
    named = os.environ.get(RUN_ID_ENV)
    if named:
        return named
    if world_size <= 1:
        return new_run_id()
    launch = [os.environ.get(name, "") for name in
              ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")]
    multinode = os.environ.get("GROUP_WORLD_SIZE", "1") not in ("", "0", "1")
    if launch[0] not in ("", "none") or (multinode and launch[1] and launch[2]):
        # (several nodes: their launchers differ, but every rank has the same store)
        return "torchrun-" + hashlib.sha256("|".join(launch).encode()).hexdigest()[:8]
    launcher = os.getppid()
    try:
        import psutil

        started = psutil.Process(launcher).create_time()
    except Exception:  # no psutil, or the launcher is gone: the hash still agrees
        started = 0.0
    key = "|".join(str(part) for part in (
        launcher, started, os.environ.get("MASTER_ADDR", ""),
        os.environ.get("MASTER_PORT", ""), os.environ.get("TORCHELASTIC_RUN_ID", "")))
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started)) + "-" + digest


@dataclass
class RunInfo:
    """What a run file holds (one per rank).

    Attributes:
        run_id, rank, world_size: identity. pid: the training process.
        pub_endpoint: ZeroMQ PUB endpoint (telemetry). cmd_endpoint: ROUTER endpoint
        (commands). token: secret that commands must carry. started_at: unix time (s).
        name: human label (script or model). host: hostname. path: the file itself.
        log_path: the run log (:mod:`agent.wire.runlog`), "" when the run has none.
        curve_server_key, curve_client_public_key, curve_client_secret_key: Z85 keys
            of a run that listens beyond this machine (ZeroMQ CURVE encryption and
            authentication); "" for local runs.
        node, nnodes: this rank's node and the job's nodes (a multi-node torchrun job;
            0 and 1 otherwise). store: ``host:port`` of the job's torch.distributed
            store, where each node's relay says where it listens ("" for one node).
        nodes: in the file of a node's local rank 0, what the store says of the job's
            nodes (see :func:`agent.wire.nodes.node_entry`), refreshed as it learns them.
    """

    run_id: str
    rank: int
    world_size: int
    pid: int
    pub_endpoint: str
    cmd_endpoint: str
    token: str
    started_at: float
    name: str = ""
    host: str = ""
    path: str = ""
    log_path: str = ""
    curve_server_key: str = ""
    curve_client_public_key: str = ""
    curve_client_secret_key: str = ""
    node: int = 0
    nnodes: int = 1
    store: str = ""
    nodes: list = field(default_factory=list)

    def public(self) -> dict:
        """The fields safe to print (no token, no path)."""
        info = asdict(self)
        for secret in ("token", "path", "curve_client_secret_key"):
            info.pop(secret)
        return info


def write_run_file(info: RunInfo, directory: Path | None = None) -> Path:
    """Write ``info`` atomically with mode 0600; set ``info.path``; return the path.

    The file is created new (``O_EXCL``, never through a link) and renamed into place.

    Raises:
        UnsafeDirectoryError, OSError: as :func:`run_dir` when ``directory`` is None;
            OSError when the file cannot be written.
    """
    directory = directory or run_dir()
    path = directory / f"{info.run_id}.rank{info.rank}.json"
    info.path = str(path)
    info.host = info.host or socket.gethostname()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".run-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(info), handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_run_file(info: RunInfo) -> None:
    """Remove the run file (and nothing else); missing is fine."""
    if info.path:
        Path(info.path).unlink(missing_ok=True)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this user (a run's process is still there)."""
    return _alive(pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this user (another user's process is not
    one of our runs: its file is stale, or forged)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return False
    if os.getuid() != 0:  # kill() said so: another user's process raises EPERM
        return True
    try:  # root may signal every process: a pid reused by another user's is not ours
        return os.stat(f"/proc/{pid}").st_uid == 0
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc (macOS): kill's answer
    except OSError:
        return True


#: The type each run-file field must have (a file with another type is malformed).
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "run_id": str, "rank": int, "world_size": int, "pid": int,
    "pub_endpoint": str, "cmd_endpoint": str, "token": str,
    "started_at": (int, float), "name": str, "host": str, "log_path": str,
    "curve_server_key": str, "curve_client_public_key": str,
    "curve_client_secret_key": str, "node": int, "nnodes": int,
    "store": str, "nodes": list}


#: Largest run file read (bytes); a larger one is not ours. A node leader's file lists
#: every node of the job (about 240 bytes a node): 8 MiB holds 30,000 nodes (64 KiB
#: held 270, and a leader's file over it was not read: its rank was not seen at all).
MAX_RUN_FILE_BYTES = 8 << 20


def _read_run_file(path: Path) -> RunInfo | None:
    """The run file at ``path``, or None when it is unreadable or malformed, or is not
    a regular file of this user (a symbolic link, a FIFO, another user's file are never
    opened through: ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if (not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid()
                or status.st_size > MAX_RUN_FILE_BYTES):
            return None
        data = json.loads(os.read(fd, MAX_RUN_FILE_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return None
    fields = {key: data[key] for key in _FIELD_TYPES if key in data}
    for key, kind in _FIELD_TYPES.items():
        value = fields.get(key)
        if key in fields and (isinstance(value, bool) or not isinstance(value, kind)):
            return None
    try:
        info = RunInfo(**fields)
    except TypeError:  # a required field is missing
        return None
    info.path = str(path)
    return info


def remove_sockets(info: RunInfo, directory: Path) -> None:
    """Remove the ipc socket files of ``info``'s endpoints that lie in ``directory``.

    Only sockets: nothing else is ever removed; missing is fine."""
    for endpoint in (info.pub_endpoint, info.cmd_endpoint):
        if not endpoint.startswith("ipc://"):
            continue
        path = Path(endpoint[len("ipc://"):])
        if path.parent != directory:
            continue
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        except OSError:
            pass


def list_runs(directory: Path | None = None) -> list[RunInfo]:
    """Live runs of this user, newest first (rank files of one run are all listed).

    Stale files (dead pid) are removed with their ipc socket files; unreadable or
    malformed files are skipped. Never raises for a file's content.

    Raises:
        UnsafeDirectoryError, OSError: as :func:`run_dir`, when ``directory`` is None.
    """
    directory = directory or run_dir()
    runs = []
    for path in directory.glob("*.rank*.json"):
        info = _read_run_file(path)
        if info is None:
            continue
        if not _alive(info.pid):
            path.unlink(missing_ok=True)
            remove_sockets(info, directory)
            continue
        runs.append(info)
    runs.sort(key=lambda r: (r.started_at, -r.rank), reverse=True)
    return runs


def find_run(selector: str | None = None, directory: Path | None = None) -> RunInfo | None:
    """The rank-0 (or lowest-rank) file of the run chosen by ``selector``.

    ``selector`` is a run id, a unique prefix of one, or an endpoint (``ipc://...``,
    ``tcp://...``); None picks the newest live run. Returns None when nothing matches.
    An endpoint that no run file names gives a :class:`RunInfo` with only the
    endpoint (commands then need ``--token``).
    """
    runs = list_runs(directory)
    if selector is None:
        return _lowest_rank(runs, runs[0].run_id) if runs else None
    if "://" in selector:
        for info in runs:
            if selector in (info.pub_endpoint, info.cmd_endpoint):
                return info
        return RunInfo(run_id="?", rank=0, world_size=1, pid=0, pub_endpoint=selector,
                       cmd_endpoint="", token="", started_at=0.0)
    matches = {info.run_id for info in runs if info.run_id.startswith(selector)}
    if len(matches) != 1:
        return None
    return _lowest_rank(runs, matches.pop())


def rank_taken(run_id: str, rank: int, directory: Path | None = None) -> int | None:
    """The pid of another live process whose run file is rank ``rank`` of run ``run_id``, or None.

    Another job that derived the same id."""
    path = (directory or run_dir()) / f"{run_id}.rank{rank}.json"
    info = _read_run_file(path) if path.exists() else None
    if info is None or info.pid == os.getpid() or not _alive(info.pid):
        return None
    return info.pid


def run_ranks(run_id: str, directory: Path | None = None) -> list[RunInfo]:
    """The live rank files of run ``run_id`` on this machine, by rank (maybe empty)."""
    return sorted((info for info in list_runs(directory) if info.run_id == run_id),
                  key=lambda info: info.rank)


def node_list(run_id: str, directory: Path | None = None) -> list[dict]:
    """The nodes of multi-node run ``run_id`` as this machine's ranks know them, by node.

    From the job's store (the freshest list of their run files; entries checked by
    :func:`agent.wire.nodes.node_entry`); empty for a single-node run."""
    from agent.wire.nodes import node_entry

    ranks = run_ranks(run_id, directory)
    listed = max((info.nodes for info in ranks), key=len, default=[])
    entries = [entry for entry in map(node_entry, listed) if entry is not None]
    return sorted({entry["node"]: entry for entry in entries}.values(),
                  key=lambda entry: entry["node"])


def _lowest_rank(runs: list[RunInfo], run_id: str) -> RunInfo:
    return min((r for r in runs if r.run_id == run_id), key=lambda r: r.rank)
