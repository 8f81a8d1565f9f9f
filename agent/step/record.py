"""The one model of an optimizer step: :class:`StepRecord`.

Every integration hands the agent one :class:`StepRecord` per optimizer step (through
:meth:`agent.integrations.run.RunBase.boundary`), and everything after reads it by name: the agent's
hot path fills in what only it knows (the step time, the device marker, the knob values
the step trained with), the encoder turns runs of them into ``steps`` columns.

The type is made in C (agent/step/_hot.c): one is made on the training thread at every
optimizer step, and a slotted dataclass's ``__init__`` there was a Python frame of 13
stores, about 1 us of CPU between real steps (cold caches); its docstring is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.step import _hot

_DOC = """One optimizer step of one rank, as recorded on the training thread.

``StepRecord(micro_batches, samples, data_wait_s, loss=None, skipped=None,
activation_bytes=None, tokens=None, lr=None, grad_norm=None, step=0, step_time_s=None,
marker=None, knobs=None)``; each field an attribute that may be set (no other).

What the integration measured (by position, in this order, or by keyword):

Attributes:
    micro_batches: micro-batches in the step's accumulation window (>= 1).
    samples: samples in those micro-batches.
    data_wait_s: host seconds the loop waited for them (inside each fetch).
    loss: the window's mean loss as the framework means it, a 0-dim tensor on any
        device (read on the training thread only on the host), or None; the agent
        takes it into the step's marker and sets it to None.
    skipped: in fp16, the GradScaler's 0-dim bool "this step was skipped" tensor
        (True: inf/NaN gradients), or None.
    activation_bytes: bytes saved for backward by one micro-batch of the window,
        when measured (:class:`gpuopt.memory.SavedActivations`), else None.
    tokens: tokens in the window (token models), or None.
    lr: the learning rate the step used: param group 0's as a host float, or every
        group's as a tuple (floats or tensors, read on the I/O thread), or None.
    grad_norm: the global gradient norm the step saw before clipping, a 0-dim
        tensor (read on the I/O thread once ready) or a float, or None.

What the run base and the agent add (an integration leaves them; give them by keyword):

Attributes:
    step: 1-based index of the optimizer step (the run base counts, unless the
        integration gives its framework's own count).
    step_time_s: host seconds since the previous boundary (None for the first).
    marker: the device marker of the step (:mod:`agent.step.markers`): holds the loss,
        the skipped flag and the gradient norm until the device has them.
    knobs: the knob values the step trained with (a dict replaced, never changed,
        when a knob changes).

Raises:
    TypeError: a field of the first three missing, one given twice, or an unknown one.

.. note:: Made in C by vectorcall: one allocation, no Python frame. Not tracked by the
   cyclic garbage collector (hundreds wait in the queue between the I/O thread's
   passes; every young collection traversed them): a value that refers back to its
   record would make a cycle that is never collected, so none of the agent's does."""

if TYPE_CHECKING:
    from agent.step._hot import StepRecord
else:
    StepRecord = _hot.define(_DOC)


#: The host columns of a run of records, in the order :func:`host_columns` gives them.
HOST_FIELDS = ("step", "step_time_s", "micro_batches", "samples", "data_wait_s", "knobs",
               "activation_bytes", "tokens", "lr")


def host_columns(records: list[StepRecord]) -> dict[str, list[Any]]:
    """The host fields (:data:`HOST_FIELDS`) of ``records`` as one list per field name.

    Raises TypeError for an item that is not a StepRecord.

    .. note:: One pass over the records in C (:func:`agent.step._hot.columns`): at 650
       records about 0.04 us a step for all nine (a C pass a field with ``attrgetter``
       cost 0.27 in the I/O thread)."""
    return dict(zip(HOST_FIELDS, _hot.columns(records, HOST_FIELDS)))
