"""A data loader whose worker settings and batch size can change in mid-epoch.

``torch.utils.data.DataLoader`` fixes ``num_workers``, ``pin_memory``, ``prefetch_factor``
and ``persistent_workers`` when it is built; changing them means a new DataLoader, and a
new DataLoader starts a new epoch (pytorch/pytorch#23048). :class:`ReconfigurableLoader`
owns the epoch's order itself and hands an inner DataLoader only the batches the consumer
has not had yet, so a switch keeps the epoch going: no sample skipped or repeated, the
order unchanged.

The dataset's own state follows the epochs too, in every process that loads from it: a
dataset with ``set_epoch(epoch)`` is set to each epoch before any of its batches is
loaded, in this process and in each worker's copy (the epoch travels with the batch's
indices, so persistent workers follow without a restart); any other change to the
dataset's attributes between epochs restarts persistent workers at the next epoch, so
that they load from the dataset as it is (pytorch/pytorch#97326: a persistent worker
keeps the copy of the dataset made when it started).

Sources: pytorch/pytorch#23048 ("Changing num_workers of a DataLoader"); the epoch
permutation and the sharding across ranks are those of
``torch.utils.data.distributed.DistributedSampler``; pytorch/pytorch#97326 ("Change
worker process's attribute while set persistent_worker = True").
"""

from __future__ import annotations

import math
import numbers
import os
import random
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = [
    "MAX_NUM_WORKERS",
    "MAX_PREFETCH_FACTOR",
    "LoaderPosition",
    "LoaderReconfigureError",
    "ReconfigurableLoader",
]

MAX_NUM_WORKERS = max(64, 4 * (os.cpu_count() or 1))
"""Largest ``num_workers`` accepted: 64, or 4 per CPU on machines with more than 16 CPUs.
Beyond that a worker pool costs more in start-up and memory than it can return."""

MAX_PREFETCH_FACTOR = 64
"""Largest ``prefetch_factor`` accepted (batches in flight per worker)."""

_DEFAULT_PREFETCH_FACTOR = 2  # DataLoader's default when num_workers > 0
_FEEDER_JOIN_TIMEOUT_S = 1.0  # longest wait for old queues' feeder threads, in seconds
_NO_BATCH = object()  # marks "no batch fetched ahead"


class LoaderReconfigureError(RuntimeError):
    """The new workers failed while :meth:`ReconfigurableLoader.reconfigure` started them.

    The loader kept its previous settings and its position; ``__cause__`` is the worker's
    error (for example ``worker_init_fn`` raising, or the dataset raising on the first
    batch the new workers load).
    """


class LoaderPosition(NamedTuple):
    """Where a :class:`ReconfigurableLoader` is in its epochs."""

    epoch: int
    """The epoch being served (its permutation is seeded with ``seed + epoch``)."""
    batches_yielded: int
    """Batches of this epoch handed to the consumer so far."""
    batches_in_epoch: int
    """Batches in the epoch for this rank (``len(loader)``)."""


class _EpochIndices(list):
    """One batch's indices (a list of ints) and the epoch whose dataset state they are
    loaded in; a worker's :class:`_EpochFollower` reads ``epoch``."""

    def __init__(self, indices: list[int], epoch: int) -> None:
        super().__init__(indices)
        self.epoch = epoch

    def __reduce__(self) -> tuple[Any, ...]:  # to the workers' index queues
        return _EpochIndices, (list(self), self.epoch)


