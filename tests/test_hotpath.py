"""The training thread's hot path in C, against what the Python it replaced did.

gpuopt._hotpath: the window meter's counts (samples from shapes, tokens), the iteration's
steady state (counted, timed, handed back to the generator at each epoch's end), and that
it ends as a generator ends: on an error of the loader or of ``on_batch``, on ``close()``,
and that it is collected in a reference cycle. agent.step._hot: the step record, made
as the dataclass was, and the agent's optimizer_step: what it fills in, its own error
reported once (training goes on), a KeyboardInterrupt passed on.
"""

from __future__ import annotations

import gc
import itertools
import struct
import threading
import weakref

import numpy
import pytest
import torch

from gpuopt._hotpath import WindowMeter
from gpuopt.data import batch_size
from gpuopt.position import DataPosition


def test_the_meter_counts_samples_and_tokens_as_batch_size_and_input_ids_say():
    """Samples: dim 0 of the first tensor (read in C for a tuple or list of tensors; an
    empty first tensor, a dict or a nested batch go through batch_size); tokens: a
    mapping's input_ids elements, or samples * tokens_per_sample."""
    batches = [
        (torch.zeros(4, 3), torch.zeros(4)),          # 4: read in C
        [torch.zeros(0, 3), torch.zeros(5)],          # 5: dim 0 of the first is 0
        (torch.tensor(1.0), torch.zeros(9)),          # 1: a 0-dim tensor counts one
        ((torch.zeros(6, 2),), torch.zeros(6)),       # 6: nested
        {"input_ids": torch.zeros(2, 7, dtype=torch.long)},  # 2 samples, 14 tokens
        (None, torch.zeros(3)),                       # 3: None is skipped
        "no tensor",                                  # 0
    ]
    meter = WindowMeter(batch_size)
    for batch in batches:
        meter.add(batch, 0.25)
    assert meter.take() == (1.75, 7, 4 + 5 + 1 + 6 + 2 + 3 + 0, 14)
    assert meter.take() == (0.0, 0, 0, None)  # (a fresh start)
    assert [batch_size(batch) for batch in batches] == [4, 5, 1, 6, 2, 3, 0]

    declared = WindowMeter(batch_size, 128)
    declared.add((torch.zeros(4, 3),), 0.0)
    declared.add({"input_ids": torch.zeros(2, 7)}, 0.0)  # (declared wins over input_ids)
    assert declared.take() == (0.0, 2, 6, 6 * 128)

    other = WindowMeter(lambda batch: 10)  # (any count_samples is called, tuple or not)
    other.add((torch.zeros(4, 3),), 0.5)
    assert other.take() == (0.5, 1, 10, None)


def _dense_tensors():
    """Dense tensors of 0 to 5 dims as loaders hand them over: dtypes, views, slices,
    transposes, expansions, a resize in place, one that requires grad, an empty one."""
    resized = torch.zeros(4, 4)
    resized.resize_(11, 2)
    return [torch.zeros(64, 8), torch.zeros(3, dtype=torch.int8), torch.tensor(1.0),
            torch.zeros(2, 3, 4, 5, 6), torch.zeros(5, 3).t(), torch.zeros(10)[2:7],
            torch.zeros(1, 4).expand(9, 4), torch.zeros(6, 2, dtype=torch.bfloat16)[::2],
            torch.zeros(7, 2, requires_grad=True), resized, torch.zeros(0, 3),
            torch.arange(12).view(3, 4)[1:], torch.zeros(2, 3).unsqueeze(0)]


