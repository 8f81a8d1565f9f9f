"""Types of :mod:`gpuopt._hotpath` (gpuopt/_hotpath.c): the per-fetch counting in C."""

from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

class PositionCounts:
    fetched_in_epoch: int
    fetched_total: int
    trained_total: int
    dropping: int
    _keeping: int
    _keeping_most: int
    _recent: deque[tuple[str, Any]]
    _restored: tuple[bool, dict[str, Any]] | None
    def _count(self, batch: Any, key: str = "") -> None: ...
    def window_done(self, micro_batches: int) -> None: ...
    def _keep(self, batches: int) -> None: ...

class WindowMeter:
    count_samples: Callable[[Any], int]
    tokens_per_sample: int | None
    data_wait_s: float
    fetched: int
    samples: int
    tokens: int | None
    def __init__(self, count_samples: Callable[[Any], int],
                 tokens_per_sample: int | None = None) -> None: ...
    def add(self, batch: Any, wait_s: float) -> None: ...
    def timed_next(self, iterator: Iterator[Any]) -> Any: ...
    def take(self) -> tuple[float, int, int, int | None]: ...

class Fetches(Iterator[Any]):
    def __init__(self, position: PositionCounts,
                 slow: Generator[list[Any], bool | None, None],
                 on_batch: Callable[[Any, float], None] | None = None) -> None: ...
    def __next__(self) -> Any: ...
    def close(self) -> None: ...

def _direct_dim0(tensor: object) -> int | None: ...
def _tensor_layout() -> tuple[int, int, int] | None: ...
