"""OpenAI response objects and SSE chunks from the SDK's `Chunk`s and `Completion`.

Token strings: the response stream carries token ids, not their text, so a logprobs entry names its
token the way vLLM's ``--return-tokens-as-token-ids`` does (``"token_id:123"``), with ``bytes`` null.

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
from producer_sdk.results import Chunk, Completion

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


def chat_logprobs(token_ids: list[int], lps: list[float] | None, tops: list | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, lps)):
        top = tops[i] if tops and i < len(tops) else []
        content.append(
            {
                "token": token_name(tid),
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [{"token": token_name(t), "logprob": v, "bytes": None} for t, v in top],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], lps: list[float] | None, tops: list | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    n = min(len(token_ids), len(lps))
    return {
        "tokens": [token_name(t) for t in token_ids[:n]],
        "token_logprobs": list(lps[:n]),
        "top_logprobs": [{token_name(t): v for t, v in (tops[i] if tops and i < len(tops) else [])} for i in range(n)],
        "text_offset": None,
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

    def __init__(self, kind: str, request_id: str, model: str, created: int, *, include_usage: bool = False) -> None:
        self.kind = kind
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
        lp = self._logprobs(c.token_ids, c.logprobs, c.top_logprobs)
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
            lp = self._logprobs(ch.token_ids, ch.logprobs, ch.top_logprobs)
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
