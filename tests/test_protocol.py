"""The wire protocol: round trips, tolerance of unknown fields and types, malformed input."""

import msgpack
import pytest

from agent.wire import protocol
from agent.wire.knobs import ACCUM_STEPS, PRECISION, KnobError, KnobSet, Knob


def test_round_trip_keeps_every_field():
    message = protocol.envelope("step", {"step": 3, "step_time_s": 0.012, "loss": None},
                                run="r1", rank=2, seq=9, t=123.5)
    topic, payload = protocol.encode(message)
    assert topic == b"step"
    assert protocol.decode_frames([topic, payload]) == message


def test_unknown_fields_and_types_are_kept_not_errors():
    raw = msgpack.packb({"v": 99, "type": "future_type", "run": "r", "extra": [1, 2],
                         "body": {"new_field_s": 1.0}})
    message = protocol.decode(raw)
    assert message["type"] == "future_type"
    assert message["extra"] == [1, 2]
    assert message["body"]["new_field_s"] == 1.0


def test_missing_body_becomes_empty():
    assert protocol.decode(msgpack.packb({"type": "heartbeat"}))["body"] == {}


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x92\x01\x02", msgpack.packb([1, 2]), msgpack.packb({"body": {}}),
    msgpack.packb({"type": 5}), msgpack.packb({"type": "step", "body": [1]}),
    b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1),
])
def test_malformed_frames_raise_protocol_error(payload):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(payload)


def test_empty_multipart_is_malformed():
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_frames([])


def _knobs():
    state = {"precision": "fp32", "accum_steps": 1}
    knobs = KnobSet()
    for spec in (PRECISION, ACCUM_STEPS):
        knobs.add(Knob(spec, get=lambda n=spec.name: state[n],
                       set=lambda v, n=spec.name: state.__setitem__(n, v)))
    return knobs


@pytest.mark.parametrize("knob, value, expected", [
    ("precision", "bf16", "bf16"), ("accum_steps", 4, 4), ("accum_steps", "8", 8),
    ("accum_steps", 2.0, 2),
])
def test_valid_values_are_coerced(knob, value, expected):
    assert _knobs().validate(knob, value) == expected


@pytest.mark.parametrize("knob, value, message", [
    ("precision", "fp8", "not one of"), ("precision", 16, "not one of"),
    ("accum_steps", 0, "below the minimum"), ("accum_steps", 10**9, "above the maximum"),
    ("accum_steps", 2.5, "not an integer"), ("accum_steps", True, "not an integer"),
    ("accum_steps", "four", "not an integer"), ("accum_steps", None, "not an integer"),
    ("accum_steps", "1_0", "not an integer"), ("accum_steps", "\u0663", "not an integer"),
    ("kernels", "triton", "unknown knob"), (None, 1, "unknown knob"),
    (["precision"], "bf16", "unknown knob"),
])
def test_bad_commands_are_refused_with_the_reason(knob, value, message):
    with pytest.raises(KnobError, match=message):
        _knobs().validate(knob, value)


def test_schema_lists_bound_knobs_only():
    schema = _knobs().schema()
    assert [k["name"] for k in schema] == ["precision", "accum_steps"]
    assert schema[0]["choices"] == ["fp32", "bf16", "fp16"]
    assert schema[1]["min"] == 1


def test_a_huge_bad_value_is_quoted_short():
    with pytest.raises(KnobError) as error:
        _knobs().validate("precision", "x" * 100_000)
    assert len(str(error.value)) <= 200


def _batch():
    columns = {"step": [7, 8, 9], "step_time_s": [0.01, 0.02, None],
               "loss": [2.5, float("nan"), None], "activation_bytes": [None, 4096, None]}
    common = {"knobs": {"precision": "bf16"}, "host_rss_bytes": 1 << 29}
    return protocol.envelope(protocol.STEPS, protocol.steps_body(columns, common),
                             run="r1", rank=1, seq=4, t=10.0)


def test_a_steps_batch_reads_as_one_step_record_a_row():
    message = protocol.decode_frames(protocol.encode(_batch()))
    rows = protocol.expand(message)
    assert [row["type"] for row in rows] == ["step"] * 3
    assert {(row["run"], row["rank"], row["seq"], row["t"]) for row in rows} == {
        ("r1", 1, 4, 10.0)}
    bodies = [row["body"] for row in rows]
    assert [body["step"] for body in bodies] == [7, 8, 9]
    assert bodies[2]["loss"] is None and bodies[2]["step_time_s"] is None  # kept: None
    assert ["activation_bytes" in body for body in bodies] == [False, True, False]
    assert all(body["knobs"] == {"precision": "bf16"} for body in bodies)
    assert protocol.expand({"type": "event", "body": {}}) == [{"type": "event", "body": {}}]


@pytest.mark.parametrize("body", [
    {"n": 2, "columns": {"step": [1]}, "common": {}},
    {"n": 1, "columns": {"step": 1}, "common": {}},
    {"n": 1, "columns": [], "common": {}},
    {"n": protocol.MAX_BATCH_STEPS + 1, "columns": {}, "common": {}},
    {"n": 1, "columns": {"step": [1]}, "common": []},
])
def test_a_malformed_steps_batch_is_a_protocol_error(body):
    with pytest.raises(protocol.ProtocolError):
        protocol.expand({"type": protocol.STEPS, "body": body})


def test_the_dashboard_folds_a_batch_as_it_folds_its_rows():
    from gpuwatch.state import RunState

    message = _batch()
    batched, one_by_one = RunState(), RunState()
    batched.ingest(message, now=1.0)
    for row in protocol.expand(message):
        one_by_one.ingest(row, now=1.0)
    assert list(batched.steps) == list(one_by_one.steps)
    assert batched.steps_total == one_by_one.steps_total == 3
    assert batched.step == one_by_one.step == 9
    assert batched.knobs == one_by_one.knobs == {"precision": "bf16"}
    assert batched.activation_bytes == one_by_one.activation_bytes == 4096
    assert batched.last_step == one_by_one.last_step
    assert batched.ranks == one_by_one.ranks and batched.malformed == 0
    bad = RunState()
    bad.ingest({**message, "body": {"n": 3, "columns": {"step": [1]}}}, now=1.0)
    assert bad.malformed == 1 and not bad.steps
