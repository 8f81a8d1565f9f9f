"""Property-based: generated frames never crash the decoder or the command validator,
and never yield a value outside the knob's schema."""

import msgpack
from hypothesis import given, settings, strategies as st

from agent.wire import protocol
from agent.wire.knobs import STANDARD_KNOBS, TEXT_MAX_CHARS, Knob, KnobError, KnobSet

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


def _knobs():
    knobs = KnobSet()
    for spec in STANDARD_KNOBS.values():
        knobs.add(Knob(spec, get=lambda: None, set=lambda value: None))
    return knobs


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_protocol_error(payload):
    try:
        message = protocol.decode(payload)
    except protocol.ProtocolError:
        return
    assert isinstance(message["type"], str) and isinstance(message["body"], dict)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "type", "run", "seq", "body", "x"]), values))
def test_generated_envelopes_decode_or_raise_protocol_error(envelope):
    try:
        message = protocol.decode(msgpack.packb(envelope, use_bin_type=True))
    except protocol.ProtocolError:
        return
    assert message["type"] == envelope["type"]


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.sampled_from(sorted(STANDARD_KNOBS)), values), values)
def test_validator_accepts_only_values_inside_the_schema(knob, value):
    knobs = _knobs()
    try:
        coerced = knobs.validate(knob, value)
    except KnobError as exc:
        assert str(exc)
        return
    spec = STANDARD_KNOBS[knob]
    if spec.kind == "choice":
        assert coerced in spec.choices
    elif spec.kind == "bool":
        assert isinstance(coerced, bool)
    elif spec.kind == "float":
        assert type(coerced) is float and spec.minimum <= coerced <= spec.maximum
    elif spec.kind == "weights":
        weights = [float(part) for part in coerced.split(",")]
        assert spec.minimum <= len(weights) <= spec.maximum
        assert all(0 <= weight <= 1 for weight in weights) and sum(weights) > 0.99
    elif spec.kind == "text":
        assert type(coerced) is str and 1 <= len(coerced) <= TEXT_MAX_CHARS
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in coerced)
    else:
        assert type(coerced) is int and spec.minimum <= coerced <= spec.maximum
