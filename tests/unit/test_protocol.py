"""Wire protocol of producer_sdk: round trips, strict decoding, limits, fuzzing."""

from __future__ import annotations

import contextlib
import datetime as dt
import pickle

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer_sdk import errors
from producer_sdk._core import build_request, deadline_to_ms
from producer_sdk.errors import (
    MalformedPayload,
    PayloadTooLarge,
    ProtocolError,
    SchemaError,
    UnsupportedVersion,
    ValidationError,
)
from producer_sdk.protocol import (
    PROTOCOL_VERSION,
    SAMPLING_FIELDS,
    ControlMessage,
    Error,
    Finished,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
    Timings,
    Tokens,
    UnknownEvent,
    Usage,
    WorkerState,
    decode_control,
    decode_event,
    encode_control,
    encode_event,
    lane_for_priority,
)
from producer_sdk.request_codec import decode_request, encode_request
from producer_sdk.validation import DEFAULT_LIMITS, Limits, validate

RID = "req_0123456789abcdef"
pack = msgspec.msgpack.encode


def raw(**overrides) -> dict:
    """A valid request as plain msgpack-able data, with overrides (None deletes a key)."""
    d = {"v": 1, "request_id": RID, "prompt": "Hello"}
    for k, v in overrides.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def decode_raw(**overrides) -> GenerateRequest:
    return decode_request(pack(raw(**overrides)))


# --- round trips ----------------------------------------------------------------------------------

FULL_SAMPLING = SamplingParams(
    n=3,
    max_tokens=None,
    min_tokens=2,
    temperature=0.7,
    top_p=0.9,
    top_k=-1,
    min_p=0.05,
    seed=1234,
    stop=["\n\n", "END"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=0.5,
    logprobs=5,
    skip_special_tokens=False,
    include_stop_str_in_output=True,
)


@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt": "Hello, 世界 🚀"},
        {"prompt_token_ids": [1, 2, 3, (1 << 31) - 1]},
        {"messages": [Message("system", "be brief"), Message("user", "hi")], "add_generation_prompt": False},
    ],
)
def test_request_round_trip(prompt):
    req = GenerateRequest(
        v=PROTOCOL_VERSION,
        request_id=RID,
        sampling=FULL_SAMPLING,
        priority=-7,
        deadline_ms=1_900_000_000_000,
        created_ms=1_800_000_000_000,
        metadata={"tenant": "acme", "trace_id": "abc"},
        **prompt,
    )
    assert decode_request(encode_request(req)) == req


def test_defaults_are_not_on_the_wire_but_the_version_is():
    req = GenerateRequest(v=1, request_id=RID, prompt="x")
    assert msgspec.msgpack.decode(encode_request(req)) == {
        "v": 1,
        "request_id": RID,
        "prompt": "x",
        "sampling": {},
    }
    assert decode_request(encode_request(req)).sampling == SamplingParams()


def test_sampling_defaults_follow_vllm_except_max_tokens():
    s = SamplingParams()
    assert (s.n, s.max_tokens, s.presence_penalty, s.frequency_penalty) == (1, 256, 0.0, 0.0)
    # unset: the worker applies the model's generation defaults, else vLLM's values
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (None,) * 5
    assert (s.stop, s.stop_token_ids, s.logprobs, s.seed) == ([], [], None, None)
    assert s.skip_special_tokens and not s.include_stop_str_in_output and not s.ignore_eos


@pytest.mark.parametrize(
    "event",
    [
        Started(seq=0, worker="gpu-1", attempt=2),
        Tokens(seq=1, index=0, token_ids=[5, 6], text="hé"),
        Tokens(seq=2, index=1, token_ids=[5], text="x", logprobs=[-0.1], top_logprobs=[[(5, -0.1), (9, -2.5)]]),
        Tokens(
            seq=2,
            token_ids=[5, 6],
            text="é",
            logprobs=[-0.1, -0.2],
            top_logprobs=[[(5, -0.1)], [(6, -0.2)]],
            token_texts=["", "é"],
            token_bytes=[b"\xc3", b"\xa9"],
            top_token_texts=[[""], ["é"]],
            top_token_bytes=[[b"\xc3"], [b"\xa9"]],
        ),
        Finished(
            seq=3,
            finish_reason="stop",
            finish_reasons=["stop", "length"],
            stop_reason="\n",
            usage=Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8),
            timings=Timings(queue_ms=1.5, ttft_ms=20.0, e2e_ms=None),
        ),
        Finished(seq=4, finish_reason="length", stop_reason=2),
        Error(seq=0, code="invalid", message="bad"),
    ],
)
def test_event_round_trip(event):
    assert decode_event(encode_event(event)) == event


