"""gpuwatch for Hugging Face ``transformers.Trainer``: one line, before ``train()``::

    agent.attach(trainer)                      # or agent.integrations.hf.attach(trainer)

or, for a Trainer built with ``callbacks=[...]``::

    Trainer(..., callbacks=[agent.integrations.hf.GpuwatchCallback()])

What is reported per optimizer step (one accumulation window of micro-batches):

- ``loss``: the window's loss as the Trainer means it: the sum of what ``training_step``
  returned for its micro-batches, i.e. the window's mean loss (token-weighted when the
  model normalises by ``num_items_in_batch``, as causal LMs do; else the mean of the
  micro-batch means), the value whose average HF logs as ``loss``. The detached tensors
  are added on the device and read by the agent's I/O thread, never on the training
  thread.
- ``samples``, ``tokens`` (elements of ``input_ids``, padding included, as HF's
  ``num_input_tokens_seen``) and tokens/s; ``micro_batches``.
- ``data_wait_s``: host seconds inside ``next()`` on HF's epoch iterator, timed around
  the fetch of each micro-batch in ``Trainer.get_batch_samples``.
- ``lr``: param group 0's learning rate as the optimizer step used it, ``lr_scale``
  included (``lr_groups``: every group's; read inside the step, before the scheduler
  steps; HF's own logged ``learning_rate`` is the schedule's).
- ``grad_norm``: the norm HF computes every step (``Trainer._get_grad_norm``: the
  pre-clip norm with ``max_grad_norm > 0``, else an unclipped one), as the device tensor
  HF made; never read on the training thread.
- events: evaluation start and its metrics, checkpoint saves, epoch ends, HF's logs.

Knobs (commands apply at an optimizer-step boundary, in ``on_step_end``, after
``optimizer.step()``, the scheduler step and ``zero_grad``):

- ``precision`` fp32 | bf16 | fp16, from any of them: at the first change the model's
  ``forward`` gets an autocast wrapper at the live precision with its outputs cast back
  to fp32 (what accelerate does for ``bf16=True`` / ``fp16=True``, whose fixed wrapper it
  replaces), so training and evaluation follow the knob; for fp16 one
  ``torch.amp.GradScaler`` (accelerate's own in a run started in fp16, else created at
  the first switch to fp16) is kept across switches and reached through a GradScaler
  lookalike (:class:`gpuopt.precision.SwitchableGradScaler`) installed as
  ``accelerator.scaler`` and on the ``AcceleratedOptimizer``: ``accelerator.backward``
  scales, the GradScaler steps and updates, a skipped step skips HF's scheduler step as
  in an fp16 run, and gradients are unscaled before HF's clipping and grad norm.
  Refused under DeepSpeed and FSDP (``fsdp=``: its mixed precision policy is fixed when
  ``train()`` wraps the model).
- ``accum_steps``: exact from the next window: every window after the change has exactly
  N micro-batches (an epoch's last one fewer when the epoch ends, as HF's own), its loss
  divided by its real size (or normalised by its own ``num_items_in_batch``), the LR
  schedule keeps stepping per optimizer step and the run ends exactly at its planned
  ``max_steps`` (more or fewer epochs than planned when needed; an event says so).
  HF plans the epoch from ``gradient_accumulation_steps`` when ``train()`` starts; the
  integration fetches each window itself (``get_batch_samples``), tells HF's loop where
  the window ends (``args.gradient_accumulation_steps`` per micro-batch in a window not
  aligned to N; N again from the next aligned window), and runs the epochs the new
  window size needs (``Trainer._run_epoch``). Refused for datasets without a length,
  DeepSpeed and SageMaker model parallelism.
- ``checkpointing``: HF's own ``activation_checkpointing_enable`` (``use_reentrant=False``)
  / ``..._disable`` for models that support it; else
  :class:`gpuopt.checkpointing.ActivationCheckpointing` over ``model.blocks``; else
  refused with the reason.
- ``kernels`` eager | compile: the model's ``forward`` runs through one kept
  ``torch.compile`` of it (:class:`gpuopt.compile.CompiledModel`; compile events in the
  event log), evaluation included; ``triton`` is refused (no gpuopt fused modules in a
  transformers model). Refused for runs started with ``torch_compile=True``.
- ``lr_scale``, ``weight_decay``: :class:`gpuopt.optim.OptimizerSettings` on the optimizer
  HF makes when ``train()`` starts (a change scheduled before applies once it exists):
  the scale multiplies what HF's scheduler sets, inside the optimizer step only; the
  decay goes to HF's decay group (``get_decay_parameter_names``: no biases, no
  LayerNorm), which stay 0. Refused under DeepSpeed, and ``weight_decay`` for an
  optimizer without it.
- ``max_grad_norm``: ``args.max_grad_norm`` (0: none), which HF reads at every step
  (``accelerator.clip_grad_norm_``, after unscaling). Refused under DeepSpeed.
- ``checkpoint=now``: HF's own ``Trainer._save_checkpoint`` (model, optimizer, scheduler,
  GradScaler, RNG states, trainer state) into ``<checkpoint_dir>/checkpoint-<N>``, made
  atomic, with gpuwatch's knob values and data position (``gpuwatch.json``; HF's own
  ``save_steps`` checkpoints get it too); ``trainer.train(resume_from_checkpoint=PATH)``
  resumes it exactly (HF restores its state and random numbers, gpuwatch the knobs, with
  :func:`attach`). The data position is the epoch and the micro-batches trained in it,
  which HF's loop is told to skip in place of its own count (``global_step`` x
  ``gradient_accumulation_steps``, wrong once ``accum_steps`` changed); the windows
  after it are planned from the restored ``accum_steps``. The command's reply, and the
  ``resumed`` event, say when the resume cannot be exact (``ignore_data_skip``, a
  dataset without a length, a sampler that is not accelerate's seedable one). Refused
  with several processes and with ``push_to_hub``.
- ``memory_fraction``, ``memory_snapshot_steps``: on CUDA, as in the reference Trainer.
- ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``micro_batch_size``: refused (HF
  builds its DataLoader in ``get_train_dataloader`` when ``train()`` starts).

The run ends (``bye``) when ``train()`` returns, when it raises (the exception named),
on SIGTERM ("stopped by SIGTERM") and at process exit (:class:`agent.integrations.run.RunBase`).

Everything here is imported only when a ``transformers.Trainer`` is attached; importing
:mod:`agent` imports no framework.

.. note:: Cost on the training thread: a few Python calls per micro-batch (one device
   add of the loss) and a few microseconds per optimizer step; no ``.item()``, no
   synchronisation (fp16's GradScaler checks for inf/NaN as in any fp16 run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import torch
import transformers
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import is_sagemaker_mp_enabled

from agent.wire.protocol import EventKind
from agent.integrations.adapters import cpu_threads_knob, dropout_knob
from agent.control.checkpoints import (GRAD_SCALER_FILE, load_tensors, read_knobs_file,
                                       write_knobs_file)
from agent.step.core import Agent, ending_reason
from agent.integrations import WindowMeter
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINT, CHECKPOINTING, DROPOUT, EVALUATE,
                              KERNELS, LR_SCALE, MAX_GRAD_NORM, MICRO_BATCH_SIZE, MIXTURE,
                              NUM_WORKERS, PIN_MEMORY, PRECISION, PREFETCH_FACTOR,
                              WEIGHT_DECAY, Knob, KnobSet)
from agent.step.record import StepRecord
from agent.integrations.run import RunBase, metric_numbers

from gpuopt.optim import OptimizerSettings
from gpuopt.precision import MixedPrecision, precision_support, precision_warning
from gpuopt.saving import rng_state, set_rng_state

__all__ = ["GpuwatchCallback", "attach"]

#: In a ``checkpoint=now`` directory: the random numbers at its epoch's start and at its
#: boundary (:func:`gpuopt.saving.rng_state`'s), which ``rewind`` puts back to make the
#: epoch's batches and what follows again, live (HF's own ``rng_state.pth`` has the
#: boundary's only).
RNG_FILE = "gpuwatch-rng.pt"

LOADER_REASON = ("transformers.Trainer builds its DataLoader in get_train_dataloader when "
                 "train() starts and iterates it inside its own epoch loop; set "
                 "TrainingArguments(dataloader_num_workers=, dataloader_pin_memory=, "
                 "dataloader_prefetch_factor=) and restart")
BATCH_SIZE_REASON = ("transformers.Trainer fixes the micro-batch size in the DataLoader it "
                     "builds when train() starts; set TrainingArguments("
                     "per_device_train_batch_size=) and restart")
MIXTURE_REASON = ("transformers.Trainer draws its batches from train_dataset with a sampler "
                  "of its own: this run's data is not a mixture gpuwatch can weight (use a "
                  "loop or Lightning over a gpuopt.mixture.MixtureLoader)")
#: The keywords of ``Trainer._run_epoch`` the windows and the data position are planned
#: with (transformers 5).
_EPOCH_KEYWORDS = frozenset({"epoch", "steps_in_epoch", "num_update_steps_per_epoch",
                             "epochs_trained", "steps_trained_in_current_epoch",
                             "resume_from_checkpoint"})


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


#: The ``resume_from_checkpoint`` a rollback gives HF's epoch call: HF then skips the
#: trained micro-batches; no such directory, so HF loads no random numbers from it.
_NO_CHECKPOINT = os.path.join(os.sep, "nonexistent", "gpuwatch-rollback")


class _TimedIterator:
    """HF's epoch iterator, with each ``next()`` timed and counted by a WindowMeter."""

    __slots__ = ("iterator", "meter")

    def __init__(self, iterator: Any, meter: WindowMeter) -> None:
        self.iterator = iterator
        self.meter = meter

    def __iter__(self) -> "_TimedIterator":
        return self

    def __next__(self) -> Any:
        return self.meter.timed_next(self.iterator)


