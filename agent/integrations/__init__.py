"""Attaching the agent to the training code people already have.

One module per framework, each imported only when used (``import agent`` imports none of
them, and no framework is a dependency of gpuwatch):

- :mod:`agent.integrations.lightning`: ``lightning.pytorch.Trainer``
- :mod:`agent.integrations.hf`: ``transformers.Trainer``
- :mod:`agent.integrations.accelerate`: hand-written loops on ``accelerate.Accelerator``
- :mod:`agent.integrations.fabric`: loops on Lightning Fabric (``lightning.fabric.Fabric``)

:func:`agent.attach` picks the module from the type of what it is given
(:func:`integration_for`). What they share lives here: the count of an accumulation
window's data wait, micro-batches, samples and tokens (:class:`WindowMeter`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable

_now = time.perf_counter

#: ``(module prefix of a class in the object's MRO, class name, integration module)``.
_INTEGRATIONS = (
    ("lightning.pytorch.trainer", "Trainer", "agent.integrations.lightning"),
    ("pytorch_lightning.trainer", "Trainer", "agent.integrations.lightning"),
    ("transformers.trainer", "Trainer", "agent.integrations.hf"),
    ("accelerate.accelerator", "Accelerator", "agent.integrations.accelerate"),
    ("lightning.fabric.fabric", "Fabric", "agent.integrations.fabric"),
)


def integration_for(obj: Any) -> str | None:
    """The integration module for ``obj``, or None when no integration knows it.

    Found by the classes in its type's MRO, without importing any framework."""
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", "") or ""
        for prefix, name, integration in _INTEGRATIONS:
            if cls.__name__ == name and module.startswith(prefix):
                return integration
    return None


class WindowMeter:
    """What the accumulation window in progress fetched: data wait, micro-batches, samples, tokens.

    Data wait: host seconds inside the fetch of each micro-batch. Tokens: from shapes
    only, ``samples * tokens_per_sample`` when declared, else the number of elements of a
    mapping's ``input_ids`` (as Hugging Face batches have; padding included, as
    ``transformers.Trainer``'s ``num_input_tokens_seen``), else none (:attr:`tokens`
    stays None).

    Args:
        count_samples: ``batch -> samples`` (e.g. :func:`gpuopt.data.batch_size`: dim 0
            of the first tensor).
        tokens_per_sample: tokens in one sample, for token models whose batches carry no
            ``input_ids``; None to count from ``input_ids``.

    .. note:: :meth:`add` costs a few hundred nanoseconds on the host; nothing reads
       tensor data.
    """

    __slots__ = ("count_samples", "tokens_per_sample", "data_wait_s", "fetched", "samples",
                 "tokens")

    def __init__(self, count_samples: Callable[[Any], int],
                 tokens_per_sample: int | None = None) -> None:
        if tokens_per_sample is not None and (
                isinstance(tokens_per_sample, bool) or not isinstance(tokens_per_sample, int)
                or tokens_per_sample < 1):
            raise ValueError(f"tokens_per_sample must be an integer >= 1, got "
                             f"{tokens_per_sample!r}")
        self.count_samples = count_samples
        self.tokens_per_sample = tokens_per_sample
        self.data_wait_s = 0.0
        self.fetched = 0
        self.samples = 0
        self.tokens: int | None = None

    def add(self, batch: Any, wait_s: float) -> None:
        """Count one fetched micro-batch that took ``wait_s`` seconds to arrive."""
        samples = self.count_samples(batch)
        self.data_wait_s += wait_s
        self.fetched += 1
        self.samples += samples
        if self.tokens_per_sample is not None:
            tokens = samples * self.tokens_per_sample
        elif type(batch) is tuple or type(batch) is list or not isinstance(batch, Mapping):
            return  # (the common batch, a tuple or list, has no input_ids)
        else:
            numel = getattr(batch.get("input_ids"), "numel", None)
            if numel is None:
                return
            tokens = int(numel())
        self.tokens = tokens if self.tokens is None else self.tokens + tokens

    def timed_next(self, iterator: Any) -> Any:
        """``next(iterator)``, timed and counted (StopIteration passes through)."""
        start = _now()
        batch = next(iterator)
        self.add(batch, _now() - start)
        return batch

    def take(self) -> tuple[float, int, int, int | None]:
        """``(data_wait_s, fetched, samples, tokens)`` of the window that just ended.

        And a fresh start for the next one."""
        window = (self.data_wait_s, self.fetched, self.samples, self.tokens)
        self.data_wait_s, self.fetched, self.samples, self.tokens = 0.0, 0, 0, None
        return window