def test_events_are_a_tagged_union_on_type():
    assert msgspec.msgpack.decode(encode_event(Started(seq=0, worker="w")))["type"] == "started"
    # A type this version does not know (a newer worker's) decodes as UnknownEvent: readers skip it.
    assert decode_event(pack({"type": "telepathy", "seq": 3})) == UnknownEvent(seq=3, type="telepathy")
    with pytest.raises(SchemaError, match="type"):
        decode_event(pack({"type": 7, "seq": 0}))
    with pytest.raises(SchemaError):
        decode_event(pack({"type": "tokens", "seq": 0}))  # a known type with a missing field


def test_events_ignore_unknown_fields_for_forward_compatibility():
    ev = decode_event(pack({"type": "started", "seq": 0, "worker": "w", "gpu": "H200"}))
    assert ev == Started(seq=0, worker="w")


def test_token_texts_are_an_addition_old_readers_ignore():
    """The logprobs' token texts and bytes (issue 47) are fields an older SDK skips (events ignore unknown
    fields), and an older worker's Tokens event reads with them None."""

    class OldTokens(msgspec.Struct, tag="tokens", tag_field="type", kw_only=True):  # Tokens before them
        seq: int
        attempt: int = 1
        index: int = 0
        token_ids: list[int]
        text: str = ""
        logprobs: list[float] | None = None
        top_logprobs: list[list[tuple[int, float]]] | None = None
        content: str | None = None

    new = Tokens(seq=1, token_ids=[7], text="é", logprobs=[-0.5], token_texts=["é"], token_bytes=[b"\xc3\xa9"])
    old = msgspec.msgpack.decode(encode_event(new), type=OldTokens)
    assert (old.token_ids, old.text, old.logprobs) == ([7], "é", [-0.5])
    back = decode_event(msgspec.msgpack.encode(old))
    assert back == Tokens(seq=1, token_ids=[7], text="é", logprobs=[-0.5])
    assert back.token_texts is None and back.token_bytes is None and back.top_token_texts is None


@pytest.mark.parametrize("data", [b"\xc1", b"", b"\x92\x01"])
def test_bad_event_bytes(data):
    with pytest.raises(ProtocolError):
        decode_event(data)


def test_control_and_worker_state_round_trip():
    msg = ControlMessage(type="cancel", request_id=RID)
    assert decode_control(encode_control(msg)) == msg
    state = WorkerState(worker="w1", host="h", pid=3, kv_usage=0.5, running=2, waiting=1, max_num_seqs=64)
    assert msgspec.json.decode(msgspec.json.encode(state), type=WorkerState) == state


def test_lanes():
    assert [lane_for_priority(p) for p in (5, 1, 0, -1, -100)] == ["high", "high", "normal", "low", "low"]
    assert GenerateRequest(v=1, request_id=RID, prompt="x", priority=3).lane == "high"


# --- strict decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"\xc1", b"\x85\xa1v", b"\xd9\xff", pack(raw()) + b"\x00", b""])
def test_not_msgpack(data):
    with pytest.raises(MalformedPayload, match="not valid msgpack"):
        decode_request(data)


def test_not_bytes():
    with pytest.raises(MalformedPayload, match="bytes"):
        decode_request("hello")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "field", "words"),
    [
        ([1, 2], None, "expected `object`, got `array`"),
        (raw(sampling={"temperature": "hot"}), "sampling.temperature", "expected `float | null`, got `str`"),
        (raw(sampling={"n": True}), "sampling.n", "expected `int`, got `bool`"),
        (raw(prompt=5), "prompt", "expected `str | null`, got `int`"),
        (raw(request_id=None), "request_id", "missing required field"),
        (raw(v=None), "v", "missing required field"),
        (raw(v="1"), "v", "got `str`"),
        (raw(sampling={"top_q": 0.5}), "sampling.top_q", "unknown field"),
        (raw(tools_x=[]), "tools_x", "unknown field"),
        (raw(v=2, tools=[{"function": {"name": "f", "extra": 1}}]), "tools[0].function.extra", "unknown field"),
        (
            raw(v=2, messages=[{"role": "user", "content": [{"type": "image_url"}]}], prompt=None),
            "messages[0].content[0].type",
            "invalid value 'image_url'",
        ),
        (raw(metadata={"k": 1}), "metadata[...]", "expected `str`"),
    ],
)
def test_schema_errors_name_the_field(payload, field, words):
    with pytest.raises(SchemaError) as info:
        decode_request(pack(payload))
    err = info.value
    assert err.field == field
    assert words in str(err)
    assert err.code == "schema"
    assert not isinstance(err, msgspec.MsgspecError)


