"""The reference Trainer: a training loop that combines gpuopt's techniques.

It runs optimizer steps made of an accumulation window of micro-batches, under a
:class:`~gpuopt.precision.MixedPrecision` policy, and calls its callbacks at every
optimizer-step boundary, the one place where settings may change safely.

Loss normalisation (huggingface/transformers#34191): with micro-batches of unequal size,
the mean of the micro-batches' mean losses is not the mean loss over the window's
samples (or tokens). ``Trainer(loss_normalization=...)`` says which of the two the
window's gradient is: ``"micro_batch_mean"`` (the default, as before), ``"samples"`` or
``"tokens"``.
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, cast

import torch
from torch.utils.data import DataLoader

from gpuopt.backends import ModelBackend
from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.data import batch_size, to_device
from gpuopt.dropout import DropoutRate
from gpuopt.loader import ReconfigurableLoader
from gpuopt.memory import SavedActivations
from gpuopt.optim import OptimizerSettings
from gpuopt.position import DataPosition
from gpuopt.precision import MixedPrecision
from gpuopt.saving import rng_state, set_rng_state


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
        tokens: tokens in the window's micro-batches, as declared by
            ``Trainer(tokens_per_sample=...)`` or counted by ``Trainer(count_tokens=...)``
            (host int); None when neither is declared.
        lr: the learning rate the step used (param group 0, after ``lr_scale``), a host
            float (None when the group keeps it in a tensor). lr_groups: the rate of each
            param group the step used, as the groups hold it (floats; a tensor where a
            group keeps its rate in one: not read here, see
            :func:`gpuopt.optim.host_rate`).
        grad_norm: with ``max_grad_norm``, the global gradient norm before clipping
            (what ``clip_grad_norm_`` returned: a 0-dim tensor on the device, not read);
            else None.

    The mean in ``loss`` is the one the gradient is of
    (:attr:`Trainer.loss_normalization`): the mean of the micro-batches' mean losses
    (``"micro_batch_mean"``), or each micro-batch's mean loss weighted by its samples
    (``"samples"``) or tokens (``"tokens"``), i.e. the mean over the window's samples or
    tokens.
    """

    step: int
    micro_batches: int
    samples: int
    data_wait_s: float
    loss: torch.Tensor | None
    skipped: torch.Tensor | None = None
    activation_bytes: int | None = None
    tokens: int | None = None
    lr: float | None = None
    grad_norm: torch.Tensor | None = None
    lr_groups: tuple[Any, ...] | None = None


#: The values of ``Trainer(loss_normalization=...)``.
LOSS_NORMALIZATIONS = ("micro_batch_mean", "samples", "tokens")


def count_target_tokens(batch: Any, ignore_index: int = -100) -> int:
    """Tokens in an ``(input, target)`` batch that the loss counts.

    For ``Trainer(count_tokens=...)``: the elements of the target tensor not equal to
    ``ignore_index`` (padding, as ``cross_entropy``'s default ``ignore_index=-100`` leaves
    out).

    A dict batch uses its ``"labels"`` (else the sum of its ``"attention_mask"``).
    Called with the batch as the loader gives it, before it is moved to the device: on
    host tensors it costs one comparison and a sum, and no device synchronisation (on a
    CUDA tensor ``int()`` would synchronise).

    Raises:
        ValueError: the batch holds no target (labels, or attention mask) tensor.
    """
    if isinstance(batch, dict):
        if isinstance(batch.get("labels"), torch.Tensor):
            return int((batch["labels"] != ignore_index).sum())
        if isinstance(batch.get("attention_mask"), torch.Tensor):
            return int(batch["attention_mask"].sum())
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2 \
            and isinstance(batch[1], torch.Tensor):
        return int((batch[1] != ignore_index).sum())
    raise ValueError("count_target_tokens needs an (input, target) batch with a target "
                     "tensor, or a dict with 'labels' or 'attention_mask', got "
                     f"{type(batch).__name__}")


