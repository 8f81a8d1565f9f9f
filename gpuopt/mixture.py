"""A weighted mixture of datasets whose weights can change between two optimizer steps.

:class:`MixtureLoader` draws each sample of an epoch from one of several map-style
datasets, chosen with the current weights (a multinomial draw, with replacement, as
``torch.utils.data.WeightedRandomSampler`` over the datasets); within a dataset it walks
that dataset's own seeded permutation, without replacement, starting a new permutation
when the epoch has drawn all of it. :meth:`MixtureLoader.set_weights` changes the
weights from the first sample not yet handed out: the rest of the epoch is drawn again
with the new weights, the samples already handed out stay as they were.

Every draw is a function of the seed, the epoch and the epoch's weight changes (where
each began, in samples, and its weights): nothing else. So the position
:meth:`MixtureLoader.save_position` gives (the base loader's, with the epoch's weight
changes) puts a fresh loader over the same datasets back on the same samples, bit for
bit, for a resume from a checkpoint and for a rollback alike; and every rank of a
data-parallel job, at the same batch of the epoch, draws the same global sequence and
takes its own share of it.

The loader is a :class:`gpuopt.loader.ReconfigurableLoader` over the datasets'
concatenation, so its workers, pinning, prefetching and batch size change mid-epoch as
that one's do.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch
from torch.utils.data import ConcatDataset, Dataset

from gpuopt.loader import ReconfigurableLoader

__all__ = ["MAX_DATASETS", "MixtureLoader", "check_weights"]

#: The most datasets one mixture holds (and weights one command carries).
MAX_DATASETS = 64


def check_weights(weights: Any, count: int) -> tuple[float, ...]:
    """``weights`` as ``count`` floats that sum to 1 (each divided by their sum).

    Raises:
        ValueError: not a sequence of ``count`` finite numbers >= 0 with a sum above 0
            (the message says which and shows the value).
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"mixture weights must be a sequence of numbers, got {weights!r}")
    if len(weights) != count:
        raise ValueError(f"this mixture has {count} datasets, got {len(weights)} weights "
                         f"({', '.join(map(str, weights[:MAX_DATASETS]))})")
    values = []
    for weight in weights:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
                or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mixture weights must be finite numbers >= 0, got {weight!r}")
        values.append(float(weight))
    total = math.fsum(values)
    if total <= 0:
        raise ValueError("mixture weights are all 0: no dataset to draw from")
    return tuple(value / total for value in values)


def _seed_of(*parts: int) -> int:
    """A generator seed from integers (Python's hash of a tuple of ints is the same in
    every process)."""
    return hash(parts) & (2 ** 63 - 1)