def test_dim_0_is_read_from_the_tensor_object_exactly_as_shape_says():
    """The layout learned at import (this torch: a dense tensor's sizes) gives dim 0 of
    every dense tensor of 0 to 5 dims as ``shape`` does (1 for 0 dims); a tensor whose
    sizes live elsewhere (6 dims, sparse, nested, a subclass) is not read there, and the
    meter counts it through ``shape`` all the same."""
    from gpuopt import _hotpath

    assert _hotpath._tensor_layout() is not None  # (else every fetch pays a torch call)
    dense = _dense_tensors()
    assert [_hotpath._direct_dim0(tensor) for tensor in dense] == [
        tensor.shape[0] if tensor.dim() else 1 for tensor in dense]

    class Marked(torch.Tensor):
        pass

    with pytest.warns(UserWarning, match="nested"):  # (torch's prototype warning)
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    others = [torch.zeros(2, 3, 4, 5, 6, 7), torch.zeros(4, 4).to_sparse(),
              torch.nn.Parameter(torch.zeros(7, 2)), torch.zeros(5, 2).as_subclass(Marked),
              nested, "not a tensor"]
    assert [_hotpath._direct_dim0(other) for other in others] == [None] * len(others)

    meter = WindowMeter(batch_size)
    for tensor in dense + others[:4]:
        meter.add((tensor, None), 0.0)
    assert meter.take()[2] == sum(batch_size((tensor,)) for tensor in dense + others[:4])


def test_a_plain_tensor_with_symbolic_sizes_is_counted_through_shape_not_stale_sizes():
    """A plain torch.Tensor may hold SymInt sizes (its TensorImpl's sizes_and_strides_
    then stale: here 500): dim 0 is not read from memory, and the meter counts what
    batch_size does (the SymInt's value through ``__index__``)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from gpuopt import _hotpath

    size = ShapeEnv().create_unspecified_symint_and_symbol(
        48, ConstantSource("s"), DimDynamic.DYNAMIC)
    restrided = torch.zeros(500).as_strided_((size, 3), (3, 1))
    meta = torch.empty((3, size), device="meta")
    assert type(restrided) is torch.Tensor and type(meta) is torch.Tensor
    assert _hotpath._direct_dim0(restrided) is None and _hotpath._direct_dim0(meta) is None
    meter = WindowMeter(batch_size)
    meter.add((restrided,), 0.0)
    meter.add([meta], 0.0)
    assert meter.take()[2] == 48 + 3 == int(batch_size((restrided,))) + batch_size([meta])
    assert _hotpath._direct_dim0(torch.zeros(7, 2)) == 7  # (a plain one still read)


def test_the_layout_is_learned_on_the_host_whatever_default_device_is_set():
    """The probes are made on the CPU: a default device set before the import (CUDA,
    absent here: a probe made there raised, and every fetch read ``shape``) neither
    starts that device nor loses the direct read."""
    import subprocess
    import sys

    from gpuopt import _hotpath

    code = ("import torch; torch.set_default_device('cuda'); import gpuopt._hotpath as h; "
            "print(h._tensor_layout())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(_hotpath._tensor_layout())


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_a_host_scalar_is_read_from_memory_exactly_as_item_reads_it():
    """A 0-dim float32 or float64 CPU tensor (a host loss) is read from its storage, its
    value bit for bit ``item()``'s; every other tensor is read by ``item()`` itself
    (host_items), with its errors."""
    from gpuopt import _hotpath

    assert -1 not in _hotpath._tensor_layout()  # (else every loss pays a torch call)
    weight = torch.tensor(1.5, requires_grad=True)
    matrix = torch.arange(12.0).reshape(3, 4)
    grown = torch.tensor(2.0)
    grown.add_(0.25)  # (changed in place: read as changed)
    read = [torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64), torch.tensor(-0.0),
            torch.tensor(float("nan")), torch.tensor(float("-inf")), torch.tensor(1e-45),
            torch.arange(8.0)[5], matrix[2, 3], matrix.t()[1, 0], weight,
            (weight * weight).sum(), torch.nn.functional.mse_loss(matrix, matrix * 2),
            weight.detach(), grown, torch.from_numpy(numpy.array(3.25, dtype=numpy.float32)),
            torch.tensor(7.0, dtype=torch.float64).clone()]
    for tensor in read:
        direct = _hotpath._host_scalar(tensor)
        assert direct is not None and _bits(direct) == _bits(tensor.item())
    with torch.inference_mode():
        inference = torch.tensor(1.5)
    not_read = [torch.tensor(3), torch.tensor(True), torch.tensor(0.5, dtype=torch.bfloat16),
                torch.tensor(0.5, dtype=torch.float16), torch.tensor([2.5]),
                torch._neg_view(torch.tensor(4.0)), inference,
                torch.nn.Parameter(torch.tensor(1.0)), torch._efficientzerotensor(()),
                torch.tensor(1 + 2j)]
    for tensor in not_read:
        assert _hotpath._host_scalar(tensor) is None
    assert _hotpath._host_scalar(torch._neg_view(torch.tensor(4.0)).neg()) == 4.0  # (plain)
    items = _hotpath.host_items(read + not_read[:-1])
    assert [_bits(value) for value in items[:len(read)]] == [
        _bits(tensor.item()) for tensor in read]
    assert items[len(read):] == [tensor.item() for tensor in not_read[:-1]]
    assert _hotpath.host_items(()) == []
    for bad in ([torch.zeros(2)], [torch.tensor(0.5, device="meta")], [1.5]):
        with pytest.raises((RuntimeError, AttributeError)) as raised:
            _hotpath.host_items(bad)
        with pytest.raises(raised.type):
            bad[0].item()


def test_a_scalar_outside_its_storage_is_never_read_from_memory():
    """A storage shrunk under its tensor (``resize_(0)``), or a view past its end, is
    ``item()``'s to refuse: never read out of bounds."""
    from gpuopt import _hotpath

    shrunk = torch.tensor(1.0)
    shrunk.untyped_storage().resize_(0)
    assert _hotpath._host_scalar(shrunk) is None
    with pytest.raises(RuntimeError):
        _hotpath.host_items([shrunk])
    short = torch.arange(4.0)[3]
    short.untyped_storage().resize_(8)  # (two floats left: the view is at the fourth)
    assert _hotpath._host_scalar(short) is None


