"""Types of :mod:`agent.step._hot` (agent/step/_hot.c): the agent's hot path in C."""

from collections import deque
from collections.abc import Callable
from typing import Any, Self

import torch

class StepRecord:
    micro_batches: int
    samples: int
    data_wait_s: float
    loss: torch.Tensor | None
    skipped: torch.Tensor | None
    activation_bytes: int | None
    tokens: int | None
    lr: float | tuple[Any, ...] | None
    grad_norm: torch.Tensor | float | None
    step: int
    step_time_s: float | None
    marker: Any
    knobs: dict[str, Any] | None
    def __init__(self, micro_batches: int, samples: int, data_wait_s: float,
                 loss: torch.Tensor | None = None, skipped: torch.Tensor | None = None,
                 activation_bytes: int | None = None, tokens: int | None = None,
                 lr: float | tuple[Any, ...] | None = None,
                 grad_norm: torch.Tensor | float | None = None, step: int = 0,
                 step_time_s: float | None = None, marker: Any = None,
                 knobs: dict[str, Any] | None = None) -> None: ...

def define(doc: str) -> type[StepRecord]: ...

def host_mark(loss: Any, skipped: Any = None, grad_norm: Any = None) -> Any: ...

class HotPath:
    _broken: bool
    _marks_on_host: bool
    _held_max: int
    _queue_size: int
    _last_boundary_t: float | None
    _records: deque[StepRecord]
    _marker: Any
    _knob_values: dict[str, Any]
    _last_step: int
    _listeners: tuple[Any, ...]
    _pending: list[Any]
    def optimizer_step(self, record: StepRecord) -> None: ...
    def mark_start(self) -> None: ...

def columns(records: list[StepRecord], names: tuple[str, ...]) -> tuple[list[Any], ...]: ...

class StepsBatch:
    n: int
    def __init__(self, packb: Callable[[Any], bytes],
                 plain: Callable[[Any], bytes] | None = None) -> None: ...
    def add_rows(self, columns: tuple[list[Any], ...]) -> None: ...
    def add_run(self, records: list[StepRecord], losses: list[Any], grad_norms: list[Any],
                gpu_times: list[Any], window: ShareWindow, skipped_total: int
                ) -> tuple[int, int, float | None] | None: ...
    def take(self, head: dict[str, Any], common: dict[str, Any]) -> bytes: ...
    def clear(self) -> None: ...
    def packed_columns(self) -> tuple[dict[str, bytes], list[Any]]: ...

class ShareWindow:
    def __new__(cls, steps: int, bounds: tuple[float, float],
                verdicts: tuple[str, str, str]) -> Self: ...
    def add(self, data_wait_s: float, step_time_s: float) -> tuple[float, str]: ...
    def add_many(self, waits: list[float], times: list[float]
                 ) -> tuple[list[float], list[str]]: ...

class RunPath:
    broken: bool
    _pause_requested: bool
    _recovering: bool
    _window_of_scaler: bool
    _next_window_due: bool
    step: int
    agent: Any
    position: Any
    meter: Any
    _micro_batches_trained: int
    _kept: tuple[int, Any, int] | None
    _lr_back: tuple[int, float] | None
    event_sources: list[Callable[[], list[tuple[str, str, dict[str, Any]]]]]
    memory: Any
    optimizer_settings: Any
    _windows_off: int | None
    _accum_steps: int | None
    scaler: Any
    _activation_bytes: int | None
    def boundary(self, record: StepRecord) -> None: ...
    def _loop_optimizer_step(self, loss: torch.Tensor | None = None, samples: int | None = None,
                             tokens: int | None = None, skipped: torch.Tensor | None = None,
                             grad_norm: torch.Tensor | float | None = None,
                             activation_bytes: int | None = None) -> None: ...
