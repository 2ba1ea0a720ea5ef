"""What the clients return: chunks while streaming, the Completion at the end, queue stats."""

from __future__ import annotations

import msgspec

from producer_sdk.protocol import Timings, Usage, WorkerState


class Chunk(msgspec.Struct, frozen=True):
    """New tokens of one sample (`index`), as they arrive."""

    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    seq: int = 0


class Choice(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Completion(msgspec.Struct):
    """The whole answer. `text`, `token_ids`, `logprobs` are those of sample 0; `choices` holds
    all `n` samples."""

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