class Callback(Protocol):
    """Hooks called by :meth:`Trainer.fit`, all on the training thread."""

    def on_fit_start(self, trainer: "Trainer") -> None: ...

    def on_optimizer_step(self, trainer: "Trainer", stats: StepStats) -> None: ...

    def on_fit_end(self, trainer: "Trainer") -> None: ...

    def on_exception(self, trainer: "Trainer", error: BaseException) -> None:
        """:meth:`Trainer.fit` is ending with ``error`` (Ctrl-C included).

        ``on_fit_end`` follows."""

    def on_out_of_memory(self, trainer: "Trainer", error: torch.OutOfMemoryError) -> bool:
        """A micro-batch ran out of memory: undo the cause and return True to run the window again.

        Undo what caused it (e.g. a live change) and return True to have the window run once
        more; False lets it raise."""


class Trainer:
    """A reference training loop with gradient accumulation and mixed precision.

    Each optimizer step takes ``accum_steps`` micro-batches from ``loader``; each
    micro-batch's loss is divided by the real window size before backward, so the
    accumulated gradient equals the gradient of the mean of the micro-batches' mean
    losses (for a mean-reduced loss and equal micro-batch sizes, the gradient of one
    batch ``accum_steps`` times larger). With micro-batches of unequal size that is not
    the mean over the window's samples; ``loss_normalization="samples"`` (or
    ``"tokens"``) makes it that. Changes to :attr:`accum_steps` take effect at the next
    window; changes to :attr:`precision` must be made between optimizer steps (the
    callbacks run exactly there).

    Epochs: before each epoch the Trainer calls ``set_epoch(epoch)`` on the loader's
    ``sampler`` (a ``DistributedSampler``, say) and, for a ``torch.utils.data.DataLoader``,
    on its ``dataset`` when they have one. A :class:`gpuopt.loader.ReconfigurableLoader`
    sets its dataset's epoch itself, workers included. A DataLoader's persistent workers
    do not see a ``set_epoch`` made here (pytorch/pytorch#97326): the Trainer warns
    (``RuntimeWarning``) once.

    Args:
        model: the module, already on ``device``.
        optimizer: its optimizer.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (mean-reduced).
        loader: iterable of ``(input, target)`` batches (tensors or nested tensors);
            re-iterated for each epoch.
        device: where batches go; default: the device of the model's first parameter.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        accum_steps: micro-batches per optimizer step (>= 1).
        max_grad_norm: clip the global gradient norm to this before each step, if set
            (:attr:`max_grad_norm`).
        lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler of ``optimizer``, stepped
            once after each optimizer step (and saved by :meth:`state_dict`); or None.
            A scheduler whose ``step()`` takes a metric (``ReduceLROnPlateau``) needs
            ``lr_scheduler_metric``.
        lr_scheduler_metric: for a metric-driven scheduler (and only for one):
            ``lr_scheduler_metric(trainer, stats) -> metric | None``, called after each
            optimizer step (before the callbacks) with its :class:`StepStats`; the
            scheduler is stepped with the metric it returns (its ``patience`` then
            counts those calls), and not stepped when it returns None. E.g. a validation
            loss every 500 steps, ``lambda t, s: evaluate(t.model) if t.step % 500 == 0
            else None``, or the window's training loss, ``lambda t, s: s.loss`` (the
            scheduler reads that device tensor with ``float()``: on a GPU a wait for
            the step, every step).
        lr_scale, weight_decay: see :attr:`lr_scale` and :attr:`weight_decay`
            (:class:`gpuopt.optim.OptimizerSettings`); ``weight_decay`` None keeps the
            optimizer's.
        callbacks: objects with the :class:`Callback` hooks (any subset).
        kernels: ``"eager"``, ``"compile"`` or ``"triton"`` (see
            :class:`gpuopt.backends.ModelBackend`); switchable between steps.
        compile_backend: the ``torch.compile`` backend used by ``kernels="compile"``.
        checkpointing: activation checkpointing of the model's repeated blocks
            (``model.blocks``); switchable between steps. :attr:`activation_checkpointing`
            is None when the model has no blocks to checkpoint.
        loss_normalization: what the window's gradient is the mean of (see
            :attr:`loss_normalization`): ``"micro_batch_mean"`` (default), ``"samples"``
            or ``"tokens"``.
        tokens_per_sample: tokens in each sample (int >= 1) for a token model whose
            samples all have that many (tokens = samples x this); or None.
        count_tokens: ``count_tokens(batch) -> int``, the tokens of a micro-batch as the
            loader gives it (before it is moved to the device), e.g.
            :func:`count_target_tokens` to leave out padding; or None. Called once per
            micro-batch on the training thread: count on host tensors (a count read
            from a CUDA tensor synchronises). At most one of the two is given; with
            either, :attr:`StepStats.tokens` is reported.
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
            ``accum_steps < 1``, a metric-driven ``lr_scheduler`` without
            ``lr_scheduler_metric`` (or one without such a scheduler),
            ``checkpointing=True`` for a model without blocks,
            ``measure_activations_every < 0``, an unknown ``loss_normalization`` (or
            ``"tokens"`` with no token count declared), a ``tokens_per_sample`` that is
            not an int >= 1, or both ``tokens_per_sample`` and ``count_tokens``.
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
        lr_scheduler: Any = None,
        lr_scheduler_metric: Callable[[Trainer, StepStats], Any] | None = None,
        lr_scale: float = 1.0,
        weight_decay: float | None = None,
        callbacks: Iterable[Any] = (),
        kernels: str = "eager",
        compile_backend: str = "inductor",
        checkpointing: bool = False,
        measure_activations_every: int = 20,
        loss_normalization: str = "micro_batch_mean",
        tokens_per_sample: int | None = None,
        count_tokens: Callable[[Any], int] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.loader = loader
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        #: where the data is, for a loader that is not a ReconfigurableLoader (which
        #: keeps its own position): see :mod:`gpuopt.position`
        self.data_position = DataPosition(self.device)
        self.mixed_precision = MixedPrecision(self.device.type, precision)
        self._accum_steps = 1
        self.accum_steps = accum_steps
        self.max_grad_norm = max_grad_norm
        _check_scheduler(lr_scheduler, lr_scheduler_metric)
        self.lr_scheduler = lr_scheduler
        #: steps a metric-driven :attr:`lr_scheduler` (see ``Trainer(lr_scheduler_metric=)``)
        self.lr_scheduler_metric = lr_scheduler_metric
        #: ``lr_scale`` and ``weight_decay`` of the optimizer (two step hooks on it)
        self.optimizer_settings = OptimizerSettings(optimizer)
        self.lr_scale = lr_scale
        if weight_decay is not None:
            self.weight_decay = weight_decay
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
        #: the rate of the model's dropout modules (:attr:`dropout`)
        self.dropout_rate = DropoutRate(model)
        if (not isinstance(measure_activations_every, int)
                or isinstance(measure_activations_every, bool) or measure_activations_every < 0):
            raise ValueError("measure_activations_every must be an integer >= 0, got "
                             f"{measure_activations_every!r}")
        self.measure_activations_every = measure_activations_every
        # Checked as an object: as an int, mypy takes isinstance(numbers.Integral) for
        # impossible (it cannot see the ABC registration) and skips what follows unchecked.
        declared: object = tokens_per_sample
        if declared is not None and (
                isinstance(declared, bool)
                or not isinstance(declared, numbers.Integral)
                or declared < 1):
            raise ValueError("tokens_per_sample must be an int >= 1 or None, got "
                             f"{tokens_per_sample!r}")
        if tokens_per_sample is not None and count_tokens is not None:
            raise ValueError("give tokens_per_sample or count_tokens, not both")
        if count_tokens is not None and not callable(count_tokens):
            raise ValueError(f"count_tokens must be callable, got {count_tokens!r}")
        #: Tokens per sample as declared, or None.
        self.tokens_per_sample: int | None = (None if tokens_per_sample is None
                                              else int(tokens_per_sample))
        #: The micro-batch token counter as declared, or None.
        self.count_tokens: Callable[[Any], int] | None = count_tokens
        self._loss_normalization = "micro_batch_mean"
        self.loss_normalization = loss_normalization
        self._warned_persistent_set_epoch = False
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
        """Current precision; set it between optimizer steps.

        Setting it raises ValueError if the device cannot run it."""
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
    def max_grad_norm(self) -> float | None:
        """Clip the global gradient norm to this before each optimizer step.

        In fp16 after unscaling. None (or 0 when set): no clipping. Set it between optimizer
        steps.

        Raises:
            ValueError (on set): not None and not a finite number >= 0.
        """
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise ValueError(f"max_grad_norm must be None or a finite number >= 0, "
                             f"got {value!r}")
        self._max_grad_norm = None if not value else float(value)

    @property
    def lr_scale(self) -> float:
        """The multiplier on every param group's learning rate, applied inside the optimizer step.

        Only there, so the schedule keeps its shape (see :mod:`gpuopt.optim`). Set it
        between optimizer steps.

        Raises:
            ValueError (on set): not a finite number >= 0.
        """
        return self.optimizer_settings.lr_scale

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        self.optimizer_settings.lr_scale = value

    @property
    def weight_decay(self) -> float:
        """The weight decay of the decaying param groups; set it between optimizer steps.

        The decaying groups: those not at 0 when the Trainer was made; the others stay 0
        (see :class:`gpuopt.optim.OptimizerSettings`).

        Raises:
            ValueError (on set): not a finite number >= 0, or an optimizer without
                ``weight_decay``.
        """
        return self.optimizer_settings.weight_decay

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        self.optimizer_settings.weight_decay = value

    @property
    def loss_normalization(self) -> str:
        """What the window's gradient (and :attr:`StepStats.loss`) is the mean of.

        - ``"micro_batch_mean"`` (default): each micro-batch's mean loss is divided by the
          number of micro-batches in the window, so the gradient is that of the mean of
          the micro-batches' mean losses. Equal to the mean over the window's samples
          only when the micro-batches are of equal size.
        - ``"samples"``: each micro-batch's mean loss is weighted by its samples over the
          window's samples, so the gradient is that of the mean loss over every sample
          of the window, whatever the micro-batches' sizes (a last short batch of an
          epoch, a sampler that varies them).
        - ``"tokens"``: weighted by tokens (``tokens_per_sample`` or ``count_tokens``)
          over the window's tokens: the mean over every token of the window, for a loss
          that is the mean over a micro-batch's counted tokens (``cross_entropy`` with
          padding at ``ignore_index`` and :func:`count_target_tokens`). A window with no
          tokens gets what the loss function gives for none (NaN for ``cross_entropy``).

        Set it between optimizer steps; it applies from the next window. The micro-batches
        are not fetched ahead: each is weighted by its count over the window's expected
        total (``accum_steps`` times the first micro-batch's count) before its backward,
        and once the window is complete its gradients are multiplied by
        expected / real total where the two differ (one in-place multiply per parameter;
        in fp16 before the GradScaler unscales). Same data wait and memory as the default.

        Raises:
            ValueError: an unknown value, or ``"tokens"`` with no token count declared.
        """
        return self._loss_normalization

    @loss_normalization.setter
    def loss_normalization(self, value: str) -> None:
        if value not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of "
                             f"{', '.join(LOSS_NORMALIZATIONS)}, got {value!r}")
        if value == "tokens" and self.tokens_per_sample is None and self.count_tokens is None:
            raise ValueError('loss_normalization="tokens" needs tokens_per_sample or '
                             "count_tokens to count a micro-batch's tokens")
        self._loss_normalization = value

    @property
    def kernels(self) -> str:
        """The kernel backend: ``"eager"``, ``"compile"`` or ``"triton"``.

        Set it between optimizer steps; setting raises ValueError with the reason if it
        cannot run here."""
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

    @property
    def dropout(self) -> float | None:
        """The ``p`` of every dropout module of the model, from the next forward.

        See :class:`gpuopt.dropout.DropoutRate`. None for a model whose dropout cannot be
        set (its ``dropout_rate.refusal`` says why: the setter raises ``ValueError`` with it
        for any value but None)."""
        return self.dropout_rate.p

    @dropout.setter
    def dropout(self, value: float | None) -> None:
        self.dropout_rate.p = value

    #: The settings :meth:`state_dict` keeps, in the order :meth:`load_state_dict` sets them.
    SETTINGS = ("precision", "accum_steps", "kernels", "checkpointing", "max_grad_norm",
                "lr_scale", "weight_decay", "loss_normalization", "dropout")

    def state_dict(self) -> dict[str, Any]:
        """What a fresh Trainer needs to go on from this optimizer-step boundary as this one would.

        The step and epoch; the model's, optimizer's, scheduler's and GradScaler's states;
        the settings (:attr:`SETTINGS`); the data position (a
        :class:`gpuopt.loader.ReconfigurableLoader`'s own in ``loader``, any other loader's
        in ``data``: :class:`gpuopt.position.DataPosition`, whose resume makes the epoch's
        iterator again and drops the batches already trained); and the random number
        generators (:func:`gpuopt.saving.rng_state`). Tensors and plain values only:
        ``torch.load(path, weights_only=True)`` reads it back.

        Call it between optimizer steps (in a callback's ``on_optimizer_step``). The
        tensors are the live ones, as ``Module.state_dict`` gives them: save them before
        training goes on.
        """
        settings = {name: getattr(self, name) for name in self.SETTINGS
                    if name != "weight_decay"
                    or self.optimizer_settings.weight_decay_reason() is None}
        return {
            "step": self.step, "epoch": self.epoch,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": (None if self.lr_scheduler is None
                             else self.lr_scheduler.state_dict()),
            "grad_scaler": self.mixed_precision.grad_scaler.state_dict(),
            "settings": settings,
            "loader": (self.loader.save_position()
                       if isinstance(self.loader, ReconfigurableLoader) else None),
            "data": (None if isinstance(self.loader, ReconfigurableLoader)
                     else self.data_position.state_dict()),
            "rng": rng_state(self.device),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: what :meth:`state_dict` returned, here or in an earlier process.

        The next :meth:`fit` trains step ``state["step"] + 1`` on, with the same batches (a
        :class:`gpuopt.loader.ReconfigurableLoader` over the same dataset) and random
        numbers as the run that saved it, so on the same machine it continues bit for bit.

        Raises:
            ValueError: a setting this Trainer cannot take (a precision or kernels the
                device cannot run, checkpointing of a model without blocks), or a
                loader position for another kind of loader (its batches would start
                over).
        """
        if state.get("loader") is not None and not isinstance(self.loader,
                                                                ReconfigurableLoader):
            raise ValueError(f"the checkpoint has a ReconfigurableLoader's position, and "
                             f"this loader is a {type(self.loader).__name__}: its batches "
                             "would start over")
        for name in self.SETTINGS:
            if name in state["settings"]:
                setattr(self, name, state["settings"][name])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("lr_scheduler") is not None:
            if self.lr_scheduler is None:
                raise ValueError("the checkpoint has an LR scheduler's state and this "
                                 "Trainer has no lr_scheduler")
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.mixed_precision.grad_scaler.load_state_dict(state["grad_scaler"])
        if state.get("loader") is not None and isinstance(self.loader, ReconfigurableLoader):
            # (a position with another loader was refused above)
            self.loader.restore_position(state["loader"])
        self.step, self.epoch = state["step"], state["epoch"]
        if state.get("data") is not None:
            self.data_position.load_state_dict(state["data"])
        set_rng_state(state["rng"])

    def stop(self) -> None:
        """Ask :meth:`fit` to return at the next optimizer-step boundary (any thread).

        Asked before :meth:`fit` starts, the next one returns before its first step."""
        self._stop.set()

    def _batches(self, epochs: int | None) -> Iterator[Any]:
        while epochs is None or self.epoch < epochs:
            sampler = getattr(self.loader, "sampler", None)
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            if isinstance(self.loader, DataLoader):
                self._set_dataset_epoch(self.loader)
            empty = True
            for batch in (self.loader if isinstance(self.loader, ReconfigurableLoader)
                          else self.data_position.epoch_iterator(self.loader)):
                empty = False
                if self.data_position.dropping:  # (a ReconfigurableLoader's: drawn, dropped)
                    self.data_position.dropping -= 1
                    continue
                yield batch
            self.epoch += 1
            if empty:
                return

    def _set_dataset_epoch(self, loader: DataLoader) -> None:
        """``loader.dataset.set_epoch(epoch)`` when it has one; a warning, once, when the
        loader's persistent workers will not see it (pytorch/pytorch#97326)."""
        set_epoch = getattr(loader.dataset, "set_epoch", None)
        if not callable(set_epoch):
            return
        set_epoch(self.epoch)
        if (loader.num_workers > 0 and loader.persistent_workers
                and not self._warned_persistent_set_epoch):
            self._warned_persistent_set_epoch = True
            warnings.warn(
                f"the DataLoader's persistent workers keep the copy of "
                f"{type(loader.dataset).__name__} made when they started: its "
                "set_epoch(epoch) reaches only the training process, and the workers load "
                "every epoch in their first epoch's state (pytorch/pytorch#97326). Use "
                "gpuopt.loader.ReconfigurableLoader (its workers follow set_epoch) or "
                "persistent_workers=False", RuntimeWarning, stacklevel=2)

    def _tokens_in(self, batch: Any) -> int | None:
        """The declared token count of a micro-batch as the loader gave it, or None."""
        if self.tokens_per_sample is not None:
            inputs = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
            return batch_size(inputs) * self.tokens_per_sample
        if self.count_tokens is None:
            return None
        # whatever the user's counter returned: a one-element tensor is taken too
        count: object = self.count_tokens(batch)
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = int(count)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"count_tokens returned {count!r}, not an int >= 0")
        return int(count)

    def _measures_activations(self) -> bool:
        """Whether the next window's first micro-batch measures its activations: every
        :attr:`measure_activations_every` steps, and when a setting that changes them
        changed since the last measurement."""
        if not self.measure_activations_every or self.kernels == "compile":
            return False  # (Dynamo would trace the meter's hooks and guard on them)
        if self._measured_at is not None:
            step, settings = self._measured_at
            if (0 <= self.step + 1 - step < self.measure_activations_every
                    and settings == (self.precision, self.kernels, self.checkpointing)):
                return False  # not due: the usual step costs two comparisons
        return SavedActivations.blocked_reason() is None  # else: a later window

    def _micro_batch(self, batch: Any, window: int, saved: SavedActivations | None = None,
                     weight: float | None = None) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch; its detached loss and size. The loss
        is divided by ``window`` before backward, or multiplied by ``weight`` when given.
        With ``saved``, the forward's tensors saved for backward are counted in it."""
        if self.fault_injection is not None:
            self.fault_injection(self)
        inputs, targets = to_device(batch, self.device)
        with self.mixed_precision.autocast():
            if saved is None:
                loss = self.loss_fn(self.model_backend(inputs), targets)
            else:
                loss = self._measured_forward(inputs, targets, saved)
        self.mixed_precision.backward(loss / window if weight is None else loss * weight)
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
        except BaseException as error:
            for callback in self.callbacks:
                _call(callback, "on_exception", self, error)
            raise
        finally:
            self._stop.clear()  # honoured: a later fit trains again
            for callback in self.callbacks:
                _call(callback, "on_fit_end", self)
        return self.step

    def _optimizer_step(self, batches: Iterator[Any]) -> bool:
        window = self._accum_steps
        normalization = self._loss_normalization
        weighted = normalization != "micro_batch_mean"
        data_wait_s = 0.0
        samples = 0
        loss_sum: torch.Tensor | None = None
        fetched: list[Any] = []  # this window's batches, kept for one retry after an OOM
        tokens: list[int | None] = []  # their token counts (None: not declared)
        weights: list[int] = []  # "samples"/"tokens": their counts, the loss weights
        expected = 1  # "samples"/"tokens": the window's expected total count
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
                tokens.append(self._tokens_in(batch))
                if weighted:
                    count = _samples_in(batch) if normalization == "samples" else tokens[-1]
                    if count is None:
                        raise ValueError('loss_normalization="tokens" needs '
                                         "tokens_per_sample or count_tokens")
                    weights.append(count)
                    if len(weights) == 1:  # known at the window's start: no fetch ahead
                        expected = window * max(weights[0], 1)
            weight = weights[micro_batches] / expected if weighted else None
            try:
                loss, size = self._micro_batch(fetched[micro_batches], window,
                                               saved if micro_batches == 0 else None,
                                               weight)
            except torch.OutOfMemoryError as error:
                if retried or not self._recovered_from(error):
                    raise
                retried = True  # a callback undid what caused it: run the window again
                self.optimizer.zero_grad(set_to_none=True)
                if saved is not None:
                    saved = SavedActivations(self.model)
                loss_sum, samples, micro_batches = None, 0, 0
                continue
            if weighted:
                loss = loss * weights[micro_batches]
            loss_sum = loss if loss_sum is None else loss_sum + loss
            samples += size
            micro_batches += 1
        if micro_batches == 0:
            return False
        assert loss_sum is not None  # a micro-batch ran: its loss is in the sum
        if weighted:
            total = sum(weights[:micro_batches])
            if total and total != expected:  # unequal sizes, or a last short window
                for param in self.model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(expected / total)
            mean_loss = loss_sum / total  # no tokens at all: NaN, as the loss of none
        else:
            if micro_batches < window:  # data ran out mid-window: divide by the real size
                for param in self.model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(window / micro_batches)
            mean_loss = loss_sum / micro_batches
        grad_norm = None
        if self.max_grad_norm is not None:
            self.mixed_precision.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.max_grad_norm)
        skipped = self.mixed_precision.step(self.optimizer)
        # the rates the step used; a step the GradScaler skipped: the ones it would have
        lr_groups = (self.optimizer_settings.take_step()[0]
                     or self.optimizer_settings.effective_lrs())
        if self.lr_scheduler is not None and self.lr_scheduler_metric is None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.data_position.window_done(micro_batches)
        if saved is not None and self.activation_measurement_error is not None:
            saved = None  # the measurement failed; the window trained without it
        if saved is not None:
            self._measured_at = (self.step, (self.precision, self.kernels, self.checkpointing))
        # every micro-batch's count is declared when the first one's is (the same settings)
        window_tokens = (None if tokens[0] is None
                         else sum(cast(list[int], tokens[:micro_batches])))
        stats = StepStats(self.step, micro_batches, samples, data_wait_s, mean_loss, skipped,
                          None if saved is None else saved.bytes, tokens=window_tokens,
                          lr=lr_groups[0] if lr_groups and isinstance(lr_groups[0], float)
                          else None, grad_norm=grad_norm, lr_groups=lr_groups)
        if self.lr_scheduler_metric is not None:
            metric = self.lr_scheduler_metric(self, stats)
            if metric is not None:
                self.lr_scheduler.step(metric)
        for callback in self.callbacks:
            _call(callback, "on_optimizer_step", self, stats)
        return micro_batches == window


