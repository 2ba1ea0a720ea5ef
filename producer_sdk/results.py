"""What the clients return: chunks while streaming, the Completion at the end, queue stats."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from producer_sdk.chat import ToolCall, ToolCallDelta
from producer_sdk.protocol import Timings, Usage, WorkerState


class Chunk(msgspec.Struct, frozen=True):
    """New tokens of one sample (`index`), as they arrive. With tools, `content` is the part of `text`
    that is message content, and a chunk may carry tool-call deltas only (no text): `tool_calls`, whose
    `arguments` fragments joined per call `index` are that call's arguments.

    With `logprobs`: `token_texts` and `token_bytes` are each token's text and UTF-8 bytes, and
    `top_token_texts` / `top_token_bytes` those of its `top_logprobs` tokens (docs/sdk.md, "Logprobs";
    None from a worker too old to send them)."""

    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    seq: int = 0
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    token_texts: list[str] | None = None
    token_bytes: list[bytes] | None = None
    top_token_texts: list[list[str]] | None = None
    top_token_bytes: list[list[bytes]] | None = None


def _parse_json(text: str) -> Any:
    return json.loads(text)


class Choice(msgspec.Struct):
    """One sample. `content` is `text` without tool-call markup (equal to it for requests without
    tools); `tool_calls` are the calls parsed from it (None when it made none). With logprobs, the
    tokens' texts and bytes as in `Chunk`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    token_texts: list[str] | None = None
    token_bytes: list[bytes] | None = None
    top_token_texts: list[list[str]] | None = None
    top_token_bytes: list[list[bytes]] | None = None

    def json(self) -> Any:
        """The text parsed as JSON (a structured-output answer); raises ValueError when it is not JSON,
        e.g. cut short by max_tokens (finish_reason "length")."""
        return _parse_json(self.text)


class Completion(msgspec.Struct):
    """The whole answer. `text`, `token_ids`, `logprobs`, `content` and `tool_calls` are those of
    sample 0; `choices` holds all `n` samples."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    choices: list[Choice] = []
    logprobs: list[float] | None = None
    worker: str | None = None
    content: str = ""
    tool_calls: list[ToolCall] | None = None

    def json(self) -> Any:
        """Sample 0's text parsed as JSON; raises ValueError when it is not JSON (see `Choice.json`)."""
        return _parse_json(self.text)


class QueueStats(msgspec.Struct):
    """Queue lengths per lane (XLEN: waiting + in flight), dead letters, live workers."""

    model: str
    lanes: dict[str, int]
    dead_letters: int
    workers: list[WorkerState]
    max_queue_len: int | None = None  # as the workers published it in keys.config(model)

    @property
    def queued(self) -> int:
        return sum(self.lanes.values())


__all__ = ["Choice", "Chunk", "Completion", "QueueStats"]
