"""Attaching the agent to the training code people already have.

One module per framework, each imported only when used (``import agent`` imports none of
them, and no framework is a dependency of gpuwatch):

- :mod:`agent.integrations.lightning`: ``lightning.pytorch.Trainer``
- :mod:`agent.integrations.hf`: ``transformers.Trainer``
- :mod:`agent.integrations.accelerate`: hand-written loops on ``accelerate.Accelerator``
- :mod:`agent.integrations.fabric`: loops on Lightning Fabric (``lightning.fabric.Fabric``)

:func:`agent.attach` picks the module from the type of what it is given
(:func:`integration_for`). What they share lives here: the count of an accumulation
window's data wait, micro-batches, samples and tokens (:class:`WindowMeter`, in C:
:mod:`gpuopt._hotpath`, as every fetch runs it).
"""

from __future__ import annotations

from typing import Any

from gpuopt._hotpath import WindowMeter

__all__ = ["WindowMeter", "integration_for"]

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
