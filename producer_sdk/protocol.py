"""Wire protocol between producers (this SDK) and pagedq workers: msgpack via msgspec Structs.
Where these Structs live in Redis (keys, entry fields, the atomic Lua steps): `producer_sdk.contract`.

Events
    Every event carries `seq` = 0, 1, 2, ... per request, contiguous across worker crashes (a new
    owner continues the numbering), and `attempt`: which run of the request wrote it. A new
    attempt begins with its `Started` event. A reader drops events with seq < expected
    (duplicates), treats seq > expected as a protocol error (a gap), and a `Started` with
    seq < expected as a diverged stream (the new attempt did not see events the reader saw: Redis
    lost writes in a failover). `Finished` and `Error` are terminal. finish_reason: stop | length
    | abort | deadline | tool_calls.

Error codes
    An `Error` event for a refused request carries the `code` of the `ProtocolError` that
    `request_codec.decode_request` raised: malformed | schema | unsupported_version | invalid | too_large.
    The worker picks its own words for other failures (engine_error, max_deliveries,
    invalid_grammar, grammar_timeout, grammar_unsatisfiable, tools_unsupported, ...).

Cancel
    ``SET keys.cancel_flag(id) 1 EX <ttl>`` then ``PUBLISH keys.control_channel(model)
    <msgpack ControlMessage(type="cancel", request_id=id)>``. The worker answers
    ``Finished(finish_reason="abort")``, also for a request still queued (when it reaches intake).

Deadline
    `GenerateRequest.deadline_ms` is absolute unix time in ms; the worker finishes the request
    with finish_reason "deadline" and never starts one already past it.

Strictness and evolution
------------------------
* Requests are versioned (`v`, required on the wire). This side reads versions 1 and 2; v2 adds
  the chat features of `producer_sdk.chat` (rich messages, tools, response formats, structured
  outputs, `ToolCalls` events), and a v1 request that uses one is refused. The SDK writes the
  lowest version that carries a request, so v1 workers keep serving v1 requests. A request of
  another version is refused with `UnsupportedVersion`, naming both versions.
* Requests are decoded strictly: no type coercion, and unknown fields are refused
  (`forbid_unknown_fields`). A worker that silently ignored a field it does not know (say a new
  sampling option) would produce wrong output; refusing is the safe answer. Fields equal to their
  default are not encoded (`omit_defaults`), so a newer SDK that adds an optional field stays
  compatible with older workers for every request that does not use it. The flip side: a
  default value is part of the protocol (the decoder fills it in), so changing one needs a new `v`.
  (Within v1/v2, the fields a model's generation config may set went to None: see SamplingParams.)
* Events are decoded strictly for types but ignore unknown fields, so a newer worker may add
  informative fields without breaking older SDKs; an event of an unknown `type` decodes as
  `UnknownEvent`, which readers skip.
* Limits (`Limits`) are checked by the SDK before sending and by the worker on intake, with the
  same `validate` function, inside `request_codec.encode_request` / `decode_request`.
* Nothing here leaks msgspec's exception types: every failure is a `ProtocolError` subclass
  (`MalformedPayload`, `SchemaError`, `UnsupportedVersion`, `ValidationError`,
  `PayloadTooLarge`) with a message that names the field.
"""

from __future__ import annotations

import re
import time

import msgspec

from producer_sdk.chat import (
    Message,
    ResponseFormat,
    StructuredOutputsParams,
    Tool,
    ToolCallDelta,
    ToolCalls,
    ToolChoice,
)
from producer_sdk.constants import (
    DEFAULT_RESULT_TTL_S,
    FINISH_REASONS,
    PROTOCOL_VERSION,
    ROLES,
    SUPPORTED_VERSIONS,
)
from producer_sdk.contract.keys import lane_for_priority
from producer_sdk.errors import (
    MalformedPayload,
    ProtocolError,
    SchemaError,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- request --------------------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """vLLM names and defaults, except `max_tokens`: the service default is 256 (vLLM: 16);
    None means "up to the model's length". temperature, top_p, top_k, min_p, repetition_penalty: None,
    not sent, unless set (then sent, 1.0 too): the worker applies the model's generation_config.json, else
    vLLM's values (1.0, 1.0, 0 = off, 0.0, 1.0); an older worker reads their absence as vLLM's values."""

    n: int = 1
    max_tokens: int | None = 256
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # v2: constrained decoding (vLLM's)


SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__


class GenerateRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """One generation request. Exactly one of `prompt`, `prompt_token_ids`, `messages` is set.

    `v` has no default on purpose: it must always be on the wire (omit_defaults would drop it).
    `add_generation_prompt` only matters for `messages` (passed to the chat template), and so do the
    v2 fields `tools` (rendered by the chat template), `tool_choice` (default: "auto" with tools) and
    `parallel_tool_calls` (OpenAI's).
    `response_format` (v2) constrains the output like `sampling.structured_outputs`.
    `traceparent` / `tracestate`: the producer's W3C Trace Context, for the worker's spans (docs/observability.md).
    """

    v: int
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0
    deadline_ms: int | None = None
    created_ms: int = 0
    metadata: dict[str, str] = {}
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # False: a forced call is exactly one call
    response_format: ResponseFormat | None = None
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def lane(self) -> str:
        return lane_for_priority(self.priority)


# --- events ---------------------------------------------------------------------------------------


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(msgspec.Struct, omit_defaults=True):
    """Milliseconds: time queued, to first token, end to end (None when unknown)."""

    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None


class Started(msgspec.Struct, tag="started", tag_field="type", kw_only=True, omit_defaults=True):
    """The first event of an attempt (a run of the request by one worker). `seq` > 0 when the attempt
    resumes a stream an earlier attempt began."""

    seq: int
    worker: str
    attempt: int = 1


class Tokens(msgspec.Struct, tag="tokens", tag_field="type", kw_only=True, omit_defaults=True):
    """New tokens of sample `index` (of `n`); `text` is the detokenized delta. In a request with tools,
    `content` is the part of `text` that is message content (tool-call markup left out).

    With logprobs, `token_texts` / `token_bytes` give each token's text and UTF-8 bytes, and
    `top_token_texts` / `top_token_bytes` those of its `top_logprobs` tokens (same order), as OpenAI's
    logprobs entries show them: the bytes are the token's own (part of a character, for a character
    split over byte-level tokens), the text is what decodes so far ("" while a character is incomplete;
    the token completing it carries it whole), so the texts concatenate to the output text (special
    tokens show their own text). A worker older than these fields leaves them out (None)."""

    seq: int
    attempt: int = 1
    index: int = 0
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None  # one per token id
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (token id, logprob)
    content: str | None = None
    token_texts: list[str] | None = None  # one per token id, with logprobs
    token_bytes: list[bytes] | None = None
    top_token_texts: list[list[str]] | None = None  # parallel to top_logprobs
    top_token_bytes: list[list[bytes]] | None = None


class Finished(msgspec.Struct, tag="finished", tag_field="type", kw_only=True, omit_defaults=True):
    seq: int
    attempt: int = 1
    finish_reason: str
    finish_reasons: list[str] = []  # one per sample
    stop_reason: str | int | None = None  # the stop string or token id that ended sample 0
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)


