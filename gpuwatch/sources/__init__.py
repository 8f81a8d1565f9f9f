"""Where a dashboard's records come from: a live run or a run log.

A live run: :mod:`gpuwatch.sources.live`; a run log: :mod:`gpuwatch.sources.replay`. A
source owns its thread and folds records into its :class:`~gpuwatch.state.RunState` under
:attr:`Source.lock`; the app only reads."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

from agent.wire.runs import RunInfo
from gpuwatch.sources.whole_run import WholeRun
from gpuwatch.state import RunState


class Source(ABC):
    """The small interface the app needs from a source of records: a thread folding into a state.

    A daemon thread that folds records into :attr:`state`, started by :meth:`start` and
    stopped by :meth:`close`. Subclasses implement :meth:`_run`, which must return soon
    after :attr:`_stop` is set (within ``poll_s``).

    Attributes:
        state: the run as folded so far; read it while holding ``lock``.
        lock: guards ``state`` between the source's thread and the app.
        info: the run to send commands to, or None when this source takes none.
        description: what is being watched, for people ("run abc at ipc://...").
        whole: the whole run read from its log, for the charts (None: none to read);
            started with the source and closed with it.
    """

    def __init__(self, info: RunInfo | None, description: str, *, poll_s: float) -> None:
        self.state = RunState()
        self.lock = threading.Lock()
        self.info = info
        self.description = description
        self.whole: WholeRun | None = None
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gpuwatch-{type(self).__name__}")

    def now(self) -> float:
        """The time the state is shown at, on the clock its records were folded with.

        The monotonic clock (s) for a run being watched; a timeline's own."""
        return time.monotonic()

    def start(self) -> None:
        """Start delivering records, and reading :attr:`whole` if there is one; returns at once.

        The work runs in the thread."""
        self._thread.start()
        if self.whole is not None:
            self.whole.start()

    def close(self) -> None:
        """Stop the threads; returns within about ``poll_s`` seconds."""
        self._stop.set()
        if self.whole is not None:
            self.whole.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._poll_s + 1.0)

    @abstractmethod
    def _run(self) -> None:
        """The thread's work: fold records into :attr:`state` until :attr:`_stop`."""
