"""The step encoder's two paths give the same ``steps`` message: in columns (the usual,
no Python a step) and one step at a time (while the rollback guard watches a change).

Real step records through a real :class:`agent.step.encoder.StepEncoder` with the host's
markers, each path's message compared field by field."""

from __future__ import annotations

import weakref
import random
from collections import deque

import msgpack
import numpy as np
import pytest
import torch

from agent.control.guard import ChangeGuard
from agent.control.ledger import Change, ChangeLedger
from agent.search.tune import AutoTune
from agent.step._hot import StepsBatch
from agent.step.encoder import _PACKB, INPUT_WINDOW_STEPS, InputWindow, StepEncoder
from agent.step.markers import CpuMarker
from agent.step.record import StepRecord
from agent.wire import protocol
from agent.wire.knobs import KnobSet
from agent.wire.runlog import pack_plain

RATES = {
    "float": lambda step: 0.1 / step,
    "one group": lambda step: (0.1 / step,),
    "two groups": lambda step: (0.1 / step, 0.01),
    "a tensor rate": lambda step: (torch.tensor(0.1 / step), 0.02),
    "no groups": lambda step: () if step % 2 else (0.5,),
    "none": lambda step: None,
}


def _wire(kind: str, body) -> dict:
    """``body`` as a reader gets it: packed into the wire's bytes and decoded."""
    envelope = protocol.envelope(kind, body, run="r", seq=1)
    return protocol.decode(protocol.encode(envelope)[1])["body"]


def _host_encoder(ledger: ChangeLedger | None = None
                  ) -> tuple[deque, CpuMarker, StepEncoder, list[tuple[str, dict]]]:
    """``(records, marker, encoder, sent)``: an encoder of the host step records queued on
    ``records``, its guard reading ``ledger`` (a fresh one by default), that appends what
    it publishes to ``sent`` as ``(kind, body)``."""
    sent: list[tuple[str, dict]] = []
    records: deque = deque()
    marker = CpuMarker()
    encoder = StepEncoder(records, marker,
                          publish=lambda kind, body: sent.append((kind, _wire(kind, body))),
                          guard=ChangeGuard(ChangeLedger() if ledger is None else ledger),
                          check_step=lambda *args: None,
                          tune=AutoTune(KnobSet(), 0, lambda kind, body: None, lambda: None,
                                        1, lambda where, exc: None), device=None,
                          report_error=lambda where, exc: None)
    return records, marker, encoder, sent


def _message(rate, *, one_at_a_time: bool) -> dict:
    """The ``steps`` body of 12 records (step time 10 ms, data wait 1 ms a step, the
    rates from ``rate(step)``) through one drain."""
    ledger = ChangeLedger()
    if one_at_a_time:  # a change the guard watches: every step is seen alone
        ledger.record(Change(step=1, knob="lr_scale", value=0.5, previous=1.0))
    records, marker, encoder, sent = _host_encoder(ledger)
    for step in range(1, 13):
        record = StepRecord(micro_batches=2, samples=8, data_wait_s=0.001,
                            loss=torch.tensor(1.0 / step), lr=rate(step), tokens=None)
        record.step, record.step_time_s = step, None if step == 1 else 0.01
        record.marker, record.knobs = marker.mark(record.loss), {"lr_scale": 1.0}
        records.append(record)
    encoder.drain()
    [(kind, body)] = sent
    assert kind == protocol.STEPS
    return body


@pytest.mark.parametrize("rate", RATES.values(), ids=RATES.keys())
def test_the_steps_in_columns_equal_the_steps_one_at_a_time(rate):
    columns = _message(rate, one_at_a_time=False)
    each = _message(rate, one_at_a_time=True)
    assert columns["columns"] == each["columns"]  # (memory readings differ: read twice)
    assert columns["common"]["knobs"] == each["common"]["knobs"] == {"lr_scale": 1.0}
    rows = protocol.step_bodies(columns)
    assert [row["step"] for row in rows] == list(range(1, 13))
    expected = [rate(step) for step in range(1, 13)]  # (as host floats)
    for row, given in zip(rows, expected):
        groups = None if given is None or isinstance(given, float) else [
            float(value) for value in given]
        first = given if isinstance(given, float) else groups[0] if groups else None
        assert (row.get("lr"), row.get("lr_groups")) == (first, groups), row