def _model_of(trainer: transformers.Trainer) -> nn.Module:
    """The Trainer's model: there from its construction on (``model=``, or what
    ``model_init`` made)."""
    model = trainer.model
    assert model is not None  # a Trainer is built with model= or model_init=
    return model


class _Run(RunBase):
    """One Trainer under the agent, on the run base (:class:`agent.integrations.run.RunBase`): its
    wrappers, its accumulation windows, its knobs and its data position. Every hook of
    :class:`GpuwatchCallback` calls one method here.

    Attributes:
        epoch: the epoch in progress, 0-based as HF counts them (after a resume, the
            checkpoint's, whatever HF derived from ``global_step``).
        micro_index: micro-batches of that epoch trained or started so far: at an
            optimizer-step boundary, the data position a checkpoint keeps.
        resume_path: the checkpoint ``train(resume_from_checkpoint=...)`` was given, until
            training begins and it is restored.
    """

    def __init__(self, trainer: transformers.Trainer, *, name: str, transport: str,
                 compile_backend: str, tokens_per_sample: int | None,
                 checkpoint_dir: str | os.PathLike | None, options: dict[str, Any]) -> None:
        self.trainer = trainer
        args = trainer.args
        self.loss_sum: torch.Tensor | None = None
        self.micro_batches = 0
        self.grad_norm: Any = None
        self.lr: float | None = None
        self.policy = MixedPrecision(args.device.type)
        self.forward: _Forward | None = None  # installed at the first precision or kernels change
        self._scaler_installed = False
        self._originals: dict[str, Any] = {}
        self._instance_attrs: dict[str, Any] = {}  # what the instance itself had there
        # accumulation planning and the data position (see the module docstring)
        self.accum: int | None = None  # None: follow args.gradient_accumulation_steps
        self.accum_changed = False
        self._epoch = 0  # HF's epoch in progress (:attr:`epoch`)
        self.micro_index = 0
        self._steps_in_epoch: int | None = None  # HF's micro-batches in an epoch
        self.window_end = 0  # micro-batch index after the current window
        self.misaligned = False
        #: a resume's correction of HF's position: the saved epoch minus HF's count, and
        #: the ``_run_epoch`` keywords that start HF's loop at the saved micro-batch
        self.epoch_offset = 0
        self._resume_at: dict[str, int] = {}
        self._saved_position: dict[str, int] | None = None  # until the resumed epoch starts
        #: the random numbers where HF made the epoch's iterator (a rollback makes it
        #: again from them)
        self._epoch_rng: dict[str, Any] | None = None
        #: a rollback's position (:meth:`state_snapshot`'s ``data``) that HF's loop goes
        #: back to once its epoch call returns (:meth:`_run_epoch`)
        self._rollback: dict[str, Any] | None = None
        #: the random numbers at a rollback's boundary, set after the first window of
        #: its epoch made again is fetched (as HF's own resume does)
        self._rollback_rng: dict[str, Any] | None = None
        self._epoch_note_sent = False
        self._evaluating = False
        self.epochs_done = 0
        #: the optimizer's settings, made when train() has made the optimizer
        self.optimizer_settings: OptimizerSettings | None = None
        self._weight_decay_reason: str | None = None
        self.resume_path: str | None = None
        self._started_precision = getattr(trainer.accelerator, "mixed_precision", "no")

        knobs = KnobSet()
        self._bind_precision(knobs)
        self._bind_accum(knobs)
        self._bind_checkpointing(knobs)
        self._bind_kernels(knobs, compile_backend)
        self._bind_optimizer(knobs)
        knobs.bind(DROPOUT, dropout_knob(_model_of(trainer)))
        for spec in (NUM_WORKERS, PIN_MEMORY, PREFETCH_FACTOR):
            knobs.bind(spec, LOADER_REASON)
        knobs.bind(MICRO_BATCH_SIZE, BATCH_SIZE_REASON)
        knobs.bind(MIXTURE, MIXTURE_REASON)
        # HF normalises by the window's num_items_in_batch (labels != -100) when the
        # model takes it (or with compute_loss_func); else micro-batch means / window size
        by_tokens = bool(getattr(trainer, "model_accepts_loss_kwargs", False)
                         or getattr(trainer, "compute_loss_func", None) is not None)
        options.setdefault("training", {
            "framework": f"transformers {transformers.__version__}",
            "loss_normalization": "tokens" if by_tokens else "micro_batch_mean"})
        super().__init__(Agent(knobs, name=name, model=trainer.model, device=args.device,
                               transport=transport, **options),
                         device=args.device, tokens_per_sample=tokens_per_sample)
        knobs.add(cpu_threads_knob(knobs))
        self._bind_checkpoint(knobs, checkpoint_dir)
        knobs.add(Knob(EVALUATE, get=lambda: None, set=self._evaluate_now,
                       check=lambda value: self._check_evaluate()))
        self._install()

    # ------------------------------------------------------------------ commands

    def end_loop(self) -> None:
        """HF's own stop: ``control.should_training_stop``, read right after the step's callbacks.

        ``on_train_end`` and the end of ``train()`` run as for ``max_steps``."""
        self.trainer.control.should_training_stop = True

    def _check_evaluate(self) -> None:
        if self.trainer.eval_dataset is None:
            raise ValueError("this Trainer has no eval_dataset for its evaluate()")

    def _evaluate_now(self, value: str) -> dict[str, Any]:
        """HF's own evaluation: ``control.should_evaluate``, so that ``evaluate()`` runs
        right after this step's callbacks, as at an ``eval_steps`` boundary (its metrics
        in the ``evaluation`` event, :meth:`evaluate`)."""
        self._check_evaluate()
        self.trainer.control.should_evaluate = True
        return {"text": "the Trainer's evaluate() runs after this step; its metrics in "
                        "the evaluation event"}

    # ------------------------------------------------------------------ knobs

    def _bind_precision(self, knobs: KnobSet) -> None:
        trainer = self.trainer
        if getattr(trainer, "is_deepspeed_enabled", False):
            knobs.bind(PRECISION, (
                "DeepSpeed keeps its own mixed precision and loss scaling (its config "
                "file); set it there and restart"))
            return
        if getattr(trainer, "is_fsdp_enabled", False):
            knobs.unsupported[PRECISION.name] = (
                "FSDP fixes its MixedPrecisionPolicy when train() wraps the model "
                "(accelerate's fsdp plugin, from --bf16 / --fp16): an autocast over it would "
                "not give the precision asked for; restart with the one you want")
            return
        started = getattr(trainer.accelerator, "mixed_precision", "no") or "no"
        if started not in ("no", "bf16", "fp16"):
            knobs.bind(PRECISION, (
                f"this run started with mixed precision {started!r}, which accelerate "
                "runs its own way; start with fp32, bf16 or fp16 to switch live"))
            return
        if started != "no":
            self.policy.precision = started
        device_type = trainer.args.device.type
        knobs.add(Knob(PRECISION, get=lambda: self.policy.precision, set=self._set_precision,
                       check=lambda value: _refuse(precision_support(value, device_type)),
                       warn=lambda value: precision_warning(value, device_type)))

    def _set_precision(self, value: str) -> None:
        _refuse(precision_support(value, self.device.type))
        self._take_over_forward()
        self._install_scaler()
        self.policy.precision = value

    def _take_over_forward(self) -> None:
        """Put :class:`_Forward` on the model, in place of the forward there (and of
        accelerate's autocast wrapper for a run started in bf16 / fp16, whose
        precision it keeps). Idempotent; atomic (nothing changes when it raises)."""
        if self.forward is not None:
            return
        model = _model_of(self.trainer)
        installed = model.__dict__.get("forward")
        original = model.__dict__.get("_original_forward")
        if getattr(self.trainer.accelerator, "native_amp", False):
            if installed is None or original is None:
                raise ValueError("accelerate's autocast wrapper of model.forward is not "
                                 "there yet (switch once training runs)")
            inner = original  # what accelerate wrapped in its autocast
        else:
            inner = installed if installed is not None else model.forward
        self.forward = _Forward(inner, self.policy)
        self.event_sources.append(self.forward.pop_events)
        model.forward = self.forward
        if original is not None:
            del model._original_forward  # accelerate's unwrap must not restore its wrapper

    def _install_scaler(self) -> None:
        """Make the policy's GradScaler lookalike accelerate's GradScaler (accelerator
        and AcceleratedOptimizer), and unscale with it before HF clips. In fp32 / bf16
        it is a disabled GradScaler: the same steps as without it. A run started in
        fp16 keeps accelerate's GradScaler (its scale and growth tracker) as the
        policy's one GradScaler."""
        if self._scaler_installed:
            return
        from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step

        optimizer = self.trainer.optimizer
        accelerator = self.trainer.accelerator
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise ValueError("the Trainer's optimizer is not accelerate-prepared yet "
                             "(switch precision once training runs)")
        existing = accelerator.scaler
        if existing is not None and not isinstance(existing, torch.amp.GradScaler):
            raise ValueError(f"accelerate's loss scaler is a {type(existing).__name__}, "
                             "not a torch.amp.GradScaler")
        scaler = self.policy.grad_scaler
        if existing is not None:
            self.policy.scaler = existing
        if optimizer.scaler is None:
            inner = optimizer.optimizer
            optimizer._accelerate_step_called = False
            optimizer._optimizer_original_step_method = inner.step
            optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer,
                                                                            inner.step)
        optimizer.scaler = scaler
        accelerator.scaler = scaler
        accelerator.unscale_gradients = self._unscale_gradients
        self._scaler_installed = True

    def _unscale_gradients(self, optimizer: Any = None) -> None:
        """``Accelerator.unscale_gradients`` for the live policy: in fp16, unscale each
        optimizer's gradients (before HF's clipping and grad norm); else nothing."""
        if self.policy.precision != "fp16":
            return
        from accelerate.optimizer import AcceleratedOptimizer

        optimizers = (self.trainer.accelerator._optimizers if optimizer is None else
                      optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.policy.grad_scaler.unscale_(opt)

    def _bind_optimizer(self, knobs: KnobSet) -> None:
        """``lr_scale`` and ``weight_decay`` on the optimizer HF makes when ``train()``
        starts (refused until then), ``max_grad_norm`` as ``args.max_grad_norm`` (HF reads
        it at every step: ``accelerator.clip_grad_norm_``, after unscaling)."""
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            for spec in (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM):
                knobs.bind(spec, (
                    "DeepSpeed runs the optimizer and clips the gradients itself (its "
                    "config's optimizer and gradient_clipping); set them there and restart"))
            return
        args = self.trainer.args

        def weight_decay() -> float:
            if self.optimizer_settings is None or self._weight_decay_reason is not None:
                return float(args.weight_decay)  # what HF's optimizer starts with
            return self.optimizer_settings.weight_decay

        knobs.add(Knob(LR_SCALE, get=lambda: (self.optimizer_settings.lr_scale
                                              if self.optimizer_settings else 1.0),
                       set=lambda value: setattr(self._settings(), "lr_scale", value)))
        knobs.add(Knob(WEIGHT_DECAY, get=weight_decay,
                       set=lambda value: setattr(self._settings(True), "weight_decay", value),
                       check=lambda value: _refuse(self._weight_decay_reason)))
        knobs.add(Knob(MAX_GRAD_NORM, get=lambda: float(args.max_grad_norm or 0.0),
                       set=lambda value: setattr(args, "max_grad_norm", value)))

    def _settings(self, weight_decay: bool = False) -> OptimizerSettings:
        """The optimizer's settings, for a change.

        Raises:
            ValueError: train() has not made the optimizer yet, or (``weight_decay``) it
                has none.
        """
        if self.optimizer_settings is None:
            raise ValueError("the Trainer makes its optimizer when train() starts: set it "
                             "once training runs")
        if weight_decay and self._weight_decay_reason is not None:
            raise ValueError(self._weight_decay_reason)
        return self.optimizer_settings

    def _bind_checkpoint(self, knobs: KnobSet, checkpoint_dir: Any) -> None:
        """``checkpoint=now``: HF's own ``Trainer._save_checkpoint`` (model, optimizer,
        scheduler, GradScaler, RNG states, trainer state), into a directory made atomic,
        with gpuwatch's knob values and data position
        (:data:`agent.control.checkpoints.KNOBS_FILE`);
        ``train(resume_from_checkpoint=...)`` resumes from it, knobs and data included."""
        args = self.trainer.args
        if args.world_size > 1:
            knobs.bind(CHECKPOINT, (
                f"this run has {args.world_size} processes, which HF's checkpoint writes "
                "from together; use TrainingArguments(save_steps=...)"))
            return
        if args.push_to_hub:
            knobs.bind(CHECKPOINT, (
                "this run pushes each checkpoint to the Hub (push_to_hub): use HF's "
                "save_steps, or start without push_to_hub"))
            return
        self.bind_checkpoint(self._save_checkpoint, directory=checkpoint_dir,
                             name="checkpoint-{step}",
                             step=lambda: self.trainer.state.global_step)

    def _save_checkpoint(self, path: Path, knobs: dict[str, Any]) -> None:
        """HF's ``_save_checkpoint`` of the state now into the directory ``path``."""
        trainer = self.trainer
        step = trainer.state.global_step
        def output_dir(trial: Any = None) -> str:
            return str(path)

        # HF saves in path/checkpoint-N: the instance's output dir, for this one call
        trainer._get_output_dir = output_dir  # type: ignore[method-assign]
        try:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        finally:
            del trainer._get_output_dir
        inner = path / f"checkpoint-{step}"
        for entry in inner.iterdir():
            os.replace(entry, path / entry.name)
        inner.rmdir()
        scaler = path / "scaler.pt"  # HF's name (SCALER_NAME)
        if self._scaler_installed and self._started_precision != "fp16" and scaler.exists():
            os.replace(scaler, path / GRAD_SCALER_FILE)
        write_knobs_file(path, self.agent, knobs, step, self.data_state())
        if self._epoch_rng is not None:
            torch.save({"epoch_rng": self._epoch_rng, "rng": rng_state(self.device)},
                       path / RNG_FILE)

    @property
    def epoch(self) -> int:
        """HF's epoch in progress (0-based; the checkpoint's after a resume)."""
        return self._epoch

    def data_state(self) -> dict[str, int] | None:
        """The data position at this boundary: ``epoch`` and ``micro_batches`` trained in it.

        ``epoch`` is 0-based; ``micro_batches`` is what a resume makes HF skip instead of
        its own count (``global_step`` x ``gradient_accumulation_steps``, wrong once
        ``accum_steps`` changed: transformers#5605, #22143). None where the windows are not
        planned here (``accum_steps`` cannot change, so HF's count is right)."""
        if not self.plan:
            return None
        return {"epoch": self._epoch, "micro_batches": self.micro_index}

    def data_reason(self, value: Any = None) -> str | None:
        """Why a resume would not train the data this run goes on to; None when it would.

        HF told to skip nothing, a dataset without a length, or a sampler whose order a
        resume draws again from other random numbers."""
        trainer = self.trainer
        if trainer.args.ignore_data_skip:
            return ("ignore_data_skip=True: transformers.Trainer trains the resumed epoch "
                    "from its first batch again")
        if trainer.train_dataset is not None and not _has_length(trainer.train_dataset):
            return ("the training dataset has no length: a resume skips the batches "
                    "already trained, the same data only if it yields the same batches "
                    "again")
        return _sampler_reason(getattr(trainer.callback_handler, "train_dataloader", None))

    def _resume(self, checkpoint: str) -> None:
        """Training thread, at train()'s start (HF restored its state): every knob value
        of a checkpoint of ours, the GradScaler the precision knob had made, and the
        data position the first epoch starts from (:meth:`_run_epoch`)."""
        saved = read_knobs_file(checkpoint)
        self.step = self.trainer.state.global_step
        differs = self.data_reason()
        if self.plan and not self.trainer.args.ignore_data_skip:
            self._saved_position = saved.get("data")
            if self._saved_position is None and saved.get("knobs"):
                differs = ("the checkpoint has no data position (an older gpuwatch's): HF "
                           "skips global_step x gradient_accumulation_steps micro-batches")
        self.restore(saved.get("knobs", {}), checkpoint, differs=differs,
                     from_run=saved.get("run"))
        scaler = Path(checkpoint) / GRAD_SCALER_FILE
        if scaler.exists() and self._scaler_installed:
            self.policy.grad_scaler.load_state_dict(load_tensors(scaler))

    @property
    def rolling_back(self) -> bool:
        """Whether a rollback ended HF's epoch call, and its position waits to be gone back to.

        See :meth:`_go_back`."""
        return self._rollback is not None

    def _scaler(self) -> Any:
        """The GradScaler in use: the precision knob's, else accelerate's (or None)."""
        if self._scaler_installed:
            return self.policy.grad_scaler
        return getattr(self.trainer.accelerator, "scaler", None)

    #: a recovery keeps these of the state as they are now (the epoch, its micro-batches
    #: and the random numbers, HF's epoch count)
    recovery_data_keys = ("data", "epochs_done", "epoch")

    def rewind_refusal(self) -> str | None:
        """Several processes cannot rewind: HF's ``_load_from_checkpoint`` loads in place.

        On each process alone, before the processes could agree that each can (one that
        fails leaves the others on the checkpoint's weights); and a checkpoint holds one
        process's random numbers."""
        world_size = self.trainer.args.world_size
        if world_size > 1:
            return (f"this run has {world_size} processes, and HF's _load_from_checkpoint "
                    "loads in place, on each alone, and a checkpoint holds one process's "
                    "random numbers: resume with trainer.train(resume_from_checkpoint=...)")
        return super().rewind_refusal()

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A ``checkpoint=now`` checkpoint read as HF's resume does, in the snapshot's form.

        In :meth:`state_snapshot`'s form, read as ``train(resume_from_checkpoint=...)``
        reads it: HF's ``_load_from_checkpoint`` and ``_load_optimizer_and_scheduler``
        (which load in place: the states now are kept in host memory first and put back if
        anything fails), its ``trainer_state.json`` (step, epoch), the GradScaler, and
        gpuwatch's data position and random numbers (:data:`RNG_FILE`).

        Raises:
            ValueError: it has no data position or random numbers of gpuwatch's (HF
                saved it on its own), or the data cannot be put back live here.
        """
        trainer, source = self.trainer, os.fspath(path)
        saved = read_knobs_file(path)
        rng_file = Path(path) / RNG_FILE
        if not saved.get("data") or not rng_file.is_file():
            raise ValueError(f"{path} has no data position and random numbers of "
                             "gpuwatch's (a checkpoint=now checkpoint has them): resume "
                             "from it with trainer.train(resume_from_checkpoint=...)")
        rng = load_tensors(rng_file)
        state = transformers.TrainerState.load_from_json(str(Path(path) / "trainer_state.json"))
        before = self.state_snapshot()  # (raises when the data cannot be put back live)
        model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
        assert model is not None and optimizer is not None and scheduler is not None
        try:
            trainer._load_from_checkpoint(source)
            trainer._load_optimizer_and_scheduler(source)
            snapshot = self.state_snapshot()
        except Exception:
            for target, part in ((model, "model"), (optimizer, "optimizer"),
                                 (scheduler, "lr_scheduler")):
                target.load_state_dict(before[part])
            raise
        for name in (GRAD_SCALER_FILE, "scaler.pt"):  # (HF's name: SCALER_NAME)
            if (Path(path) / name).is_file() and snapshot["grad_scaler"] is not None:
                snapshot["grad_scaler"] = load_tensors(Path(path) / name)
                break
        data = saved["data"]
        snapshot.update(global_step=state.global_step, epoch=state.epoch,
                        epochs_done=data["epoch"],
                        data={"epoch": data["epoch"], "micro_batches": data["micro_batches"],
                              "epoch_rng": rng["epoch_rng"], "rng": rng["rng"]})
        return snapshot, state.global_step, saved.get("knobs", {})

    def live_state(self) -> dict[str, Any]:
        """For a rollback, live: the states, HF's counts, random numbers, data position.

        The model's, optimizer's, scheduler's and GradScaler's states, HF's step and epoch
        counts, the random numbers now and at the epoch's start, and the data position
        (epoch, micro-batches trained in it).

        Raises:
            ValueError: the data position cannot be put back (the windows are not
                planned here, or :meth:`data_reason`).
        """
        trainer = self.trainer
        reason = (self.data_reason() if self.plan and self._epoch_rng is not None else
                  "this Trainer's epoch loop is not the one gpuwatch plans")
        if reason is not None:
            raise ValueError(f"the train data cannot be put back live: {reason}")
        scaler, model = self._scaler(), trainer.model
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        assert model is not None and optimizer is not None and scheduler is not None
        return ({
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "grad_scaler": None if scaler is None else scaler.state_dict(),
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "epochs_done": self.epochs_done,
            "data": {"epoch": self._epoch, "micro_batches": self.micro_index,
                     "epoch_rng": self._epoch_rng, "rng": rng_state(self.device)}})

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Put the states and HF's counts back at once, and end HF's epoch call after this step.

        :meth:`_run_epoch` then trains again from the snapshot's data position
        (:meth:`_go_back`). HF calls ``on_epoch_end`` for the epoch so ended (other
        callbacks see an epoch's end there; gpuwatch reports none)."""
        trainer = self.trainer
        model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
        assert model is not None and optimizer is not None and scheduler is not None
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        scheduler.load_state_dict(snapshot["lr_scheduler"])
        scaler = self._scaler()
        if scaler is not None and snapshot["grad_scaler"] is not None:
            scaler.load_state_dict(snapshot["grad_scaler"])
        trainer.state.global_step = snapshot["global_step"]
        trainer.state.epoch = snapshot["epoch"]
        self.epochs_done = snapshot["epochs_done"]
        trainer._globalstep_last_logged = min(trainer._globalstep_last_logged,
                                              snapshot["global_step"])
        trainer.control.should_training_stop = False
        trainer.control.should_epoch_stop = True
        self._rollback = snapshot["data"]

    def drop_refusal(self, snapshot: Any, micro_batches: int) -> str | None:
        """Why HF cannot skip ``micro_batches`` from ``snapshot``'s position, or None.

        HF skips an epoch's first micro-batches itself when it makes the epoch again
        (:meth:`_go_back`); it makes a later epoch's order only when it starts it, so the
        skip must end within the snapshot's epoch."""
        data = snapshot["data"]
        if self._steps_in_epoch is None:
            return "HF's epoch loop is not the one gpuwatch plans"
        left = self._steps_in_epoch - data["micro_batches"]
        if micro_batches > left:
            return (f"HF makes an epoch's order only when it starts it: only the {left} "
                    f"micro-batches left in epoch {data['epoch']} can be skipped")
        return None

    def drop_micro_batches(self, micro_batches: int) -> None:
        """HF's epoch made again skips ``micro_batches`` more of its first micro-batches.

        After :meth:`load_snapshot` (within the epoch: :meth:`drop_refusal`)."""
        assert self._rollback is not None  # (load_snapshot set it)
        self._rollback = {**self._rollback,
                          "micro_batches": self._rollback["micro_batches"] + micro_batches}

    def _bind_accum(self, knobs: KnobSet) -> None:
        trainer = self.trainer
        reason = None
        if not hasattr(type(trainer), "_run_epoch") or not hasattr(trainer, "get_batch_samples"):
            reason = (f"this transformers version ({transformers.__version__}) has no "
                      "Trainer._run_epoch / get_batch_samples to plan the windows with")
        elif getattr(trainer, "is_deepspeed_enabled", False):
            reason = ("DeepSpeed fixes gradient_accumulation_steps in its engine config "
                      "when train() starts; restart with --gradient_accumulation_steps N")
        elif is_sagemaker_mp_enabled():
            reason = "SageMaker model parallelism accumulates inside its own step function"
        elif trainer.train_dataset is not None and not _has_length(trainer.train_dataset):
            reason = ("the training dataset has no length: transformers.Trainer then plans "
                      "an epoch as max_steps x gradient_accumulation_steps micro-batches "
                      "when train() starts; restart with --gradient_accumulation_steps N")
        if reason is not None:
            knobs.bind(ACCUM_STEPS, reason)
            self.plan = False
            return
        self.plan = True
        knobs.add(Knob(ACCUM_STEPS, get=self._accum_value, set=self._set_accum))

    def _accum_value(self) -> int:
        if self.accum is not None:
            return self.accum
        return self.trainer.args.gradient_accumulation_steps

    def _set_accum(self, value: int) -> None:
        if not self.plan:
            raise ValueError(f"this transformers version's ({transformers.__version__}) "
                             "Trainer._run_epoch is not the one the windows are planned "
                             "with; restart with --gradient_accumulation_steps N")
        if value != self._accum_value():
            self.accum_changed = True
        self.accum = value

    def _bind_checkpointing(self, knobs: KnobSet) -> None:
        model = _model_of(self.trainer)
        if isinstance(model, transformers.PreTrainedModel):
            if model.supports_gradient_checkpointing:
                had_hooks = bool(getattr(model, "_require_grads_hooks", None))
                enable = getattr(model, "activation_checkpointing_enable", None)
                disable = getattr(model, "activation_checkpointing_disable", None)

                def set_checkpointing(value: bool) -> None:
                    if value:
                        if enable is not None:
                            enable(activation_checkpointing_kwargs={"use_reentrant": False})
                        else:
                            model.gradient_checkpointing_enable(
                                gradient_checkpointing_kwargs={"use_reentrant": False})
                        return
                    if disable is not None:
                        disable()
                    else:
                        model.gradient_checkpointing_disable()
                    if not had_hooks:  # the input-grad hooks enable() added, if any
                        model.disable_input_require_grads()

                knobs.add(Knob(CHECKPOINTING, get=lambda: _hf_checkpointing(model),
                               set=set_checkpointing))
                return
            knobs.bind(CHECKPOINTING, (
                f"{type(model).__name__} does not support activation checkpointing "
                "(supports_gradient_checkpointing is False)"))
            return
        from gpuopt.checkpointing import ActivationCheckpointing

        try:
            checkpointing = ActivationCheckpointing(model)
        except ValueError as exc:
            knobs.bind(CHECKPOINTING, str(exc))
            return
        knobs.add(Knob.attribute(CHECKPOINTING, checkpointing, "enabled"))

    def _bind_kernels(self, knobs: KnobSet, compile_backend: str) -> None:
        trainer = self.trainer
        if trainer.args.torch_compile:
            knobs.bind(KERNELS, (
                "this run started with torch_compile=True: accelerate compiles the model "
                "when train() prepares it; start without it to switch kernels live"))
            return
        from gpuopt.compile import compile_support
        from gpuopt.kernels.backend import KernelBackendMixin

        model = _model_of(trainer)
        self.compile_backend = compile_backend
        fused = any(isinstance(module, KernelBackendMixin) for module in model.modules())
        device_type = trainer.args.device.type

        def support(value: str, thorough: bool = False) -> str | None:
            if value == "triton":
                if fused:
                    return ("kernels=triton is not wired for transformers models here; "
                            "use kernels=compile")
                return (f"kernels=triton runs gpuopt's fused Triton modules; "
                        f"{type(model).__name__} has none (a transformers model picks its "
                        "attention kernels with attn_implementation= when it is loaded)")
            if value == "compile":  # (thorough at the switch only: see compile_support)
                return compile_support(compile_backend, device_type, thorough=thorough)
            return None

        def set_kernels(value: str) -> None:
            _refuse(support(value, thorough=True))
            self._take_over_forward()
            assert self.forward is not None  # _take_over_forward put it there
            self.forward.set_compiled(value == "compile", compile_backend)

        knobs.add(Knob(KERNELS, get=lambda: self.forward.kernels if self.forward else "eager",
                       set=set_kernels, check=lambda value: _refuse(support(value))))

    # ------------------------------------------------------------------ wrappers

    def _install(self) -> None:
        """Put the wrappers on the Trainer instance (its class is left alone); each
        calls what was there before (a subclass's override included)."""
        trainer = self.trainer
        names = ["training_step", "get_batch_samples"]
        if hasattr(trainer, "_get_grad_norm"):
            names.append("_get_grad_norm")
        if self.plan:
            names.append("_run_epoch")
        for name in names:
            self._originals[name] = getattr(trainer, name)
            self._instance_attrs[name] = trainer.__dict__.get(name)
            setattr(trainer, name, getattr(self, name))

    def uninstall(self) -> None:
        """After ``train()``: HF's own methods and the optimizer's own step again.

        With the window size in force (``args.gradient_accumulation_steps``); the precision
        and kernels in force stay (the model keeps its :class:`_Forward`)."""
        if self.optimizer_settings is not None:
            self.optimizer_settings.remove()
        if self.accum is not None:
            self.trainer.args.gradient_accumulation_steps = self.accum
        for name, before in self._instance_attrs.items():
            if self.trainer.__dict__.get(name) != getattr(self, name):
                continue  # replaced by someone else since: theirs now
            if before is None:
                del self.trainer.__dict__[name]
            else:
                self.trainer.__dict__[name] = before

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any,
                      **kwargs: Any) -> torch.Tensor:
        """``Trainer.training_step`` of one micro-batch, its loss added to the window's sum.

        Its returned (detached) loss is added to the window's sum on the device."""
        loss = self._originals["training_step"](model, inputs, *args, **kwargs)
        try:
            value = loss.detach().float() if isinstance(loss, torch.Tensor) else \
                torch.tensor(float(loss))
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            self.micro_batches += 1
            self.micro_index += 1
            if self.misaligned and self.micro_index < self.window_end:
                self.trainer.args.gradient_accumulation_steps = self._window_gas(self.micro_index)
        except Exception as exc:  # never crash the training over a measurement
            self.agent.report_error("hf training_step", exc)
        return loss

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any,
                          *args: Any, **kwargs: Any) -> Any:
        """HF's fetch of one accumulation window, each ``next()`` timed.

        With the ``accum_steps`` knob in use, the window has the knob's size."""
        if self.plan:
            num_batches = self._accum_value()
        batches, num_items = self._originals["get_batch_samples"](
            _TimedIterator(epoch_iterator, self.meter), num_batches, device, *args, **kwargs)
        if self._rollback_rng is not None:  # the boundary's, after the epoch is made again
            rng, self._rollback_rng = self._rollback_rng, None
            set_rng_state(rng)
        if self.plan:
            self._plan_window(len(batches))
        return batches, num_items

    def _plan_window(self, size: int) -> None:
        """Tell HF's loop where the window of ``size`` micro-batches just fetched ends.

        HF's loop decides per micro-batch ``j`` of the epoch: optimizer step after it
        when ``(j + 1) % gradient_accumulation_steps == 0`` (or at the epoch's last
        micro-batch), ``on_step_begin`` before it when ``j % ... == 0``. For a window
        starting at a multiple of N, N is right for every micro-batch. Otherwise (only in
        the epoch of a change) each micro-batch gets a value that gives the right
        answer: ``j + 1`` for the window's last (step after it), ``j + 2`` for the
        others (no step), and ``on_step_begin`` is sent here, before the window."""
        trainer = self.trainer
        if size == 0:  # the epoch's data is used up: end HF's (longer) epoch loop
            trainer.control.should_epoch_stop = True
            return
        start, size_n = self.micro_index, self._accum_value()
        self.window_end = start + size
        if start % size_n == 0:
            self.misaligned = False
            trainer.args.gradient_accumulation_steps = size_n
            return
        self.misaligned = True
        trainer.control = trainer.callback_handler.on_step_begin(
            trainer.args, trainer.state, trainer.control)
        trainer.args.gradient_accumulation_steps = self._window_gas(start)

    def _window_gas(self, index: int) -> int:
        return index + 1 if index == self.window_end - 1 else index + 2

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """One epoch of HF's loop, planned for any window size: HF's count of updates
        per epoch becomes an upper bound (the epoch ends when its data does); on a
        resume it starts at the saved data position (:meth:`_at_saved_position`); and
        after HF's last planned epoch more run while the planned max_steps is not
        reached (only after an ``accum_steps`` change, a resume HF counted other epochs
        for, or a loss-spike recovery that skipped data)."""
        run_epoch = self._originals["_run_epoch"]
        if args or not _EPOCH_KEYWORDS <= kwargs.keys():
            self.plan = False  # an unknown signature: HF's own plan, and no accum_steps
            return run_epoch(*args, **kwargs)
        trainer = self.trainer
        state = trainer.state
        last_planned = kwargs["epoch"] >= state.num_train_epochs - 1  # HF calls no more
        kwargs = self._at_saved_position(kwargs)
        kwargs["num_update_steps_per_epoch"] = max(kwargs["num_update_steps_per_epoch"],
                                                   kwargs["steps_in_epoch"])
        self._start_epoch(kwargs)
        result = run_epoch(**kwargs)
        epoch = kwargs["epoch"]
        result = self._go_back(run_epoch, kwargs, result)
        while (last_planned and (self.accum_changed or self.epoch_offset
                                 or self.skipped_windows)
               and not trainer.control.should_training_stop
               and state.global_step < state.max_steps):
            epoch += 1
            if not self._epoch_note_sent:
                self._epoch_note_sent = True
                why = (f"{self.skipped_windows} windows of data skipped by a loss-spike "
                       "recovery" if self.skipped_windows and not self.accum_changed
                       else f"accum_steps={self._accum_value()}")
                self.agent.event("info", f"{why}: the run trains "
                                 f"beyond its {state.num_train_epochs} planned epoch(s) to "
                                 f"reach its planned step {state.max_steps} (max_steps; the "
                                 "LR schedule is built on it)", kind=EventKind.PLAN,
                                 step=state.global_step)
            state.num_train_epochs = epoch + 1
            trainer.control = trainer.callback_handler.on_epoch_begin(
                trainer.args, state, trainer.control)
            kwargs = {**kwargs, "epoch": epoch}
            self._start_epoch(kwargs)
            result = self._go_back(run_epoch, kwargs, run_epoch(**kwargs))
        return result

    def _go_back(self, run_epoch: Callable[..., Any], kwargs: dict[str, Any],
                 result: Any) -> Any:
        """After HF's epoch call ``run_epoch(**kwargs)`` returned ``result``: where a
        rollback ended it (:meth:`load_snapshot`), train again from the rollback's
        position to the end of this epoch, as HF's own resume would: the rollback's
        epoch from its micro-batch (its iterator made again from the random numbers at
        its start, the trained batches skipped by HF, the random numbers set to the
        boundary's after the first window), then each later epoch up to this one.
        Returns the last epoch call's result."""
        trainer = self.trainer
        while self._rollback is not None and not trainer.control.should_training_stop:
            back, self._rollback = self._rollback, None
            epochs = [{**kwargs, "epoch": back["epoch"], "epochs_trained": back["epoch"],
                       "steps_trained_in_current_epoch": back["micro_batches"],
                       "resume_from_checkpoint": _NO_CHECKPOINT}]
            epochs += [{**kwargs, "epoch": epoch}
                       for epoch in range(back["epoch"] + 1, kwargs["epoch"] + 1)]
            set_rng_state(back["epoch_rng"] if back["micro_batches"] else back["rng"])
            self._rollback_rng = back["rng"] if back["micro_batches"] else None
            for again in epochs:
                if trainer.control.should_training_stop or self.rolling_back:
                    break  # (a rollback again, in an epoch trained again)
                trainer.control = trainer.callback_handler.on_epoch_begin(
                    trainer.args, trainer.state, trainer.control)
                self._start_epoch(again)
                result = run_epoch(**again)
        return result

    def _at_saved_position(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """HF's ``_run_epoch`` keywords, put at the data position of the checkpoint
        resumed from: HF derives the epoch (``global_step // num_update_steps_per_epoch``)
        and the micro-batches to skip in it (``global_step % ... x
        gradient_accumulation_steps``) from a fixed window size; the saved epoch and
        micro-batch count replace them, and every later epoch number moves by as much."""
        if (self._saved_position is not None and kwargs["resume_from_checkpoint"] is not None
                and kwargs["epoch"] == kwargs["epochs_trained"]):
            saved, self._saved_position = self._saved_position, None
            self.epoch_offset = saved["epoch"] - kwargs["epochs_trained"]
            self._resume_at = {"epochs_trained": saved["epoch"],
                               "steps_trained_in_current_epoch": saved["micro_batches"]}
        return {**kwargs, **self._resume_at, "epoch": kwargs["epoch"] + self.epoch_offset}

    def _start_epoch(self, kwargs: dict[str, Any]) -> None:
        args = self.trainer.args
        self._epoch_rng = rng_state(self.device)  # HF makes the epoch's iterator next
        self._epoch = kwargs["epoch"]
        # the epochs before this one (a resumed run starts in a later one than its first)
        self.epochs_done = kwargs["epoch"]
        self._steps_in_epoch = kwargs["steps_in_epoch"]
        self.micro_index = 0
        if (kwargs["resume_from_checkpoint"] is not None
                and kwargs["epoch"] == kwargs["epochs_trained"]
                and not args.ignore_data_skip):  # HF skips them: they count as trained
            self.micro_index = kwargs["steps_trained_in_current_epoch"]
        self.misaligned = False
        args.gradient_accumulation_steps = self._accum_value()

    def _get_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        """HF's gradient norm of the step, kept as HF made it (a device tensor)."""
        norm = self._originals["_get_grad_norm"](*args, **kwargs)
        self.grad_norm = norm
        return norm

    # ------------------------------------------------------------------ hooks

    def train_begin(self) -> None:
        optimizer: Any = self.trainer.optimizer  # or a wrapper of it
        while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
            optimizer = optimizer.optimizer
        if isinstance(optimizer, torch.optim.Optimizer) and self.optimizer_settings is None:
            self.optimizer_settings = OptimizerSettings(
                optimizer, decay_groups=_decay_groups(self.trainer, optimizer))
            self._weight_decay_reason = self.optimizer_settings.weight_decay_reason()
            self.agent.refresh_knobs()  # the optimizer's own weight_decay, not args'
        if self.resume_path is not None:
            self._resume(self.resume_path)
            self.resume_path = None
        accelerator = self.trainer.accelerator
        if self.trainer.args.fsdp and not getattr(self.trainer, "is_fsdp_enabled", False):
            self.agent.event("warning", (
                f"fsdp={self.trainer.args.fsdp!r} is not FSDP here: accelerate runs "
                f"{accelerator.distributed_type.value} (its FSDP plugin only on a GPU-like "
                "device), so the model is not sharded and the knobs are that run's"),
                kind=EventKind.WARNING)
        self.agent.mark_start()

    def optimizer_step(self, optimizer: Any) -> None:
        try:
            source = optimizer or self.trainer.optimizer
            lr = source.param_groups[0]["lr"] if source is not None else None
            self.lr = float(lr) if isinstance(lr, (int, float)) or (
                isinstance(lr, torch.Tensor) and lr.device.type == "cpu") else None
        except Exception:
            self.lr = None

    def step_end(self, state: Any) -> None:
        wait_s, _, samples, tokens = self.meter.take()
        loss, self.loss_sum = self.loss_sum, None
        micro_batches, self.micro_batches = self.micro_batches, 0
        grad_norm, self.grad_norm = self.grad_norm, None
        lr: Any = self.lr
        if self.optimizer_settings is not None:  # every group's rate, as the step used it
            lr = self.optimizer_settings.take_step()[0] or lr
        skipped = None
        if self._scaler_installed:
            skipped = self.policy.grad_scaler.skipped
        elif getattr(self.trainer.accelerator, "scaler", None) is not None:  # fp16 start
            skipped = torch.tensor(self.trainer.accelerator.optimizer_step_was_skipped)
        self.boundary(StepRecord(
            step=state.global_step, micro_batches=max(micro_batches, 1), samples=samples,
            data_wait_s=wait_s, loss=loss, skipped=skipped, tokens=tokens, lr=lr,
            grad_norm=grad_norm))

    def prediction_step(self, state: Any) -> None:
        if not self._evaluating:
            self._evaluating = True
            self.agent.event("info", f"evaluation started after step {state.global_step}",
                             kind=EventKind.EVALUATION_START, step=state.global_step)

    def evaluate(self, state: Any, metrics: dict[str, Any] | None) -> None:
        self._evaluating = False
        self.publish_evaluation(state.global_step, metrics)
        self.agent.mark_start()  # the next step's time leaves the evaluation out

    def save(self, args: Any, state: Any) -> None:
        """After HF saved a checkpoint of its own: gpuwatch's knob values and data position go in.

        HF's own: ``save_steps``, ``save_strategy``. With them in it,
        ``train(resume_from_checkpoint=...)`` resumes it exactly as a ``checkpoint=now`` one
        (a few hundred bytes of JSON, on the process that saves)."""
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(path):
            write_knobs_file(Path(path), self.agent, self.chosen_knobs()[0],
                             state.global_step, self.data_state())
        self.agent.event("info", f"checkpoint saved at step {state.global_step}: {path}",
                         kind=EventKind.CHECKPOINT_SAVED, step=state.global_step, path=path)
        self.agent.mark_start()  # the next step's time leaves the save out

    def epoch_end(self, state: Any, control: Any) -> None:
        if self.rolling_back:  # ended by a rollback: no epoch's end
            return
        self.epochs_done += 1
        complete = not control.should_training_stop  # HF also ends an epoch cut short
        how = "ended" if complete else "stopped (the run ends)"
        self.agent.event("info", f"epoch {self.epochs_done} {how} at step {state.global_step}",
                         kind=EventKind.EPOCH_END, epoch=self.epochs_done, complete=complete,
                         step=state.global_step)

    def log(self, state: Any, logs: dict[str, Any] | None) -> None:
        numbers, shown = metric_numbers(logs)
        if not numbers:
            return
        self.agent.event("info", f"log at step {state.global_step}: {shown}", kind=EventKind.LOG,
                         step=state.global_step, logs=numbers)


class _Forward:
    """``model.forward`` while gpuwatch steers it (an instance attribute, so module hooks
    run as before): the forward it replaced, through one kept ``torch.compile`` of it
    under ``kernels=compile``, inside autocast at the policy's live precision with the
    outputs cast back to fp32, as accelerate's own mixed-precision wrapper does (so the
    loss HF computes outside the model, and evaluation, see what they would in a run
    started with ``bf16=True`` / ``fp16=True``). In fp32 it only calls the forward.

    Autocast wraps the compiled call: Dynamo guards on the autocast state, so a
    precision change compiles once per combination, never runs stale code."""

    def __init__(self, inner: Callable[..., Any], policy: MixedPrecision) -> None:
        self.inner = inner
        self.policy = policy
        self.compiled: Any = None  # a gpuopt.compile.CompiledModel, made once
        self.target: Callable[..., Any] = inner

    @property
    def kernels(self) -> str:
        return "compile" if self.compiled is not None and self.compiled.enabled else "eager"

    def set_compiled(self, enabled: bool, backend: str) -> None:
        """Switch ``kernels`` between eager and compile (between optimizer steps)."""
        if enabled and self.compiled is None:
            from gpuopt.compile import CompiledModel

            self.compiled = CompiledModel(self.inner, backend=backend)
            self.target = self.compiled  # disabled, it calls ``inner`` eagerly
        if self.compiled is not None:
            self.compiled.enabled = enabled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy.precision == "fp32":
            return self.target(*args, **kwargs)
        from accelerate.utils.operations import convert_to_fp32

        with self.policy.autocast():
            outputs = self.target(*args, **kwargs)
        return convert_to_fp32(outputs)

    def pop_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Compile events since the last call; empty and free when compile was never used.

        See :meth:`gpuopt.compile.CompiledModel.pop_step_events`."""
        return [] if self.compiled is None else self.compiled.pop_step_events()


def _decay_groups(trainer: transformers.Trainer, optimizer: torch.optim.Optimizer
                  ) -> list[int] | None:
    """The param groups of HF's decay split (``get_decay_parameter_names``: no biases, no
    norms), which HF's ``create_optimizer`` gives ``args.weight_decay`` (0 by default, so
    it cannot be told from the split's other group by value); None for an optimizer
    whose groups do not follow that split."""
    model = _model_of(trainer)
    names = set(trainer.get_decay_parameter_names(model))
    decaying = {id(p) for name, p in model.named_parameters() if name in names}
    groups = [index for index, group in enumerate(optimizer.param_groups)
              if group["params"] and all(id(p) in decaying for p in group["params"])]
    return groups or None


def _has_length(dataset: Any) -> bool:
    try:
        len(dataset)
    except (TypeError, NotImplementedError):
        return False
    return not isinstance(dataset, torch.utils.data.IterableDataset)


def _sampler_reason(loader: Any) -> str | None:
    """Why a resumed epoch of ``loader`` (the Trainer's prepared training DataLoader)
    would not have the saved run's order, or None: a ``RandomSampler`` draws the order
    from torch's generator when the epoch starts, which a resume cannot put back there
    (accelerate's seedable sampler, HF's default, draws it from its seed and the
    epoch)."""
    from accelerate.data_loader import SeedableRandomSampler

    batches = getattr(loader, "batch_sampler", None)
    sampler = getattr(getattr(batches, "batch_sampler", batches), "sampler", None)
    if isinstance(sampler, torch.utils.data.RandomSampler) and not isinstance(
            sampler, SeedableRandomSampler):
        return ("the training sampler draws each epoch's order from torch's random "
                "numbers when the epoch starts, which a resume draws again from others: "
                "keep TrainingArguments(accelerator_config={'use_seedable_sampler': True})")
    return None


def _hf_checkpointing(model: Any) -> bool:
    """Whether HF's activation checkpointing is on in ``model`` (no deprecation warning)."""
    return any(getattr(module, "gradient_checkpointing", False) is True
               for module in model.modules())


def _find_trainer() -> transformers.Trainer | None:
    """The ``transformers.Trainer`` whose ``train()`` is calling us (its frame's
    ``self``), for a callback made without one. Walks the call stack once."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


class GpuwatchCallback(TrainerCallback):
    """The gpuwatch agent as a ``transformers.TrainerCallback``.

    With a ``trainer`` (what :func:`attach` does) the agent starts at once; without one
    (``Trainer(..., callbacks=[GpuwatchCallback()])``) it starts at ``on_train_begin``,
    with the Trainer found on the call stack of its ``train()``. It closes (``bye``, run
    file removed) at ``on_train_end``, when ``train()`` raises (with :func:`attach`; an
    uncaught exception otherwise), on SIGTERM, or at process exit. See the module
    docstring for what it reports and its knobs.

    Args:
        trainer: the ``transformers.Trainer`` to observe and steer, or None (see above).
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"`` (see :class:`agent.Agent`).
        compile_backend: ``torch.compile`` backend of ``kernels=compile``
            (``"inductor"``; ``"aot_eager"`` compiles much faster on small CPUs).
        tokens_per_sample: tokens in one sample, for token models whose batches have no
            ``input_ids``; by default tokens are the elements of ``input_ids``.
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        options: more :class:`agent.Agent` arguments.

    Attributes:
        agent: the :class:`agent.Agent` (None until it starts).

    .. note:: Never raises into training: a failure inside a hook is reported once as
       an event and the agent stops observing; training goes on.
    """

    def __init__(self, trainer: transformers.Trainer | None = None, *, name: str = "",
                 transport: str = "ipc", compile_backend: str = "inductor",
                 tokens_per_sample: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, **options: Any) -> None:
        self._settings: dict[str, Any] = dict(
            name=name, transport=transport, compile_backend=compile_backend,
            tokens_per_sample=tokens_per_sample, checkpoint_dir=checkpoint_dir,
            options=options)
        self.run: _Run | None = None
        self._failed = False  # no Trainer to observe was found
        if trainer is not None:
            self._bind(trainer)

    @property
    def agent(self) -> Agent | None:
        return self.run.agent if self.run is not None else None

    def _bind(self, trainer: transformers.Trainer) -> None:
        self.run = _Run(trainer, **self._settings)
        self.run.start()

    def _call(self, what: Callable[[], Any]) -> None:
        """Run one hook body; an error stops the observing (an event says so), never
        raised into training."""
        if self.run is None or self.run.broken:
            return
        try:
            what()
        except Exception as exc:
            self.run.fail("a transformers.Trainer callback", exc)

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: D102
        if self.run is None and not self._failed:
            try:
                trainer = _find_trainer()
                if trainer is None:
                    raise RuntimeError("no transformers.Trainer on the call stack")
                self._bind(trainer)
            except Exception as exc:
                self._failed = True
                print(f"gpuwatch: not observing this run: {exc}", file=sys.stderr)
                return
        self._call(self.run.train_begin)

    def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: D102
        self._call(lambda: self.run.optimizer_step(kwargs.get("optimizer")))

    def on_step_end(self, args, state, control, **kwargs):  # noqa: D102
        self._call(lambda: self.run.step_end(state))

    def on_prediction_step(self, args, state, control, **kwargs):  # noqa: D102
        self._call(lambda: self.run.prediction_step(state))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: D102
        self._call(lambda: self.run.evaluate(state, metrics))

    def on_save(self, args, state, control, **kwargs):  # noqa: D102
        self._call(lambda: self.run.save(args, state))

    def on_epoch_end(self, args, state, control, **kwargs):  # noqa: D102
        self._call(lambda: self.run.epoch_end(state, control))

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: D102
        self._call(lambda: self.run.log(state, logs))

    def on_train_end(self, args, state, control, **kwargs):  # noqa: D102
        if self.run is not None:
            try:
                self.run.close("finished")
            except Exception:  # noqa: BLE001 -- never into training
                pass


def attach(trainer: transformers.Trainer, *, name: str = "", transport: str = "ipc",
           loggers: bool = False,
           **options: Any) -> Agent:
    """Attach a started agent to a ``transformers.Trainer`` before ``train()``; return the agent.

    Adds a :class:`GpuwatchCallback` (``trainer.add_callback``) and wraps the
    instance's ``train`` so that the agent also closes when training raises (``bye``
    names the exception), and so that ``train(resume_from_checkpoint=PATH)`` (or
    ``True``: HF's last checkpoint in ``output_dir``) of a checkpoint with gpuwatch's
    file restores gpuwatch's knob values and data position too (HF restores the rest).
    The agent reports every optimizer step of the next ``train()`` and takes the knobs
    listed in the module docstring; the others are refused with their reason.

    Args:
        trainer: the Trainer, not yet training.
        name: label for the run (default: the script name).
        transport: ``"ipc"`` or ``"tcp"``.
        loggers: also add gpuwatch's measurements and knob values to every log of the
            Trainer, so its ``report_to`` integrations record them
            (:class:`agent.integrations.hf_loggers.GpuwatchHFLoggers`).
        options: ``compile_backend``, ``tokens_per_sample``, ``checkpoint_dir`` (see
            :class:`GpuwatchCallback`) and more :class:`agent.Agent` arguments.

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        ValueError: ``resume_from=`` (HF resumes with ``train(resume_from_checkpoint=
            PATH)``).
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"expected a transformers.Trainer, got {type(trainer).__name__}")
    if "resume_from" in options:
        raise ValueError("a transformers.Trainer resumes through HF: trainer.train("
                         "resume_from_checkpoint=PATH) (gpuwatch's knob values come back "
                         "with it)")
    callback = GpuwatchCallback(trainer, name=name, transport=transport, **options)
    trainer.add_callback(callback)
    if loggers:
        from agent.integrations.hf_loggers import GpuwatchHFLoggers

        trainer.add_callback(GpuwatchHFLoggers(trainer))
    train = trainer.train

    def train_closing_on_error(*args: Any, **kwargs: Any) -> Any:
        run = callback.run
        assert run is not None  # the callback was made with the trainer: it has its run
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True and os.path.isdir(trainer.args.output_dir or ""):
            resume = get_last_checkpoint(trainer.args.output_dir)  # as HF finds it
        if isinstance(resume, (str, os.PathLike)):
            run.resume_path = os.fspath(resume)
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            run.close(ending_reason(exc))
            raise

    train_closing_on_error.__doc__ = train.__doc__
    # the instance's train, wrapped (its class is left alone)
    trainer.train = train_closing_on_error  # type: ignore[method-assign]
    agent = callback.agent
    assert agent is not None  # made with the trainer: its agent is started
    return agent