@pytest.mark.parametrize("v", [0, 3, 99])
def test_unknown_version_is_refused_naming_both(v):
    # A future version may carry fields this side does not know: the version error wins.
    with pytest.raises(UnsupportedVersion) as info:
        decode_request(pack(raw(v=v, future_field={"x": 1})))
    assert f"version {v}" in str(info.value) and f"version {PROTOCOL_VERSION}" in str(info.value)
    assert info.value.code == "unsupported_version"


def test_prompt_kinds():
    with pytest.raises(ValidationError, match="no prompt"):
        decode_raw(prompt=None)
    with pytest.raises(ValidationError, match="prompt and messages are both set"):
        decode_raw(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValidationError, match="both set"):
        decode_raw(prompt_token_ids=[1])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 1_000_001}, "prompt"),
        ({"prompt": None, "prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": [1] * 131073}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": [1, -1]}, "prompt_token_ids"),
        ({"prompt": None, "prompt_token_ids": [1 << 31]}, "prompt_token_ids"),
        ({"prompt": None, "messages": []}, "messages"),
        ({"prompt": None, "messages": [{"role": "user", "content": "x"}] * 513}, "messages"),
        ({"prompt": None, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
        ({"sampling": {"max_tokens": 131073}}, "sampling.max_tokens"),
        ({"sampling": {"n": 0}}, "sampling.n"),
        ({"sampling": {"n": 17}}, "sampling.n"),
        ({"sampling": {"min_tokens": 300}}, "sampling.min_tokens"),
        ({"sampling": {"temperature": -0.1}}, "sampling.temperature"),
        ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
        ({"sampling": {"temperature": float("inf")}}, "sampling.temperature"),
        ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"sampling": {"top_k": -2}}, "sampling.top_k"),
        ({"sampling": {"min_p": 1.5}}, "sampling.min_p"),
        ({"sampling": {"stop": ["x"] * 17}}, "sampling.stop"),
        ({"sampling": {"stop": [""]}}, "sampling.stop"),
        ({"sampling": {"stop": ["x" * 257]}}, "sampling.stop"),
        ({"sampling": {"stop_token_ids": [1] * 65}}, "sampling.stop_token_ids"),
        ({"sampling": {"stop_token_ids": [-3]}}, "sampling.stop_token_ids"),
        ({"sampling": {"repetition_penalty": 0.0}}, "sampling.repetition_penalty"),
        ({"sampling": {"presence_penalty": 2.5}}, "sampling.presence_penalty"),
        ({"sampling": {"frequency_penalty": -2.5}}, "sampling.frequency_penalty"),
        ({"sampling": {"logprobs": 21}}, "sampling.logprobs"),
        ({"sampling": {"logprobs": -1}}, "sampling.logprobs"),
        ({"priority": 101}, "priority"),
        ({"priority": -101}, "priority"),
        ({"deadline_ms": -5}, "deadline_ms"),
        ({"metadata": {f"k{i}": "v" for i in range(33)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 1025}}, "metadata.k"),
    ],
)
def test_limit_violations(overrides, field):
    with pytest.raises(ValidationError) as info:
        decode_raw(**overrides)
    assert info.value.field == field, str(info.value)
    assert field.split("[")[0] in str(info.value)


def test_limits_at_their_edges_pass():
    decode_raw(
        sampling={"n": 16, "max_tokens": 131072, "top_p": 1.0, "top_k": -1, "logprobs": 20, "stop": ["x"] * 16},
        priority=-100,
        metadata={f"k{i}": "v" * 1024 for i in range(32)},
    )
    decode_raw(prompt=None, prompt_token_ids=[0, (1 << 31) - 1])


def test_validation_message_is_readable():
    with pytest.raises(ValidationError) as info:
        decode_raw(sampling={"top_p": 1.5})
    assert str(info.value) == "invalid request: sampling.top_p=1.5: must be in (0, 1]"


@pytest.mark.parametrize("rid", ["short", "x" * 65, "has space__", "semi;colon__", "abcdefgh\n", "ünïcode123", ""])
def test_bad_request_ids(rid):
    with pytest.raises(ValidationError, match="request_id"):
        decode_raw(request_id=rid)


def test_payload_size_limit():
    big = "x" * 600_000
    data = pack(raw(prompt=None, messages=[{"role": "user", "content": big}] * 2))
    with pytest.raises(PayloadTooLarge, match="bytes"):
        decode_request(data)
    req = GenerateRequest(v=1, request_id=RID, prompt=big, metadata={"a": "b"})
    with pytest.raises(PayloadTooLarge):
        encode_request(req, Limits(max_payload_bytes=500_000))


