"""The wire protocol: round trips, tolerance of unknown fields and types, malformed input."""

import msgpack
import pytest

from agent import protocol
from agent.knobs import ACCUM_STEPS, PRECISION, KnobError, KnobSet, Knob


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
