"""``torch.compile`` as a backend that can be switched on and off between steps.

:class:`CompiledModel` holds a model and one ``torch.compile`` d view of it (an
``OptimizedModule`` that shares the model's parameters and buffers: no copy, the
optimizer's state stays valid) and calls one or the other. The compiled view is made
once and kept: Dynamo caches the compiled code per code object with guards, so going
back to compiled after an eager stretch reuses the cached graphs instead of compiling
again. What does compile again (a *recompile*), once per new combination, is anything
the guards check: autocast on/off and its dtype, ``model.train()`` / ``eval()``, grad
mode, input shapes (after one shape change Dynamo turns to dynamic shapes), and the
blocks' ``forward`` attribute that :mod:`gpuopt.checkpointing` switches.

It reports what compilation costs and where it silently falls back to eager, as
readable strings for the caller to publish as events (:meth:`CompiledModel.pop_events`)
and as numbers (:meth:`CompiledModel.stats`). Sources of these figures, read around
each call:

* ``torch._dynamo.utils.get_compilation_metrics()``: one record per compiled frame
  (forward) and per AOTAutograd backward compile, with its duration, the recompile
  reason (the failed guard) and the failure reason. Compile time is the sum of their
  durations.
* ``torch._dynamo.utils.counters["graph_break"]``: the reasons for graph breaks, where
  Dynamo splits the model and runs the part between graphs eagerly.
* Failed frames (``fail_type`` in the metrics), for example when
  ``torch._dynamo.config.recompile_limit`` (8 per code object in torch 2.13) is hit:
  Dynamo then runs that code eagerly from then on, with only a log warning.

* ``torch._dynamo.callback.callback_handler``: Dynamo's start and end callbacks of each
  compile (a frame traced, or a backward compiled lazily at its first run), with the
  compile id (``"frame/attempt"``; an attempt past 0 is a recompile). They run on the
  compiling thread; :data:`COMPILE_WATCH` keeps which graph is compiling now and since
  when, for a monitor's thread to read while the training thread is inside the compile.

These are the APIs torch's own tooling reads (``TORCH_LOGS=recompiles,graph_breaks``
prints the same); there is no public equivalent in ``torch.compiler`` as of 2.13.
``torch._dynamo.explain`` is deliberately not used: it calls ``torch._dynamo.reset()``,
which throws away every compiled graph in the process.

Measured on a shared 2-core x86 CPU (torch 2.13, gcc 12), first forward+backward of
the demo :class:`~gpuopt.demo.models.CharTransformer` (d_model 64, 2 layers, batch
8 x 32): ``inductor`` 20-27 s with a cold on-disk cache (``/tmp/torchinductor_$USER``,
or ``TORCHINDUCTOR_CACHE_DIR``), about 2 s warm, and 8-22 s more for the recompile
under bf16 autocast; ``aot_eager`` 1-3 s, and about 1 s per recompile. Steady-state
steps then take milliseconds with either. ``aot_eager`` (Dynamo and AOTAutograd, no
code generation) is the backend to use where inductor is too slow to compile or has no
compiler; it exercises the same capture, guards and recompiles but does not speed up.

Inductor generates its own random numbers for dropout, so after a switch the masks
differ from eager's (the loss stays continuous, not bit-identical) unless
``torch._inductor.config.fallback_random = True``.

Source: PyTorch ``torch.compile`` documentation
(https://pytorch.org/docs/stable/generated/torch.compile.html) and "torch.compile
Troubleshooting" (recompilations, graph breaks).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["COMPILE_WATCH", "CompileWatch", "CompiledModel", "compile_support"]

_REASON_CHARS = 240  # reasons in events are cut to their first line and this length


def compile_support(backend: str, device_type: str, *, thorough: bool = True) -> str | None:
    """Why ``torch.compile(backend=backend)`` cannot run on ``device_type``, or None.

    Checks what can be checked without compiling: Dynamo supports this Python and
    platform; the backend exists; for ``"inductor"``, a C++ compiler (CPU) or Triton
    and a GPU of compute capability 7.0+ (CUDA).

    Args:
        backend: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``, ...).
        device_type: ``torch.device.type`` of the model (``"cpu"``, ``"cuda"``).
        thorough: False: only what needs no import (the backend is not looked up; a
            C++ compiler on ``PATH``; Triton installed and the GPU's capability), for a
            monitor's thread, which must not hold the GIL through the imports while the
            training thread steps. The thorough check is made where the switch happens.

    .. note:: ``thorough``: imports ``torch._dynamo`` and its backends (about 0.5-2 s
       of CPU the first time in a process, holding the GIL); looks up the compiler on
       ``PATH`` but does not run it. Call it once, at setup or at the switch.
    """
    if not thorough:
        return _quick_compile_support(backend, device_type)
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported

        check_if_dynamo_supported()
    except Exception as exc:  # noqa: BLE001 -- any reason is the answer
        return f"torch.compile is not supported here: {exc}"
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(backend)
    except InvalidBackend:
        return f"unknown torch.compile backend {backend!r}"
    if backend != "inductor":
        return None
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as exc:  # noqa: BLE001
            return f"inductor on CPU needs a C++ compiler (g++ or clang++ on PATH): {exc}"
    elif device_type == "cuda":
        from torch.utils._triton import has_triton

        return _inductor_cuda_problem(has_triton)
    return None


def _inductor_cuda_problem(triton_installed: Callable[[], bool]) -> str | None:
    """Why inductor cannot run on this CUDA device (no CUDA, compute capability under
    7.0, ``triton_installed()`` False), or None. Never synchronizes the device."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return (f"inductor needs a GPU of compute capability 7.0+ for Triton, "
                f"{torch.cuda.get_device_name()} is {major}.{minor}")
    if not triton_installed():
        return "inductor on CUDA needs Triton, which is not installed"
    return None


