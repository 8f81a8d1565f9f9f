"""Datasets for the demo workloads: real text and real images, both shipped with Python.

Nothing is downloaded. The text is the English documentation that Python itself ships
(:mod:`pydoc_data.topics`, about 465 thousand characters on CPython 3.11); the images are
scikit-learn's ``load_digits`` (1,797 handwritten 8x8 digits, 16 grey levels).

Two datasets:

* :class:`CharTextDataset` -- next-character prediction windows ``(input ids [T],
  target ids [T])``, built by :func:`char_text_dataset`.
* :class:`DigitsDataset` -- ``(image [1, H, W] float32 in [0, 1], label)``, built by
  :func:`digits_dataset`, with a pluggable per-sample ``transform`` (CPU augmentation).

Both are deterministic: the same arguments and seed give the same samples in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

__all__ = [
    "CharVocabulary",
    "CharTextDataset",
    "DigitsDataset",
    "char_text_dataset",
    "digits_dataset",
    "pydoc_text",
]

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# --------------------------------------------------------------------------------------
# Character-level text
# --------------------------------------------------------------------------------------


def pydoc_text() -> str:
    """The English text of Python's documentation topics, as one string.

    The values of :data:`pydoc_data.topics.topics` (a dict in the standard library)
    joined in sorted key order. The text differs between Python versions, so the
    vocabulary derived from it (:class:`CharVocabulary`) can differ too.

    Returns:
        The text; about 465,000 characters on CPython 3.11.
    """
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


@dataclass(frozen=True)
class CharVocabulary:
    """A character vocabulary: token id ``i`` is the character ``chars[i]``.

    Built from the sorted set of characters of a text (about 100 for the pydoc text:
    printable ASCII, newline and a few typographic characters such as curly quotes),
    as in char-rnn and nanoGPT's ``shakespeare_char``. Every character of that text has
    an id; characters outside it cannot be encoded.

    Attributes:
        chars: The characters, sorted by code point, without repeats.
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocabulary:
        """The vocabulary of every distinct character of ``text``, sorted by code point."""
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``.

        Returns:
            LongTensor ``[len(text)]``.

        Raises:
            KeyError: ``text`` holds a character outside the vocabulary.
        """
        index = {char: i for i, char in enumerate(self.chars)}
        return torch.tensor([index[char] for char in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a 1-D sequence of token ids (a list or a LongTensor ``[T]``)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class CharTextDataset(Dataset):
    """Next-character windows over a token stream.

    Sample ``i`` is the window that starts at ``offsets[i]``: ``input ids =
    tokens[o : o + T]`` and ``target ids = tokens[o + 1 : o + T + 1]`` (the input shifted
    by one character), both LongTensor ``[T]`` with ``T = context_len``. Windows are
    views of one shared tensor, so a sample costs no copy and no Python loop.

    Args:
        tokens: LongTensor ``[N]`` of token ids, ``N >= context_len + 1``.
        context_len: Window length ``T`` in tokens, ``>= 1``.
        offsets: LongTensor ``[num_windows]`` of window starts, each in
            ``[0, N - T - 1]``. Build them with :meth:`strided_offsets` or
            :meth:`random_offsets`.
        vocab: The vocabulary the ids come from (kept for decoding and its size).

    Raises:
        ValueError: ``context_len < 1``, the stream is shorter than one window plus its
            target, or an offset would read past the end of the stream.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        context_len: int,
        offsets: torch.Tensor,
        vocab: CharVocabulary,
    ) -> None:
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        if tokens.dim() != 1 or tokens.numel() < context_len + 1:
            raise ValueError(
                f"tokens must be a 1-D stream of at least context_len + 1 = {context_len + 1}"
                f" ids, got shape {tuple(tokens.shape)}"
            )
        max_offset = tokens.numel() - context_len - 1
        if offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) > max_offset):
            raise ValueError(f"offsets must lie in [0, {max_offset}] for this stream")
        self.tokens = tokens.to(torch.long)
        self.context_len = context_len
        self.offsets = offsets.to(torch.long)
        self.vocab = vocab

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids ``V``."""
        return len(self.vocab)

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        window = self.tokens[start : start + self.context_len + 1]
        return window[:-1], window[1:]

    @staticmethod
    def strided_offsets(num_tokens: int, context_len: int) -> torch.Tensor:
        """Starts of non-overlapping windows ``0, T, 2T, ...`` that fit in the stream.

        Returns:
            LongTensor ``[(num_tokens - 1) // context_len]``.
        """
        count = (num_tokens - 1) // context_len
        return torch.arange(count, dtype=torch.long) * context_len

    @staticmethod
    def random_offsets(
        num_tokens: int, context_len: int, num_windows: int, seed: int
    ) -> torch.Tensor:
        """``num_windows`` window starts drawn uniformly from the stream, from ``seed``.

        Uses its own :class:`torch.Generator`, so the global RNG is untouched and the
        same ``seed`` always gives the same offsets.

        Returns:
            LongTensor ``[num_windows]`` of starts in ``[0, num_tokens - context_len - 1]``.

        Raises:
            ValueError: the stream is shorter than ``context_len + 1`` tokens.
        """
        high = num_tokens - context_len  # exclusive bound: start + T + 1 <= num_tokens
        if high < 1:
            raise ValueError(
                f"a stream of {num_tokens} tokens holds no window of {context_len} + 1 tokens"
            )
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, high, (num_windows,), generator=generator, dtype=torch.long)


def char_text_dataset(
    context_len: int = 64,
    *,
    split: str = "train",
    seed: int = 0,
    val_fraction: float = 0.05,
    num_windows: int | None = None,
) -> CharTextDataset:
    """Character-level language modelling windows over Python's documentation text.

    The text (:func:`pydoc_text`) is encoded with the vocabulary of all its characters
    (:class:`CharVocabulary`, the same for both splits) and cut in two: the first
    ``1 - val_fraction`` of the characters train, the last ``val_fraction`` validate.

    * ``split="train"``: ``num_windows`` windows at random offsets drawn from ``seed``;
      by default as many as non-overlapping windows would fit (one pass over the text
      is about one epoch, ~6,900 windows for ``T = 64``). Windows may overlap.
    * ``split="val"``: non-overlapping windows from the start of the held-out text, in
      order; ``seed`` and ``num_windows`` are ignored.

    Args:
        context_len: Window length ``T`` in characters.
        split: ``"train"`` or ``"val"``.
        seed: Seed of the training window offsets.
        val_fraction: Share of the text held out for validation, in ``(0, 1)``.
        num_windows: Number of training windows; ``None`` for one epoch's worth.

    Returns:
        A :class:`CharTextDataset` of ``(input ids LongTensor [T], target ids
        LongTensor [T])``; ``dataset.vocab_size`` is ``V``.

    Raises:
        ValueError: unknown ``split``, ``context_len < 1``, ``val_fraction`` outside
            ``(0, 1)``, or a ``context_len`` too long for the chosen part of the text.
    """
    _check_split(split)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = pydoc_text()
    vocab = CharVocabulary.from_text(text)
    tokens = vocab.encode(text)
    split_at = int(round(tokens.numel() * (1.0 - val_fraction)))
    if split == "train":
        part = tokens[:split_at]
        if num_windows is None:
            num_windows = (part.numel() - 1) // context_len
        offsets = CharTextDataset.random_offsets(part.numel(), context_len, num_windows, seed)
    else:
        part = tokens[split_at:]
        offsets = CharTextDataset.strided_offsets(part.numel(), context_len)
    return CharTextDataset(part, context_len, offsets, vocab)


# --------------------------------------------------------------------------------------
# Handwritten digits
# --------------------------------------------------------------------------------------

Transform = Callable[[torch.Tensor], torch.Tensor]


class DigitsDataset(Dataset):
    """Images and labels held in memory, with an optional per-sample transform.

    Sample ``i`` is ``(transform(images[i]), labels[i])``: a float32 tensor
    ``[1, H, W]`` with values in ``[0, 1]`` and a 0-dim LongTensor (class ``0..9``). The
    transform runs in :meth:`__getitem__`, i.e. on the CPU in the DataLoader's worker
    processes, which is where data-loading work (augmentation) belongs.

    Args:
        images: float32 ``[N, 1, H, W]`` in ``[0, 1]``.
        labels: LongTensor ``[N]``.
        transform: Callable from an image ``[1, H, W]`` to an image, or ``None``.
            Must be picklable (a module-level function or class instance) for
            ``num_workers > 0``.

    Raises:
        ValueError: images and labels differ in length or images are not ``[N, 1, H, W]``.
    """

    num_classes = 10

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        transform: Transform | None = None,
    ) -> None:
        if images.dim() != 4 or images.shape[1] != 1:
            raise ValueError(f"images must be [N, 1, H, W], got {tuple(images.shape)}")
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{images.shape[0]} images but {labels.shape[0]} labels; they must match"
            )
        self.images = images
        self.labels = labels.to(torch.long)
        self.transform = transform

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]


def digits_dataset(
    *,
    split: str = "train",
    image_size: int = 16,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    transform: Transform | None = None,
) -> DigitsDataset:
    """scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped with the package).

    Pixel values ``0..16`` are divided by 16 into ``[0, 1]``. By default each image is
    upsampled bilinearly to 16x16 (``image_size=16``), so that the demo CNN's two 2x2
    poolings leave a 4x4 map instead of 2x2 and each step does a more realistic amount
    of convolution; pass ``image_size=8`` for the original pixels.

    The train/validation split is stratified by class and fixed by ``split_seed``
    (default: 1,437 train, 360 validation images), so it does not change with the
    training seed.

    Args:
        split: ``"train"`` or ``"val"``.
        image_size: Side ``H = W`` of the returned images in pixels, ``>= 8``.
        val_fraction: Share of images held out for validation, in ``(0, 1)``.
        split_seed: Seed of the train/validation split.
        transform: Per-sample transform, see :class:`DigitsDataset`.

    Returns:
        A :class:`DigitsDataset` of ``(float32 [1, image_size, image_size], long label)``.

    Raises:
        ValueError: unknown ``split``, ``image_size < 8`` or ``val_fraction`` outside
            ``(0, 1)``.
    """
    _check_split(split)
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 pixels, got {image_size}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = list(range(len(digits.target)))
    train_idx, val_idx = train_test_split(
        indices, test_size=val_fraction, stratify=digits.target, random_state=split_seed
    )
    chosen = sorted(train_idx if split == "train" else val_idx)
    images = torch.tensor(digits.images[chosen], dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        images = torch.nn.functional.interpolate(
            images, size=(image_size, image_size), mode="bilinear", align_corners=False
        ).clamp_(0.0, 1.0)
    labels = torch.tensor(digits.target[chosen], dtype=torch.long)
    return DigitsDataset(images, labels, transform=transform)