def test_the_meter_refuses_bad_arguments_and_passes_errors_on():
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="tokens_per_sample must be an integer >= 1"):
            WindowMeter(batch_size, bad)
    with pytest.raises(TypeError, match="count_samples must be callable"):
        WindowMeter(None)
    meter = WindowMeter(lambda batch: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        meter.add((), 0.0)
    with pytest.raises(StopIteration):
        WindowMeter(batch_size).timed_next(iter([]))
    with pytest.raises(TypeError, match="needs an iterator"):
        WindowMeter(batch_size).timed_next([1])
    timed = WindowMeter(batch_size)
    assert timed.timed_next(iter([(torch.zeros(3),)])) is not None
    wait_s, fetched, samples, tokens = timed.take()
    assert (fetched, samples, tokens) == (1, 3, None) and 0.0 <= wait_s < 1.0


def test_the_iteration_counts_every_batch_across_epochs_and_hands_each_end_back():
    """3 epochs of 4 batches: 12 batches in order, each counted and given to on_batch
    (a Python callable: called from C) with its wait; epochs_done 3, fetched_in_epoch
    counted again from each epoch's start; the latest batch kept, no other."""
    position = DataPosition()
    data = [(torch.full((2,), float(i)),) for i in range(4)]
    seen: list[tuple[int, float]] = []
    iteration = position.iterate(data, 3, lambda batch, wait: seen.append((int(batch[0][0]),
                                                                          wait)))
    got = [int(batch[0][0]) for batch in iteration]
    assert got == [0, 1, 2, 3] * 3
    assert [index for index, _ in seen] == got and all(w >= 0.0 for _, w in seen)
    assert (position.epoch, position.epochs_done, position.fetched_in_epoch,
            position.fetched_total) == (3, 3, 4, 12)
    assert [batch for _, batch in position._recent] == [data[3]]
    with pytest.raises(StopIteration):
        next(iteration)
    assert list(position.iterate([], None)) == []  # (an epoch that yields nothing ends it)


def test_the_iteration_counts_into_the_meter_without_a_call():
    """on_batch a WindowMeter's add: the same counts as calling it."""
    position, meter = DataPosition(), WindowMeter(batch_size)
    data = [(torch.zeros(3, 2), torch.zeros(3))] * 5
    assert len(list(position.iterate(data, 2, meter.add))) == 10
    wait_s, fetched, samples, tokens = meter.take()
    assert (fetched, samples, tokens) == (10, 30, None) and wait_s >= 0.0


class _Failing:
    """Batches 0, 1, 2, then an error."""

    def __iter__(self):
        for index in range(3):
            yield (torch.tensor([index]),)
        raise OSError("the disk went away")


def test_an_error_of_the_loader_or_of_on_batch_ends_the_iteration_as_a_generator_ends():
    position = DataPosition()
    iteration = position.iterate(_Failing(), None)
    assert [int(next(iteration)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="the disk went away"):
        next(iteration)
    with pytest.raises(StopIteration):
        next(iteration)
    assert position.fetched_total == 3

    def refuse(batch, wait_s):
        if int(batch[0]) == 2:
            raise ValueError("no")

    iteration = DataPosition().iterate([(torch.tensor([i]),) for i in range(5)], 1, refuse)
    assert [int(next(iteration)[0]) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="no"):
        next(iteration)
    assert list(iteration) == []


def test_a_closed_iteration_fetches_nothing_more():
    fetched: list[int] = []

    def batches():
        for index in range(10):
            fetched.append(index)
            yield (torch.tensor([index]),)

    class Loader:
        def __iter__(self):
            return batches()

    iteration = DataPosition().iterate(Loader(), None)
    next(iteration), next(iteration)
    iteration.close()
    iteration.close()  # (again: nothing)
    assert list(iteration) == [] and fetched == [0, 1]


def test_an_iteration_in_a_reference_cycle_is_collected():
    """The iteration, its generator and the position free each other (no leak): a batch
    it held is gone once the cycle is collected."""
    position = DataPosition()
    batch = (torch.zeros(3),)
    held = weakref.ref(batch[0])
    iteration = position.iterate([batch, (torch.zeros(2),)], None)
    next(iteration)
    position.cycle = iteration  # type: ignore[attr-defined]  # position -> iteration -> position
    gone = weakref.ref(iteration)
    del batch, iteration, position
    gc.collect()
    assert gone() is None and held() is None


def test_the_step_record_is_made_by_position_or_keyword_with_its_defaults():
    """agent.step.record.StepRecord (C): the dataclass it replaced, field for field."""
    from agent.step.record import StepRecord

    loss = torch.tensor(0.5)
    by_position = StepRecord(2, 16, 0.25, loss, None, 1024, 64, 0.1, 1.5)
    by_keyword = StepRecord(grad_norm=1.5, lr=0.1, tokens=64, activation_bytes=1024,
                            skipped=None, loss=loss, data_wait_s=0.25, samples=16,
                            micro_batches=2)
    fields = ("micro_batches", "samples", "data_wait_s", "loss", "skipped",
              "activation_bytes", "tokens", "lr", "grad_norm", "step", "step_time_s",
              "marker", "knobs")
    expected = (2, 16, 0.25, loss, None, 1024, 64, 0.1, 1.5, 0, None, None, None)
    for record in (by_position, by_keyword, StepRecord(**dict(zip(fields, expected)))):
        assert tuple(getattr(record, name) for name in fields) == expected
    by_position.step, by_position.knobs = 7, {"precision": "bf16"}
    assert (by_position.step, by_position.knobs) == (7, {"precision": "bf16"})
    assert repr(StepRecord(1, 8, 0.0, step=3)).startswith(
        "StepRecord(micro_batches=1, samples=8, data_wait_s=0.0, loss=None")
    for make, message in ((lambda: StepRecord(1, 8), "missing required argument 'data_wait_s'"),
                          (lambda: StepRecord(1, 8, 0.0, steps=2), "unexpected keyword"),
                          (lambda: StepRecord(1, 8, 0.0, samples=8), "multiple values"),
                          (lambda: StepRecord(*range(14)), "at most 13 arguments")):
        with pytest.raises(TypeError, match=message):
            make()
    with pytest.raises(AttributeError):
        by_position.steps = 3  # type: ignore[attr-defined]  # (a typo is refused, as slots)
    assert "as recorded on the training thread" in (StepRecord.__doc__ or "")


def test_a_step_record_is_not_tracked_by_the_collector_and_lets_its_values_go(run_dir):
    """Records are not traversed by the cyclic collector (hundreds queue between the I/O
    thread's passes); a record gone lets its values go at once, and the records of a
    real run's steps leave no object behind once published."""
    import agent
    from agent.step.record import StepRecord

    loss = torch.tensor(0.5)
    record = StepRecord(1, 8, 0.0, loss, knobs={"precision": "fp32"})
    assert not gc.is_tracked(record)
    gone = weakref.ref(loss)
    del loss, record
    assert gone() is None  # (no collection needed)

    losses = [torch.tensor(float(i)) for i in range(200)]
    kept = [weakref.ref(loss) for loss in losses]
    with agent.session(name="untracked") as run:
        for _batch in run.loader([(torch.zeros(4, 2),)] * len(losses)):
            run.optimizer_step(losses.pop(0))
    assert [ref() for ref in kept] == [None] * len(kept)  # (every record freed)


def test_the_agents_hot_path_reports_its_own_error_once_and_lets_the_training_go_on(run_dir):
    """agent.Agent.optimizer_step (C): a wrong record is gpuwatch's error: reported once
    (an agent_error event), the agent stops observing, nothing raised; a
    KeyboardInterrupt (the person's) is not caught; steps before are queued as recorded,
    each with its step time, the loss in its marker and the knob values."""
    import agent
    from agent.step.record import StepRecord

    monitor = agent.Agent(name="hot-errors")  # (not started: the queue is read here)
    told: list[dict] = []
    monitor.add_listener(told.append)
    loss = torch.tensor(0.25)
    monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, step=1))
    monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, skipped=None, grad_norm=2.0, step=2))
    first, second = monitor._records
    assert (first.step_time_s, first.marker, first.loss) == (None, loss, None)
    assert second.step_time_s > 0.0 and second.marker == (loss, None, 2.0)
    assert first.knobs is monitor.knob_values and monitor.last_step == 2
    assert [record["step"] for record in told if record["type"] == "step"] == [1, 2]

    def interrupt(record):
        raise KeyboardInterrupt

    monitor.add_listener(interrupt)
    with pytest.raises(KeyboardInterrupt):
        monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, step=3))
    monitor._listeners = monitor._listeners[:1]
    monitor.optimizer_step({"step": 4})  # type: ignore[arg-type]
    monitor.optimizer_step(StepRecord(1, 8, 0.0, loss, step=5))  # (no longer observed)
    assert monitor.errors == ["gpuwatch agent: hot path failed: TypeError: optimizer_step "
                              "needs a StepRecord, got dict"]
    assert [record.step for record in monitor._records  # (events are queued in between)
            if isinstance(record, StepRecord)] == [1, 2, 3]
    assert [record["text"] for record in told if record.get("kind") == "agent_error"] == [
        monitor.errors[0] + " (training continues)"]
    monitor.close()