def _quick_compile_support(backend: str, device_type: str) -> str | None:
    """:func:`compile_support`'s answer from what needs no import: Dynamo supports this
    Python (once it is imported), inductor's C++ compiler on ``PATH`` (CPU; ``CXX`` or
    g++ / clang++), Triton installed and a GPU of compute capability 7.0+ (CUDA).
    Microseconds."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None:
        try:
            eval_frame.check_if_dynamo_supported()
        except Exception as exc:  # noqa: BLE001 -- any reason is the answer
            return f"torch.compile is not supported here: {exc}"
    if backend != "inductor":
        return None
    if device_type == "cpu":
        compilers = (os.environ.get("CXX", ""), "g++", "clang++")
        if not any(name and shutil.which(name) for name in compilers):
            return ("inductor on CPU needs a C++ compiler (g++ or clang++ on PATH): none "
                    "found")
    elif device_type == "cuda":  # (Triton found, not imported)
        return _inductor_cuda_problem(lambda: importlib.util.find_spec("triton") is not None)
    return None


class CompileWatch:
    """Which graph Dynamo is compiling in this process now, for another thread to read.

    A monitor reads it while the training thread is inside the compile; it comes from
    Dynamo's compile start and end callbacks, installed once (:meth:`install`).

    .. note:: Each callback is two attribute assignments on the compiling thread; a
       read (:meth:`progress`) copies a tuple. Nothing else is touched.
    """

    def __init__(self) -> None:
        self._current: tuple[str, str, float] | None = None  # (id, kind, monotonic s)
        #: graphs whose compile ended in this process
        self.graphs_compiled = 0

    def install(self) -> None:
        """Register the callbacks with Dynamo, unless they are registered.

        Call it again after ``torch._dynamo.reset()``, which clears them. A torch without
        them leaves :meth:`progress` None."""
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # another torch: no progress, nothing else lost
            return
        if self._started not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._started)
            callback_handler.register_end_callback(self._ended)

    def _started(self, args: Any) -> None:
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "")
        kind = "backward" if trigger == "LAZY_BACKWARD" else "forward"
        self._current = (str(getattr(args, "compile_id", "?")), kind, time.monotonic())

    def _ended(self, args: Any) -> None:
        self._current = None
        self.graphs_compiled += 1

    def progress(self) -> dict[str, Any] | None:
        """The compile under way, or None.

        ``compiling_graph`` (Dynamo's compile id, ``"frame/attempt"``),
        ``compiling_graph_kind`` (``forward``: a frame traced; ``backward``: its backward
        graph), ``compiling_graph_s`` (seconds since this graph's compile began) and
        ``graphs_compiled`` (graphs done in this process)."""
        current = self._current
        if current is None:
            return None
        graph, kind, since = current
        return {"compiling_graph": graph, "compiling_graph_kind": kind,
                "compiling_graph_s": round(time.monotonic() - since, 3),
                "graphs_compiled": self.graphs_compiled}


#: The process's one :class:`CompileWatch` (Dynamo's callbacks are process-wide);
#: installed by a :class:`CompiledModel` when it is switched on.
COMPILE_WATCH = CompileWatch()


class CompiledModel:
    """Calls a model eagerly or through one kept ``torch.compile`` view, switchable.

    Use it where the model is called; everything else (``parameters()``,
    ``train()``, ``state_dict()``, the optimizer) keeps using the model itself::

        forward = CompiledModel(model, backend="inductor")
        forward.enabled = True            # between optimizer steps
        loss = loss_fn(forward(inputs), targets)
        ...
        for text in forward.pop_events(): publish(text)

    Args:
        model: the module (or a function such as a module's bound ``forward``); it is
            not modified.
        backend, mode, dynamic, fullgraph, options: passed to :func:`torch.compile`.
        enabled: start compiled.
        fallback_on_error: if compiling the forward fails in the backend (for example
            no working C++ compiler), switch back to eager, record an event, and run
            that call eagerly instead of raising. A backward compile failure (inductor
            compiles the backward graph during the first ``loss.backward()``) still
            raises from ``backward()``.

    Raises:
        ValueError: an unknown backend.

    Attributes:
        model: the eager module. compiled: its ``torch.compile`` view (made once).
        compile_time_s: seconds spent compiling, forward and backward graphs, since
            construction (the process's compilations while this object's calls ran,
            and backward compilations between them).
        compiles: forward frames compiled (graphs, and code between graph breaks).
        recompiles: those of them compiled again for code already compiled once,
            because a guard failed (the reason is in the event).
        graph_breaks: graph breaks met while compiling.
        fallbacks: times compilation failed and code ran eagerly instead.

    .. note:: Cost per call when compiled: reads of Dynamo's counters and a copy of
       its list of compilation records (at most 64), about 4 us on a 2-core CPU on top
       of the compiled module's own ~30 us of guard checks; nothing touches the device.
       Eager calls cost nothing extra. The first call after a switch to compiled, or
       after a change of precision, mode or shapes, compiles (seconds to minutes: see
       the module docstring); switching back and forth otherwise costs nothing.
       Construction imports ``torch._dynamo`` (about 1 s the first time in a process)
       but compiles nothing.
    """

    def __init__(
        self,
        model: nn.Module | Callable[..., Any],
        *,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        dynamic: bool | None = None,
        fullgraph: bool = False,
        options: dict[str, Any] | None = None,
        enabled: bool = False,
        fallback_on_error: bool = True,
    ) -> None:
        from torch._dynamo.exc import InvalidBackend

        try:
            self.compiled = torch.compile(model, backend=backend, mode=mode, dynamic=dynamic,
                                          fullgraph=fullgraph, options=options)
        except InvalidBackend as exc:
            raise ValueError(f"unknown torch.compile backend {backend!r}") from exc
        self.model = model
        #: the backend's name, for events
        self.backend = backend if isinstance(backend, str) else getattr(
            backend, "__name__", type(backend).__name__)
        self.fallback_on_error = fallback_on_error
        self.compile_time_s = 0.0
        self.compiles = 0
        self.recompiles = 0
        self.graph_breaks = 0
        self.fallbacks = 0
        self._events: list[str] = []
        self._enabled = False
        self._compiling = False
        self._was_compiling = False  # as last told by pop_step_events
        self._last_record = _last_compilation_record()
        self.enabled = enabled

    @property
    def enabled(self) -> bool:
        """Whether calls go through the compiled view; set it between optimizer steps."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"enabled must be a bool, got {value!r}")
        if value and not self._enabled:
            self._compiling = True  # until a call compiles nothing
            COMPILE_WATCH.install()  # again, if something reset Dynamo since
        elif not value:
            self._compiling = False
        self._enabled = value

    @property
    def compiling(self) -> bool:
        """Whether a step time measured now is mostly compile time.

        True from a switch to compiled until a call runs without compiling, and after a call
        that (re)compiled."""
        return self._compiling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)``, compiled if :attr:`enabled`."""
        if not self._enabled:
            return self.model(*args, **kwargs)
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._dynamo.utils import counters

        self._harvest(in_call=False)  # a backward compiled since the last call
        frames = counters["frames"]["total"]
        breaks = Counter(counters["graph_break"])
        try:
            output = self.compiled(*args, **kwargs)
        except BackendCompilerFailed as exc:
            if not self.fallback_on_error:
                raise
            self._harvest(in_call=True, report_failures=False)
            self.fallbacks += 1
            self._enabled = self._compiling = False
            inner = getattr(exc, "inner_exception", None) or exc
            self._events.append(f"torch.compile ({self.backend}) failed, back to eager: "
                                f"{type(inner).__name__}: {_first_line(inner)}")
            return self.model(*args, **kwargs)
        compiled_now = counters["frames"]["total"] != frames
        if compiled_now:
            self._harvest(in_call=True)
            new_breaks = Counter(counters["graph_break"])
            new_breaks.subtract(breaks)
            for reason, count in new_breaks.items():
                if count > 0:
                    self.graph_breaks += count
                    self._events.append(f"graph break: the code around it runs eagerly: "
                                        f"{_first_line(reason)}")
        self._compiling = compiled_now
        return output

    def pop_step_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Events for a training loop's log since the last call, as ``(kind, text, fields)``.

        ``compiling`` when compiled steps start, ``compiled`` (with ``compile_time_s``) when
        a step ran without compiling, and the reports of :meth:`pop_events` as
        ``compile_note``. Call it on the training thread, between optimizer steps."""
        events: list[tuple[str, str, dict[str, Any]]] = [
            ("compile_note", text, {}) for text in self.pop_events()]
        compiling = self.compiling
        if compiling and not self._was_compiling:
            events.append(("compiling", f"compiling the model ({self.backend}): "
                           "the next steps are slow", {}))
        elif self._was_compiling and not compiling:
            events.append(("compiled", f"compiled ({self.backend}); "
                           f"{self.compile_time_s:.1f} s spent compiling so far",
                           {"compile_time_s": self.compile_time_s}))
        self._was_compiling = compiling
        return events

    def pop_events(self) -> list[str]:
        """Readable reports since the last call, oldest first, then forgotten.

        Compiles with their time, recompiles with the failed guard, graph breaks and
        fallbacks to eager with their reasons. Call it after the optimizer step to include a
        backward compiled during ``backward()``."""
        self._harvest(in_call=False)
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, Any]:
        """Numbers for a ``state`` or ``step`` message.

        ``compile_enabled``, ``compiling``, ``compile_time_s``, ``compiles``,
        ``recompiles``, ``graph_breaks``, ``compile_fallbacks``. Does not read new records
        (see :meth:`pop_events`)."""
        return {
            "compile_enabled": self._enabled,
            "compiling": self._compiling,
            "compile_time_s": self.compile_time_s,
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "graph_breaks": self.graph_breaks,
            "compile_fallbacks": self.fallbacks,
        }

    def _harvest(self, *, in_call: bool, report_failures: bool = True) -> None:
        """Account the compilation records added since the last harvest. Outside a call
        only backward records are ours (the forward ones belong to other code). With
        ``report_failures=False`` failed records only add their time (the caller
        reports the failure itself)."""
        records = _new_compilation_records(self._last_record)
        if not records:
            return
        self._last_record = records[-1]
        for record in records:
            is_backward = record.is_forward is False
            if not in_call and not is_backward:
                continue
            if is_backward and self.compiles == 0:
                continue  # another compiled function's backward
            seconds = _duration_s(record)
            self.compile_time_s += seconds
            name = repr(record.co_name) if record.co_name else "a frame"
            if record.fail_type:
                if not report_failures:
                    continue
                self.fallbacks += 1
                reason = record.fail_reason or record.fail_type
                guard = f" (after guard failed: {_first_line(record.recompile_reason)})" \
                    if record.recompile_reason else ""
                self._events.append(f"torch.compile gave up on {name}, it runs eagerly: "
                                    f"{_first_line(reason)}{guard}")
            elif is_backward:
                self._events.append(f"compiled backward graph in {seconds:.2f} s "
                                    f"({self.backend})")
            else:
                self.compiles += 1
                if record.recompile_reason or (record.cache_size or 0) > 0:
                    self.recompiles += 1
                    self._events.append(
                        f"recompiled {name} in {seconds:.2f} s ({self.backend}), guard "
                        f"failed: {_first_line(record.recompile_reason or 'unknown')}")
                else:
                    self._events.append(f"compiled {name} in {seconds:.2f} s ({self.backend})")


def _last_compilation_record() -> Any:
    from torch._dynamo.utils import get_compilation_metrics

    records = get_compilation_metrics()
    return records[-1] if records else None


def _new_compilation_records(last: Any) -> list[Any]:
    """Records after ``last`` (by identity) in Dynamo's bounded list; all of them if
    ``last`` is gone from it (cleared, or pushed out by more than 64 new ones)."""
    from torch._dynamo.utils import get_compilation_metrics

    records = get_compilation_metrics()
    for index in range(len(records) - 1, -1, -1):
        if records[index] is last:
            return records[index + 1:]
    return records


def _duration_s(record: Any) -> float:
    if record.duration_us is not None:
        return record.duration_us / 1e6
    return record.entire_frame_compile_time_s or 0.0


def _first_line(text: Any) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS - 3] + "..."
