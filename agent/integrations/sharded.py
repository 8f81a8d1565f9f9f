"""A model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``) in a run.

What its knobs need to stay exact, and its checkpoints
(:mod:`torch.distributed.checkpoint`).

Each rank holds a shard of every parameter, gradient and optimizer state (DTensors), so:

- gradient accumulation reduces the gradients only at the window's last micro-batch
  (:func:`sync_at_window_end`: ``set_requires_gradient_sync``); the others accumulate
  unreduced local gradients, as ``no_sync`` does under DDP;
- the precision knob is autocast over fp32 parameters: exact as on an unsharded model
  unless ``fully_shard`` was given a ``MixedPrecisionPolicy`` that casts (it is fixed
  when the model is wrapped), and never fp16, whose GradScaler would check each rank's
  gradient shard for inf alone (:func:`precision_refusal`);
- a checkpoint is a directory every rank writes its shard into (:func:`save_sharded`)
  and every rank reads its shard back from (:func:`load_sharded`); ``torch.save`` of
  rank 0's state would hold rank 0's shards only.
"""

from __future__ import annotations

import os
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from agent.control.checkpoints import load_checkpoint
from agent.integrations.ranks import agree, every_rank

#: The file of one rank's own states (random numbers, data position, step, knob values)
#: in a sharded checkpoint directory, formatted with the rank.
RANK_FILE = "rank-{rank}.pt"