class MixtureLoader(ReconfigurableLoader):
    """Batches drawn from several map-style datasets in proportion to live weights.

    Epoch ``e`` holds as many samples as the datasets together (``len(loader.dataset)``,
    their :class:`torch.utils.data.ConcatDataset`), split across ranks as
    :class:`~gpuopt.loader.ReconfigurableLoader` splits an epoch. Its global sequence is
    drawn in segments, one per weight change in the epoch: the segment that begins at
    global sample ``s`` picks each sample's dataset with ``torch.multinomial(weights,
    replacement=True)`` from a generator seeded with ``(seed, e, s)``; the ``k``-th
    sample the epoch takes from dataset ``d`` is element ``k mod len(d)`` of permutation
    ``k // len(d)`` of ``d`` (seeded with ``(seed, e, d, that number)``; the identity
    without ``shuffle``). A batch is a collated list of the datasets' samples.

    Args:
        datasets: the map-style datasets, 1 to :data:`MAX_DATASETS`, each with at least
            one sample.
        weights: one number >= 0 per dataset, not all 0 (normalised to sum 1).
        batch_size: samples per batch.
        seed: base of every draw; must be the same on every rank.
        shuffle: walk each dataset in a seeded permutation (else in its order).
        options: the rest of :class:`~gpuopt.loader.ReconfigurableLoader`'s arguments
            (``num_workers``, ``drop_last``, ``num_replicas``, ``rank``...).

    Raises:
        ValueError: no dataset or more than :data:`MAX_DATASETS`, an empty one, weights
            :func:`check_weights` refuses, or a setting the base loader refuses.

    .. note:: Each epoch's draw, and each weight change's, is one pass over the
       epoch's indices on the calling thread (a multinomial draw, a stable sort, a
       permutation per dataset): for an epoch of a million samples, measured 0.4-0.8 s
       over two datasets and 1.7 s over ten on a 2-core CPU at a load average of 10.
       Nothing per batch beyond the base loader's.
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float],
                 batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 **options: Any) -> None:
        if not 1 <= len(datasets) <= MAX_DATASETS:
            raise ValueError(f"a mixture takes 1 to {MAX_DATASETS} datasets, "
                             f"got {len(datasets)}")
        lengths = [len(dataset) for dataset in datasets]  # type: ignore[arg-type]
        if min(lengths) == 0:
            raise ValueError(f"dataset {lengths.index(0)} of the mixture is empty")
        self.datasets = list(datasets)
        self.dataset_lengths = lengths
        self._weights = check_weights(weights, len(datasets))
        #: the current epoch's weight changes: (first global sample, weights)
        self._segments: list[tuple[int, tuple[float, ...]]] = [(0, self._weights)]
        super().__init__(ConcatDataset(self.datasets), batch_size, seed=seed,
                         shuffle=shuffle, **options)

    @property
    def weights(self) -> tuple[float, ...]:
        """The weights the next samples are drawn with (one per dataset, sum 1)."""
        return self._weights

    def set_weights(self, weights: Sequence[float]) -> None:
        """Draw the samples not yet handed out with ``weights``, from the next one on.

        ``weights``: one per dataset, >= 0, not all 0 (normalised). The rest of the
        epoch is drawn again, and later epochs start with them. Call it between two
        batches (at an optimizer-step boundary) on the thread that iterates; every rank
        must call it at the same batch of the epoch. Batches loaded ahead are dropped
        and loaded again from the new draw (persistent workers are restarted).

        Raises:
            ValueError: weights :func:`check_weights` refuses; nothing changes.
        """
        normalised = check_weights(weights, len(self.datasets))
        with self._lock:
            if normalised == self._weights:
                return
            self._weights = normalised
            if self._yielded >= self._batches_per_epoch:
                return  # the next epoch starts with them
            start = self._first_sample(self._yielded) * self.num_replicas
            self._segments = [segment for segment in self._segments
                              if segment[0] < start] + [(start, normalised)]
            self._redraw()

    def save_position(self) -> dict[str, Any]:
        """The base loader's position, with the weights and the epoch's weight changes.

        Under ``mixture``: :meth:`restore_position` in a fresh loader over the same
        datasets goes on with the same samples."""
        with self._lock:
            return {**super().save_position(), "mixture": {
                "weights": list(self._weights),
                "segments": [[start, list(weights)] for start, weights in self._segments]}}

    def restore_position(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (:meth:`save_position`'s), with the saving loader's draw.

        The base loader's position, the weights and the epoch's weight changes are put
        back, so the next samples are the ones the saving loader would have given.

        Raises:
            ValueError: a position of another loader (no ``mixture``, or weights for
                another number of datasets), weight changes that do not cover the epoch
                (the first not at sample 0, starts not rising strictly below the epoch's
                samples, not whole numbers, more than the epoch's samples), or one the
                base loader refuses. The message says which; nothing changes.
        """
        mixture = state.get("mixture")
        if not isinstance(mixture, dict):
            raise ValueError("the position is not a MixtureLoader's (it has no mixture "
                             "weights): its samples would differ")
        count = len(self.datasets)
        weights = check_weights(mixture.get("weights"), count)
        segments = self._check_segments(mixture.get("segments"))
        with self._lock:
            super().restore_position(state)
            self._weights, self._segments = weights, segments
            self._redraw()

    # ----------------------------------------------------------------- internals

    def _check_segments(self, segments: Any) -> list[tuple[int, tuple[float, ...]]]:
        """A position's weight changes (``[[first global sample, weights], ...]``) as
        :attr:`_segments`, once they could be this loader's.

        Raises:
            ValueError: not a list of 1 to (the epoch's samples) pairs; a start that is
                not a whole number, or starts that do not begin at 0 and rise strictly
                below the epoch's samples (the draw would leave samples of the epoch
                undrawn, or draw them twice); weights :func:`check_weights` refuses.
                The message says which.
        """
        total = self._samples_per_rank * self.num_replicas
        if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) \
                or not 1 <= len(segments) <= total:
            raise ValueError(f"the position's mixture segments must be a list of 1 to "
                             f"{total} (the epoch's samples) weight changes, got "
                             f"{type(segments).__name__} of "
                             f"{len(segments) if isinstance(segments, Sequence) else '?'}")
        checked: list[tuple[int, tuple[float, ...]]] = []
        for segment in segments:
            if isinstance(segment, (str, bytes)) or not isinstance(segment, Sequence) \
                    or len(segment) != 2:
                raise ValueError(f"a mixture segment must be [first sample, weights], "
                                 f"got {str(segment)[:80]!r}")
            first, weights = segment
            if isinstance(first, bool) or not isinstance(first, numbers.Integral):
                raise ValueError(f"a mixture segment's first sample must be a whole "
                                 f"number, got {str(first)[:40]!r}")
            start = int(first)
            if not checked and start != 0:
                raise ValueError(f"the first mixture segment must start at sample 0, "
                                 f"got {start}: the epoch's first samples would "
                                 "not be drawn")
            if checked and not checked[-1][0] < start < total:
                raise ValueError(f"the mixture segments' starts must rise strictly below "
                                 f"the epoch's {total} samples, got {start} after "
                                 f"{checked[-1][0]}: the epoch would not be drawn once")
            checked.append((start, check_weights(weights, len(self.datasets))))
        return checked

    def _move_to_epoch(self, epoch: int) -> None:
        self._segments = [(0, self._weights)]
        super()._move_to_epoch(epoch)

    def _redraw(self) -> None:
        """The epoch's shard drawn again from :attr:`_segments`; the batches loaded
        ahead are dropped with the workers (the next batch starts new ones on the new
        shard: a change of weights is rare, a pool's start is tens of ms)."""
        self._close_inner()
        self._shard = self._epoch_shard(self._epoch)

    def _epoch_shard(self, epoch: int) -> torch.Tensor:
        """This rank's share of the epoch's global sequence of concatenated indices."""
        total = self._samples_per_rank * self.num_replicas
        bounds = [start for start, _ in self._segments] + [total]
        choices = torch.cat([
            torch.multinomial(torch.tensor(weights, dtype=torch.float64), end - start,
                              replacement=True,
                              generator=torch.Generator().manual_seed(
                                  _seed_of(self.seed, epoch, start)))
            if end > start else torch.empty(0, dtype=torch.int64)
            for (start, weights), end in zip(self._segments, bounds[1:])])
        indices = torch.empty(total, dtype=torch.int64)
        # each dataset's draws, in the order drawn (one stable sort, then a slice each)
        by_dataset = torch.argsort(choices, stable=True).split(
            torch.bincount(choices, minlength=len(self.datasets)).tolist())
        offset = 0
        for number, (length, taken) in enumerate(zip(self.dataset_lengths, by_dataset)):
            passes = math.ceil(len(taken) / length)
            order = torch.cat([
                torch.randperm(length, generator=torch.Generator().manual_seed(
                    _seed_of(self.seed, epoch, -1 - number, walk)))
                if self.shuffle else torch.arange(length) for walk in range(passes)]
            ) if passes else torch.empty(0, dtype=torch.int64)
            indices[taken] = order[:len(taken)] + offset
            offset += length
        return indices[self.rank:total:self.num_replicas].clone()

