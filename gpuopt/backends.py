"""Which implementation runs a model's forward, switchable between optimizer steps.

Eager PyTorch, torch.compile, or the fused Triton kernels:

- ``eager``: the fused modules run their plain-torch references.
- ``compile``: one kept ``torch.compile`` view of the model (sharing its parameters, so
  the optimizer state stays valid), reused at every switch: flipping back and forth does
  not recompile (:class:`gpuopt.compile.CompiledModel`).
- ``triton``: the fused modules run their Triton kernels (:mod:`gpuopt.kernels`); only
  on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpuopt.compile import CompiledModel, compile_support
from gpuopt.kernels import set_kernel_backend, triton_available
from gpuopt.kernels.backend import KernelBackendMixin

KERNEL_BACKENDS = ("eager", "compile", "triton")


class ModelBackend:
    """Calls a model through the chosen kernel backend.

    Args:
        model: the model (its fused modules are switched in place).
        device: where it runs.
        compile_backend: the ``torch.compile`` backend for ``compile`` (``"inductor"``;
            ``"aot_eager"`` compiles much faster on small CPUs but fuses nothing).
        in_place: make the switch in the model itself, for loops that call ``model(...)``
            directly (and evaluation code that should follow the knob): under
            ``compile`` the model gets an instance attribute ``forward`` that runs its
            original forward through one kept ``torch.compile`` of it (module hooks
            still run once, outside); back to ``eager`` the attribute is deleted, leaving
            the model exactly as it was. Otherwise call the model through this object.

    Raises (from the :attr:`kernels` setter):
        ValueError: an unknown backend, or one that cannot run here (the reason: e.g.
            "Triton kernels need a CUDA device; this run is on cpu"), or ``triton`` for
            a model without fused modules (it would change nothing).
    """

    def __init__(self, model: nn.Module, device: torch.device, *,
                 compile_backend: str = "inductor", in_place: bool = False) -> None:
        self.model = model
        self.device = torch.device(device)
        self.compile_backend = compile_backend
        self.in_place = in_place
        self.compiled: CompiledModel | None = None  # made on the first switch to compile
        #: the model's fused modules, which ``triton`` switches (none: triton is refused)
        self.fused_modules = sum(isinstance(m, KernelBackendMixin) for m in model.modules())
        self._kernels = "eager"
        self._shadowed: Any = None  # in place: the instance forward compile replaced

    def support(self, kernels: str, *, thorough: bool = False) -> str | None:
        """Why ``kernels`` cannot run here, or None. Never touches the device.

        Cheap (any thread): ``compile`` is checked without importing Dynamo until it is
        imported (:func:`gpuopt.compile.compile_support`); ``thorough``: in full (the
        switch itself does it)."""
        if kernels not in KERNEL_BACKENDS:
            return f"unknown kernels {kernels!r} (choose from {', '.join(KERNEL_BACKENDS)})"
        if kernels == "triton":
            if not self.fused_modules:
                return (f"{type(self.model).__name__} has no gpuopt fused modules "
                        "(gpuopt.kernels) for Triton kernels to run")
            return triton_available(self.device)
        if kernels == "compile":
            return compile_support(self.compile_backend, self.device.type,
                                   thorough=thorough)
        return None

    @property
    def kernels(self) -> str:
        """The current backend: ``"eager"``, ``"compile"`` or ``"triton"``."""
        return self._kernels

    @kernels.setter
    def kernels(self, value: str) -> None:
        reason = self.support(value, thorough=True)
        if reason is not None:
            raise ValueError(reason)
        set_kernel_backend(self.model, "triton" if value == "triton" else "eager")
        if value == "compile" and self.compiled is None:
            # in place: compile the original forward (compiling the module would call
            # the instance forward installed below, i.e. itself)
            target = self.model.forward if self.in_place else self.model
            self.compiled = CompiledModel(target, backend=self.compile_backend)
        if self.compiled is not None:
            self.compiled.enabled = value == "compile"
        if self.in_place:
            # the model's own instance dict, never setattr: a wrapper whose __setattr__
            # passes attributes on to the module it wraps (Lightning Fabric's
            # _FabricModule) would give that module the compiled wrapper's forward,
            # which calls that module, which calls it again (RecursionError)
            attributes = vars(self.model)
            installed = attributes.get("forward")
            if value == "compile" and installed is not self.compiled:
                assert self.compiled is not None  # made above on a switch to compile
                self._shadowed = installed  # an instance forward of someone else's, or None
                attributes["forward"] = self.compiled
            elif value != "compile" and installed is self.compiled:
                if self._shadowed is None:
                    del attributes["forward"]  # the class's own forward shows through
                else:
                    attributes["forward"] = self._shadowed
        self._kernels = value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward through the current backend."""
        if self.in_place:
            return self.model(*args, **kwargs)
        if self.compiled is not None and self.compiled.enabled:
            return self.compiled(*args, **kwargs)
        return self.model(*args, **kwargs)

    def pop_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Compile events since the last call, as ``(kind, text, fields)``.

        ``compiling`` when compiled steps start, ``compiled`` (with ``compile_time_s``) when
        a step ran without compiling, and the compiler's own notes (recompilations, graph
        breaks, fallbacks to eager) as ``compile_note``. Empty and free when compile was
        never used. Call it on the training thread, between optimizer steps."""
        return [] if self.compiled is None else self.compiled.pop_step_events()