def fsdp_modules(model: torch.nn.Module | None) -> list[FSDPModule]:
    """The modules of ``model`` (itself included) that ``fully_shard`` wrapped.

    Empty for None or a model that is not sharded."""
    if model is None:
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` has parameters that are DTensors: a checkpoint needs every rank's part.

    Sharded by FSDP2, tensor parallelism, ...: each rank holds a part, so a checkpoint needs
    every rank's."""
    return model is not None and any(isinstance(p, DTensor) for p in model.parameters())


def sharded_precision(model: torch.nn.Module | None
                      ) -> Callable[[str], str | None] | None:
    """The precision knob's refusal for ``model`` when ``fully_shard`` wrapped it, else None.

    :func:`agent.integrations.adapters.precision_knob`'s ``refusal``:
    :func:`precision_refusal` of it."""
    modules = fsdp_modules(model)
    return (lambda value: precision_refusal(modules, value)) if modules else None


def precision_refusal(modules: list[FSDPModule], value: str) -> str | None:
    """Why the precision knob may not switch the sharded ``modules``' model to ``value``, or None.

    The model whose ``fully_shard`` modules are ``modules``; ``value``: ``"fp32"``,
    ``"bf16"``, ``"fp16"``. None when autocast over its fp32 parameters gives ``value``
    exactly as on an unsharded model."""
    for module in modules:
        policy = module._get_fsdp_state()._mp_policy  # (FSDP2 keeps it nowhere public)
        if policy.param_dtype is not None or policy.reduce_dtype is not None:
            return (f"fully_shard fixed this model's MixedPrecisionPolicy when it wrapped it "
                    f"(param_dtype={policy.param_dtype}, reduce_dtype="
                    f"{policy.reduce_dtype}); autocast over it would not be {value}: set the "
                    "precision in the fully_shard call")
    if value == "fp16":
        return ("FSDP2 shards the gradients, and the GradScaler would check each rank's "
                "shard for inf/NaN alone: a step skipped on one rank and taken on another "
                "splits the model (use bf16)")
    return None


def sync_at_window_end(model: torch.nn.Module, accum_steps: Callable[[], int]
                       ) -> Callable[[int], None]:
    """A ``before_backward`` for FSDP2 ``model``: reduce gradients at a window's end only.

    A :attr:`gpuopt.precision.SwitchableGradScaler.before_backward`: before the ``n``-th
    backward of a window of ``accum_steps()`` micro-batches, gradient reduction on for the
    last one only (a flag on each ``fully_shard`` module: no communication, no
    synchronization)."""
    modules = fsdp_modules(model)

    def before_backward(micro_batch: int) -> None:
        last = micro_batch >= accum_steps()
        for module in modules:
            module.set_requires_gradient_sync(last, recurse=False)

    return before_backward


@contextmanager
def gradient_sync_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside: backward passes through FSDP2 ``model`` accumulate unreduced local gradients.

    ``set_requires_gradient_sync(False)`` on each ``fully_shard`` module: a flag, no
    communication. After: reduction on again, so the next backward reduces everything
    accumulated."""
    modules = fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def _failure_text(exc: BaseException) -> str:
    """``exc`` in one line; torch's ``CheckpointException`` as each rank's own failure
    (its text holds their tracebacks)."""
    # (told by its name: torch.distributed.checkpoint takes seconds to import)
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict):
        return "; ".join(f"{type(error).__name__}: {error} (rank {rank})"
                         for rank, (error, _) in failures.items())
    return f"{type(exc).__name__}: {exc}"


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 rank_state: Callable[[], dict[str, Any]]) -> None:
    """Write a sharded checkpoint into the directory rank 0 gives as ``path``, on every rank.

    The model's and the optimizer's shards (``torch.distributed.checkpoint``, each rank its
    own) and each rank's ``rank_state()`` (:data:`RANK_FILE`, ``torch.save``). Every rank
    calls it at the same step; it returns once every rank has written, so rank 0 may
    then rename the directory. Its first collective is an
    :func:`agent.integrations.ranks.every_rank` of each rank's failure and rank 0's
    ``path`` (rank 0's failure before it calls this comes there from its ``agree``),
    its last one an :func:`agent.integrations.ranks.agree`; ``rank_state`` is called
    before the first, so that its failure on any rank reaches every rank there (none
    is left waiting at a collective the failed one never calls).

    Raises:
        OSError: the checkpoint failed on some rank (every rank raises it, naming that
            rank), e.g. a directory that cannot be written, or a ``rank_state`` that
            raised.
    """
    import torch.distributed.checkpoint as dcp  # (seconds to import: only when saving)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    own: dict[str, Any] | None = None
    try:
        own = rank_state()
    except Exception as exc:
        failure: str | None = f"{type(exc).__name__}: {exc}"
    else:
        failure = None
    # each rank's failure, and rank 0's path; or rank 0's failure before it called this
    # (a text: its Checkpoints' agree, in this same collective)
    gathered = every_rank({"failure": failure,
                           "path": str(path) if dist.get_rank() == 0 else None})
    failures = [f"rank {rank}: {item if isinstance(item, str) else item['failure']}"
                for rank, item in enumerate(gathered)
                if isinstance(item, str) or item["failure"] is not None]
    failure = failures[0] if failures else None
    if failure is None:
        directory = Path(gathered[0]["path"])
        try:
            if optimizer is None:
                state: dict[str, Any] = {"model": get_model_state_dict(model)}
            else:
                model_state, optimizer_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optimizer": optimizer_state}
            dcp.save(state, checkpoint_id=directory)  # (raises on every rank on a failure)
            torch.save(own, directory / RANK_FILE.format(rank=dist.get_rank()))
        except (Exception, CheckpointException) as exc:  # (the latter: a BaseException)
            failure = _failure_text(exc)
        failure = agree(failure)
    if failure is not None:
        raise OSError(f"the sharded checkpoint failed on {failure}")


#: What a ``torch.distributed.checkpoint`` directory's ``.metadata`` pickle may name:
#: ``(module, name)``, besides torch's dtypes, layouts and memory formats.
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"),
    ("pathlib", "PosixPath"), ("collections", "OrderedDict")})


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a checkpoint directory's ``.metadata`` naming nothing but :data:`METADATA_GLOBALS`.

    ``torch.distributed.checkpoint`` reads it with a full ``pickle.load``, which runs
    any code the file names; this runs none.

    Raises:
        pickle.UnpicklingError: the file names anything else.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's metadata names {module}.{name}, which no checkpoint's "
            "metadata holds: not read (it could run code)")


def _metadata_reader(directory: Path) -> Any:
    """A ``FileSystemReader`` of ``directory`` whose ``.metadata`` is read by
    :class:`MetadataUnpickler` (else as torch reads it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = MetadataUnpickler(stream).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"{path} holds no checkpoint metadata")
            storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    return Reader(directory)


def load_sharded(path: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a :func:`save_sharded` directory's shards into ``model`` and ``optimizer``.

    On every rank, at once; returns this rank's own state (what
    :func:`agent.control.checkpoints.load_checkpoint` reads; no code runs from the files:
    the shards' metadata is read by :class:`MetadataUnpickler`).

    Raises:
        ValueError: ``path`` is not such a directory, was written by another number of
            ranks, or its shards cannot be loaded (their metadata names what no
            checkpoint's metadata holds, a file is missing or damaged: torch's
            ``CheckpointException``, a BaseException, said on every rank).
            OSError: it cannot be read.
    """
    import torch.distributed.checkpoint as dcp  # (seconds to import: only when resuming)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    directory = Path(path)
    rank_file = directory / RANK_FILE.format(rank=dist.get_rank())
    if not directory.is_dir() or not rank_file.is_file():
        raise ValueError(f"{path} is not a sharded checkpoint of this model's rank "
                         f"{dist.get_rank()}: a model sharded by fully_shard resumes from the "
                         "directory its checkpoint command wrote")
    rank_state = load_checkpoint(rank_file)
    if rank_state.get("world_size") != dist.get_world_size():
        raise ValueError(f"{path} was written by {rank_state.get('world_size')} ranks, this "
                         f"job has {dist.get_world_size()}")
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=_metadata_reader(directory))
    except CheckpointException as exc:  # (a BaseException, which no caller would catch)
        raise ValueError(f"{path} cannot be loaded ({_failure_text(exc)})") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    return rank_state
