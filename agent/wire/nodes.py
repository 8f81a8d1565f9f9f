"""Beyond one node: what the nodes of a multi-node torchrun job know of each other.

A job whose ranks span several machines is found through its own rendezvous: the
local rank 0 of each node starts a node relay (:mod:`agent.io.relay`, a child process)
and publishes where it listens in torch.distributed's store (the TCPStore at
``MASTER_ADDR:MASTER_PORT`` that torchrun's ranks already share), under
:func:`store_key`. The relay is the node's one tcp door: it relays commands to the
node's ranks and sums their telemetry up, so that a dashboard holds one socket per
node, not per rank.

Nothing secret ever goes into the store (it is unauthenticated: whoever reaches its
port may read and write it). Every key is derived from the user's job secret
(:func:`load_secret`, a file of the user's own, the same on every node: a shared home
has it once), so that a node's relay and a dashboard on any node agree on them without
sending them anywhere:

- the relay's CURVE server key pair (:func:`server_keys`, one per run and node): a
  dashboard derives the public key itself, so an endpoint planted in the store is never
  trusted (its handshake fails);
- the one CURVE client key pair the relays let in (:func:`client_keys`);
- the token that commands to a relay carry (:func:`relay_token`).

No torch here, and zmq only where keys are made: the dashboard and :mod:`agent.wire.runs`
import it too.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

#: Environment variable naming the job secret's file (default :data:`DEFAULT_SECRET`).
SECRET_ENV = "GPUWATCH_SECRET_FILE"
#: Where the job secret is by default, under the user's home.
DEFAULT_SECRET = Path(".config") / "gpuwatch" / "secret"
#: Shortest and longest secret file accepted (bytes).
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 4096
#: Environment variable with the address a node's relay listens on (default: the
#: address of this machine's interface towards ``MASTER_ADDR``).
LISTEN_ENV = "GPUWATCH_LISTEN"


class SecretError(PermissionError):
    """A job secret file that gpuwatch refuses to use, or none at all.

    Refused: another user's, readable by others, a link, too short."""