def test_a_next_or_close_while_the_iteration_fetches_is_refused_as_a_generator_refuses():
    """From inside the loader (at an epoch's start, in Python; in the steady state, in C),
    from a loader that chains the iteration itself, and from another thread while a fetch
    waits: ValueError, as a running generator gives, and the iteration goes on (it once
    freed the generator it was running: a crash under ``-X dev``)."""
    position = DataPosition()
    refused: list[str] = []

    class Reentrant:
        """Each fetch calls next() and close() on the iteration it feeds."""

        def __iter__(self):
            for index in range(4):
                for call in (lambda: next(iteration), iteration.close):
                    try:
                        call()
                    except ValueError as exc:
                        refused.append(str(exc))
                yield (torch.tensor([index]),)

    iteration = position.iterate(Reentrant(), 1)
    assert [int(batch[0]) for batch in iteration] == [0, 1, 2, 3]
    assert len(refused) == 8 and all("already fetching" in text for text in refused)

    class Chained:
        def __iter__(self):
            return itertools.chain([(torch.tensor([7]),)], chained)

    chained = DataPosition().iterate(Chained(), 1)
    assert int(next(chained)[0]) == 7
    with pytest.raises(ValueError, match="already fetching"):
        next(chained)  # (it once recursed in C until the stack overflowed)

    started, release = threading.Event(), threading.Event()

    def slow_batches():
        for index in range(3):
            started.set()
            release.wait(10)
            yield (torch.tensor([index]),)

    class Slow:
        def __iter__(self):
            return slow_batches()

    waiting = DataPosition().iterate(Slow(), 1)
    closing: list[BaseException] = []

    def close_during_the_fetch():
        started.wait(10)
        try:
            waiting.close()
        except ValueError as exc:
            closing.append(exc)
        release.set()

    closer = threading.Thread(target=close_during_the_fetch)
    closer.start()
    assert int(next(waiting)[0]) == 0
    closer.join(10)
    assert len(closing) == 1 and [int(batch[0]) for batch in waiting] == [1, 2]


