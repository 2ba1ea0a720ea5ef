"""One sampling-parameter path: the engine's `SamplingParams` has the wire struct's fields, is built from it
mechanically, and is checked by the same rule set (`producer_sdk.validation.sampling_problems`)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from producer_sdk import protocol, request_codec, validation
from worker.engine.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams, SamplingParamsError

ENGINE_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def test_the_engine_has_exactly_the_wire_fields_in_the_same_order():
    assert list(protocol.SAMPLING_FIELDS) == ENGINE_FIELDS


def test_defaults_agree_except_max_tokens_and_what_the_model_may_set():
    engine, wire = SamplingParams(), protocol.SamplingParams()
    differ = [name for name in ENGINE_FIELDS if getattr(engine, name) != getattr(wire, name)]
    assert differ == ["max_tokens", *MODEL_DEFAULT_FIELDS]
    assert engine.max_tokens == 16 and wire.max_tokens == 256  # vLLM's offline default; the service's
    # on the wire, unset (None): the model's generation defaults, else the engine's (vLLM's) values
    assert all(getattr(wire, name) is None for name in MODEL_DEFAULT_FIELDS)
    resolved = SamplingParams.from_wire(wire).with_defaults({})
    assert all(getattr(resolved, name) == getattr(engine, name) for name in MODEL_DEFAULT_FIELDS)


WIRE = protocol.SamplingParams(
    n=3,
    max_tokens=40,
    min_tokens=2,
    temperature=0.7,
    top_p=0.9,
    top_k=12,
    min_p=0.05,
    seed=99,
    stop=["\n\n", "END"],
    stop_token_ids=[7, 8],
    ignore_eos=True,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    logprobs=3,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
    structured_outputs=protocol.StructuredOutputsParams(json={"type": "object"}),
)


def test_every_wire_field_reaches_the_engine():
    defaults = protocol.SamplingParams()
    assert all(getattr(WIRE, name) != getattr(defaults, name) for name in ENGINE_FIELDS), "set every field"
    engine = SamplingParams.from_wire(WIRE)
    assert {name: getattr(engine, name) for name in ENGINE_FIELDS} == msgspec.structs.asdict(WIRE)
    assert engine.stop is not WIRE.stop and engine.stop_token_ids is not WIRE.stop_token_ids  # own lists


def test_from_wire_after_a_wire_round_trip_keeps_the_wire_defaults():
    request = protocol.GenerateRequest(v=protocol.PROTOCOL_VERSION, request_id="r" * 8, prompt="hi")
    decoded = request_codec.decode_request(request_codec.encode_request(request))
    assert SamplingParams.from_wire(decoded.sampling).max_tokens == 256


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams.from_wire(protocol.SamplingParams(top_k=-1)).top_k == 0


def test_a_single_stop_string_is_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", -1),
    ],
)
def test_a_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=f"^{field}=") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)
    # the same value is refused on the wire, by the same rules
    wire_problems = dict(validation.sampling_problems(protocol.SamplingParams(**{field: value}), validation.Limits()))
    assert field in wire_problems


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


def test_the_engine_limits_only_bound_what_it_can_run():
    """The service's limits (max_n, max_tokens, stop counts, logprobs) are the service's; offline runs are
    bounded by the engine config (max_logprobs at add_request, max_model_len while generating)."""
    wire_limits = validation.Limits()
    params = SamplingParams(
        n=wire_limits.max_n + 1,
        max_tokens=wire_limits.max_tokens + 1,
        stop=["x"] * (wire_limits.max_stop + 1),
        logprobs=wire_limits.max_logprobs + 1,
    )
    assert dict(validation.sampling_problems(params, wire_limits)).keys() == {"n", "max_tokens", "stop", "logprobs"}