class _BatchList:
    """Batch sampler over the rest of one rank's epoch: ``batches`` batches of
    ``batch_size`` samples from sample ``first_sample`` of ``shard`` on (the last one
    shorter where the shard ends).

    ``shard`` is the rank's index order for the epoch (1-D int64 tensor); each batch is a
    slice of it as a list of ints, an :class:`_EpochIndices` tagged with ``epoch`` when
    that is not None. Re-pointed by the loader (new epoch, new start) before each
    ``iter(dataloader)``; a persistent-worker DataLoader re-iterates this same object on
    ``_reset``.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.shard = torch.empty(0, dtype=torch.int64)
        self.first_sample = 0
        self.batches = 0
        self.epoch: int | None = None

    def point(self, shard: torch.Tensor, first_sample: int, batches: int,
              epoch: int | None) -> None:
        self.shard, self.first_sample, self.batches, self.epoch = (shard, first_sample,
                                                                   batches, epoch)

    def __iter__(self) -> Iterator[list[int]]:
        shard, size, epoch = self.shard, self.batch_size, self.epoch
        for start in range(self.first_sample, self.first_sample + self.batches * size, size):
            indices = shard[start:start + size].tolist()
            yield indices if epoch is None else _EpochIndices(indices, epoch)

    def __len__(self) -> int:
        return self.batches


def _accelerator_pins() -> tuple[bool, str]:
    """Whether ``pin_memory=True`` would pin here, and why not (checked once per loader)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        if not accelerator.is_available():
            return False, "no accelerator (torch.accelerator.is_available() is False)"
        current = accelerator.current_accelerator()
        if current is not None and current.type == "mps":
            return False, "DataLoader does not pin memory for MPS"
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def _check_int(name: str, value: Any, low: int, high: int | None) -> int:
    # bool is an int subclass; a flag passed as a count is a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bounds}, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _close_iterator(dataloader: DataLoader | None, iterator: Any) -> None:
    """Stop ``iterator``'s worker processes now and drop the DataLoader's hold on it.

    ``_MultiProcessingDataLoaderIter._shutdown_workers`` is what the iterator's
    ``__del__`` runs: it stops the pin-memory thread, tells each worker to exit, joins it
    (terminates it after 5 s), closes the index queues and unregisters the pids from the
    SIGCHLD handler. Calling it here makes the shutdown happen now rather than whenever
    the last reference goes; then the result queue is closed, the queues' feeder threads
    joined (at most 1 s in all; they exit within microseconds) and the process objects
    closed, so that no descriptor outlives the call. Blocks until each worker finishes
    the batch it is loading (a worker that does not exit is terminated after 5 s).
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        result_queue = getattr(iterator, "_worker_result_queue", None)
        queues = [*getattr(iterator, "_index_queues", ()), result_queue]
        if result_queue is not None:  # not closed by _shutdown_workers without pinning
            result_queue.cancel_join_thread()
            result_queue.close()
        # A closed multiprocessing queue's feeder thread closes the pipe's write end a
        # moment later; wait for it so the descriptors are gone when this returns.
        deadline = time.monotonic() + _FEEDER_JOIN_TIMEOUT_S
        for queue in queues:
            feeder = getattr(queue, "_thread", None)
            if feeder is not None:
                feeder.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in getattr(iterator, "_workers", ()):
            if not worker.is_alive():
                worker.close()  # releases its sentinel pipe now, not at garbage collection
    if dataloader is not None and getattr(dataloader, "_iterator", None) is iterator:
        dataloader._iterator = None  # a persistent-worker DataLoader keeps its iterator


def _set_epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the global RNGs while ``dataset.set_epoch(epoch)`` runs: a function of
    the loader's ``seed`` and the epoch only (plain integer arithmetic, the same in every
    process and on every rank)."""
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % (2 ** 63)


def _call_set_epoch(dataset: Any, epoch: int, seed: int) -> None:
    """``dataset.set_epoch(epoch)`` with the global torch (CPU), ``random`` and numpy RNGs
    seeded from ``(seed, epoch)`` and restored afterwards.

    So a ``set_epoch`` that draws from the global RNGs (``torch.randperm(n)``,
    ``random.shuffle(...)``) gives the same state in this process and in every worker's
    copy, and does not move the training's (or the worker's) own random numbers.
    """
    numpy: types.ModuleType | None
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with every torch install here
        numpy = None
    value = _set_epoch_seed(seed, epoch)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        torch.default_generator.manual_seed(value)  # the CPU generator only, not CUDA's
        random.seed(value)
        if numpy is not None:
            numpy.random.seed(value % (2 ** 32))
        dataset.set_epoch(epoch)
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


class _EpochFollower:
    """The ``__getitems__`` a worker puts on its copy of a dataset that has ``set_epoch``:
    before loading a batch of an epoch its copy is not in yet, it calls
    ``set_epoch(epoch)`` on it (as the loader did on the training process's dataset), then
    loads the batch as DataLoader would (the dataset's own ``__getitems__``, or
    ``__getitem__`` per index). Costs one comparison per batch otherwise."""

    def __init__(self, dataset: Any, epoch: int | None, seed: int) -> None:
        self.dataset, self.epoch, self.seed = dataset, epoch, seed
        own = vars(dataset).get("__getitems__")
        if own is None:
            method = getattr(type(dataset), "__getitems__", None)
            own = None if method is None else types.MethodType(method, dataset)
        self._own = own

    def __call__(self, indices: list[int]) -> list[Any]:
        epoch = getattr(indices, "epoch", None)
        if epoch is not None and epoch != self.epoch:
            _call_set_epoch(self.dataset, epoch, self.seed)
            self.epoch = epoch
        if self._own is not None:
            return self._own(indices)
        dataset = self.dataset
        return [dataset[index] for index in indices]