def test_the_input_window_over_a_batch_equals_it_step_by_step():
    """``InputWindow.add_many`` (over a batch) gives the shares and verdicts that ``add``
    gives one step at a time, bit for bit, however the batches fall against the window:
    every verdict, waits longer than their steps (a share of 1), the window's edge inside
    a batch; and each share is the window's sums, oldest first, divided."""
    rng = random.Random(7)
    times = [1e-3 + 1e-3 * rng.random() for _ in range(300)]
    # 100 steps of each: compute-bound, partly input-bound, input-bound (some waits longer
    # than their steps)
    waits = [time_s * rng.uniform(*(0.0, 0.1) if step < 100 else (0.25, 0.4) if step < 200
                                  else (0.6, 1.5)) for step, time_s in enumerate(times)]
    one, many = InputWindow(), InputWindow()
    expected = [one.add(wait_s, time_s) for wait_s, time_s in zip(waits, times)]
    got: list[tuple[float, str]] = []
    start = 0
    for size in (1, 3, 19, 2, 40, 1, 235):  # 300 steps in batches of these sizes
        shares, verdicts = many.add_many(waits[start:start + size], times[start:start + size])
        got += zip(shares, verdicts)
        start += size
    assert [verdict for _, verdict in got] == [verdict for _, verdict in expected]
    assert {verdict for _, verdict in got} == {"compute-bound", "partly input-bound",
                                               "input-bound"}
    assert [share for share, _ in got] == [share for share, _ in expected]
    assert max(share for share, _ in got) == 1.0
    for step, (share, _) in enumerate(got):
        first = max(0, step + 1 - INPUT_WINDOW_STEPS)
        assert share == min(1.0, sum(waits[first:step + 1]) / sum(times[first:step + 1]))


LOSSES = {
    "float32 with its graph": lambda step: (torch.ones(3, requires_grad=True) / step).sum(),
    "float64": lambda step: torch.tensor(1.0 / 3 / step, dtype=torch.float64),
    "bfloat16": lambda step: torch.tensor(1.0 / 3 / step, dtype=torch.bfloat16),
    "one value, one dim": lambda step: torch.tensor([1.0 / 3 / step], dtype=torch.float64),
    "three values (their mean)": lambda step: torch.full((3,), 1.0 / 3 / step),
    "an integer": lambda step: torch.tensor(step),
    "none on odd steps": lambda step: None if step % 2 else torch.tensor(1.0 / step),
}
#: A gradient norm on some steps: their markers are tuples, the others' the loss alone.
NORMS = {"no norm": lambda step: None,
         "a norm on steps 3 to 5": lambda step: torch.tensor(step / 3) if 3 <= step <= 5 else None,
         "a norm on every step": lambda step: step / 7}


def _losses(loss, norm, *, marked: bool) -> tuple[list, list | None]:
    """The ``loss`` and ``grad_norm`` columns of 12 records through one drain: their
    markers made by :meth:`CpuMarker.mark` (``marked``: the loss alone where there is
    no norm), or each the tuple of the loss detached, no flag and its norm (the
    encoder's other path)."""
    records, marker, encoder, sent = _host_encoder()
    for step in range(1, 13):
        value, grad_norm = loss(step), norm(step)
        record = StepRecord(1, 8, 0.001, value, step=step, step_time_s=0.01, knobs={})
        record.marker = (marker.mark(value, None, grad_norm) if marked else
                         (None if value is None else value.detach(), None, grad_norm))
        records.append(record)
    encoder.drain()
    [(kind, body)] = sent
    return body["columns"]["loss"], body["columns"].get("grad_norm")


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_a_host_loss_is_published_bit_for_bit_as_the_tensor_reads(loss, norm):
    """A host loss is its step's whole marker when the step has no norm, unread on the
    training thread; the published losses and norms are those the I/O thread's own read of
    each tensor gives, of the same type, bit for bit."""
    (marked, marked_norms), (unread, unread_norms) = (
        _losses(loss, norm, marked=True), _losses(loss, norm, marked=False))
    assert [(type(value), repr(value)) for value in marked] == [
        (type(value), repr(value)) for value in unread]
    assert marked_norms == unread_norms
    # each tensor's own value (a one-element one's item(), float64 kept), a larger one's
    # mean in float32
    expected = [None if value is None else value.item() if value.numel() == 1
                else float(value.float().mean()) for value in map(loss, range(1, 13))]
    assert [repr(value) for value in marked] == [repr(value) for value in expected]
    value = loss(2)
    assert CpuMarker().mark(value) is value  # (no torch call, no copy)


