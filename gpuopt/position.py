"""Where a run is in its data at an optimizer-step boundary, exactly, and how to go back.

A resume that restores the model, the optimizer and the random number generators but
not the data position re-trains or skips data: the field's oldest resume bug
(transformers#5605, #22143; EleutherAI/gpt-neox#308). Counting optimizer steps is not
enough once the window size can change live, and a loop that fetches its next batch
before the boundary (nanoGPT's ``X, Y = get_batch()`` at the end of its micro-step loop)
has drawn the random numbers of a batch the saved state no longer shows.

:class:`DataPosition` counts what it sees instead:

- every batch fetched for training (under ``torch.is_grad_enabled()``: fetches for
  evaluation inside ``no_grad`` do not move it), with its epoch and index in the epoch;
- the micro-batches each finished accumulation window trained on, so that the batches
  fetched but not yet trained at a boundary (fetched *ahead*) are known and saved
  themselves;
- the random number generators' state where each epoch's iterator was made (a
  ``DataLoader`` draws its sampler's permutation and its workers' base seed there).

Resuming an iterable (:meth:`DataPosition.epoch_iterator`) makes the saved epoch's iterator
again from that state, fetches and drops the batches the saved run had fetched in it,
puts back the generators as they were at the boundary, yields the saved batches fetched
ahead, and goes on. For a map-style dataset with any sampler drawn from torch's
generator, and workers seeded from it, that is the same data bit for bit; it costs the
loading of the dropped batches once. Resuming a fetch function
(:meth:`DataPosition.timed_fetch`'s) hands back the batches fetched ahead, then calls the
function again: its draws come from the generators restored at the boundary.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Generator, Iterable, Iterator

import torch

from gpuopt._hotpath import Fetches, PositionCounts
from gpuopt.saving import rng_state, set_rng_state

#: The most batches fetched ahead of a boundary that a position keeps (a loop that
#: prefetches more is told its resume differs: :attr:`DataPosition.exact_reason`).
MAX_AHEAD = 8


class DataPosition(PositionCounts):
    """The data position of one training loop (see the module docstring).

    Args:
        device: where the run's tensors live; batches fetched ahead are saved on the
            host and moved back here on resume, and CUDA's generators are saved too.

    Attributes:
        epoch: epochs started by :meth:`epoch_iterator` (0 before the first).
        epochs_done: epochs it iterated to their end: the 0-based index of the epoch in
            progress (a loop that counts its epochs resumes from it).
        fetched_in_epoch: training batches fetched in that epoch.
        fetched_total, trained_total: training batches fetched, and trained on by
            finished windows (or dropped: :meth:`drop`), since the run began (a resumed
            run counts on).
        dropping: training batches the iteration is still to draw and drop
            (:meth:`drop`).
        exact_reason: why a resume from here would not continue exactly, or None.

    .. note:: Per fetch: a grad-mode check, two counter additions and a deque append
       (a reference, no copy), in C (:class:`gpuopt._hotpath.PositionCounts`, its base,
       with :meth:`window_done`: no Python frame on the training thread). Per epoch:
       one :func:`gpuopt.saving.rng_state`. Nothing reads tensor data until
       :meth:`state_dict`. Memory: it keeps the latest batch alive (the loop holds it
       too), and no more until a boundary finds the loop fetched more ahead; then as
       many as it fetched ahead (up to :data:`MAX_AHEAD`): no batch outlives the loop's
       use of it unless a checkpoint would need it (a device batch kept longer is device
       memory the job did not plan for).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.epoch = 0
        self.epochs_done = 0
        self.fetched_in_epoch = 0
        self.fetched_total = 0
        self.trained_total = 0
        self.exact_reason: str | None = None
        self.dropping = 0
        self._epoch_rng: dict[str, Any] | None = None
        #: how many of the latest training batches fetched are kept: as many as a
        #: boundary has found fetched ahead so far (at least 1, at most MAX_AHEAD)
        self._keeping = 1
        self._keeping_most = MAX_AHEAD  # (read by window_done, in C)
        #: those batches: ``(key, batch)``
        self._recent: deque[tuple[str, Any]] = deque(maxlen=self._keeping)
        #: a restored position the iteration has not gone back to yet:
        #: ``(replay, state)`` from :meth:`load_state_dict`
        self._restored: tuple[bool, dict[str, Any]] | None = None
        #: batches fetched ahead that a restored fetch function hands back, oldest first
        self._replay: deque[tuple[str, Any]] = deque()

    # ------------------------------------------------------------ counting

    def fetched(self, batch: Any, key: str = "") -> None:
        """A batch was fetched (``key``: which source, for :meth:`timed_fetch`'s arguments).

        Ignored under ``no_grad`` (an evaluation's fetch)."""
        if torch.is_grad_enabled():
            self._count(batch, key)

    def _keep(self, batches: int) -> None:
        """Keep the latest ``batches`` batches fetched from now on (at most
        :data:`MAX_AHEAD`; never fewer than kept now)."""
        self._keeping = max(self._keeping, min(batches, self._keeping_most))
        self._recent = deque(self._recent, maxlen=self._keeping)

    def epoch_made(self, rng: dict[str, Any]) -> None:
        """A new epoch's iterator was made: count from its first batch, and keep ``rng``.

        Made by :meth:`epoch_iterator` or by a loop that makes its own (a framework's epoch
        loop, which then sets :attr:`fetched_in_epoch` from its own count). ``rng``
        (:func:`gpuopt.saving.rng_state`, taken just before the iterator was made) is what a
        resume makes that epoch's iterator again from."""
        self._epoch_rng = rng
        self.epoch += 1
        self.fetched_in_epoch = 0

    def drop(self, batches: int) -> None:
        """Draw the next ``batches`` training batches and drop them, untrained.

        :meth:`epoch_iterator` (and :meth:`timed_fetch`'s function) draws them from the
        loader, in its order, before the next batch it yields, across epochs as the
        iteration goes on; each counts as fetched and trained (never fetched ahead). A
        loss-spike recovery skips the data that led to it this way."""
        self.dropping += batches

    @property
    def ahead(self) -> int:
        """Training batches fetched but not trained on by a finished window."""
        return max(0, self.fetched_total - self.trained_total)

    # ------------------------------------------------------------ save and restore

    def state_dict(self) -> dict[str, Any]:
        """The position at this boundary: epoch, batches fetched, generators, batches fetched ahead.

        The epoch, batches fetched in it, the generators at its start and now, and the
        batches fetched ahead (tensors moved to the host). Tensors and plain values only
        (``torch.load(..., weights_only=True)``).

        Raises:
            ValueError: more batches are fetched ahead than a position keeps
                (:data:`MAX_AHEAD`), or than it kept before a boundary first found that
                many (a later boundary's checkpoint has them), or a batch fetched ahead is
                not made of tensors, numbers, strings, lists, tuples and dicts.
        """
        ahead = self.ahead
        if ahead > len(self._recent):
            if ahead > MAX_AHEAD:
                raise ValueError(f"{ahead} batches are fetched ahead of this boundary, "
                                 f"more than the {MAX_AHEAD} a checkpoint keeps")
            raise ValueError(
                f"{ahead} batches are fetched ahead of this boundary, and {len(self._recent)} "
                "kept: the data position keeps as many as the loop fetched ahead at an "
                "earlier boundary, and this is the first with so many (a checkpoint at a "
                "later boundary has them)")
        batches = list(self._recent)[len(self._recent) - ahead:] if ahead else []
        return {"epoch": self.epoch, "epochs_done": self.epochs_done,
                "fetched_in_epoch": self.fetched_in_epoch,
                "fetched_total": self.fetched_total, "trained_total": self.trained_total,
                "epoch_rng": self._epoch_rng, "rng": rng_state(self.device),
                "ahead": [(key, _to_host(batch)) for key, batch in batches],
                "dropping": self.dropping}

    def load_state_dict(self, state: dict[str, Any], *, replay: bool = True) -> None:
        """Go back to ``state`` (:meth:`state_dict`'s), before training or in the middle of it.

        In the middle: a rollback. The generators are set to the boundary's now; the batches
        fetched ahead come back first from the next fetch (:meth:`timed_fetch`) or from
        :meth:`epoch_iterator`, which first replays the epoch from its start
        (``replay=False``: a loader that restores its own position, whose next iterator goes
        on from there, is only iterated again)."""
        self.epoch = int(state["epoch"])
        self.epochs_done = int(state.get("epochs_done", self.epoch))
        self.fetched_in_epoch = int(state["fetched_in_epoch"])
        self.fetched_total = int(state["fetched_total"])
        self.trained_total = int(state["trained_total"])
        self.dropping = int(state.get("dropping", 0))
        self._epoch_rng = state["epoch_rng"]
        self._recent.clear()
        self._replay = deque((key, _to_device(batch, self.device))
                             for key, batch in state["ahead"])
        self._keep(len(self._replay))
        for key, batch in self._replay:  # they count as fetched ahead again
            self._recent.append((key, batch))
        self._restored = (replay and self._epoch_rng is not None, state)
        set_rng_state(state["rng"])

    # ------------------------------------------------------------ the loop's data

    def timed_fetch(self, fetch: Callable[..., Any],
                    on_batch: Callable[[Any, float], None] | None = None,
                    clock: Callable[[], float] | None = None) -> Callable[..., Any]:
        """``fetch`` (e.g. nanoGPT's ``get_batch(split)``) with each training call counted.

        After a resume, a call with the same arguments as a batch fetched ahead gets that
        batch back instead of a new one. ``on_batch(batch, wait_s)`` (with ``clock``) times
        each real training call: a call under ``no_grad`` (an evaluation's, e.g. nanoGPT's
        ``estimate_loss()``) is neither counted nor timed. Arguments are told apart by
        ``repr``."""
        now = clock or time.perf_counter

        def counted_fetch(*args: Any, **kwargs: Any) -> Any:
            key = repr((args, sorted(kwargs.items()))) if args or kwargs else ""
            while self.dropping and torch.is_grad_enabled():
                if self._replay and self._replay[0][0] == key:
                    self._replay.popleft()
                else:
                    self._count(fetch(*args, **kwargs), key)
                self._dropped()
            if self._replay and torch.is_grad_enabled() and self._replay[0][0] == key:
                return self._replay.popleft()[1]
            start = now()
            batch = fetch(*args, **kwargs)
            if on_batch is not None and torch.is_grad_enabled():
                on_batch(batch, now() - start)
            self.fetched(batch, key)
            return batch

        return counted_fetch

    def iterate(self, batches: Iterable[Any], epochs: int | None = 1,
                on_batch: Callable[[Any, float], None] | None = None) -> Fetches:
        """``batches`` for ``epochs`` epochs, each batch counted (and timed for ``on_batch``).

        ``epochs`` None: without end; an epoch that yields nothing ends it. Each batch
        fetched is counted whatever the grad mode, and ``on_batch(batch, wait_s)`` is
        called with the host seconds its ``next()`` took (``time.perf_counter``'s clock).
        After :meth:`load_state_dict` (before this call or while it iterates) the first
        epoch is the rest of the saved one: its iterator made again from the generators
        at its start, the batches the saved run fetched dropped, the generators put back
        as at the boundary, the batches fetched ahead (not given to ``on_batch``: their
        fetch was timed before the save), then the epoch's remaining ones. The iteration
        has ``close()``, as a generator has: its next ``next()`` raises StopIteration.

        Raises:
            ValueError: the saved epoch had more batches than ``batches`` has (not the
                same data).

        .. note:: In the steady state (past an epoch's first batch, nothing restored or
           to drop) each fetch runs no Python code besides the iterator's own
           (:class:`gpuopt._hotpath.Fetches`: a frame between real steps costs 0.4 to
           1 us of CPU on the training thread, its caches being cold): two clock reads,
           the count, and ``on_batch`` (a :class:`gpuopt._hotpath.WindowMeter`'s ``add``
           is called without a frame too).
        """
        return Fetches(self, self._iterate(batches, epochs, on_batch), on_batch)

    def _iterate(self, batches: Iterable[Any], epochs: int | None,
                 on_batch: Callable[[Any, float], None] | None
                 ) -> Generator[list[Any], bool | None, None]:
        """What :meth:`iterate`'s :class:`gpuopt._hotpath.Fetches` does not: each epoch's
        start and end, a restored position's replay, the batches to drop. Yields
        ``[batch, iterator]``, the batch counted and timed, ``iterator`` the epoch's when
        the steady state may fetch from it (the list is emptied as it is taken); is sent
        True when that fetching found the epoch's end."""
        now = time.perf_counter
        done = 0
        while epochs is None or done < epochs:
            done += 1
            if self._restored is None:
                rng = rng_state(self.device)
                iterator = iter(batches)
                self.exact_reason = _replay_reason(batches, iterator)
                self.epoch_made(rng)
            yielded = False
            while True:
                if self._restored is not None:
                    iterator = self.replay_epoch(batches)
                    while self._replay and not self.restoring:  # (a rollback may come again)
                        batch = self._replay.popleft()[1]
                        if self.dropping:
                            self._dropped()
                            continue
                        yielded = True
                        yield [batch, None]
                    continue
                try:
                    while self.dropping:  # (nothing of them is timed)
                        self._count(next(iterator))
                        self._dropped()
                    start = now()
                    batch = next(iterator)
                    wait_s = now() - start
                except StopIteration:
                    self.epochs_done += 1
                    break
                self._count(batch)
                if on_batch is not None:
                    on_batch(batch, wait_s)
                yielded = True
                handed = [batch, iterator]
                del batch  # (the list is emptied as it is taken: no batch is kept here)
                if (yield handed):  # (the steady state fetched to the epoch's end)
                    self.epochs_done += 1
                    break
            if not yielded:
                return

    def replay_epoch(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The iterator of ``batches`` where the restored position (:meth:`load_state_dict`) was.

        Made again from the generators at the saved epoch's start, the batches the saved run
        fetched in it dropped, and the generators put back as at the boundary (a position
        restored with ``replay=False``: ``iter(batches)`` as it is). :meth:`epoch_iterator`
        calls it where it goes back (a resume, a rollback); a framework's loop that fetches
        from its own iterator calls it where it would make that iterator.

        Raises:
            ValueError: the saved epoch had more batches than ``batches`` has (not the
                same data), or no restored position is waiting.
        """
        restored, self._restored = self._restored, None
        if restored is None:
            raise ValueError("no restored position to replay: load_state_dict(state) "
                             "first, with an epoch's start in it")
        replay, state = restored
        if not replay:
            return iter(batches)
        set_rng_state(state["epoch_rng"])
        iterator = iter(batches)
        try:
            for _ in range(self.fetched_in_epoch):
                next(iterator)
        except StopIteration:
            raise ValueError(
                f"the checkpoint's epoch {self.epoch} had {self.fetched_in_epoch} "
                "batches fetched, more than this data has: is it the same data "
                "set?") from None
        set_rng_state(state["rng"])
        return iterator

    def epoch_iterator(self, batches: Iterable[Any],
                       on_batch: Callable[[Any, float], None] | None = None) -> Fetches:
        """One epoch of ``batches``: :meth:`iterate` for one epoch (see it).

        Raises:
            ValueError: the saved epoch had more batches than ``batches`` has (not the
                same data).
        """
        return self.iterate(batches, 1, on_batch)

    def _dropped(self) -> None:
        """One batch of :meth:`drop`'s, fetched (counted already), dropped."""
        self.dropping -= 1
        self.trained_total += 1

    @property
    def restoring(self) -> bool:
        """Whether a restored position waits for the iteration to go back to it."""
        return self._restored is not None


def _replay_reason(batches: Iterable[Any], iterator: Iterator[Any]) -> str | None:
    """Why an epoch of ``batches`` cannot be made again exactly by a resume, or None."""
    if iterator is batches:
        return (f"the batches come from a one-shot iterator ({type(batches).__name__}), "
                "which a resume cannot make again: pass the loader (or a re-iterable) "
                "instead")
    dataset = getattr(batches, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return (f"the data set is an IterableDataset ({type(dataset).__name__}): a resume "
                "makes the epoch again and drops the batches already trained, which is "
                "the same data only if it yields the same batches again")
    return None


def _to_host(batch: Any) -> Any:
    """``batch`` with every tensor on the host (lists, tuples and dicts walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_host(item) for item in batch) if type(batch) in (list, tuple) \
            else [_to_host(item) for item in batch]
    if isinstance(batch, dict):
        return {key: _to_host(value) for key, value in batch.items()}
    if batch is None or isinstance(batch, (int, float, str, bool)):
        return batch
    raise ValueError(f"a batch fetched ahead of the boundary is a {type(batch).__name__}, "
                     "which a checkpoint cannot keep (tensors, numbers, strings, lists, "
                     "tuples and dicts can be)")


def _to_device(batch: Any, device: torch.device | None) -> Any:
    """``batch`` with every tensor moved to ``device`` (the host: left as it is)."""
    if device is None or device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    return batch