class _WorkerInit:
    """``worker_init_fn`` of a loader whose dataset has ``set_epoch``: installs an
    :class:`_EpochFollower` on the worker's copy of the dataset, then calls the user's
    ``worker_init_fn``.

    ``dataset_epoch`` is kept equal to the epoch the training process's dataset was last
    set to; a worker receives this object (forked or pickled) at the moment it receives
    its copy of the dataset, so the two agree.
    """

    def __init__(self, user_fn: Callable[[int], None] | None, seed: int) -> None:
        self.user_fn, self.seed = user_fn, seed
        self.dataset_epoch: int | None = None

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        assert info is not None  # a worker_init_fn runs in a worker, where this is set
        dataset = info.dataset
        # An instance attribute, in this worker's copy only: DataLoader's fetcher calls
        # dataset.__getitems__(indices) when the dataset has one.
        vars(dataset)["__getitems__"] = _EpochFollower(dataset, self.dataset_epoch, self.seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


_VALUE_TYPES = (int, float, complex, str, bytes, bool, type(None))
_STATE_DEPTH = 2  # datasets inside datasets (Subset.dataset, ConcatDataset.datasets) followed


class _DatasetState:
    """A shallow record of a dataset's attributes (and those of the datasets it wraps),
    to tell later which of them the training code has rebound since.

    Numbers, strings and None are compared by value, anything else by identity (held
    by a weak reference where the type allows one, else by a reference). Changes inside
    an object (a tensor written in place, a list appended to) are not seen. Cost: one
    entry per attribute.
    """

    def __init__(self, dataset: Any) -> None:
        self.entries: dict[str, tuple[str, Any]] = {}
        self._capture(dataset, "", 0, set())

    def _capture(self, obj: Any, path: str, depth: int, seen: set[int]) -> None:
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, dict) or id(obj) in seen:
            return
        seen.add(id(obj))
        for name, value in list(attributes.items()):
            if name == "__getitems__":
                continue
            key = f"{path}.{name}" if path else name
            if type(value) in _VALUE_TYPES:
                self.entries[key] = ("=", value)
            else:
                try:
                    self.entries[key] = ("ref", weakref.ref(value))
                except TypeError:
                    self.entries[key] = ("is", value)
            if depth < _STATE_DEPTH:
                if isinstance(value, Dataset):
                    self._capture(value, key, depth + 1, seen)
                elif isinstance(value, (list, tuple)) and 0 < len(value) <= 64 \
                        and all(isinstance(item, Dataset) for item in value):
                    for i, item in enumerate(value):
                        self._capture(item, f"{key}[{i}]", depth + 1, seen)

    def changed(self, dataset: Any) -> list[str]:
        """Attributes added, removed or rebound in ``dataset`` since this record."""
        now = _DatasetState(dataset).entries
        changed = []
        for key in sorted(self.entries.keys() | now.keys()):
            if key not in self.entries or key not in now:
                changed.append(key)
                continue
            kind, then = self.entries[key]
            current = now[key]
            if kind == "=":
                if current[0] != "=" or not _same_value(then, current[1]):
                    changed.append(key)
                continue
            obj = then() if kind == "ref" else then
            value = current[1]() if current[0] == "ref" else current[1]
            if obj is None or obj is not value:
                changed.append(key)
        return changed


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return a == b or (a != a and b != b)  # NaN is NaN


class _EpochIterator:
    """What ``iter(loader)`` returns. A class rather than a generator, so that nothing
    keeps the last batch (and its shared memory) alive after the consumer drops it."""

    def __init__(self, loader: ReconfigurableLoader, token: int) -> None:
        self._loader, self._token = loader, token

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        return self._loader._take(self._token)