def test_a_host_loss_and_its_graph_are_let_go_once_published():
    """The marker holds a host loss with its autograd graph (nothing is read on the
    training thread): the I/O thread lets both go as it publishes the step, the last
    step's included, so memory kept for the agent is bounded by what is in flight."""
    records, marker, encoder, sent = _host_encoder()
    held = []
    for step in range(1, 6):
        loss = (torch.ones(3, requires_grad=True) * step).sum()
        held.append(weakref.ref(loss))
        record = StepRecord(1, 8, 0.001, None, step=step, step_time_s=0.01, knobs={})
        record.marker = marker.mark(loss)
        records.append(record)
        del loss, record
    assert all(ref() is not None for ref in held)  # in flight: kept
    encoder.drain()
    assert sent[0][1]["columns"]["loss"] == [3.0, 6.0, 9.0, 12.0, 15.0]
    assert [ref() for ref in held] == [None] * 5


def test_the_batches_of_one_drain_share_one_memory_reading_and_the_next_takes_its_own():
    """A drain of more steps than a batch holds sends two ``steps`` batches with one
    memory reading (all their steps ran before it); the next drain reads again."""
    records, marker, encoder, sent = _host_encoder()
    readings: list[dict] = []
    read = encoder._memory

    def counted() -> dict:
        readings.append(read())
        return readings[-1]

    encoder._memory = counted  # type: ignore[method-assign]  # (the real reading, counted)

    def queue(first: int, count: int) -> None:
        for step in range(first, first + count):
            record = StepRecord(1, 8, 0.001, loss=torch.tensor(0.5))
            record.step, record.step_time_s = step, 0.01
            record.marker, record.knobs = marker.mark(record.loss), {}
            records.append(record)

    queue(1, protocol.MAX_BATCH_STEPS + 10)
    encoder.drain()
    assert [body["n"] for kind, body in sent] == [protocol.MAX_BATCH_STEPS, 10]
    assert len(readings) == 1
    assert [body["common"]["host_rss_bytes"] for kind, body in sent] == [
        readings[0]["host_rss_bytes"]] * 2
    queue(protocol.MAX_BATCH_STEPS + 11, 5)
    encoder.drain()
    assert len(readings) == 2 and sent[-1][1]["n"] == 5
    assert encoder.latest_memory is readings[1]


# ---------------------------------------------------------------- the batch's packing

#: Values a step's field may hold, each packed by msgpack's own rules: ints at each
#: boundary of msgpack's forms, floats that are not finite, strs of each length form, and
#: the containers the knobs and the param groups' rates are.
_VALUES = [
    None, True, False, 0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
    2**63 - 1, 2**64 - 1, -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1,
    -2**63, 0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e300, "", "a" * 31,
    "b" * 32, "c" * 255, "d" * 256, "e" * 65535, "f" * 65536, "héllo ✓", [], [1.0, None],
    (0.1, 0.2), list(range(16)), {"a": 1}, {str(i): i for i in range(16)}, {1: [{"x": ()}]},
    b"raw",
]


