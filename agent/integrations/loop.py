"""The agent for a hand-written training loop: :func:`session`.

A loop keeps its own structure (its ``micro_step`` loop, its ``ctx``, its ``scaler``,
its ``get_batch()``) and takes its settings from the run object instead, so that every
loop knob is live::

    run = agent.session(model=model, optimizer=optimizer, precision="bf16",
                        accum_steps=8, tokens_per_sample=block_size)
    ctx, scaler, get_batch = run.autocast, run.scaler, run.timed(get_batch)
    while True:
        for micro_step in range(run.accum_steps):        # read at each window's start
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / run.accum_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        run.optimizer_step()                              # the boundary: commands apply

The run starts at once (no ``with`` needed) and ends when the process exits, on SIGTERM
as on a normal exit (``bye`` sent, run file removed); ``with agent.session(...)`` or
:meth:`Session.close` end it sooner.

Loss convention: the loss a step reports is the window's mean loss. Without an argument
:meth:`LoopRun.optimizer_step` takes it from :attr:`Session.scaler`: the sum of the
losses passed to ``scaler.scale()`` in the window, which is the window's mean when each
micro-batch's loss was divided by the window size (``loss / run.accum_steps``) before
backward, as gradient accumulation requires. A loop without the scaler passes the
window's mean (undivided) loss itself: ``run.optimizer_step(loss)``.

What a loop that takes its data and window from the run has, whatever runs its
forward and backward, is :class:`LoopRun` (Lightning Fabric's loops share it:
:mod:`agent.integrations.fabric`), with the binders of the model's and the optimizer's
knobs (:func:`model_knobs`, :func:`optimizer_settings_knobs`).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from agent.integrations.adapters import (cpu_threads_knob, dropout_knob, loader_knobs,
                                         micro_batch_size_knob, optimizer_knobs, precision_knob,
                                         refuse)
from agent.control.checkpoints import load_checkpoint, restore_knobs, torch_checkpoint
from agent.step.core import Agent
from agent.step._hot import RunPath
from agent.integrations.run import RunBase
from agent.integrations.ranks import agree
from agent.integrations.sharded import (fsdp_modules, is_sharded,
                                        load_sharded, save_sharded,
                                        sharded_precision, sync_at_window_end)
from agent.wire.protocol import EventKind
from agent.wire.knobs import (ACCUM_STEPS, CHECKPOINT, CHECKPOINTING, KERNELS, LOADER_KNOBS,
                              DROPOUT, LR_SCALE, MAX_GRAD_NORM, MICRO_BATCH_SIZE, PRECISION,
                              WEIGHT_DECAY, Knob, KnobSet)
from gpuopt.backends import ModelBackend
from gpuopt.checkpointing import ActivationCheckpointing
from gpuopt.loader import ReconfigurableLoader
from gpuopt.memory import SavedActivations
from gpuopt.optim import OptimizerSettings
from gpuopt._hotpath import Fetches
from gpuopt.precision import MixedPrecision, precision_name
from gpuopt.saving import rng_state, set_rng_state

#: Optimizer steps between two activation-memory measurements (as the Trainer's default).
MEASURE_ACTIVATIONS_EVERY = 20


class _MeasuredAutocast:
    """The loop's ``ctx``: the policy's reusable autocast, and on the first micro-batch
    of every :attr:`Session.measure_activations_every`-th window (and the first after a
    change of a knob that changes activations: precision, kernels, checkpointing) a
    :class:`SavedActivations` around the forward. Never measures under ``no_grad``
    (evaluation), under ``kernels=compile`` (Dynamo would trace the meter's hooks) or
    under saved-tensor hooks of your own."""

    def __init__(self, run: "Session") -> None:
        self._run = run
        self._saved: list[SavedActivations | None] = []

    def __enter__(self) -> None:
        run = self._run
        saved = None
        if run._measure_due and torch.is_grad_enabled():
            run._measure_due = False
            if SavedActivations.blocked_reason() is None:
                saved = SavedActivations(run.model)
                saved.__enter__()
        self._saved.append(saved)
        run.mixed_precision.autocast().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._run.mixed_precision.autocast().__exit__(*exc_info)
        saved = self._saved.pop()
        if saved is not None:
            saved.__exit__(*exc_info)
            self._run._activation_bytes = saved.bytes

    def __call__(self) -> "_MeasuredAutocast":
        return self  # ``with run.autocast:`` and ``with run.autocast():`` alike


class LoopRun(RunBase):
    """A run whose loop takes its data and its window size from the run.

    Batches through :meth:`loader` (or :meth:`timed`), micro-batches per optimizer step from
    :attr:`accum_steps` (or :attr:`is_accumulating`), the boundary at
    :meth:`optimizer_step`. What a hand-written loop (:class:`Session`) and a Lightning
    Fabric loop (:class:`agent.integrations.fabric.FabricRun`) share; a subclass says how
    its window's losses are counted (:meth:`_take_window`) and how it saves and resumes.

    Attributes:
        agent: the :class:`agent.Agent`. step: optimizer steps marked so far (after a
            resume, the checkpoint's: the loop goes on from there).
        epoch: epochs :meth:`loader` iterated to their end (after a resume, the
            checkpoint's: a loop that counts its own epochs starts from it).
        optimizer_settings: ``lr_scale``, ``weight_decay`` and the clipping of
            ``max_grad_norm`` inside the optimizer's step
            (:class:`gpuopt.optim.OptimizerSettings`), or None without an optimizer.
    """

    #: how the loop declares a setting (``.format("accum_steps=N")``), for the reasons
    #: of what it has not declared
    declare = "agent.session({})"
    #: what a loop that declares ``accum_steps`` does with it
    accum_use = ("read run.accum_steps in its micro-step loop, or run.is_accumulating "
                 "after each fetch")

    def __init__(self, agent: Agent, *, accum_steps: int | None,
                 optimizer_settings: OptimizerSettings | None,
                 tokens_per_sample: int | None, accum_refused: str | None = None) -> None:
        super().__init__(agent, device=agent.device, tokens_per_sample=tokens_per_sample)
        self.optimizer_settings = optimizer_settings
        self._accum_steps = accum_steps
        #: knobs of the checkpoint resumed from that this run had not bound then
        self._unbound_knobs: dict[str, Any] = {}
        #: a ReconfigurableLoader's own position from the checkpoint resumed from, set
        #: on it when :meth:`loader` gets it
        self._loader_position: dict[str, Any] | None = None
        self._reconfigurable: ReconfigurableLoader | None = None
        #: the iterations :meth:`loader` made that are still alive (:meth:`end_loop`
        #: closes them)
        self._iterations: weakref.WeakSet[Fetches] = weakref.WeakSet()
        #: windows in a row whose counted micro-batches were not ``accum_steps``; None once
        #: the loop was warned (or has no ``accum_steps``): :meth:`_window_off`
        self._windows_off: int | None = 0 if accum_steps is not None else None
        if accum_steps is not None and accum_refused is None:
            self.knobs.add(Knob(ACCUM_STEPS, get=lambda: self.accum_steps,
                                set=self._set_accum_steps))
        else:  # (a window size the knob may not change is still the loop's)
            self.knobs.bind(ACCUM_STEPS, (
                accum_refused or (
                f"this loop did not declare accum_steps: pass "
                f"{self.declare.format('accum_steps=N')} and {self.accum_use}")))
        for spec in (*LOADER_KNOBS, MICRO_BATCH_SIZE):  # (bound by loader())
            self.knobs.unsupported.setdefault(spec.name, (
                "this loop's data does not come through a gpuopt.loader.ReconfigurableLoader "
                "given to run.loader(...)"))

    # ------------------------------------------------------------ what the loop reads

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step: read it at the start of each window.

        The knob changes it only at a boundary, so it is constant within a window.

        Raises:
            AttributeError: the run was made without ``accum_steps=``.
        """
        if self._accum_steps is None:
            raise AttributeError(f"this run has no accum_steps: pass "
                                 f"{self.declare.format('accum_steps=N')} to make it a knob")
        return self._accum_steps

    @property
    def is_accumulating(self) -> bool:
        """Whether the micro-batch last fetched from :meth:`loader` is not the last of its window.

        Its accumulation window: :attr:`accum_steps` micro-batches, counted from the
        boundary. For a loop over :meth:`loader` (or :meth:`timed`) that reads it after each
        fetch and steps the optimizer after the micro-batch for which it is False (the
        other form reads :attr:`accum_steps` at each window's start and fetches that many)::

            for x, y in run.loader(train_loader):
                accumulating = run.is_accumulating
                (loss_fn(model(x), y) / run.accum_steps).backward()
                if not accumulating:
                    optimizer.step(); optimizer.zero_grad(); run.optimizer_step()

        Raises:
            AttributeError: the run has no ``accum_steps`` (made without ``accum_steps=``).
            RuntimeError: no micro-batch of this window came through :meth:`loader`.
        """
        accum_steps, fetched = self.accum_steps, self.meter.fetched
        if not fetched:
            raise RuntimeError("run.is_accumulating counts the micro-batches run.loader() "
                               "fetched, and none came through it in this window: iterate "
                               "run.loader(train_loader)")
        return fetched < accum_steps

    def _set_accum_steps(self, value: int) -> None:
        self._accum_steps = value

    # ------------------------------------------------------------ data

    def loader(self, batches: Iterable[Any], *, epochs: int | None = 1) -> Iterator[Any]:
        """Iterate ``batches`` for ``epochs`` epochs, timing each ``next()`` and counting its batch.

        ``epochs`` None: epoch after epoch until the loop stops; an epoch that yields
        nothing ends it. Each ``next()`` is timed (the data wait), and samples (dim 0 of the
        batch's first tensor) and tokens are counted. Given a
        :class:`gpuopt.loader.ReconfigurableLoader`, its ``num_workers``, ``pin_memory`` and
        ``prefetch_factor`` become live knobs (announced to dashboards at once), and
        ``micro_batch_size`` too when the run has ``accum_steps``.

        Raises:
            ValueError: ``epochs`` is not None or an integer >= 1.
        """
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):
            raise ValueError(f"epochs must be None or an integer >= 1, got {epochs!r}")
        self.bind_loader(batches)
        return self._batches(batches, epochs)

    def bind_loader(self, batches: Any) -> None:
        """The knobs of ``batches`` when it is the first ReconfigurableLoader seen; else nothing.

        Put at the checkpoint's position after a resume; nothing for other data."""
        if isinstance(batches, ReconfigurableLoader) and self._reconfigurable is None:
            self._reconfigurable = batches
            if self._loader_position is not None:
                batches.restore_position(self._loader_position)
                self._loader_position = None
        if (isinstance(batches, ReconfigurableLoader)
                and "num_workers" not in self.agent.knobs.knobs):
            for knob in loader_knobs(batches):
                self.agent.knobs.add(knob)
            if ACCUM_STEPS.name in self.agent.knobs.knobs:
                self.agent.knobs.add(micro_batch_size_knob(batches, lambda: self.accum_steps,
                                                           self._set_accum_steps))
            else:
                self.agent.knobs.bind(MICRO_BATCH_SIZE, (
                    "it moves accum_steps to keep the effective batch, and accum_steps: "
                    + self.agent.knobs.unsupported[ACCUM_STEPS.name]))
            self.agent.refresh_knobs()
            self._restore_unbound()

    def _restore_unbound(self) -> None:
        """The knobs of the checkpoint resumed from that only :meth:`loader` binds (the
        loader's, ``micro_batch_size``): set now, with the saved ``accum_steps`` kept
        (``micro_batch_size`` moves it)."""
        knobs = {name: value for name, value in self._unbound_knobs.items()
                 if name in self.agent.knobs.knobs}
        if not knobs:
            return
        for name in knobs:
            del self._unbound_knobs[name]
        if self._accum_steps is not None:
            knobs[ACCUM_STEPS.name] = self._accum_steps
        restore_knobs(self.agent, knobs, self.resumed_from or "", self.step)

    def _batches(self, batches: Iterable[Any], epochs: int | None) -> Iterator[Any]:
        """The iteration :meth:`loader` returns: the data position's own generator
        (:meth:`gpuopt.position.DataPosition.iterate`), each ``next()`` timed, with no
        generator of the run's around it and no per-batch check: after stop (applied at a
        boundary in the last batch's iteration) nothing more is fetched, in this epoch or
        a later one's loader(), since :meth:`end_loop` closes it (and an iteration made
        after stop is closed at once)."""
        iteration = self.position.iterate(batches, epochs, self.meter.add)
        if self.stopping:
            iteration.close()
        else:
            self._iterations.add(iteration)
        return iteration

    def end_loop(self) -> None:
        """Training thread, at the boundary stop applies at: every :meth:`loader` ends there.

        Each iteration is closed: its next ``next()`` raises StopIteration, nothing more is
        fetched."""
        for iteration in list(self._iterations):
            iteration.close()

    def timed(self, fetch: Callable[..., Any]) -> Callable[..., Any]:
        """``fetch`` (e.g. nanoGPT's ``get_batch``), each training call timed and its batch counted.

        Each training call (not under ``no_grad``) timed as data wait and its batch counted
        like :meth:`loader`'s: an evaluation's calls (nanoGPT's ``estimate_loss()``, under
        ``@torch.no_grad()``) count in neither; a loop that evaluates with grad enabled
        wraps only the training calls. The training calls' batches are the data position a
        checkpoint keeps, a batch fetched ahead of the boundary included (nanoGPT's
        ``X, Y = get_batch()`` at the end of its micro-step loop): after a resume the first
        call gets that batch back."""
        return self.position.timed_fetch(fetch, self.meter.add)

    # ------------------------------------------------------------ the boundary

    #: Mark an optimizer-step boundary, once per optimizer step after ``zero_grad()``:
    #: ``optimizer_step(loss=None, samples=None, tokens=None, skipped=None,
    #: grad_norm=None, activation_bytes=None)``, in C (its docstring says each argument):
    #: the window's counts (:meth:`_take_window`, or a Session's scaler), the meter's,
    #: the optimizer's rates, the record and :meth:`boundary`, then
    #: :meth:`_next_window` where ``_next_window_due``.
    optimizer_step = RunPath._loop_optimizer_step

    def _window_off(self, counted: int) -> None:
        """Training thread, at a boundary: the window that ended had ``counted``
        micro-batches (backward passes through the run, else batches through
        :meth:`loader`), not :attr:`accum_steps`. A short window now and then is an
        epoch's end; three in a row mean the loop does not read the window's size, so
        a live ``accum_steps`` would not reach it: warned once."""
        assert self._windows_off is not None
        self._windows_off += 1
        if self._windows_off < 3:
            return
        self._windows_off = None
        self.agent.event(
            "warning", f"accum_steps is {self._accum_steps}, but the last 3 optimizer steps "
            f"had other micro-batch counts (the last: {counted}): the loop does not take "
            f"its window's size from the run, so accum_steps changes do not reach it (it "
            f"should {self.accum_use})",
            kind=EventKind.WARNING, step=self.step + 1)

    def _next_window(self) -> None:
        """Training thread, after the boundary, where ``_next_window_due``: prepare the next
        window (:class:`Session` plans its next activation measurement)."""

    def _take_window(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int | None]:
        """``(loss_sum, skipped, backwards, activation_bytes)`` of the window that just
        ended (the sum of its backpropagated losses on the device, fp16's skipped flag,
        its backward passes, a measurement of one micro-batch's saved activations), and
        a fresh start for the next one. (A Session's is its scaler's, read in C:
        ``_window_of_scaler``.)"""
        raise NotImplementedError

    # ------------------------------------------------------------ checkpoints

    def data_state(self) -> dict[str, Any]:
        """The data position (:class:`gpuopt.position.DataPosition`'s) and a loader's own.

        A ReconfigurableLoader's own position when :meth:`loader` has one."""
        state = self.position.state_dict()
        if self._reconfigurable is not None:
            state["loader"] = self._reconfigurable.save_position()
        return state

    def _checkpoint(self, knobs: dict[str, Any], states: dict[str, Any]) -> dict[str, Any]:
        """What the ``checkpoint`` command saves: ``states`` (the model's, the
        optimizer's, ...) with the step, the knob values ``knobs``, the random number
        generators and the data position (:meth:`data_state`)."""
        return torch_checkpoint(self.agent, knobs, self.step, {
            **states, "rng": rng_state(self.device), "data": self.data_state()})

    def _load_states(self, saved: dict[str, Any], source: str, **targets: Any) -> None:
        """Load each state ``saved`` has (``model``, ``optimizer``, ...) into its target
        of ``targets`` (``target.load_state_dict``).

        Raises:
            ValueError: ``saved`` has a state whose target is None (not given to the run).
        """
        for part, target in targets.items():
            if saved.get(part) is not None:
                if target is None:
                    raise ValueError(f"{source} has the {part}'s state: pass "
                                     f"{self.declare.format(part + '=...')} to resume it")
                target.load_state_dict(saved[part])

    def _load_position(self, data: dict[str, Any] | None) -> None:
        """Go back to the data position ``data`` (:meth:`data_state`'s, of a checkpoint
        or a rollback's snapshot), if it has one: :meth:`loader`'s iteration (the one
        running, or the next) goes back there; a ReconfigurableLoader is put back at its
        own position (at once, or when :meth:`loader` gets it)."""
        if data is None or self.no_position(data) is not None:
            return
        if "loader" in data:
            if self._reconfigurable is not None:
                self._reconfigurable.restore_position(data["loader"])
            else:
                self._loader_position = data["loader"]
        self.position.load_state_dict(data, replay="loader" not in data)

    def _resume_run(self, saved: dict[str, Any], source: str) -> None:
        """Training thread, before training goes on from ``saved`` (a
        :meth:`_checkpoint`): its step, data position, knob values (those
        :meth:`loader` binds are set when it does; an event names them all) and
        random number generators."""
        self.step = saved["step"]
        self._load_position(saved.get("data"))
        self._unbound_knobs = self.restore(
            saved["knobs"], source, differs=self.no_position(saved.get("data")),
            unbound="not bound yet (set when run.loader() binds them)",
            from_run=saved.get("run"))
        set_rng_state(saved["rng"])


class Session(LoopRun):
    """The agent of one hand-written loop (see :func:`session`, which makes it).

    The loop run (:class:`LoopRun`) with the loop's precision, model and checkpoints.

    Attributes:
        model: the model (``kernels`` and ``checkpointing`` switch it in place, so the
            loop's own ``model(...)`` calls, evaluation included, follow them).
        measure_activations_every: :func:`session`'s. It and :attr:`model` are fixed when
            the session is made (the boundary, in C, plans activation measurements by
            them: assigning either later does not start or stop them).
        mixed_precision: the live precision policy (:class:`gpuopt.MixedPrecision`).
        scaler: a ``GradScaler`` lookalike that follows the precision knob
            (:class:`gpuopt.precision.SwitchableGradScaler`): a real GradScaler in fp16.
        autocast: the loop's reusable autocast context (``ctx``): ``with run.autocast:``.
        lr_scheduler: the scheduler the checkpoints save, or None.
        (and :class:`LoopRun`'s)
    """

    def __init__(self, agent: Agent, *, model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None,
                 optimizer_settings: OptimizerSettings | None, lr_scheduler: Any,
                 mixed_precision: MixedPrecision,
                 accum_steps: int | None, model_backend: ModelBackend | None,
                 checkpointing: ActivationCheckpointing | None,
                 tokens_per_sample: int | None, measure_activations_every: int) -> None:
        super().__init__(agent, accum_steps=accum_steps, optimizer_settings=optimizer_settings,
                         tokens_per_sample=tokens_per_sample)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.mixed_precision = mixed_precision
        self.scaler = mixed_precision.grad_scaler
        self.autocast = _MeasuredAutocast(self)
        self.model_backend = model_backend
        self.checkpointing = checkpointing
        self.measure_activations_every = measure_activations_every
        if model_backend is not None:
            self.event_sources.append(model_backend.pop_events)
        #: the model's parameters are sharded (DTensors: FSDP2, tensor parallelism):
        #: checkpoints are directories every rank writes its part into
        self.sharded = is_sharded(model)
        if model is not None and fsdp_modules(model) and accum_steps is not None:
            self.scaler.before_backward = sync_at_window_end(model, lambda: self.accum_steps)
        self._measured_settings: Any = None
        #: the agent's knob values when the settings were last read
        self._measured_values: dict[str, Any] | None = None
        self._measure_due = False
        #: a measurement of one micro-batch's saved activations, for the next record
        self._activation_bytes: int | None = None
        # the window's losses are the scaler's (read in C, with _activation_bytes), and
        # the next activation measurement is planned after each boundary
        self._window_of_scaler = True
        self._next_window_due = bool(measure_activations_every) and model is not None
        self._next_window()

    # ------------------------------------------------------------ the boundary

    def _next_window(self) -> None:  # the next activation measurement planned
        if not self.measure_activations_every or self.model is None:
            return
        kernels = self.model_backend.kernels if self.model_backend is not None else "eager"
        if kernels == "compile":
            return
        if (self.step + 1) % self.measure_activations_every == 0:
            self._measure_due = True
        values = self.agent.knob_values
        if values is self._measured_values:  # (replaced when a knob changes: none did)
            return
        self._measured_values = values
        # the bound knobs that change the activations (KnobSpec.activation_memory)
        settings = tuple(knob.get() for knob in self.agent.knobs.knobs.values()
                         if knob.spec.activation_memory)
        if settings != self._measured_settings:
            self._measured_settings = settings
            self._measure_due = True

    # ------------------------------------------------------------ checkpoints

    def _states(self) -> dict[str, Any]:
        """The live states a checkpoint or a rollback keeps (tensors not copied)."""
        return {
            "model": None if self.model is None else self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "lr_scheduler": (None if self.lr_scheduler is None
                             else self.lr_scheduler.state_dict()),
            "grad_scaler": self.scaler.state_dict()}

    def save_checkpoint(self, path: Any, knobs: dict[str, Any]) -> None:
        """The ``checkpoint`` command's ``torch.save``: states, step, knob values and data position.

        Model, optimizer, scheduler, GradScaler, random number generators, step, knob values
        and data position. A sharded model (:attr:`sharded`) is saved by every rank into one
        directory (:func:`agent.integrations.sharded.save_sharded`), each rank with its own
        random numbers and data position."""
        if not self.sharded:
            torch.save(self._checkpoint(knobs, self._states()), path)
            return
        assert self.model is not None  # (sharded says there is one)
        save_sharded(path, self.model, self.optimizer, lambda: self._checkpoint(knobs, {
            **self._states(), "model": None, "optimizer": None,
            "world_size": torch.distributed.get_world_size()}))

    def live_state(self) -> dict[str, Any] | None:
        """The loop's states, random numbers and data position, live, for a rollback.

        None without a model or optimizer."""
        if self.model is None and self.optimizer is None:
            return None
        return ({**self._states(), "rng": rng_state(self.device),
                          "data": self.data_state()})

    def load_snapshot(self, snapshot: dict[str, Any]) -> str | None:
        """Go back to ``snapshot`` in the middle of the loop.

        The states, the random numbers and the data position (:meth:`loader`'s iteration
        goes back; a batch the loop holds itself cannot)."""
        held = self.position.ahead if self.position.fetched_total else 0
        self._load_states(snapshot, "the rollback's snapshot", model=self.model,
                          optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
        self.scaler.load_state_dict(snapshot["grad_scaler"])
        self._load_position(snapshot["data"])
        set_rng_state(snapshot["rng"])
        if held:
            return (f"the loop holds {held} batch(es) it fetched ahead and trains them first: "
                    "the data after the rollback is that far off a run that never made "
                    "the change")
        return None

    def rewind_refusal(self) -> str | None:
        """Why ``rewind`` cannot load a checkpoint here: a sharded model, or no model and optimizer.

        A sharded model's checkpoint is each rank's part in a directory, which is not read
        live yet."""
        if self.sharded:
            return ("a sharded model's checkpoint (every rank's part) is not loaded into "
                    "a live run yet: resume from it (agent.session(resume_from=...))")
        if self.model is None and self.optimizer is None:
            return "pass agent.session(model=..., optimizer=...) for a checkpoint to have them"
        return None

    def read_checkpoint(self, path: Path) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """A checkpoint :meth:`save_checkpoint` wrote, read as :meth:`resume` reads it.

        In :meth:`state_snapshot`'s form, with its step and knob values."""
        saved = load_checkpoint(path)
        snapshot = {part: saved.get(part) for part in ("model", "optimizer", "lr_scheduler",
                                                      "grad_scaler", "rng", "data")}
        return snapshot, saved["step"], saved["knobs"]

    def resume(self, source: str | os.PathLike) -> None:
        """Continue from the checkpoint :meth:`save_checkpoint` wrote at ``source``.

        Every state it has, the step, the knob values, the data position and the random
        number generators (an event says which)."""
        if self.sharded:
            assert self.model is not None  # (sharded says there is one)
            saved = load_sharded(source, self.model, self.optimizer)
        else:
            saved = load_checkpoint(source)
        source = str(source)
        self._load_states(saved, source, model=self.model, optimizer=self.optimizer,
                          lr_scheduler=self.lr_scheduler)
        self.scaler.load_state_dict(saved["grad_scaler"])
        self._resume_run(saved, source)
        self._next_window()


def check_accum_steps(accum_steps: int | None) -> None:
    """Raises ``ValueError`` unless ``accum_steps`` is None or an integer >= 1."""
    if accum_steps is not None and (isinstance(accum_steps, bool)
                                    or not isinstance(accum_steps, int) or accum_steps < 1):
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")


def model_knobs(knobs: KnobSet, model: torch.nn.Module, device: torch.device, *,
                kernels_refused: str | None = None, compile_backend: str = "inductor",
                checkpoint_blocks: Any = None, declare: str = LoopRun.declare
                ) -> tuple[ModelBackend | None, ActivationCheckpointing | None]:
    """Bind the ``kernels`` and ``checkpointing`` knobs of ``model``, or their refusals.

    ``kernels`` is switched in the model itself (:class:`gpuopt.backends.ModelBackend` with
    ``in_place=True``; refused with ``kernels_refused`` when it is a reason);
    ``checkpointing`` covers its repeated blocks, or ``checkpoint_blocks`` (refused with the
    reason when it has none). ``declare``: how the loop passes ``checkpoint_blocks``
    (:attr:`LoopRun.declare`).

    Returns:
        ``(model_backend, checkpointing)``, each None where its knob is refused.

    Raises:
        ValueError: ``checkpoint_blocks`` that select nothing.
    """
    model_backend = checkpointing = None
    if kernels_refused is None:
        backend = model_backend = ModelBackend(model, device, compile_backend=compile_backend,
                                               in_place=True)
        knobs.add(Knob.attribute(KERNELS, backend,
                                 check=lambda value: refuse(backend.support(value))))
    else:
        knobs.bind(KERNELS, kernels_refused)
    try:
        blocks = checkpointing = ActivationCheckpointing(model, checkpoint_blocks)
    except ValueError as exc:
        if checkpoint_blocks is not None:
            raise
        knobs.bind(CHECKPOINTING, f"{exc} ({declare.format('checkpoint_blocks=...')})")
    else:
        knobs.add(Knob.attribute(CHECKPOINTING, blocks, "enabled"))
    return model_backend, checkpointing


def optimizer_settings_knobs(knobs: KnobSet, optimizer: torch.optim.Optimizer,
                             max_grad_norm: float | None, *, declare: str = LoopRun.declare,
                             own_clip: str = "clip_grad_norm_") -> OptimizerSettings:
    """Bind ``lr_scale`` and ``weight_decay`` of ``optimizer``, and ``max_grad_norm`` if declared.

    ``optimizer``: a torch optimizer, not a framework's wrapper
    (:class:`gpuopt.optim.OptimizerSettings` hooks its step). ``max_grad_norm`` when the
    loop declared it (``max_grad_norm``: the starting value, 0: off; the run clips inside
    ``optimizer.step()``, so the loop leaves out its own ``own_clip``); ``declare`` as
    :func:`model_knobs`'.

    Raises:
        ValueError: ``max_grad_norm`` is not a finite number >= 0.
    """
    settings = OptimizerSettings(optimizer)
    optimizer_knobs(settings, knobs)
    if max_grad_norm is not None:
        settings.max_grad_norm = max_grad_norm
        knobs.add(Knob.attribute(MAX_GRAD_NORM, settings))
    else:
        knobs.bind(MAX_GRAD_NORM, (
            f"this loop did not declare max_grad_norm: pass "
            f"{declare.format('max_grad_norm=X')} (0: off) and leave out the loop's own "
            f"{own_clip}; the run then clips inside optimizer.step()"))
    return settings


def session(*, model: torch.nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None, precision: str | None = None,
            mixed_precision: MixedPrecision | None = None, accum_steps: int | None = None,
            kernels: bool = True, compile_backend: str = "inductor",
            checkpoint_blocks: Any = None, tokens_per_sample: int | None = None,
            measure_activations_every: int = MEASURE_ACTIVATIONS_EVERY,
            device: torch.device | str | None = None, knobs: KnobSet | None = None,
            lr_scheduler: Any = None, max_grad_norm: float | None = None,
            checkpoint_dir: str | os.PathLike | None = None,
            resume_from: str | os.PathLike | None = None,
            eval_fn: Callable[[], dict[str, Any] | None] | None = None,
            name: str = "", transport: str = "ipc", **options: Any) -> Session:
    """Start the agent for a hand-written loop and return its :class:`Session`.

    Which knobs the run gets:

    - ``precision`` with ``precision=`` (``"fp32"``, ``"bf16"``, ``"fp16"``, or a torch
      dtype or its name, see :func:`gpuopt.precision.precision_name`) or a
      ``mixed_precision=`` policy of your own: the loop uses :attr:`Session.autocast` as
      its ``ctx`` and :attr:`Session.scaler` as its GradScaler.
    - ``accum_steps`` with ``accum_steps=N``: the loop reads :attr:`Session.accum_steps`
      at each window's start and divides each micro-batch's loss by it.
    - ``kernels`` (eager, compile; triton where the model has fused modules and CUDA)
      with a ``model=``: switched in the model itself (:class:`gpuopt.backends.ModelBackend`
      with ``in_place=True``); ``kernels=False`` leaves it out.
    - ``checkpointing`` with a ``model=`` that has repeated blocks: ``model.blocks``, or
      else its repeated blocks (nanoGPT's ``transformer.h`` is found), or
      ``checkpoint_blocks=`` names or types (see :func:`gpuopt.checkpointing.find_blocks`).
    - ``num_workers``, ``pin_memory``, ``prefetch_factor`` once :meth:`Session.loader`
      gets a :class:`gpuopt.loader.ReconfigurableLoader`, and ``micro_batch_size`` then
      too when the loop declared ``accum_steps`` (the loop reads ``run.accum_steps`` at
      each window's start, so the effective batch stays).
    - ``lr_scale`` and ``weight_decay`` with an ``optimizer=``
      (:class:`gpuopt.optim.OptimizerSettings`: the scale multiplies whatever the loop or
      its scheduler sets in the param groups, inside ``optimizer.step()`` only, so the
      schedule keeps its shape; the decay goes to the groups that decay).
    - ``max_grad_norm`` with ``max_grad_norm=X`` (0: off): the run clips the global
      gradient norm to it inside ``optimizer.step()`` (after ``run.scaler`` unscaled the
      gradients in fp16; a step the GradScaler skips is not clipped), and each step
      reports that norm. The loop then leaves out its own ``clip_grad_norm_``.
    - the ``checkpoint`` command with a ``model=`` or ``optimizer=``: ``torch.save`` of the
      model, optimizer, ``lr_scheduler=``, GradScaler, random number generators, step
      and knob values (see :mod:`agent.control.checkpoints`); ``resume_from=`` continues from one.
    - ``cpu_threads`` (``torch.set_num_threads``) always.
    - ``memory_fraction``, ``memory_snapshot_steps`` on CUDA; and ``knobs=`` of your own.

    A knob the loop did not declare is refused with what to declare.

    A model sharded by FSDP2 (``fully_shard``) gets the same knobs, kept exact
    (:mod:`agent.integrations.sharded`): a window's gradients are reduced at its last
    ``run.scaler.scale(loss).backward()`` only, the checkpointed blocks are the
    ``fully_shard`` modules inside the model when it has no others, ``precision`` is
    refused for fp16 and for a ``MixedPrecisionPolicy`` that casts, ``kernels`` is
    refused (compiling it is not verified), and a checkpoint (of any model with DTensor
    parameters) is a ``torch.distributed.checkpoint`` directory every rank writes its
    part into and resumes its part from.

    Args:
        model: the model (parameter count, device, kernels, checkpointing,
            activation memory).
        optimizer: its optimizer (the learning rate each step reports: param group 0's,
            read by a step pre-hook as the optimizer steps).
        tokens_per_sample: tokens in one sample (e.g. nanoGPT's ``block_size``), for
            tokens/s; batches with ``input_ids`` are counted without it.
        measure_activations_every: measure the activation memory of one micro-batch
            (inside :attr:`Session.autocast`) every this many optimizer steps and after
            a change of precision, kernels or checkpointing; 0 never. Set 0 for a model
            whose forward uses ``torch.func`` transforms (they refuse the meter's hooks).
        device: the device, when there is no model or its parameters are elsewhere.
        lr_scheduler: the loop's LR scheduler (the loop steps it), saved in checkpoints.
        max_grad_norm: declares the ``max_grad_norm`` knob and its starting value (0: no
            clipping); see above.
        checkpoint_dir: where ``checkpoint=now`` saves (default:
            :func:`agent.control.checkpoints.default_checkpoint_dir`).
        resume_from: a checkpoint the command saved (a sharded model's: its directory,
            on every rank): the model, optimizer, scheduler,
            GradScaler, random number generators, knob values and data position are
            restored, and :attr:`Session.step` is its step (the loop goes on from
            there). Data that comes through :meth:`Session.loader` continues where it
            was (the saved epoch is made again and its trained batches dropped; a
            ReconfigurableLoader is put back at its position); through
            :meth:`Session.timed`, the batches fetched ahead of the boundary come back
            first, then the restored random numbers draw the rest.
        eval_fn: what ``evaluate=now`` runs (on the training thread, at the boundary it
            applies at): returns a dict of metric names to numbers for the
            ``evaluation`` event; the model's train/eval mode is put back after it.
            Without it the run has no ``evaluate`` command.
        name, transport, options: as for :class:`agent.Agent`.

    The run also takes ``pause=on|off`` (the loop waits inside :meth:`Session.optimizer_step`)
    and ``stop=now|checkpoint``: :meth:`Session.loader` ends at the next fetch, and a loop
    whose data does not come through it leaves its loop on :attr:`Session.stopping`.

    Raises:
        ValueError: a precision the device cannot run, ``accum_steps < 1``,
            ``measure_activations_every < 0``, both ``precision`` and
            ``mixed_precision``, ``checkpoint_blocks`` that select nothing, a bad
            ``max_grad_norm``, or a ``resume_from`` that is no such checkpoint or has a
            state this session was given nothing for.
    """
    if precision is not None and mixed_precision is not None:
        raise ValueError("give precision= or mixed_precision=, not both")
    check_accum_steps(accum_steps)
    if (isinstance(measure_activations_every, bool)
            or not isinstance(measure_activations_every, int) or measure_activations_every < 0):
        raise ValueError("measure_activations_every must be an integer >= 0, got "
                         f"{measure_activations_every!r}")
    if device is None and model is not None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
    if device is None and mixed_precision is not None:
        device = mixed_precision.device_type
    device = torch.device(device if device is not None else "cpu")
    knobs = knobs or KnobSet()
    declared = mixed_precision is not None or precision is not None
    mixed_precision = mixed_precision or MixedPrecision(
        device.type, precision_name(precision or "fp32"))
    if declared:
        knobs.add(precision_knob(mixed_precision, sharded_precision(model)))
    else:
        knobs.bind(PRECISION, "this loop did not declare precision: pass "
                              "agent.session(precision=...) and use run.autocast "
                              "and run.scaler")
    model_backend = checkpointing = None
    if model is not None:
        model_backend, checkpointing = model_knobs(
            knobs, model, device, compile_backend=compile_backend,
            kernels_refused=("compiling a model sharded by fully_shard is not verified"
                             if fsdp_modules(model) else None if kernels
                             else "agent.session(kernels=False) leaves it out"),
            checkpoint_blocks=checkpoint_blocks)
    else:
        knobs.bind(KERNELS, "this loop has no model for gpuwatch to switch: pass "
                            "agent.session(model=model)")
        knobs.bind(CHECKPOINTING, "pass agent.session(model=model) to checkpoint it")
    settings = None
    if optimizer is not None:
        settings = optimizer_settings_knobs(knobs, optimizer, max_grad_norm)
    else:
        for spec in (LR_SCALE, WEIGHT_DECAY, MAX_GRAD_NORM):
            knobs.bind(spec, "pass agent.session(optimizer=optimizer) for "
                             "gpuwatch to set it in the optimizer's step")
    knobs.add(cpu_threads_knob(knobs))
    knobs.bind(DROPOUT, "pass agent.session(model=model) for gpuwatch to set its dropout"
               if model is None else dropout_knob(model))
    agent = Agent(knobs, name=name, model=model, device=device, transport=transport,
                  training={"framework": "loop",
                            "loss_normalization": "as the loop divides its losses"},
                  **options)
    run = Session(agent, model=model, optimizer=optimizer, optimizer_settings=settings,
                  lr_scheduler=lr_scheduler, mixed_precision=mixed_precision,
                  accum_steps=accum_steps, model_backend=model_backend,
                  checkpointing=checkpointing, tokens_per_sample=tokens_per_sample,
                  measure_activations_every=measure_activations_every)
    if model is not None or optimizer is not None:
        run.bind_checkpoint(run.save_checkpoint, directory=checkpoint_dir,
                            every_rank=run.sharded,
                            agree=agree if run.sharded else None,
                            name="step-{step:08d}" if run.sharded else "step-{step:08d}.pt")
    else:
        knobs.bind(CHECKPOINT, "pass agent.session(model=..., optimizer=...) "
                               "for a checkpoint to have their states")
    run.bind_evaluate(eval_fn, model, declare="agent.session(eval_fn=...)")
    if resume_from is not None:
        run.resume(resume_from)
    run.start()
    return run