class ReconfigurableLoader:
    """Batches of a map-style dataset whose loader settings can change mid-epoch.

    One epoch per ``for batch in loader``; ``num_workers``, ``pin_memory``,
    ``prefetch_factor``, ``persistent_workers`` and ``batch_size`` can change between two
    batches without losing the epoch's place.

    Epochs: epoch ``e`` visits the indices in the order
    ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)`` gives
    after ``set_epoch(e)`` (a ``torch.randperm`` seeded with ``seed + e``, padded by
    repeating its head, or truncated with ``drop_last``, so that every rank has the same
    number of samples, then ``indices[rank::num_replicas]``), cut into batches of
    ``batch_size`` (after a change of batch size, the rest of the epoch is cut into
    batches of the new size). The order of the samples does not depend on the settings
    or on when they change.

    Iteration: ``iter(loader)`` continues the current epoch where the consumer left it
    (after a ``break``, or an exception from the dataset, the next batch is the first one
    not yet handed out); once an epoch is finished, ``iter(loader)`` starts the next one,
    so a plain ``for epoch ...: for batch in loader`` walks epochs 0, 1, 2, ...
    :meth:`set_epoch` jumps to the start of any epoch, as with DistributedSampler. Only
    the newest iterator yields; an older one stops.

    The dataset's state (pytorch/pytorch#97326): a DataLoader worker loads from its own
    copy of the dataset, made when it started; a persistent worker keeps that copy from
    epoch to epoch. This loader keeps every copy in the state of the epoch being served:

    - A dataset with a ``set_epoch(epoch)`` method is set to each epoch by the loader
      before any batch of that epoch is loaded: in this process (once per epoch), and in
      each worker's copy before the first batch of that epoch the worker loads (the epoch
      travels with each batch's indices, so persistent workers keep running and batches
      loaded ahead are loaded in their own epoch's state; new workers started by
      :meth:`reconfigure` get a copy already set). ``set_epoch`` must depend only on the
      epoch and the dataset's state: it runs with the global torch (CPU), ``random`` and
      numpy RNGs seeded from ``(seed, epoch)``, the same in every process and on every
      rank, and restored afterwards. Do not call ``dataset.set_epoch`` yourself (call
      :meth:`set_epoch` here to change epochs): it is harmless, but counts as a change
      made outside the loader (next point).
    - Any other change to the dataset's attributes (an attribute rebound, e.g.
      ``dataset.max_len = 256``; also in datasets it wraps, as ``Subset.dataset``) is seen
      at the start of the next epoch: persistent workers are then restarted, so that the
      new epoch is loaded from the dataset as it is (:attr:`dataset_restarts`,
      :attr:`last_dataset_restart` say when and why). Workers started later (new epoch
      without persistent workers, or :meth:`reconfigure`) copy the dataset as it is then,
      so such a change reaches the batches they load even mid-epoch. A change inside an
      attribute (a tensor written in place, a list appended to) cannot be seen: call
      :meth:`refresh_dataset` after making one.
    - The dataset's length is fixed when the loader is built; a change of it is refused
      (ValueError) before the next batch is loaded.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch (int >= 1).
        shuffle: permute the indices each epoch; otherwise ``0, 1, ..., len - 1``.
        seed: base of the per-epoch permutation seed; must be the same on every rank.
        drop_last: drop the tail that does not split evenly across ranks (instead of
            padding with repeated indices) and the last partial batch of each rank
            (DistributedSampler's and DataLoader's ``drop_last`` together).
        collate_fn: merges a list of samples into a batch; DataLoader's default collate
            when None.
        num_workers, pin_memory, prefetch_factor, persistent_workers: as for DataLoader,
            changeable later with :meth:`reconfigure` (see there for the accepted values;
            ``prefetch_factor=None`` means DataLoader's default, 2 batches per worker).
        num_replicas, rank: data-parallel world size and this process's rank in it.
        worker_init_fn: called with the worker id in each new worker process.
        timeout_s: how long to wait for a batch from the workers before raising, in
            seconds; 0 waits as long as it takes (DataLoader's ``timeout``).
        multiprocessing_context: start method of the workers (``"fork"``, ``"spawn"``,
            ``"forkserver"``, or a context), the platform's default when None.

    Raises:
        ValueError: a setting of the wrong type or out of range (the message names it and
            the value), or an ``IterableDataset`` (an epoch here is a list of indices);
            later, from ``next()``, when ``len(dataset)`` is no longer what it was.
        TypeError: ``dataset`` has no ``__len__``.

    .. note:: Worker processes never draw from the global torch RNG of the training
       process: the base seed of each worker pool comes from a private generator seeded
       with ``(seed, rank)``, so a switch does not change the training's random numbers.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout_s: float = 0.0,
        multiprocessing_context: Any = None,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError("ReconfigurableLoader needs a map-style dataset, "
                             f"got the IterableDataset {type(dataset).__name__}")
        self.dataset = dataset
        self.dataset_len = len(dataset)  # TypeError without __len__, as DataLoader's samplers
        self.batch_size = _check_int("batch_size", batch_size, 1, None)
        self.shuffle = _check_bool("shuffle", shuffle)
        self.seed = _check_int("seed", seed, -(2 ** 63), 2 ** 63 - 1)
        self.drop_last = _check_bool("drop_last", drop_last)
        self.num_replicas = _check_int("num_replicas", num_replicas, 1, None)
        self.rank = _check_int("rank", rank, 0, self.num_replicas - 1)
        # Checked as an object: as a float, mypy takes isinstance(numbers.Real) for impossible
        # (it cannot see the ABC registration) and skips the rest of __init__ unchecked.
        timeout: object = timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
                or not float(timeout) >= 0 or math.isinf(timeout):
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
        self.timeout_s = float(timeout)
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        #: Whether the dataset has a ``set_epoch`` method (called by the loader each epoch).
        self.dataset_has_set_epoch = callable(getattr(dataset, "set_epoch", None))
        # Workers can set their copy's epoch only where it has a __dict__ (the follower is
        # an instance attribute); otherwise persistent workers restart at each new epoch.
        self._workers_follow = self.dataset_has_set_epoch and isinstance(
            getattr(dataset, "__dict__", None), dict)
        self._worker_init = (_WorkerInit(worker_init_fn, self.seed)
                             if self._workers_follow else None)
        self._dataset_epoch: int | None = None  # the epoch the dataset here was set to
        self._pool_state: _DatasetState | None = None  # dataset as the live pool has it
        self.dataset_restarts = 0
        """Times persistent workers were restarted for the dataset's sake: it changed
        outside ``set_epoch``, or their copies could not follow ``set_epoch`` (a dataset
        without ``__dict__``); see the class notes."""
        self.last_dataset_restart: str | None = None
        """Why persistent workers were last restarted for the dataset's sake, or None."""
        self._requested = self._validated(
            {"num_workers": num_workers, "pin_memory": pin_memory,
             "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers})
        self._pins, self._no_pin_reason = _accelerator_pins()
        self._effective = self._normalised(self._requested)

        # Samples per rank and epoch, as DistributedSampler.num_samples.
        n, replicas = self.dataset_len, self.num_replicas
        if self.drop_last and n % replicas:
            self._samples_per_rank = math.ceil((n - replicas) / replicas)
        else:
            self._samples_per_rank = math.ceil(n / replicas)
        # Batch number ``_size_changed_at[0]`` of the epoch starts at sample
        # ``_size_changed_at[1]`` of its shard; from there batches have ``batch_size``
        # samples (a change of batch size mid-epoch moves this point; an epoch starts at 0).
        self._size_changed_at = (0, 0)
        self._batches_per_epoch = self._batches_from(0, self.batch_size)

        self._seed_generator = torch.Generator()
        self._seed_generator.manual_seed(hash((self.seed, self.rank)) & (2 ** 63 - 1))
        self._lock = threading.RLock()  # one fetch or switch at a time
        self._epoch = 0
        self._shard = self._epoch_shard(0)
        self._yielded = 0
        self._iter_token = 0
        # The inner DataLoader for the current settings (built lazily), its batch
        # sampler, and its iterator. Invariant: the iterator's next batch (or _pending,
        # fetched ahead by reconfigure) is batch number _yielded of the epoch.
        self._dataloader: DataLoader | None = None
        self._batch_list: _BatchList | None = None
        self._iterator: Any = None
        self._pending: Any = _NO_BATCH
        self.last_reconfigure_s: float | None = None
        """Wall time of the last :meth:`reconfigure` that restarted workers, in seconds."""

    # ----------------------------------------------------------------- public API

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, or the next epoch if the current one is done."""
        with self._lock:
            if self._yielded >= self._batches_per_epoch:
                self._move_to_epoch(self._epoch + 1)
            self._iter_token += 1
            token = self._iter_token
        return _EpochIterator(self, token)

    @property
    def epoch(self) -> int:
        """The epoch being served (see :meth:`set_epoch`)."""
        return self._epoch

    @property
    def position(self) -> LoaderPosition:
        """Epoch, batches of it yielded so far, and batches in it."""
        with self._lock:
            return LoaderPosition(self._epoch, self._yielded, self._batches_per_epoch)

    def save_position(self) -> dict[str, Any]:
        """Where the loader is, and the state of its workers' seed generator.

        The epoch, the batches of it handed out, its batch size and where in the epoch that
        size began:
        :meth:`restore_position` in a fresh loader over the same dataset goes on with the
        same batches, also after a mid-epoch change of batch size
        (:meth:`gpuopt.Trainer.state_dict` keeps it).

        Not called ``state_dict`` on purpose: Lightning takes a train loader with
        ``state_dict`` / ``load_state_dict`` for one it can resume mid-epoch, and saves
        it while it holds a batch fetched ahead, so a resume would be a batch off."""
        with self._lock:
            return {"epoch": self._epoch, "batches_yielded": self._yielded,
                    "batch_size": self.batch_size,
                    "size_changed_at": list(self._size_changed_at),
                    "seed_generator": self._seed_generator.get_state()}

    def restore_position(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`save_position`'s).

        The next batch is the first one the saving loader had not handed out, and
        :attr:`batch_size` is the saving loader's (a position saved without one keeps this
        loader's). Batches fetched ahead are dropped; persistent workers stay up unless the
        batch size changes.

        Raises:
            ValueError: a position outside this loader's epochs (another dataset length,
                batch size or number of ranks). Nothing changes.
        """
        epoch = _check_int("epoch", state["epoch"], 0, None)
        size = _check_int("batch_size", state.get("batch_size", self.batch_size), 1, None)
        changed_batch, changed_sample = state.get("size_changed_at", (0, 0))
        changed_batch = _check_int("size_changed_at batch", changed_batch, 0, None)
        changed_sample = _check_int("size_changed_at sample", changed_sample, 0,
                                    self._samples_per_rank)
        batches = changed_batch + self._batches_from(changed_sample, size)
        yielded = _check_int("batches_yielded", state["batches_yielded"], changed_batch,
                             batches)
        with self._lock:
            if size != self.batch_size:
                self._close_inner()  # its batch sampler cuts batches of the old size
                self.batch_size = size
            self._move_to_epoch(epoch)
            self._size_changed_at = (changed_batch, changed_sample)
            self._batches_per_epoch = batches
            self._yielded = yielded
            self._seed_generator.set_state(state["seed_generator"])

    @property
    def config(self) -> dict[str, Any]:
        """The worker settings: as requested, and as in effect.

        Keys: ``num_workers``, ``pin_memory``, ``prefetch_factor`` (None: DataLoader's
        default), ``persistent_workers`` (as last set); ``pin_memory_effective``,
        ``prefetch_factor_effective`` (batches in flight per worker, None without
        workers), ``persistent_workers_effective`` (what the inner DataLoader gets); and
        ``notes``, a list of sentences saying why a setting has no effect here.
        """
        with self._lock:
            return self._describe(self._requested, self._effective)

    def set_epoch(self, epoch: int) -> None:
        """Serve epoch ``epoch`` from its first batch (as ``DistributedSampler.set_epoch``).

        A no-op when the loader is already at the start of that epoch. Otherwise the
        batches fetched ahead are dropped; persistent workers stay up. A dataset with
        ``set_epoch`` is set to ``epoch`` before the epoch's first batch is loaded (here
        and in the workers; see the class notes).

        Raises:
            ValueError: ``epoch`` is not an int >= 0.
        """
        epoch = _check_int("epoch", epoch, 0, None)
        with self._lock:
            if epoch == self._epoch and self._yielded == 0:
                return
            self._move_to_epoch(epoch)

    def reconfigure(
        self,
        *,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        batch_size: int | None = None,
    ) -> dict[str, Any]:
        """Change worker settings or the batch size; the epoch goes on where it was.

        Call it from the thread that iterates, between two batches (at an optimizer-step
        boundary). The new settings apply from the first batch not yet handed to the
        consumer: batches the old workers had loaded ahead are loaded again by the new
        ones, never skipped, so the epoch's order is the same as without the switch.

        When batches of the current epoch remain, the new workers are started and the
        next batch is loaded before this returns, so that a failing worker is reported
        here and not at some later step. Until then the old workers stay up; they are
        shut down (joined) only once the new ones have delivered. If no batch remains,
        the settings are stored and the workers start with the next epoch. The new
        workers copy the dataset as it is then, set to its epoch (see the class notes).

        Args:
            num_workers: worker processes, int in ``[0, MAX_NUM_WORKERS]``.
            pin_memory: copy batches into page-locked memory (faster, asynchronous
                host-to-device copies); has no effect without an accelerator.
            prefetch_factor: batches in flight per worker, int in
                ``[1, MAX_PREFETCH_FACTOR]``; ignored with ``num_workers=0``.
            persistent_workers: keep the workers from one epoch to the next; ignored
                with ``num_workers=0``.
            batch_size: samples per batch from the next batch on (int >= 1): the rest of
                the epoch, from the first sample not yet handed out, is cut into batches
                of this size (the last one shorter, or dropped with ``drop_last``), so
                every sample of the epoch still comes once and in the same order;
                :attr:`batch_size` and ``len(loader)`` (the epoch's batches) follow.
            A setting left at None stays as it is.

        Returns:
            :attr:`config` after the change.

        Raises:
            ValueError: a value of the wrong type (a bool or float for a count, an int
                for a flag, a string) or out of range; the message names it. Nothing
                changes.
            LoaderReconfigureError: the new workers failed to start or to load the next
                batch; they are shut down, and the previous settings and position are
                kept (the next batch is the one that would have come).

        .. note:: Cost, on the calling thread: one worker-pool start-up (a fork per worker
           plus ``worker_init_fn``) and the loading of one batch by the new pool, then the
           old pool's shutdown (each old worker finishes the batch it is loading, then is
           joined). Meanwhile the old workers go on with the batches they had been handed
           (at most ``prefetch_factor`` each) and compete for CPU; for a moment both pools
           exist. Batches the old pool had loaded ahead and not handed out (at most
           ``prefetch_factor * num_workers``) are loaded a second time. Measured on an
           otherwise idle 2-core CPU with a trivial dataset (fork start method): 0 -> 2
           workers median 30 ms (20-45 ms), 2 -> 0 median 10 ms (8-30 ms); about twice
           that with the CPUs busy. Settings that change nothing in effect (for example
           ``pin_memory`` without an accelerator) restart nothing and cost nothing.
        """
        with self._lock:
            requested = dict(self._requested)
            for name, value in (("num_workers", num_workers), ("pin_memory", pin_memory),
                                ("prefetch_factor", prefetch_factor),
                                ("persistent_workers", persistent_workers)):
                if value is not None:
                    requested[name] = value
            requested = self._validated(requested)
            effective = self._normalised(requested)
            size = self.batch_size if batch_size is None else _check_int(
                "batch_size", batch_size, 1, None)
            if effective == self._effective and size == self.batch_size:
                self._requested = requested
                return self._describe(self._requested, self._effective)
            if self._yielded >= self._batches_per_epoch:
                self._close_inner()
                self._requested, self._effective = requested, effective
                self.batch_size = size  # from the next epoch's first batch
                return self._describe(self._requested, self._effective)

            started = time.perf_counter()
            self._prepare_dataset(watch=False)  # new workers copy it in this epoch's state
            dataloader, batch_list = self._build(effective, size)
            first_sample = self._first_sample(self._yielded)
            batches = self._yielded + self._batches_from(first_sample, size)
            iterator = None
            try:
                batch_list.point(self._shard, first_sample, batches - self._yielded,
                                 self._epoch if self._workers_follow else None)
                state = self._new_pool_state(dataloader, effective)
                iterator = iter(dataloader)
                first = next(iterator)
            except BaseException as error:
                _close_iterator(dataloader, iterator if iterator is not None
                                else getattr(dataloader, "_iterator", None))
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt and the like: the old workers stay as they were
                epoch, yielded, total = self.position
                # A worker's error arrives as "Caught X in DataLoader worker process i.
                # Original Traceback: ..."; its last line says what went wrong.
                lines = str(error).strip().splitlines()
                reason = lines[-1].strip() if len(lines) > 1 else \
                    f"{type(error).__name__}: {lines[0] if lines else ''}"
                raise LoaderReconfigureError(
                    f"new DataLoader workers ({self._describe_short(effective)}) failed "
                    f"({reason}); kept {self._describe_short(self._effective)} at epoch "
                    f"{epoch}, batch {yielded} of {total}") from error
            self._close_inner()
            self._dataloader, self._batch_list, self._iterator = dataloader, batch_list, iterator
            self._pool_state = state
            self._pending = first
            self._requested, self._effective = requested, effective
            if size != self.batch_size:
                self.batch_size = size
                self._size_changed_at = (self._yielded, first_sample)
                self._batches_per_epoch = batches
            self.last_reconfigure_s = time.perf_counter() - started
            return self._describe(self._requested, self._effective)

    def close(self) -> None:
        """Shut the workers down now (persistent ones too).

        Iterating again restarts them at the same position."""
        with self._lock:
            self._close_inner()

    def refresh_dataset(self) -> None:
        """Have the next batches loaded from the dataset as it is now.

        For a change the loader cannot see (one inside an attribute: a tensor written in
        place, a list appended to; see the class notes). The workers, persistent ones
        too, are shut down now; the next batch (the first one not yet handed out, none
        skipped) starts new ones, which copy the dataset as it is then. Batches the old
        workers had loaded ahead are loaded again. Costs one worker-pool start, as
        :meth:`close`; without workers it changes nothing (batches are loaded here).
        """
        with self._lock:
            self._close_inner()

    def __enter__(self) -> ReconfigurableLoader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _take(self, token: int) -> Any:
        """The next batch for iterator ``token``; StopIteration at the end of the epoch or
        when a newer iterator exists."""
        with self._lock:
            if token != self._iter_token or self._yielded >= self._batches_per_epoch:
                raise StopIteration
            batch = self._next_batch()
            self._yielded += 1
            if self._yielded == self._batches_per_epoch:
                self._end_epoch()
            return batch

    def _next_batch(self) -> Any:
        if self._pending is not _NO_BATCH:
            batch, self._pending = self._pending, _NO_BATCH
            return batch
        try:
            if self._iterator is None:
                self._prepare_dataset()
                if self._dataloader is None:
                    self._dataloader, self._batch_list = self._build(self._effective,
                                                                     self.batch_size)
                assert self._batch_list is not None
                self._batch_list.point(self._shard, self._first_sample(self._yielded),
                                       self._batches_per_epoch - self._yielded,
                                       self._epoch if self._workers_follow else None)
                state = self._new_pool_state(self._dataloader, self._effective)
                self._iterator = iter(self._dataloader)
                if state is not None:
                    self._pool_state = state
            return next(self._iterator)
        except BaseException:
            # A DataLoader iterator moves past a batch that raised; drop it so that the
            # next attempt restarts at batch _yielded and nothing is skipped.
            self._close_inner()
            raise

    def _end_epoch(self) -> None:
        """Every batch of the epoch was handed out: stop non-persistent workers now."""
        if self._effective["persistent_workers"]:
            self._iterator = None  # the DataLoader keeps it and resets it next epoch
        else:
            self._close_inner()

    def _move_to_epoch(self, epoch: int) -> None:
        if self._effective["persistent_workers"]:
            self._iterator = None  # iter(dataloader) resets the persistent one
            self._pending = _NO_BATCH
        else:
            self._close_inner()
        self._epoch = epoch
        self._shard = self._epoch_shard(epoch)
        self._yielded = 0
        self._size_changed_at = (0, 0)
        self._batches_per_epoch = self._batches_from(0, self.batch_size)

    def _persistent_pool(self) -> bool:
        """Whether persistent workers are up (kept by the inner DataLoader)."""
        return (self._dataloader is not None and self._effective["persistent_workers"]
                and getattr(self._dataloader, "_iterator", None) is not None)

    @staticmethod
    def _new_pool_state(dataloader: DataLoader, effective: dict[str, Any]
                        ) -> _DatasetState | None:
        """Called just before ``iter(dataloader)``: when that starts a persistent pool,
        the record of the dataset its workers are about to copy; else None (no pool to
        watch, or one already up, whose record stays)."""
        if not effective["persistent_workers"] or \
                getattr(dataloader, "_iterator", None) is not None:
            return None
        return _DatasetState(dataloader.dataset)

    def _prepare_dataset(self, *, watch: bool = True) -> None:
        """Before the first batch of an inner iterator is loaded: the dataset, here and in
        live persistent workers, in the state of the epoch being served.

        Persistent workers are restarted (shut down here; the caller starts new ones)
        when the dataset's attributes changed since they copied it (not looked at with
        ``watch=False``: :meth:`reconfigure`, which replaces them anyway), or when a new
        epoch needs ``set_epoch`` and their copies cannot follow. Then
        ``dataset.set_epoch`` is called here once per epoch (the workers follow from the
        batches' epoch tags).

        Raises:
            ValueError: ``len(dataset)`` is not what it was when the loader was built.
        """
        new_epoch = self.dataset_has_set_epoch and self._dataset_epoch != self._epoch
        if self._persistent_pool():
            changed = (self._pool_state.changed(self.dataset)
                       if watch and self._pool_state is not None else [])
            reason = None
            if changed:
                names = ", ".join(repr(name) for name in changed[:5])
                more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
                reason = (f"the dataset's attribute{'s' if len(changed) > 1 else ''} "
                          f"{names}{more} changed since the workers copied it")
            elif new_epoch and not self._workers_follow:
                reason = (f"{type(self.dataset).__name__} has no __dict__, so the workers' "
                          "copies cannot follow set_epoch")
            if reason is not None:
                self._close_inner()
                self.dataset_restarts += 1
                self.last_dataset_restart = (f"persistent workers restarted for epoch "
                                             f"{self._epoch}, batch {self._yielded}: {reason}")
        if new_epoch:
            _call_set_epoch(self.dataset, self._epoch, self.seed)
            self._dataset_epoch = self._epoch
            if self._worker_init is not None:
                self._worker_init.dataset_epoch = self._epoch
            if self._persistent_pool():  # they apply the same set_epoch from the tags
                self._pool_state = _DatasetState(self.dataset)
        length = len(self.dataset)
        if length != self.dataset_len:
            raise ValueError(
                f"len(dataset) is {length}, but was {self.dataset_len} when the "
                "ReconfigurableLoader was built: its epochs are planned from that length "
                "(every sample once per epoch); build a new loader for the new length")

    def _close_inner(self) -> None:
        dataloader, iterator = self._dataloader, self._iterator
        if iterator is None and dataloader is not None:
            iterator = getattr(dataloader, "_iterator", None)
        self._dataloader = self._batch_list = self._iterator = None
        self._pending = _NO_BATCH
        self._pool_state = None
        if iterator is not None:
            _close_iterator(dataloader, iterator)

    def _epoch_shard(self, epoch: int) -> torch.Tensor:
        """This rank's indices for ``epoch``, as DistributedSampler orders them (int64)."""
        n = self.dataset_len
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            indices = torch.randperm(n, generator=generator)
        else:
            indices = torch.arange(n)
        total = self._samples_per_rank * self.num_replicas
        if total > n:  # pad by repeating the head (the whole order as often as needed)
            indices = indices.repeat(math.ceil(total / n))[:total] if n else indices
        return indices[self.rank:total:self.num_replicas].clone()

    def _first_sample(self, batch: int) -> int:
        """Where batch number ``batch`` of the epoch (at or after the last change of
        batch size) starts in the epoch's shard, in samples."""
        changed_batch, changed_sample = self._size_changed_at
        return changed_sample + (batch - changed_batch) * self.batch_size

    def _batches_from(self, first_sample: int, size: int) -> int:
        """Batches of ``size`` samples left in the epoch from ``first_sample`` on (the
        last one shorter, or dropped with ``drop_last``)."""
        left = max(0, self._samples_per_rank - first_sample)
        return left // size if self.drop_last else math.ceil(left / size)

    def _build(self, effective: dict[str, Any], batch_size: int
               ) -> tuple[DataLoader, _BatchList]:
        batch_list = _BatchList(batch_size)
        workers = effective["num_workers"]
        dataloader = DataLoader(
            self.dataset,
            batch_sampler=batch_list,
            collate_fn=self.collate_fn,
            num_workers=workers,
            pin_memory=effective["pin_memory"],
            prefetch_factor=effective["prefetch_factor"],
            persistent_workers=effective["persistent_workers"],
            worker_init_fn=(self._worker_init if self._worker_init is not None
                            else self.worker_init_fn),
            timeout=self.timeout_s if workers else 0,
            multiprocessing_context=self.multiprocessing_context if workers else None,
            generator=self._seed_generator,
        )  # in_order stays at its default, True: batches come in sampler order
        return dataloader, batch_list

    @staticmethod
    def _validated(settings: dict[str, Any]) -> dict[str, Any]:
        prefetch = settings["prefetch_factor"]
        return {
            "num_workers": _check_int("num_workers", settings["num_workers"], 0, MAX_NUM_WORKERS),
            "pin_memory": _check_bool("pin_memory", settings["pin_memory"]),
            "prefetch_factor": None if prefetch is None else _check_int(
                "prefetch_factor", prefetch, 1, MAX_PREFETCH_FACTOR),
            "persistent_workers": _check_bool("persistent_workers",
                                              settings["persistent_workers"]),
        }

    def _normalised(self, requested: dict[str, Any]) -> dict[str, Any]:
        """What the inner DataLoader gets: drops what it refuses or ignores here."""
        workers = requested["num_workers"]
        prefetch = requested["prefetch_factor"]
        return {
            "num_workers": workers,
            "pin_memory": requested["pin_memory"] and self._pins,
            "prefetch_factor": (prefetch or _DEFAULT_PREFETCH_FACTOR) if workers else None,
            "persistent_workers": requested["persistent_workers"] and workers > 0,
        }

    def _describe(self, requested: dict[str, Any], effective: dict[str, Any]) -> dict[str, Any]:
        notes = []
        if requested["pin_memory"] and not effective["pin_memory"]:
            notes.append(f"pin_memory has no effect: {self._no_pin_reason}")
        if requested["prefetch_factor"] is not None and not effective["num_workers"]:
            notes.append("prefetch_factor is ignored with num_workers=0")
        if requested["persistent_workers"] and not effective["num_workers"]:
            notes.append("persistent_workers is ignored with num_workers=0")
        if effective["persistent_workers"] and not isinstance(
                getattr(self.dataset, "__dict__", None), dict):
            notes.append(f"{type(self.dataset).__name__} has no __dict__: a change of its "
                         "attributes does not reach the persistent workers; call "
                         "refresh_dataset() after one")
        return {
            **requested,
            "pin_memory_effective": effective["pin_memory"],
            "prefetch_factor_effective": effective["prefetch_factor"],
            "persistent_workers_effective": effective["persistent_workers"],
            "notes": notes,
        }

    @staticmethod
    def _describe_short(effective: dict[str, Any]) -> str:
        return ", ".join(f"{name}={value}" for name, value in effective.items())
