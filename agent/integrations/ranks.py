"""What the ranks of a job agree on before one of them changes its training state.

A command applies at one optimizer step on every rank, but what it does there can fail on
one rank only (a checkpoint it cannot read, a state over its host-memory budget). Before
any rank changes its state, every rank tells the others how it went with
:func:`every_rank`, one collective over the job's default process group, which every rank
calls at the same point (the same boundary); :func:`agree` is its common use, the first
rank's failure. With one rank, or no process group, each is this rank's own answer.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist


def every_rank(item: Any, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``item``, in rank order: one collective that every rank calls at one point.

    Args:
        item: a small picklable value (a few texts and numbers: it is pickled and sent
            to every rank).
        device: this rank's device; with NCCL the collective runs on it (else on the
            current CUDA device, as ``all_gather_object`` does).

    Returns:
        ``[item]`` with one rank or no initialized process group.

    .. note:: Blocks until every rank has called it: call it only where every rank
       does (a command's boundary), never on one rank's condition.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [item]
    gathered: list[Any] = [None] * dist.get_world_size()
    on_device = (torch.cuda.device(device) if device is not None and device.type == "cuda"
                 and dist.get_backend() == "nccl" else nullcontext())
    with on_device:
        dist.all_gather_object(gathered, item)
    return gathered


def agree(failure: str | None, device: torch.device | None = None) -> str | None:
    """The first rank's failure as ``"rank N: <its failure>"``, the same on every rank, or None.

    ``failure``: this rank's (None: it went well). A collective: :func:`every_rank`."""
    failures = [f"rank {rank}: {text}" for rank, text in
                enumerate(every_rank(failure, device)) if text is not None]
    return failures[0] if failures else None