def secret_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$GPUWATCH_SECRET_FILE``, else ``~/.config/gpuwatch/secret``."""
    named = environ.get(SECRET_ENV)
    if named:
        return Path(named)
    return Path(environ.get("HOME") or Path.home()) / DEFAULT_SECRET


def load_secret(path: Path | None = None) -> bytes:
    """The job secret: the content of :func:`secret_path`.

    Raises:
        SecretError: there is none, or it is a symbolic link, not a regular file of this
            user, readable or writable by others (mode must be 0600 or stricter), or
            shorter than :data:`MIN_SECRET_BYTES`; the message says how to make one.
    """
    path = path or secret_path()
    make = f"(make one with `gpuwatch secret`, the same file on every node: {path})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SecretError(f"no job secret {make}") from None
    except OSError as exc:
        raise SecretError(f"cannot open the job secret {path}: {exc} {make}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
            raise SecretError(f"{path} is not a regular file of this user {make}")
        if status.st_mode & 0o077:
            raise SecretError(f"{path} is readable or writable by others (mode "
                              f"{stat.S_IMODE(status.st_mode):04o}); chmod 600 it")
        secret = os.read(fd, MAX_SECRET_BYTES + 1).strip()
    finally:
        os.close(fd)
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise SecretError(f"{path} holds {len(secret)} bytes; a job secret has "
                          f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} {make}")
    return secret


def create_secret(path: Path | None = None) -> Path:
    """Write a new random job secret (32 bytes, hex) with mode 0600; never replaces one.

    Raises:
        FileExistsError: there is one already. OSError: it cannot be written.
    """
    path = path or secret_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(os.urandom(32).hex() + "\n")
    return path


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, f"gpuwatch-multinode-v1|{label}".encode(),
                    hashlib.sha256).digest()


@functools.lru_cache(maxsize=1 << 14)
def _key_pair(secret: bytes, label: str) -> tuple[str, str]:
    """A CURVE key pair (public, secret; Z85) derived from the job secret (remembered:
    a command to a job of 1,024 nodes derives every relay's, 0.2 s of CPU each time)."""
    import zmq
    from zmq.utils import z85

    secret_key = z85.encode(_derive(secret, label))
    return zmq.curve_public(secret_key).decode(), secret_key.decode()


def server_keys(secret: bytes, run_id: str, node: int) -> tuple[str, str]:
    """The CURVE key pair of node ``node``'s relay in run ``run_id`` (public, secret)."""
    return _key_pair(secret, f"server|{run_id}|{node}")


def client_keys(secret: bytes, run_id: str) -> tuple[str, str]:
    """The CURVE client key pair that the relays of run ``run_id`` let in."""
    return _key_pair(secret, f"client|{run_id}")


def relay_token(secret: bytes, run_id: str) -> str:
    """The token commands to a relay of run ``run_id`` must carry."""
    return _derive(secret, f"token|{run_id}").hex()


def store_key(run_id: str, node: int) -> str:
    """The store key under which node ``node`` of run ``run_id`` says where its relay is."""
    return f"gpuwatch/{run_id}/node/{node}"


@dataclass(frozen=True)
class NodeEnv:
    """Where this process is in a multi-node torchrun job (from torchrun's environment).

    Attributes:
        node: this node's index (``GROUP_RANK``). nnodes: nodes of the job.
        rank, local_rank, world_size, local_world_size: as torchrun sets them.
        store_host, store_port: the job's TCPStore (``MASTER_ADDR``, ``MASTER_PORT``).
    """

    node: int
    nnodes: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    store_host: str
    store_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> NodeEnv | None:
        """The job's layout under torchrun with more than one node, else None.

        None: a single-node job, or not torchrun (nothing changes for it)."""
        try:
            world = int(environ["WORLD_SIZE"])
            local_world = int(environ["LOCAL_WORLD_SIZE"])
            node = cls(node=int(environ["GROUP_RANK"]), nnodes=0,
                       rank=int(environ["RANK"]), local_rank=int(environ["LOCAL_RANK"]),
                       world_size=world, local_world_size=local_world,
                       store_host=environ["MASTER_ADDR"],
                       store_port=int(environ["MASTER_PORT"]))
        except (KeyError, ValueError):
            return None
        if local_world <= 0 or world <= local_world or world % local_world:
            return None  # one node (or an uneven layout this version does not know)
        nnodes = world // local_world
        try:
            nnodes = int(environ.get("GROUP_WORLD_SIZE", nnodes))
        except ValueError:
            pass
        if nnodes <= 1:
            return None
        return cls(**{**node.__dict__, "nnodes": nnodes})

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this node (torchrun numbers them node by node)."""
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_world_size))


def listen_address(env: NodeEnv, listen: str | None = None,
                   environ: Mapping[str, str] = os.environ) -> str:
    """The address this node's relay listens on, found without sending a packet.

    ``listen``, else ``$GPUWATCH_LISTEN``, else that of this machine's interface towards the
    store (where the other nodes reach this one: they reach the store the same way). No
    packet is sent to find it."""
    chosen = listen or environ.get(LISTEN_ENV)
    if chosen:
        return chosen
    import socket

    try:
        family = socket.AF_INET6 if ":" in env.store_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((env.store_host, env.store_port))  # UDP: a route, no packet
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


#: The fields of a node entry (in the store and in the local leader's run file).
NODE_FIELDS: dict[str, type] = {"node": int, "host": str, "pub_endpoint": str, "cmd_endpoint": str,
                                "server_key": str, "ranks": list}


def node_entry(value: Any) -> dict[str, Any] | None:
    """A node entry read from the store or a run file, checked; None when malformed.

    The store is writable by anyone who reaches it."""
    if not isinstance(value, dict):
        return None
    entry: dict[str, Any] = {}
    for key, kind in NODE_FIELDS.items():
        item = value.get(key)
        if isinstance(item, bool) or not isinstance(item, kind):
            return None
        entry[key] = item
    ranks = entry["ranks"]
    if len(ranks) > 4096 or not all(type(rank) is int and rank >= 0 for rank in ranks):
        return None
    if not all(entry[key].startswith("tcp://") for key in ("pub_endpoint", "cmd_endpoint")):
        return None
    return entry
