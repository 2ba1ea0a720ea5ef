"""OpenAI response objects and SSE chunks from the SDK's `Chunk`s and `Completion`.

Logprobs: each entry's ``token`` is the token's text and ``bytes`` its UTF-8 bytes, as the worker
sent them (`Tokens.token_texts` / `token_bytes`, made with the model's tokenizer, which the gateway does
not load): for a token inside a multi-byte character, its own bytes and the text that decodes so far, so
the texts concatenate to the output text. With vLLM's ``--return-tokens-as-token-ids`` (the gateway
flag, or the request's ``return_tokens_as_token_ids``), and for a worker too old to send texts, the
token is named ``"token_id:123"`` instead (``bytes``: the token's bytes when known, else null).
Completions' ``text_offset`` is each token's offset in the text (the running length of the token texts).

Tool calls: a chat message carries the calls the worker parsed (`tool_calls`, `content` null when the
model wrote nothing else); streamed, each ToolCalls event becomes a chunk of OpenAI's
`delta.tool_calls` (`index`, then `id`, `type` and `function.name` once, then `function.arguments`
fragments), and token chunks carry the content without the call markup.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.mapping import CHAT
from producer_sdk.chat import ToolCall, ToolCallDelta
from producer_sdk.protocol import Usage
from producer_sdk.results import Choice, Chunk, Completion

_json = msgspec.json.Encoder()
ID_PREFIX = {CHAT: "chatcmpl-", "completion": "cmpl-"}
DONE = b"data: [DONE]\n\n"


def response_id(kind: str, request_id: str) -> str:
    return ID_PREFIX[kind] + request_id


def request_id_of(kind: str, response_id: str) -> str:
    """The pagedq request id inside a response id (``chatcmpl-<id>``; the bare id is accepted too)."""
    prefix = ID_PREFIX[kind]
    return response_id[len(prefix) :] if response_id.startswith(prefix) else response_id


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _at(values: list | None, i: int) -> Any:
    return values[i] if values is not None and i < len(values) else None


class _Tokens:
    """The logprobs of a Chunk or Choice: per position, (token, bytes, logprob, [(token, bytes, logprob)])."""

    def __init__(self, c: Chunk | Choice, as_ids: bool) -> None:
        self.c, self.as_ids = c, as_ids
        self.n = min(len(c.token_ids), len(c.logprobs or []))
        self.has_texts = not as_ids and c.token_texts is not None

    def token(self, i: int) -> tuple[str, bytes | None]:
        c = self.c
        data = _at(c.token_bytes, i)
        if self.has_texts and i < len(c.token_texts or []):
            return c.token_texts[i], data  # type: ignore[index]
        return token_name(c.token_ids[i]), data

    def top(self, i: int) -> list[tuple[str, bytes | None, float]]:
        c = self.c
        tops = _at(c.top_logprobs, i) or []
        texts = _at(c.top_token_texts, i) if self.has_texts else None
        datas = _at(c.top_token_bytes, i)
        return [
            (
                texts[j] if texts is not None and j < len(texts) else token_name(t),
                _at(datas, j),
                v,
            )
            for j, (t, v) in enumerate(tops)
        ]


def _bytes(data: bytes | None) -> list[int] | None:
    return None if data is None else list(data)


def chat_logprobs(c: Chunk | Choice, as_ids: bool = False, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's `choice.logprobs` of a chat chunk or choice (None without logprobs)."""
    del offset
    if c.logprobs is None:
        return None
    t = _Tokens(c, as_ids)
    content = []
    for i in range(t.n):
        token, data = t.token(i)
        content.append(
            {
                "token": token,
                "logprob": c.logprobs[i],
                "bytes": _bytes(data),
                "top_logprobs": [{"token": s, "logprob": v, "bytes": _bytes(b)} for s, b, v in t.top(i)],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(c: Chunk | Choice, as_ids: bool = False, offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions' `choice.logprobs` (None without logprobs); `offset`: the characters of
    the sample's token texts before these tokens (a stream's earlier chunks)."""
    if c.logprobs is None:
        return None
    t = _Tokens(c, as_ids)
    tokens = [t.token(i)[0] for i in range(t.n)]
    offsets = None
    if c.token_texts is not None:
        offsets = []
        for text in c.token_texts[: t.n]:
            offsets.append(offset)
            offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(c.logprobs[: t.n]),
        "top_logprobs": [{s: v for s, _, v in t.top(i)} for i in range(t.n)],
        "text_offset": offsets,
    }


def tool_call_delta(d: ToolCallDelta) -> dict[str, Any]:
    """One `delta.tool_calls` entry (OpenAI's streaming shape)."""
    out: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        out["id"] = d.id
        out["type"] = "function"
    fn: dict[str, Any] = {"name": d.name} if d.name is not None else {}
    fn["arguments"] = d.arguments
    out["function"] = fn
    return out


def tool_call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}


class Renderer:
    """Builds the objects of one request (chat or completion), streamed or whole."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        created: int,
        *,
        include_usage: bool = False,
        token_ids: bool = False,
    ) -> None:
        """`token_ids`: name logprobs' tokens ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
        self.kind = kind
        self.token_ids = token_ids
        self._offsets: dict[int, int] = {}  # completions, streamed: per choice, the token texts' length so far
        self.id = response_id(kind, request_id)
        self.model = model
        self.created = created
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
        head = {"id": self.id, "object": obj, "created": created, "model": model, "system_fingerprint": None}
        self._head = _json.encode(head)[:-1] + b',"choices":'
        self._tail = b',"usage":null}' if include_usage else b"}"
        self._logprobs = chat_logprobs if kind == CHAT else completion_logprobs

    # --- streamed ---------------------------------------------------------------------------------

    def _frame(self, seq: int, choices: list[dict[str, Any]]) -> bytes:
        return b"id: %d\ndata: %s%s%s\n\n" % (seq, self._head, _json.encode(choices), self._tail)

    def role_frame(self, n: int) -> bytes:
        """Chat only: the first chunk of each choice names the role (SSE id 0: the Started event)."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ]
        return self._frame(0, choices)

    def token_frame(self, c: Chunk) -> bytes:
        """The chunk of `c` (b"" for a chat chunk of tool-call markup only: nothing to say)."""
        if c.tool_calls:
            delta = {"tool_calls": [tool_call_delta(d) for d in c.tool_calls]}
            return self._frame(c.seq, [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}])
        offset = self._offsets.get(c.index, 0)
        lp = self._logprobs(c, self.token_ids, offset)
        if lp is not None and c.token_texts is not None and self.kind != CHAT:
            self._offsets[c.index] = offset + sum(map(len, c.token_texts))
        if self.kind == CHAT:
            if c.content is not None and not c.content and lp is None:
                return b""
            text = c.text if c.content is None else c.content
            choice = {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            choice = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": None}
        return self._frame(c.seq, [choice])

    def finish_frames(self, seq: int, done: Completion) -> bytes:
        """The finish_reason of every choice, then (with include_usage) the usage chunk."""
        choices = []
        for ch in done.choices:
            extra = {"stop_reason": done.stop_reason if ch.index == 0 else None}
            if self.kind == CHAT:
                choices.append(
                    {"index": ch.index, "delta": {}, "logprobs": None, "finish_reason": ch.finish_reason, **extra}
                )
            else:
                choices.append(
                    {"index": ch.index, "text": "", "logprobs": None, "finish_reason": ch.finish_reason, **extra}
                )
        out = self._frame(seq, choices)
        if self.include_usage:
            out += b'id: %d\ndata: %s[],"usage":%s}\n\n' % (seq, self._head, _json.encode(usage(done.usage)))
        return out

    # --- whole ------------------------------------------------------------------------------------

    def whole(self, done: Completion) -> bytes:
        choices = []
        for ch in done.choices:
            lp = self._logprobs(ch, self.token_ids)
            stop_reason = done.stop_reason if ch.index == 0 else None
            if self.kind == CHAT:
                calls = [tool_call(c) for c in ch.tool_calls or []]
                content = (ch.content or None) if calls else ch.content
                message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
                choices.append(
                    {
                        "index": ch.index,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": ch.index,
                        "text": ch.text,
                        "logprobs": lp,
                        "finish_reason": ch.finish_reason,
                        "stop_reason": stop_reason,
                    }
                )
        obj = "chat.completion" if self.kind == CHAT else "text_completion"
        return _json.encode(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": choices,
                "usage": usage(done.usage),
                "system_fingerprint": None,
            }
        )


def error_frame(body: bytes) -> bytes:
    """A mid-stream error, as OpenAI's clients read it (`data: {"error": {...}}`)."""
    return b"data: %s\n\n" % body