def test_custom_limits_for_the_worker():
    lim = Limits(max_tokens=64)
    with pytest.raises(ValidationError, match=r"max_tokens.*\[1, 64\]"):
        decode_request(pack(raw(sampling={"max_tokens": 65})), lim)
    validate(GenerateRequest(v=1, request_id=RID, prompt="x", sampling=SamplingParams(max_tokens=64)), lim)


def test_validate_checks_the_version_of_a_struct():
    with pytest.raises(UnsupportedVersion):
        validate(GenerateRequest(v=3, request_id=RID, prompt="x"))


def test_errors_pickle_with_their_attributes():
    cases = [
        errors.QueueFull("high", 5, 5),
        errors.RequestFailed("engine_error", "boom", request_id=RID),
        errors.RequestTimeout(RID, 1.5, cancelled=True),
        errors.UnsupportedVersion(2, 1),
        errors.ValidationError("bad", field="sampling.n"),
        errors.Cancelled("c", request_id=RID, completion=None),
        errors.ConnectionLost("gone", attempts=3, request_id=RID),
    ]
    for err in cases:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
    assert isinstance(errors.RequestTimeout(RID, 1.0), TimeoutError)
    assert isinstance(errors.ConnectionLost("x", attempts=1), ConnectionError)


# --- the SDK's request builder --------------------------------------------------------------------


def test_build_request_checks_like_the_worker():
    p = build_request("hi", stop="END", temperature=0, max_tokens=8, metadata={"tenant": "a"})
    assert decode_request(p.payload) == p.request
    assert p.request.sampling.stop == ["END"] and p.request.sampling.temperature == 0.0
    assert len(p.request.request_id) == 32 and p.lane == "normal"


def test_build_request_unknown_sampling_name_lists_valid_ones():
    with pytest.raises(TypeError) as info:
        build_request("hi", temprature=0.5)
    assert "temprature" in str(info.value)
    assert all(name in str(info.value) for name in SAMPLING_FIELDS)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": "hot"}, "sampling.temperature"),
        ({"max_tokens": 1.5}, "sampling.max_tokens"),
        ({"messages": [{"role": "user", "content": 3}], "prompt": None}, "messages[0].content"),
        ({"metadata": {"k": 1}}, "metadata[...]"),
        ({"priority": 500}, "priority"),
        ({"request_id": "no"}, "request_id"),
    ],
)
def test_build_request_wrong_values(kwargs, field):
    args = {"prompt": "hi", **kwargs}
    with pytest.raises(ValidationError) as info:
        build_request(args.pop("prompt"), **args)
    assert info.value.field == field


def test_deadlines():
    now = deadline_to_ms(0)
    assert abs(deadline_to_ms(2.5) - now - 2500) < 200
    assert abs(deadline_to_ms(dt.timedelta(seconds=1)) - now - 1000) < 200
    at = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    assert deadline_to_ms(at) == int(at.timestamp() * 1000)
    with pytest.raises(TypeError):
        deadline_to_ms("soon")  # type: ignore[arg-type]


# --- fuzzing --------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
structures = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=5)
    ),
    max_leaves=30,
)
field_names = st.sampled_from(
    ["v", "request_id", "prompt", "prompt_token_ids", "messages", "sampling", "priority", "deadline_ms",
     "created_ms", "metadata", "add_generation_prompt", "role", "content", *SAMPLING_FIELDS]
)  # fmt: skip
# Request-shaped maps: known names with arbitrary values, so the decoder gets deep, not just refused.
near_requests = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(field_names, inner, max_size=8),
    max_leaves=40,
)


def _only_protocol_errors(decode, data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data):
    _only_protocol_errors(decode_request, data)
    _only_protocol_errors(decode_event, data)


@FUZZ
@given(structures)
def test_fuzz_arbitrary_msgpack(value):
    _only_protocol_errors(decode_request, pack(value))
    _only_protocol_errors(decode_event, pack(value))


@settings(FUZZ, max_examples=200)
@given(near_requests, st.dictionaries(field_names, near_requests, max_size=6))
def test_fuzz_request_shaped(value, extra):
    base = {"v": 1, "request_id": RID, "prompt": "x"}
    if isinstance(value, dict):
        base.update(value)
    base.update(extra)
    _only_protocol_errors(decode_request, pack(base))


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            name: st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=3) | st.none()
            for name in SAMPLING_FIELDS
        },
    )
)
def test_fuzz_sampling_values(sampling):
    try:
        req = decode_request(pack(raw(sampling=sampling)))
    except ProtocolError:
        return
    assert validate(req, DEFAULT_LIMITS) is req  # anything accepted passes validation again
