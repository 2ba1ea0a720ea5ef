"""W3C trace context on the wire: the SDK's argument and automatic propagation, and the one rule set."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider

from producer_sdk._core import build_request
from producer_sdk.errors import ValidationError
from producer_sdk.protocol import GenerateRequest
from producer_sdk.request_codec import decode_request, encode_request

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_explicit_traceparent_and_tracestate_ride_the_request():
    p = build_request("hi", traceparent=TP, tracestate="congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    got = decode_request(p.payload)
    assert (got.traceparent, got.tracestate) == (TP, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    assert got.v == 1  # an optional field, not a new protocol version


def test_without_trace_context_nothing_goes_on_the_wire():
    """Older workers refuse unknown fields: a request without trace context must not carry the key."""
    p = build_request("hi")
    raw = msgspec.msgpack.decode(p.payload)
    assert "traceparent" not in raw and "tracestate" not in raw


@pytest.mark.parametrize(
    "bad",
    [
        "garbage",
        TP.upper(),
        TP + "-extra",  # version 00 has exactly four parts
        "ff" + TP[2:],  # version ff is invalid
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
    ],
)
def test_a_malformed_traceparent_is_a_typed_validation_error(bad):
    with pytest.raises(ValidationError) as e:
        build_request("hi", traceparent=bad)
    assert e.value.field == "traceparent" and e.value.code == "invalid"


def test_the_worker_refuses_a_malformed_traceparent_with_the_same_rule():
    """A producer that is not the SDK gets the same typed error from the worker's decoder."""
    req = GenerateRequest(v=1, request_id="abcdefgh1234", prompt="hi", traceparent="00-nope")
    with pytest.raises(ValidationError) as e:
        decode_request(encode_request(req, limits=None))
    assert e.value.field == "traceparent"


def test_a_future_version_may_append_fields():
    p = build_request("hi", traceparent="01" + TP[2:] + "-more")
    assert decode_request(p.payload).traceparent == "01" + TP[2:] + "-more"


def test_tracestate_needs_a_traceparent_and_stays_short():
    with pytest.raises(ValidationError) as e:
        build_request("hi", tracestate="a=b")
    assert e.value.field == "tracestate"
    with pytest.raises(ValidationError):
        build_request("hi", traceparent=TP, tracestate="a=" + "b" * 600)


def test_the_current_span_is_propagated_unless_turned_off():
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("producer") as span:
        ctx = span.get_span_context()
        auto = build_request("hi").request
        off = build_request("hi", propagate_trace=False).request
        explicit = build_request("hi", traceparent=TP).request
    assert auto.traceparent is not None
    _, trace_id, span_id, _ = auto.traceparent.split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == (ctx.trace_id, ctx.span_id)
    assert off.traceparent is None
    assert explicit.traceparent == TP
    assert build_request("hi").request.traceparent is None  # no span current any more


def test_submit_many_items_carry_their_own_trace_context():
    from producer_sdk._core import prepare_many
    from producer_sdk.validation import DEFAULT_LIMITS

    items = ["a", {"prompt": "b", "traceparent": TP}]
    a, b = prepare_many(items, {}, DEFAULT_LIMITS)
    assert a.request.traceparent is None and b.request.traceparent == TP


def test_the_sdk_does_not_import_opentelemetry_on_its_own():
    code = (
        "import sys; from producer_sdk._core import build_request; build_request('hi'); "
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
