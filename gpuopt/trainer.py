"""The reference Trainer: a training loop that combines gpuopt's techniques.

It runs optimizer steps made of an accumulation window of micro-batches, under a
:class:`~gpuopt.precision.MixedPrecision` policy, and calls its callbacks at every
optimizer-step boundary, the one place where settings may change safely.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from gpuopt.backends import ModelBackend
from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.data import batch_size, to_device
from gpuopt.memory import SavedActivations
from gpuopt.precision import MixedPrecision


@dataclass
class StepStats:
    """What the Trainer knows of one finished optimizer step (host side only).

    Attributes:
        step: 1-based index of the optimizer step just taken.
        micro_batches: micro-batches in its accumulation window.
        samples: samples in those micro-batches.
        data_wait_s: host seconds spent waiting in the loader's ``next()``.
        loss: mean loss over the window as a detached 0-dim tensor on the model's
            device (reading it with ``.item()`` would synchronize a GPU: leave that to
            another thread, or to when the value is needed).
        skipped: in fp16, a 0-dim bool tensor on the device, True when the GradScaler
            skipped this step for inf/NaN gradients; None otherwise. Not read either.
        activation_bytes: bytes autograd saved for backward in the window's first
            micro-batch (:class:`gpuopt.memory.SavedActivations`) when this step
            measured them (see ``Trainer(measure_activations_every=...)``); else None.
    """

    step: int
    micro_batches: int
    samples: int
    data_wait_s: float
    loss: torch.Tensor | None
    skipped: torch.Tensor | None = None
    activation_bytes: int | None = None


class Callback(Protocol):
    """Hooks called by :meth:`Trainer.fit`, all on the training thread."""

    def on_fit_start(self, trainer: "Trainer") -> None: ...

    def on_optimizer_step(self, trainer: "Trainer", stats: StepStats) -> None: ...

    def on_fit_end(self, trainer: "Trainer") -> None: ...

    def on_out_of_memory(self, trainer: "Trainer", error: torch.OutOfMemoryError) -> bool:
        """A micro-batch ran out of memory: undo what caused it (e.g. a live change)
        and return True to have the window run once more; False lets it raise."""


class Trainer:
    """A reference training loop with gradient accumulation and mixed precision.

    Each optimizer step takes ``accum_steps`` micro-batches from ``loader``; each
    micro-batch's loss is divided by the real window size before backward, so the
    accumulated gradient equals the gradient of the mean loss over the whole window
    (for a mean-reduced loss and equal micro-batch sizes, the gradient of one batch
    ``accum_steps`` times larger). Changes to :attr:`accum_steps` take effect at the next
    window; changes to :attr:`precision` must be made between optimizer steps (the
    callbacks run exactly there).

    Args:
        model: the module, already on ``device``.
        optimizer: its optimizer.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (mean-reduced).
        loader: iterable of ``(input, target)`` batches (tensors or nested tensors);
            re-iterated for each epoch.
        device: where batches go; default: the device of the model's first parameter.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        accum_steps: micro-batches per optimizer step (>= 1).
        max_grad_norm: clip the global gradient norm to this before each step, if set.
        callbacks: objects with the :class:`Callback` hooks (any subset).
        kernels: ``"eager"``, ``"compile"`` or ``"triton"`` (see
            :class:`gpuopt.backends.ModelBackend`); switchable between steps.
        compile_backend: the ``torch.compile`` backend used by ``kernels="compile"``.
        checkpointing: activation checkpointing of the model's repeated blocks
            (``model.blocks``); switchable between steps. :attr:`activation_checkpointing`
            is None when the model has no blocks to checkpoint.
        measure_activations_every: measure the activation memory
            (:attr:`StepStats.activation_bytes`) of one micro-batch every this many
            optimizer steps, and at the first step after precision, kernels or
            checkpointing changed; 0 never. A measured micro-batch costs about a
            microsecond per tensor saved for backward, on the host only. Not measured
            under ``kernels="compile"`` (Dynamo would trace the meter's hooks). A model
            that refuses saved-tensor hooks (``torch.func`` inside ``forward``) is not
            measured: its first measured micro-batch's forward runs once more without
            them, from the same random state and buffers.

    Raises:
        ValueError: a precision or kernel backend the device cannot run,
            ``accum_steps < 1``, ``checkpointing=True`` for a model without blocks, or
            ``measure_activations_every < 0``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loader: Iterable[Any],
        *,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        accum_steps: int = 1,
        max_grad_norm: float | None = None,
        callbacks: Iterable[Any] = (),
        kernels: str = "eager",
        compile_backend: str = "inductor",
        checkpointing: bool = False,
        measure_activations_every: int = 20,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.loader = loader
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.mixed_precision = MixedPrecision(self.device.type, precision)
        self._accum_steps = 1
        self.accum_steps = accum_steps
        self.max_grad_norm = max_grad_norm
        self.model_backend = ModelBackend(model, self.device, compile_backend=compile_backend)
        self.model_backend.kernels = kernels
        try:
            self.activation_checkpointing: ActivationCheckpointing | None = (
                ActivationCheckpointing(model))
        except ValueError:
            if checkpointing:
                raise
            self.activation_checkpointing = None
        self.checkpointing = checkpointing
        if (not isinstance(measure_activations_every, int)
                or isinstance(measure_activations_every, bool) or measure_activations_every < 0):
            raise ValueError("measure_activations_every must be an integer >= 0, got "
                             f"{measure_activations_every!r}")
        self.measure_activations_every = measure_activations_every
        self._measured_at: tuple[int, Any] | None = None  # (step, settings) last measured
        #: Why activations are no longer measured (the model refused saved-tensor hooks),
        #: or None.
        self.activation_measurement_error: str | None = None
        self.callbacks: list[Any] = list(callbacks)
        #: Called before every micro-batch with the trainer; tests set it to raise
        #: faults (e.g. ``torch.OutOfMemoryError``) where no real one can be provoked.
        self.fault_injection: Callable[["Trainer"], None] | None = None
        self.step = 0
        self.epoch = 0
        self._stop = threading.Event()

    @property
    def precision(self) -> str:
        """Current precision; set it between optimizer steps (raises ValueError if the
        device cannot run it)."""
        return self.mixed_precision.precision

    @precision.setter
    def precision(self, value: str) -> None:
        self.mixed_precision.precision = value

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step; a change takes effect at the next window."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"accum_steps must be an integer >= 1, got {value!r}")
        self._accum_steps = value

    @property
    def kernels(self) -> str:
        """The kernel backend (``"eager"``, ``"compile"``, ``"triton"``); set it between
        optimizer steps (raises ValueError with the reason if it cannot run here)."""
        return self.model_backend.kernels

    @kernels.setter
    def kernels(self, value: str) -> None:
        self.model_backend.kernels = value

    @property
    def checkpointing(self) -> bool:
        """Whether activation checkpointing is on; set it between optimizer steps."""
        return (self.activation_checkpointing is not None
                and self.activation_checkpointing.enabled)

    @checkpointing.setter
    def checkpointing(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"checkpointing must be a bool, got {value!r}")
        if self.activation_checkpointing is None:
            if value:
                raise ValueError(f"{type(self.model).__name__} has no blocks to checkpoint")
            return
        self.activation_checkpointing.enabled = value

    def stop(self) -> None:
        """Ask :meth:`fit` to return at the next optimizer-step boundary (any thread);
        asked before :meth:`fit` starts, the next one returns before its first step."""
        self._stop.set()

    def _batches(self, epochs: int | None) -> Iterator[Any]:
        while epochs is None or self.epoch < epochs:
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            empty = True
            for batch in self.loader:
                empty = False
                yield batch
            self.epoch += 1
            if empty:
                return

    def _measures_activations(self) -> bool:
        """Whether the next window's first micro-batch measures its activations: every
        :attr:`measure_activations_every` steps, and when a setting that changes them
        changed since the last measurement."""
        if not self.measure_activations_every or self.kernels == "compile":
            return False  # (Dynamo would trace the meter's hooks and guard on them)
        if self._measured_at is not None:
            step, settings = self._measured_at
            if (self.step + 1 - step < self.measure_activations_every
                    and settings == (self.precision, self.kernels, self.checkpointing)):
                return False  # not due: the usual step costs two comparisons
        return SavedActivations.blocked_reason() is None  # else: a later window

    def _micro_batch(self, batch: Any, window: int, saved: SavedActivations | None = None
                     ) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch; its detached loss and size. With
        ``saved``, the forward's tensors saved for backward are counted in it."""
        if self.fault_injection is not None:
            self.fault_injection(self)
        inputs, targets = to_device(batch, self.device)
        with self.mixed_precision.autocast():
            if saved is None:
                loss = self.loss_fn(self.model_backend(inputs), targets)
            else:
                loss = self._measured_forward(inputs, targets, saved)
        self.mixed_precision.backward(loss / window)
        return loss.detach(), batch_size(inputs)

    def _measured_forward(self, inputs: Any, targets: Any, saved: SavedActivations
                          ) -> torch.Tensor:
        """The forward and loss under ``saved``'s hooks. Some code refuses saved-tensor
        hooks (``torch.func`` transforms raise when any are set): if the forward raises
        there, it is run again without (on the first measurement, from the same random
        state and module buffers, so training is as without measuring), and activations
        are not measured again (:attr:`activation_measurement_error` says why); any
        other error is the model's own and propagates as it would have."""
        first = self._measured_at is None  # a model refuses the hooks the first time
        if first:  # so that running it again draws the same numbers and counts once
            rng = _rng_state(self.device)
            buffers = [buffer.detach().clone() for buffer in self.model.buffers()]
        try:
            with saved:
                return self.loss_fn(self.model_backend(inputs), targets)
        except RuntimeError as error:
            if not _refused_hooks(error):
                raise  # the model's own error, as it would be without the measurement
            if first:
                _set_rng_state(self.device, rng)
                with torch.no_grad():
                    for buffer, before in zip(self.model.buffers(), buffers):
                        buffer.copy_(before)
            loss = self.loss_fn(self.model_backend(inputs), targets)
            self.measure_activations_every = 0
            self.activation_measurement_error = f"{type(error).__name__}: {error}"
            return loss

    def _recovered_from(self, error: torch.OutOfMemoryError) -> bool:
        """Ask the callbacks' ``on_out_of_memory`` to undo what caused ``error``; True
        when one did (the window is then run once more)."""
        handled = [_call(callback, "on_out_of_memory", self, error)
                   for callback in self.callbacks]
        if any(handled) and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return any(handled)

    def fit(self, *, max_steps: int | None = None, epochs: int | None = None) -> int:
        """Train until ``max_steps`` optimizer steps, ``epochs`` epochs, or :meth:`stop`.

        With neither limit it trains until :meth:`stop`. A last partial window at the
        end of the data is stepped with its gradient rescaled to its real size. When a
        micro-batch runs out of memory and a callback's ``on_out_of_memory`` undoes the
        cause, the window's gradients are dropped and the same batches run once more;
        otherwise the ``torch.OutOfMemoryError`` propagates.

        Returns:
            The number of optimizer steps taken in total (:attr:`step`).
        """
        self.model.train()
        batches = self._batches(epochs)
        for callback in self.callbacks:
            _call(callback, "on_fit_start", self)
        try:
            while not self._stop.is_set() and (max_steps is None or self.step < max_steps):
                if not self._optimizer_step(batches):
                    break
        finally:
            self._stop.clear()  # honoured: a later fit trains again
            for callback in self.callbacks:
                _call(callback, "on_fit_end", self)
        return self.step

    def _optimizer_step(self, batches: Iterator[Any]) -> bool:
        window = self._accum_steps
        data_wait_s = 0.0
        samples = 0
        loss_sum: torch.Tensor | None = None
        fetched: list[Any] = []  # this window's batches, kept for one retry after an OOM
        retried = False
        micro_batches = 0
        saved = SavedActivations(self.model) if self._measures_activations() else None
        while micro_batches < window:
            if micro_batches == len(fetched):
                start = time.perf_counter()
                batch = next(batches, None)
                data_wait_s += time.perf_counter() - start
                if batch is None:
                    break
                fetched.append(batch)
            try:
                loss, size = self._micro_batch(fetched[micro_batches], window,
                                               saved if micro_batches == 0 else None)
            except torch.OutOfMemoryError as error:
                if retried or not self._recovered_from(error):
                    raise
                retried = True  # a callback undid what caused it: run the window again
                self.optimizer.zero_grad(set_to_none=True)
                if saved is not None:
                    saved = SavedActivations(self.model)
                loss_sum, samples, micro_batches = None, 0, 0
                continue
            loss_sum = loss if loss_sum is None else loss_sum + loss
            samples += size
            micro_batches += 1
        if micro_batches == 0:
            return False
        if micro_batches < window:  # data ran out mid-window: divide by the real size
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(window / micro_batches)
        if self.max_grad_norm is not None:
            self.mixed_precision.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        skipped = self.mixed_precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if saved is not None and self.activation_measurement_error is not None:
            saved = None  # the measurement failed; the window trained without it
        if saved is not None:
            self._measured_at = (self.step, (self.precision, self.kernels, self.checkpointing))
        stats = StepStats(self.step, micro_batches, samples, data_wait_s,
                          loss_sum / micro_batches, skipped,
                          None if saved is None else saved.bytes)
        for callback in self.callbacks:
            _call(callback, "on_optimizer_step", self, stats)
        return micro_batches == window


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The host generator's state and ``device``'s (CUDA), to draw the same numbers again."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]
                   ) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _refused_hooks(error: BaseException) -> bool:
    """Whether ``error`` was raised where code disables saved-tensor hooks (torch.func
    transforms, AOTAutograd), i.e. because hooks were set: the innermost frame says."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    name = traceback.tb_frame.f_code.co_name if traceback is not None else ""
    return "disable_saved_tensors_hooks" in name or "saved_tensors_hooks_disable" in name


def _call(callback: Any, hook: str, *args: Any) -> Any:
    method = getattr(callback, hook, None)
    return None if method is None else method(*args)