def test_a_deleted_field_is_an_error_never_a_crash(run_dir):
    """The C types' fields can be deleted from Python: what reads one then raises (the
    agent reports it once and stops observing), as the Python they replaced did."""
    import agent
    from agent.step.record import StepRecord

    position = DataPosition()
    del position._recent
    with pytest.raises(AttributeError, match="_recent was deleted"):
        position._count((torch.zeros(2),))
    meter = WindowMeter(batch_size)
    del meter.tokens
    with pytest.raises(AttributeError, match="tokens was deleted"):
        meter.add((torch.zeros(2),), 0.0)
    with pytest.raises(TypeError, match="not callable"):
        StepRecord(1, 8, 0.0)()  # type: ignore[operator]  # (it once jumped to its refcount)
    for name in ("_records", "_marker", "_knob_values", "_last_step", "_pending",
                 "_last_boundary_t"):
        monitor = agent.Agent(name="deleted")
        delattr(monitor, name)
        monitor.optimizer_step(StepRecord(1, 8, 0.0, step=1))
        assert monitor.errors == ["gpuwatch agent: hot path failed: AttributeError: a field "
                                  "of the agent's hot path was deleted"], name
        monitor.close()


def test_a_count_of_samples_may_be_any_integer_type():
    """count_samples' answer is read through ``__index__`` (a numpy integer, a 0-dim
    integer tensor), as the Python meter summed it; a float is refused."""
    import numpy

    for count in (numpy.int64(5), torch.tensor(5), 5):
        meter = WindowMeter(lambda batch, count=count: count)
        meter.add((), 0.0)
        assert meter.take()[2] == 5
    with pytest.raises(TypeError):
        WindowMeter(lambda batch: 5.0).add((), 0.0)


