"""Where a dashboard's records come from: a live run (:mod:`gpuwatch.sources.live`) or
a run log (:mod:`gpuwatch.sources.replay`). A source owns its thread and folds records
into its :class:`~gpuwatch.state.RunState` under :attr:`Source.lock`; the app only
reads."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

from agent.runs import RunInfo
from gpuwatch.state import RunState


class Source(ABC):
    """The small interface the app needs from a source of records.

    Attributes:
        state: the run as folded so far; read it while holding ``lock``.
        lock: guards ``state`` between the source's thread and the app.
        info: the run to send commands to, or None when this source takes none.
        description: what is being watched, for people ("run abc at ipc://...").
    """

    def __init__(self, info: RunInfo | None, description: str) -> None:
        self.state = RunState()
        self.lock = threading.Lock()
        self.info = info
        self.description = description

    @abstractmethod
    def start(self) -> None:
        """Start delivering records (returns at once; the work runs in a thread)."""

    @abstractmethod
    def close(self) -> None:
        """Stop delivering records and release the thread and its resources."""