def _check_scheduler(scheduler: Any, metric: Any) -> None:
    """Refuse a scheduler whose ``step()`` needs a metric (a first parameter without a
    default, as ``ReduceLROnPlateau.step(metrics)``) without ``metric``, and ``metric``
    without such a scheduler (a time-driven ``step(epoch)`` would take it for an
    epoch).

    Raises:
        ValueError: with the reason and what to give.
    """
    first = None
    if scheduler is not None:
        try:
            first = next(iter(inspect.signature(scheduler.step).parameters.values()), None)
        except (TypeError, ValueError):  # not introspectable: taken as time-driven
            pass
    needs = (first is not None and first.default is inspect.Parameter.empty
             and first.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                inspect.Parameter.POSITIONAL_OR_KEYWORD))
    name = type(scheduler).__name__
    if needs and metric is None:
        raise ValueError(
            f"{name}.step() needs a metric, which the Trainer cannot guess: give "
            "lr_scheduler_metric=, a function (trainer, stats) -> the metric (e.g. a "
            "validation loss), or None where the scheduler is not to step")
    if metric is not None and not needs:
        raise ValueError(
            "lr_scheduler_metric is for a scheduler whose step() takes a metric (such as "
            "ReduceLROnPlateau); " + ("there is no lr_scheduler" if scheduler is None
                                      else f"{name}.step() takes none"))
    if metric is not None and not callable(metric):
        raise ValueError(f"lr_scheduler_metric must be callable, got {metric!r}")


def _samples_in(batch: Any) -> int:
    """Samples in an ``(input, target)`` batch as the loader gave it (dim 0 of the input)."""
    return batch_size(batch[0] if isinstance(batch, (list, tuple)) and batch else batch)


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
