"""The in-process gpuwatch agent: measures every optimizer step and takes live commands.

``agent.attach(trainer)`` for a :class:`gpuopt.Trainer`, a Lightning or Hugging Face
Trainer, an accelerate Accelerator or a Lightning Fabric; ``agent.session(...)`` for a
hand-written loop.
Importing :mod:`agent` itself is light (no torch, no framework): the dashboard imports
:mod:`agent.wire.protocol` and :mod:`agent.wire.runs` from here.
"""

from __future__ import annotations

from typing import Any

_HOMES = {"attach": "agent.integrations.adapters", "session": "agent.integrations.loop",
          "Session": "agent.integrations.loop", "Agent": "agent.step.core"}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