def test_the_columns_of_a_run_of_records_are_their_fields_and_bad_input_is_refused():
    """agent.step._hot.columns (C, the encoder's pass over a run of records): each field
    named, in the records' order; a name that is no field, an item that is no record, a
    field deleted: each its clear error, the records as they were."""
    from agent.step._hot import columns
    from agent.step.record import HOST_FIELDS, StepRecord, host_columns

    records = [StepRecord(step, 8 * step, step / 10, step=step, knobs={"n": step})
               for step in range(1, 6)]
    got = host_columns(records)
    assert list(got) == list(HOST_FIELDS)
    for name in HOST_FIELDS:
        assert got[name] == [getattr(record, name) for record in records], name
    assert columns([], ("step", "marker")) == ([], [])
    with pytest.raises(ValueError, match="no field 'steps'"):
        columns(records, ("step", "steps"))
    with pytest.raises(TypeError, match="item 1 is a dict, not a StepRecord"):
        columns([records[0], {"step": 2}], ("step",))
    del records[2].lr
    with pytest.raises(AttributeError, match="lr was deleted"):
        columns(records, ("step", "lr"))
    assert [record.step for record in records] == [1, 2, 3, 4, 5]


def test_the_input_window_refuses_what_is_not_a_number_and_keeps_its_steps():
    """InputWindow (C): a batch with a value that is not a number raises TypeError and
    adds none of its steps; a NaN step time leaves shares of 0 until it leaves the window
    (the Python window's running sums stayed NaN for the rest of the run)."""
    from agent.step.encoder import INPUT_WINDOW_STEPS, InputWindow

    window = InputWindow()
    assert window.add(0.25, 1.0) == (0.25, "partly input-bound")
    with pytest.raises(TypeError):
        window.add_many([0.5, "late"], [1.0, 1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="of one length"):
        window.add_many([0.5], [1.0, 1.0])
    assert window.add(0.75, 1.0) == (0.5, "input-bound")  # (the batch added nothing)
    assert window.add(0.0, float("nan")) == (0.0, "compute-bound")
    window.add_many([0.0] * INPUT_WINDOW_STEPS, [1.0] * INPUT_WINDOW_STEPS)  # (NaN gone)
    assert window.add(1.0, 1.0)[0] == 1.0 / INPUT_WINDOW_STEPS
    with pytest.raises(ValueError):
        InputWindow(0)


def test_the_loops_optimizer_step_takes_its_arguments_as_a_python_function_would(run_dir):
    """LoopRun.optimizer_step (C): its six arguments by position or keyword, None as not
    given; an unknown keyword, one given twice, a seventh argument: TypeError before
    anything is counted; the record has what was given, else the window's counts."""
    import agent

    loss = torch.tensor(0.5)
    with agent.session(name="loop-args") as run:
        seen: list[dict] = []
        run.agent.add_listener(seen.append)
        for _ in run.loader([(torch.zeros(4, 2),)] * 2):
            pass  # two micro-batches fetched, 8 samples
        run.optimizer_step(loss, None, 100, activation_bytes=2048)
        for call, message in (
                (lambda: run.optimizer_step(loss, los=loss), "unexpected keyword argument 'los'"),
                (lambda: run.optimizer_step(loss, loss=loss), "multiple values for argument"),
                (lambda: run.optimizer_step(*[None] * 7), "at most 6 arguments")):
            with pytest.raises(TypeError, match=message):
                call()
        run.optimizer_step(samples=3, grad_norm=1.5)
        assert (run.step, run._micro_batches_trained) == (2, 3)  # (a window of no fetch: 1)
    steps = [record for record in seen if record["type"] == "step"]
    assert [(record["step"], record["micro_batches"], record["samples"], record.get("tokens"),
             record.get("activation_bytes")) for record in steps] == [
        (1, 2, 8, 100, 2048), (2, 1, 3, None, None)]


def test_the_boundary_refuses_what_is_not_a_step_record_and_a_deleted_field(run_dir):
    """RunBase.boundary (C): a dict is a TypeError and counts nothing; a hot-path field
    deleted from Python is an AttributeError, never a crash; a window hook that gives the
    wrong number of values says which and how many."""
    import agent
    from agent.step.record import StepRecord

    with agent.session(name="boundary-args") as run:
        with pytest.raises(TypeError, match="boundary needs a StepRecord, got dict"):
            run.boundary({"step": 1})  # type: ignore[arg-type]
        assert run.step == 0
        run.boundary(StepRecord(1, 8, 0.0))
        assert run.step == 1 and run._micro_batches_trained == 1
        run._window_of_scaler = False
        run._take_window = lambda: (None, None)  # type: ignore[method-assign]
        with pytest.raises(ValueError, match=r"_take_window\(\) gave 2 values, not 4"):
            run.optimizer_step()
        run._window_of_scaler = True
        run.optimizer_step()
        assert run.step == 2
        meter = run.meter
        del run.meter
        with pytest.raises(AttributeError, match="a field of the run's hot path was deleted"):
            run.optimizer_step()
        run.meter = meter
        run.optimizer_step()
        assert run.step == 3


def test_a_queue_without_an_append_is_refused_when_it_is_set(run_dir):
    """The agent's ``_records`` and a position's ``_recent`` keep their bound ``append``
    (no lookup a step): something without one is refused at once, the old queue kept."""
    import agent

    position = DataPosition()
    recent = position._recent
    with pytest.raises(AttributeError, match="append"):
        position._recent = 5  # type: ignore[assignment]
    assert position._recent is recent
    position._count((torch.zeros(2),))
    assert len(position._recent) == 1
    monitor = agent.Agent(name="queue")
    records = monitor._records
    with pytest.raises(AttributeError, match="append"):
        monitor._records = ()  # type: ignore[assignment]
    assert monitor._records is records


def test_a_field_a_hook_deletes_during_the_step_is_an_error_never_a_crash(run_dir):
    """LoopRun.optimizer_step and the boundary (C) read each run's field again after each
    call into Python: a window hook, the meter, the position or a comparison that deletes
    one (here: each in turn) is an AttributeError, never a read of a freed field; with the
    field back, the run counts on."""
    import agent

    with agent.session(name="hook-deletes") as run:
        run._window_of_scaler = False
        fields = {name: getattr(run, name) for name in (
            "meter", "optimizer_settings", "_micro_batches_trained", "agent", "_accum_steps",
            "_windows_off", "position")}

        class Meter:  # (a meter whose take deletes the optimizer's settings)
            def take(self):
                del run.optimizer_settings
                return fields["meter"].take()

        class Position:  # (window_done deletes what the boundary reads after it)
            def __init__(self, name):
                self.name = name

            def window_done(self, micro_batches):
                delattr(run, self.name)

        class Counted(int):  # (a window's count whose == deletes the accumulation steps)
            def __eq__(self, other):
                del run._accum_steps
                return True

            __hash__ = int.__hash__

        def take_window_deleting_the_meter():
            del run.meter
            return None, None, 0, None

        attacks = [
            lambda: setattr(run, "_take_window", take_window_deleting_the_meter),
            lambda: setattr(run, "meter", Meter()),
            lambda: setattr(run, "position", Position("_micro_batches_trained")),
            lambda: setattr(run, "position", Position("agent")),
            lambda: (setattr(run, "_windows_off", 0), setattr(run, "_accum_steps", 2),
                     setattr(run, "_take_window", lambda: (None, None, Counted(2), None))),
        ]
        for number, attack in enumerate(attacks):
            attack()
            with pytest.raises(AttributeError, match="a field of the run's hot path was "
                                                     "deleted"):
                run.optimizer_step()
            for name, value in fields.items():
                setattr(run, name, value)
            run._take_window = lambda: (None, None, 0, None)
            step = run.step
            run.optimizer_step()
            assert run.step == step + 1, number
        assert not run.broken and not run.agent.errors


def test_a_listener_that_deletes_an_agents_field_stops_the_observing_never_training(
        run_dir):
    """Agent.optimizer_step (C) reads its fields again after the listeners ran: one that
    deletes the pending commands is the agent's error, reported once; training goes on."""
    import agent
    from agent.step.record import StepRecord

    monitor = agent.Agent(name="listener-deletes")
    monitor.add_listener(lambda record: delattr(monitor, "_pending")
                         if record.get("type") == "step" else None)
    monitor.optimizer_step(StepRecord(1, 8, 0.0, step=1))
    monitor.optimizer_step(StepRecord(1, 8, 0.0, step=2))  # (no longer observed)
    assert monitor.errors == ["gpuwatch agent: hot path failed: AttributeError: a field "
                              "of the agent's hot path was deleted"]
    monitor.close()


def test_the_input_window_refuses_lists_a_value_changes_while_read():
    """InputWindow.add_many (C) reads each value through ``__float__``: one that empties
    the lists is a RuntimeError and adds no step, never a read past a list's end."""
    from agent.step.encoder import InputWindow

    window = InputWindow()

    class Emptying:
        def __float__(self):
            waits.clear()
            times.clear()
            return 0.5

    waits = [Emptying()] + [0.0] * 999
    times = [1.0] * 1000
    with pytest.raises(RuntimeError, match="a list changed size while read"):
        window.add_many(waits, times)  # type: ignore[arg-type]
    assert window.add(0.25, 1.0) == (0.25, "partly input-bound")  # (nothing was added)


def test_a_scaler_that_deletes_itself_from_the_run_while_read_is_never_a_crash(run_dir):
    """A Session's window is read from its scaler in C: a scaler whose attribute's Python
    deletes ``run.scaler`` is held while it is read, the step is an AttributeError (not
    counted), and the run counts on once the scaler is back."""
    import agent

    with agent.session(name="scaler-gone") as run:
        scaler = run.scaler

        class Vanishing:
            skipped = None

            @property
            def micro_batches(self):
                del run.scaler
                return 0

        run.scaler = Vanishing()
        with pytest.raises(AttributeError, match="a field of the run's hot path was deleted"):
            run.optimizer_step()
        assert run.step == 0
        run.scaler = scaler
        run.optimizer_step()
        assert run.step == 1