class Error(msgspec.Struct, tag="error", tag_field="type", kw_only=True, omit_defaults=True):
    seq: int
    attempt: int = 1
    code: str
    message: str


Event = Started | Tokens | ToolCalls | Finished | Error
TERMINAL_EVENTS = (Finished, Error)
EVENT_TYPES = ("started", "tokens", "tool_calls", "finished", "error")


class UnknownEvent(msgspec.Struct, frozen=True):
    """An event of a type this version does not know (a newer worker wrote it). Readers skip it,
    counting its seq, so a rolling upgrade that adds an event type breaks no older reader."""

    seq: int
    type: str


class ControlMessage(msgspec.Struct, omit_defaults=True):
    """Published on keys.control_channel(model). Workers ignore types they do not know."""

    type: str
    request_id: str | None = None


class WorkerState(msgspec.Struct, kw_only=True):
    """The JSON a worker keeps at keys.worker_state(model, worker) (unknown keys are ignored)."""

    worker: str
    host: str = ""
    pid: int = 0
    model: str = ""
    started_ms: int = 0
    ts_ms: int = 0
    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 0
    kv_usage: float = 0.0  # 0..1
    gen_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    requests_finished: int = 0


# --- encode / decode ------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(Event, strict=True)
_control_decoder = msgspec.msgpack.Decoder(ControlMessage, strict=True)


_AT = re.compile(r"(?s)(.*?) - at `\$\.?([^`]*)`$")
_NAMED = re.compile(r"Object (?:missing required|contains unknown) field `([^`]*)`")


def schema_error(exc: msgspec.ValidationError, what: str, cls: type[ProtocolError] = SchemaError) -> ProtocolError:
    """A readable typed error from msgspec's ValidationError, naming the dotted field path."""
    text = str(exc)
    path = None
    m = _AT.match(text)
    if m:
        text, path = m.group(1), m.group(2) or None
    named = _NAMED.match(text)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    text = text[:1].lower() + text[1:]
    where = f" (field `{path}`)" if path else ""
    return cls(f"invalid {what}{where}: {text}", field=path)


def malformed(exc: BaseException, what: str) -> MalformedPayload:
    return MalformedPayload(f"{what} is not valid msgpack: {exc}")


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


class _EventEnvelope(msgspec.Struct):
    type: str
    seq: int


_envelope_decoder = msgspec.msgpack.Decoder(_EventEnvelope)


def decode_event(data: bytes | bytearray | memoryview) -> Event | UnknownEvent:
    try:
        return _event_decoder.decode(data)
    except msgspec.ValidationError as e:
        try:
            envelope = _envelope_decoder.decode(data)
        except (msgspec.MsgspecError, ValueError, RecursionError, OverflowError):
            envelope = None
        if envelope is not None and envelope.type not in EVENT_TYPES:
            return UnknownEvent(seq=envelope.seq, type=envelope.type)
        raise schema_error(e, "response event") from None
    except (msgspec.MsgspecError, ValueError, RecursionError, OverflowError) as e:
        raise malformed(e, "response event") from None


def encode_control(message: ControlMessage) -> bytes:
    return _encoder.encode(message)


def decode_control(data: bytes | bytearray | memoryview) -> ControlMessage:
    try:
        return _control_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise schema_error(e, "control message") from None
    except (msgspec.MsgspecError, ValueError, RecursionError, OverflowError) as e:
        raise malformed(e, "control message") from None


__all__ = [
    "DEFAULT_RESULT_TTL_S",
    "EVENT_TYPES",
    "FINISH_REASONS",
    "PROTOCOL_VERSION",
    "ROLES",
    "SAMPLING_FIELDS",
    "SUPPORTED_VERSIONS",
    "TERMINAL_EVENTS",
    "ControlMessage",
    "Error",
    "Event",
    "Finished",
    "GenerateRequest",
    "Message",
    "ResponseFormat",
    "SamplingParams",
    "Started",
    "StructuredOutputsParams",
    "Timings",
    "Tokens",
    "Tool",
    "ToolCallDelta",
    "ToolCalls",
    "UnknownEvent",
    "Usage",
    "WorkerState",
    "decode_control",
    "decode_event",
    "encode_control",
    "encode_event",
    "lane_for_priority",
    "now_ms",
    "schema_error",
]