def _reference(rows: list[tuple], head: dict, common: dict) -> bytes:
    """What a ``steps`` message of ``rows`` (in the order of a row of
    ``StepEncoder._add_each``) is, built in Python as its format says and packed by
    msgpack."""
    names = ("step", "micro_batches", "samples", "step_time_s", "data_wait_s", "loss",
             "gpu_step_time_s", "knobs", "grad_scaler_skipped", "activation_bytes", "tokens",
             "lr", "lr_groups", "grad_norm", "skipped_steps_total", "data_wait_share_window",
             "input_verdict")
    values = {name: [row[k] for row in rows] for k, name in enumerate(names)}
    times = values["step_time_s"]
    values["data_wait_share"] = [min(1.0, wait / time_s) if time_s else None
                                 for wait, time_s in zip(values["data_wait_s"], times)]
    values["samples_per_s"] = [count / time_s if time_s else None
                               for count, time_s in zip(values["samples"], times)]
    values["tokens_per_s"] = [count / time_s if count is not None and time_s else None
                              for count, time_s in zip(values["tokens"], times)]
    columns = {name: values[name] for name in (
        "step", "micro_batches", "samples", "step_time_s", "data_wait_s", "data_wait_share",
        "samples_per_s", "loss", "gpu_step_time_s", "skipped_steps_total")}
    for name in ("grad_scaler_skipped", "activation_bytes", "tokens", "lr", "lr_groups",
                 "grad_norm", "data_wait_share_window", "input_verdict"):
        if any(value is not None for value in values[name]):
            columns[name] = values[name]
    if "tokens" in columns:
        columns["tokens_per_s"] = values["tokens_per_s"]
    knobs = values["knobs"]
    common = dict(common)
    if knobs and all(each == knobs[0] for each in knobs):
        common["knobs"] = knobs[0]
    elif knobs:
        columns["knobs"] = knobs
    message = {**head, "body": {"n": len(rows), "columns": columns, "common": common}}
    return msgpack.packb(message, use_bin_type=True)


_HEAD = {"v": 2, "type": "steps", "run": "r", "rank": 0, "seq": 7, "t": 1.5}


