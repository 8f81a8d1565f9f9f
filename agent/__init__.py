"""The in-process gpuwatch agent: measures every optimizer step and takes live commands.

``agent.attach(trainer)`` for a :class:`gpuopt.Trainer`; ``agent.session(...)`` for a
hand-written loop. Importing :mod:`agent` itself is light (no torch): the dashboard
imports :mod:`agent.protocol` and :mod:`agent.runs` from here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["attach", "session", "Agent", "Session"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agent import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