def _row(rng: random.Random, step: int) -> tuple:
    """A step's row: numbers where the format has them, any value elsewhere."""
    some = lambda: rng.choice(_VALUES)  # noqa: E731
    time_s = rng.choice([None, 0.0, 0.01 * rng.random() + 1e-9, float("nan"), 2, 3.0])
    return (step, rng.choice([1, 4, 2**40]), rng.choice([0, 64, 2**53 + 1]), time_s,
            rng.choice([0, 0.001 * rng.random(), 1.0, 5.0, float("inf")]), some(), some(),
            rng.choice([{"precision": "fp32"}, {"precision": "bf16"}]), some(), some(),
            rng.choice([None, 0, 10**6, 2**60]), some(), some(), some(), some(), some(), some())


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_packs_its_steps_byte_for_byte_as_msgpack_packs_the_format(seed):
    rng = random.Random(seed)
    batch = StepsBatch(_PACKB)
    rows = [_row(rng, step) for step in range(1, rng.randint(1, 40))]
    parts = [rows[:len(rows) // 3], rows[len(rows) // 3:]]  # (added in two parts)
    for part in parts:
        if part:
            batch.add_rows(tuple(map(list, zip(*part))))
    assert batch.n == len(rows)
    common = {"host_rss_bytes": 123456789, "mem_peak_reserved_bytes": 2**40}
    assert batch.take(dict(_HEAD), common) == _reference(rows, _HEAD, common)
    assert batch.n == 0
    assert batch.take(dict(_HEAD), {}) == _reference([], _HEAD, {})  # emptied


def test_a_value_msgpack_cannot_pack_leaves_the_batch_as_it_was():
    rng = random.Random(1)
    batch = StepsBatch(_PACKB)
    kept = [_row(rng, 1), _row(rng, 2)]
    batch.add_rows(tuple(map(list, zip(*kept))))
    bad = [list(row) for row in (_row(rng, 3), _row(rng, 4))]
    bad[1][5] = object()  # the second step's loss
    with pytest.raises(TypeError):
        batch.add_rows(tuple(map(list, zip(*bad))))
    bad[1][5], bad[0][3], bad[0][4] = 0.5, 1.0, "s"  # a wait that does not divide
    with pytest.raises(TypeError):
        batch.add_rows(tuple(map(list, zip(*bad))))
    assert batch.n == 2
    assert batch.take(dict(_HEAD), {}) == _reference(kept, _HEAD, {})


def test_a_run_of_records_packs_as_its_rows_do():
    """The usual run (read from the records in C) and the same steps as rows (the
    general path): the same bytes, and the same input window after."""
    rng = random.Random(3)
    knobs = {"precision": "fp32"}
    records = [StepRecord(1, 64, rng.random() * 1e-3, step=step, knobs=knobs,
                          step_time_s=None if step == 5 else rng.random() * 1e-2,
                          lr=None if step % 3 else 0.1 / step,
                          tokens=None if step < 8 else 640, activation_bytes=None)
               for step in range(5, 25)]
    losses = [rng.random() for _ in records]
    norms = [None if step % 2 else 1.5 for step in range(len(records))]
    gpu_times = [None] * len(records)
    run_window, rows_window = InputWindow(), InputWindow()
    batch = StepsBatch(_PACKB)
    assert batch.add_run(records, losses, norms, gpu_times, run_window, 2) == (
        5, 24, records[-1].step_time_s)
    rows = []
    for record, loss, norm in zip(records, losses, norms):
        share = verdict = None
        if record.step_time_s:
            share, verdict = rows_window.add(record.data_wait_s, record.step_time_s)
        rows.append((record.step, 1, 64, record.step_time_s, record.data_wait_s, loss, None,
                     knobs, None, None, record.tokens, record.lr, None, norm, 2, share,
                     verdict))
    packed = batch.take(dict(_HEAD), {})
    assert packed == _reference(rows, _HEAD, {})
    assert run_window.add(0.0, 1.0) == rows_window.add(0.0, 1.0)


@pytest.mark.parametrize("change", ["gap", "lr groups", "int step time", "float step"])
def test_a_run_the_batch_does_not_take_is_left_whole_to_the_caller(change):
    records = [StepRecord(1, 8, 0.001, step=step, step_time_s=0.01, knobs={})
               for step in range(1, 6)]
    if change == "gap":
        records[3].step = 9
    elif change == "lr groups":
        records[2].lr = (0.1, 0.2)
    elif change == "int step time":
        records[1].step_time_s = 1
    else:
        records[4].step = 5.0
    window = InputWindow()
    batch = StepsBatch(_PACKB)
    assert batch.add_run(records, [0.5] * 5, [None] * 5, [None] * 5, window, 0) is None
    assert batch.n == 0
    assert window.add(0.0, 1.0) == InputWindow().add(0.0, 1.0)  # (nothing added)


def _plain_row(step: int, **values) -> tuple:
    """A step's row of plain values (see :func:`_row`), ``values`` by field name."""
    row = dict(step=step, micro_batches=1, samples=8, step_time_s=0.01, data_wait_s=0.001,
               loss=0.5, gpu_step_time_s=None, knobs={"k": 1}, grad_scaler_skipped=None,
               activation_bytes=None, tokens=None, lr=None, lr_groups=None, grad_norm=None,
               skipped_steps_total=0, data_wait_share_window=None, input_verdict=None)
    row.update(values)
    return tuple(row.values())


@pytest.mark.parametrize(("field", "value"), [
    ("tokens", np.int64(64)), ("tokens", torch.tensor(64)), ("tokens", 2**64),
    ("lr_groups", [1, 2**70])], ids=["numpy int", "tensor", "int past 64 bits", "in a list"])
def test_a_value_msgpack_refuses_is_held_as_its_plain_form_and_the_steps_kept(field, value):
    """With ``plain`` (the run log's), a value msgpack cannot pack (a ``tokens=`` a loop
    gave as a numpy or torch number) keeps its steps: take raises msgpack's error (the
    wire cannot carry them) and the batch's columns hold the value's plain form (the
    log's); an add that fails after it leaves the refusal as it was."""
    batch = StepsBatch(_PACKB, plain=pack_plain)
    rows = [_plain_row(1), _plain_row(2, **{field: value}), _plain_row(3, **{field: 64})]
    batch.add_rows(tuple(map(list, zip(*rows))))
    assert batch.n == 3
    with pytest.raises((TypeError, OverflowError)):
        batch.take(dict(_HEAD), {})
    assert batch.n == 3  # kept
    packed, knobs = batch.packed_columns()
    tokens = msgpack.unpackb(packed[field], strict_map_key=False)
    assert tokens[0] is None and tokens[2] == 64
    assert tokens[1] == msgpack.unpackb(pack_plain(value), strict_map_key=False)
    assert [row[0] for row in rows] == msgpack.unpackb(packed["step"])
    batch.clear()
    batch.add_rows(tuple(map(list, zip(*[_plain_row(1)]))))
    with pytest.raises(TypeError):  # (a refused value, then a wait that does not divide)
        batch.add_rows(tuple(map(list, zip(*[_plain_row(2, **{field: value}),
                                             _plain_row(3, data_wait_s="s")]))))
    assert batch.take(dict(_HEAD), {}) == _reference([_plain_row(1)], _HEAD, {})


def test_a_call_back_into_the_batch_while_it_adds_or_takes_is_refused():
    """A value's Python code (a step time's ``__bool__``, a knob's ``__eq__``, a list in
    ``common`` msgpack iterates) that empties or adds to the batch it is being added to
    or taken from raises RuntimeError: the batch stays whole (no crash, no message whose
    counts are not its own)."""
    batch = StepsBatch(_PACKB)
    batch.add_rows(tuple(map(list, zip(*[_plain_row(1)]))))

    class Clearing(float):
        def __bool__(self):
            batch.clear()
            return True

    with pytest.raises(RuntimeError):
        batch.add_rows(tuple(map(list, zip(*[_plain_row(2, step_time_s=Clearing(0.01))]))))

    class Knob:
        def __eq__(self, other):
            batch.clear()
            return True

    batch.add_rows(tuple(map(list, zip(*[_plain_row(2, knobs={"k": Knob()}),
                                         _plain_row(3, knobs={"k": Knob()})]))))
    with pytest.raises(RuntimeError):
        batch.take(dict(_HEAD), {})

    class Iterated(list):
        def __iter__(self):
            batch.clear()
            return super().__iter__()

    with pytest.raises(RuntimeError):
        batch.take(dict(_HEAD), {"c": Iterated([1, 2])})
    head = dict(_HEAD)

    class Emptying(list):
        def __iter__(self):
            head.clear()
            return super().__iter__()

    head["c"] = Emptying([1])
    with pytest.raises(RuntimeError):  # (each entry held while packed)
        batch.take(head, {})
    assert batch.n == 3
    batch.clear()
    assert batch.n == 0 and batch.take(dict(_HEAD), {}) == _reference([], _HEAD, {})


@pytest.mark.parametrize("change", ["loss past 64 bits", "tokens past 64 bits",
                                    "a list loss", "a float skipped total"])
def test_a_run_with_a_value_that_is_not_a_plain_number_is_not_taken(change):
    """add_run takes a run only of plain numbers C packs: a value that would run Python
    code (which could change the records or lists it reads) or that msgpack refuses is
    left to the caller, the batch and the window untouched."""
    records = [StepRecord(1, 8, 0.001, step=step, step_time_s=0.01, knobs={})
               for step in range(1, 6)]
    losses, skipped_total = [0.5] * 5, 0
    if change == "loss past 64 bits":
        losses[3] = 2**64
    elif change == "tokens past 64 bits":
        records[3].tokens = 2**64
    elif change == "a list loss":
        losses[0] = [0.5]
    else:
        skipped_total = 1.0
    window = InputWindow()
    batch = StepsBatch(_PACKB)
    assert batch.add_run(records, losses, [None] * 5, [None] * 5, window,
                         skipped_total) is None
    assert batch.n == 0
    assert window.add(0.0, 1.0) == InputWindow().add(0.0, 1.0)  # (nothing added)
