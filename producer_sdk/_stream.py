"""Following one response stream (sans-IO): resume from the last id, detect duplicates and gaps,
back off over connection errors, notice a request Redis lost, and build the Completion."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import redis.exceptions as rex

from producer_sdk.chat import FunctionCall, ToolCall, ToolCallDelta
from producer_sdk.contract import keys
from producer_sdk.contract.keys import EVENT_FIELD
from producer_sdk.contract.redis_errors import is_transient
from producer_sdk.errors import (
    AuthenticationFailed,
    Cancelled,
    ConnectionLost,
    DeadlineExceeded,
    PermissionDenied,
    ProtocolError,
    RequestFailed,
    RequestLost,
    RequestTimeout,
    StreamDiverged,
)
from producer_sdk.prepared import EnqueueResult, Prepared
from producer_sdk.protocol import (
    Error,
    Finished,
    Started,
    Timings,
    Tokens,
    ToolCalls,
    UnknownEvent,
    Usage,
    decode_event,
)
from producer_sdk.results import Choice, Chunk, Completion

# --- errors and backoff ---------------------------------------------------------------------------


class Backoff:
    """Exponential backoff with full jitter over redis errors that a reconnect may cure.

    `delay(exc)` maps auth/ACL failures to typed errors, re-raises errors that are no connection
    problem, and raises `ConnectionLost` once `attempts` retries in a row have failed.
    """

    def __init__(self, attempts: int = 10, base_s: float = 0.05, max_s: float = 2.0) -> None:
        self.attempts = attempts
        self.base_s = base_s
        self.max_s = max_s
        self.failures = 0

    def reset(self) -> None:
        self.failures = 0

    def delay(self, exc: BaseException, request_id: str | None = None) -> float:
        translated = translate_redis_error(exc)
        if translated is not None:
            raise translated from exc
        if not is_transient(exc):
            raise exc
        self.failures += 1
        if self.failures > self.attempts:
            raise ConnectionLost(
                f"redis unreachable after {self.attempts} reconnect attempts: {exc}",
                attempts=self.attempts,
                request_id=request_id,
            ) from exc
        return random.uniform(0, min(self.max_s, self.base_s * 2 ** (self.failures - 1)))


def translate_redis_error(exc: BaseException) -> Exception | None:
    """A typed error for a redis error that retrying cannot fix, else None."""
    if isinstance(exc, rex.AuthenticationError) or (
        isinstance(exc, rex.ResponseError) and str(exc).startswith(("WRONGPASS", "NOAUTH"))
    ):
        return AuthenticationFailed(f"redis refused the credentials: {exc}")
    if isinstance(exc, rex.NoPermissionError) or str(exc).startswith("NOPERM"):
        return PermissionDenied(
            f"redis ACL denies an operation the SDK needs (keys ~pagedq:*, channels &pagedq:*): {exc}"
        )
    return None


# --- following a response stream ------------------------------------------------------------------


class _CallParts:
    """One tool call being assembled from its deltas."""

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []

    def add(self, d: ToolCallDelta) -> None:
        self.id = d.id or self.id
        self.name = d.name or self.name
        self.arguments.append(d.arguments)

    def build(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments="".join(self.arguments)))


class CompletionBuilder:
    """Accumulates Tokens and ToolCalls events per sample index into choices."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.text: dict[int, list[str]] = {}
        self.content: dict[int, list[str]] = {}
        self.calls: dict[int, dict[int, _CallParts]] = {}
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float] | None] = {}
        self.top: dict[int, list | None] = {}
        self.texts: dict[int, list | None] = {}
        self.bytes: dict[int, list | None] = {}
        self.top_texts: dict[int, list | None] = {}
        self.top_bytes: dict[int, list | None] = {}
        self.worker: str | None = None

    def add_tool_calls(self, ev: ToolCalls) -> None:
        calls = self.calls.setdefault(ev.index, {})
        for d in ev.tool_calls:
            calls.setdefault(d.index, _CallParts()).add(d)

    def add(self, ev: Tokens) -> None:
        i = ev.index
        self.text.setdefault(i, []).append(ev.text)
        self.content.setdefault(i, []).append(ev.text if ev.content is None else ev.content)
        self.ids.setdefault(i, []).extend(ev.token_ids)
        for store, value in (
            (self.logprobs, ev.logprobs),
            (self.top, ev.top_logprobs),
            (self.texts, ev.token_texts),
            (self.bytes, ev.token_bytes),
            (self.top_texts, ev.top_token_texts),
            (self.top_bytes, ev.top_token_bytes),
        ):
            if value is not None:
                got = store.get(i)
                if got is None:
                    store[i] = list(value)
                else:
                    got.extend(value)
            else:
                store.setdefault(i, None)

    @property
    def has_tokens(self) -> bool:
        return bool(self.ids)

    def build(self, fin: Finished | None) -> Completion:
        reasons = fin.finish_reasons if fin else []
        n = max([*self.ids, *self.calls, len(reasons) - 1, 0]) + 1
        choices = [
            Choice(
                index=i,
                text="".join(self.text.get(i, [])),
                token_ids=self.ids.get(i, []),
                finish_reason=reasons[i] if i < len(reasons) else (fin.finish_reason if fin else None),
                logprobs=_copy(self.logprobs.get(i)),
                top_logprobs=_copy(self.top.get(i)),
                content="".join(self.content.get(i, [])),
                token_texts=_copy(self.texts.get(i)),
                token_bytes=_copy(self.bytes.get(i)),
                top_token_texts=_copy(self.top_texts.get(i)),
                top_token_bytes=_copy(self.top_bytes.get(i)),
                tool_calls=[c.build() for _, c in sorted(self.calls[i].items())] if self.calls.get(i) else None,
            )
            for i in range(n)
        ]
        first = choices[0]
        return Completion(
            request_id=self.request_id,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=fin.finish_reason if fin else None,
            stop_reason=fin.stop_reason if fin else None,
            usage=fin.usage if fin else Usage(),
            timings=fin.timings if fin else Timings(),
            choices=choices,
            logprobs=first.logprobs,
            worker=self.worker,
            content=first.content,
            tool_calls=first.tool_calls,
        )


def _copy(values: list | None) -> list | None:
    """A built Completion's own list (the builder's goes on growing if more events come)."""
    return None if values is None else list(values)


def outcome(completion: Completion, *, partial_ok: bool) -> Completion:
    """Return the completion, or raise Cancelled / DeadlineExceeded for an abort / deadline finish."""
    reason = completion.finish_reason
    if partial_ok or reason not in ("abort", "deadline"):
        return completion
    rid = completion.request_id
    if reason == "abort":
        raise Cancelled(f"request {rid} was cancelled", request_id=rid, completion=completion)
    raise DeadlineExceeded(f"request {rid} reached its deadline", request_id=rid, completion=completion)


class Follower:
    """State machine of one reader of one response stream (sans-IO).

    Per loop, the driver (async or sync) does:
    ``needs_check`` -> run the reads of `_core.queue_liveness` (EXISTS marker, EXISTS stream, and the
    entry in its lane when known) and pass them to `on_liveness` (which may ask for a resubmit: run
    the enqueue script again and call `on_resubmitted`); else
    ``xread_args()`` -> XREAD BLOCK and feed the reply to `on_reply`, yielding its chunks;
    on a redis error sleep `on_error(exc)` seconds (it raises when giving up).
    Resuming costs nothing: `last_id` is only advanced past entries already turned into chunks.
    """

    RESUBMIT = "resubmit"

    def __init__(
        self,
        request_id: str,
        *,
        model: str,
        prepared: Prepared | None,
        timeout: float | None,
        block_ms: int,
        backoff: Backoff,
        resubmit_lost: bool,
        count: int = 512,
        owner: Any = None,
        entry_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.key = keys.response_stream(request_id)
        self.marker = keys.submitted_marker(model, request_id)
        self.prepared = prepared
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.block_ms = max(1, int(block_ms))
        self.backoff = backoff
        self.resubmit_lost = resubmit_lost
        self.count = count
        self.last_id: bytes | str = b"0-0"
        self.expected_seq = 0
        self.attempt = 0  # of the last Started event read
        self.builder = CompletionBuilder(request_id)
        self.finished: Finished | None = None
        self.failed: Error | None = None
        self.needs_check = False
        self.owner = owner  # gets `reconnects` and `resubmits` counted
        # The request's entry, when this reader's handle enqueued it: while the entry is in its lane
        # the request is queued or running, even after its marker expired.
        self.lane_stream = keys.lane_stream(model, prepared.lane) if prepared is not None else None
        self.entry_id = entry_id

    @property
    def done(self) -> bool:
        return self.finished is not None or self.failed is not None

    def _remaining_s(self) -> float | None:
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout(self.request_id, float(self.timeout or 0))
        return remaining

    def xread_args(self) -> tuple[dict, int, int]:
        """(streams, count, block ms) for XREAD; raises RequestTimeout once past the timeout."""
        remaining = self._remaining_s()
        block = self.block_ms if remaining is None else max(1, min(self.block_ms, int(remaining * 1000)))
        return {self.key: self.last_id}, self.count, block

    def on_reply(self, reply: Any) -> Iterator[Chunk]:
        """Feed an XREAD reply; yields chunks; raises at a gap, bad event or failure."""
        self.backoff.reset()
        entries = _entries_of(reply)
        if not entries:
            self.needs_check = True  # idle for a whole block: is the request still there?
            return
        for entry_id, fields in entries:
            if self.done:
                return
            self.last_id = entry_id
            data = fields.get(_EVENT_KEY) if isinstance(fields, dict) else None
            if data is None:
                raise ProtocolError(f"request {self.request_id}: response entry {entry_id!r} has no event")
            ev = decode_event(data)
            if isinstance(ev, Started) and ev.seq < self.expected_seq and ev.attempt != self.attempt:
                raise StreamDiverged(
                    f"request {self.request_id}: attempt {ev.attempt} restarted the stream at seq {ev.seq}, "
                    f"after this reader saw up to seq {self.expected_seq - 1} of attempt {self.attempt} "
                    "(Redis lost writes in a failover); read it again from the start",
                    request_id=self.request_id,
                )
            if ev.seq < self.expected_seq:
                if isinstance(ev, (Finished, Error)):
                    # Never a duplicate (reading stops at the first terminal event): dropping it
                    # would leave this reader waiting forever.
                    raise ProtocolError(
                        f"request {self.request_id}: final event with seq {ev.seq}, after seq "
                        f"{self.expected_seq - 1} (the worker numbered its events wrong)"
                    )
                continue  # a duplicate (a resumed worker republished it)
            if ev.seq > self.expected_seq:
                raise ProtocolError(
                    f"request {self.request_id}: response events {self.expected_seq}..{ev.seq - 1} are "
                    "missing (trimmed or lost stream)"
                )
            self.expected_seq += 1
            if isinstance(ev, UnknownEvent):
                continue  # written by a newer worker: its seq counts, its content is not ours to read
            if isinstance(ev, Tokens):
                self.builder.add(ev)
                yield Chunk(
                    ev.text,
                    ev.token_ids,
                    ev.index,
                    ev.logprobs,
                    ev.top_logprobs,
                    ev.seq,
                    ev.content,
                    token_texts=ev.token_texts,
                    token_bytes=ev.token_bytes,
                    top_token_texts=ev.top_token_texts,
                    top_token_bytes=ev.top_token_bytes,
                )
            elif isinstance(ev, ToolCalls):
                self.builder.add_tool_calls(ev)
                yield Chunk("", [], ev.index, seq=ev.seq, content="", tool_calls=ev.tool_calls)
            elif isinstance(ev, Started):
                self.builder.worker = ev.worker
                self.attempt = ev.attempt
            elif isinstance(ev, Finished):
                self.finished = ev
            elif isinstance(ev, Error):
                self.failed = ev
                raise RequestFailed(ev.code, ev.message, request_id=self.request_id)

    def on_error(self, exc: BaseException) -> float:
        """Seconds to wait before the next try after a redis error (raises when giving up)."""
        delay = self.backoff.delay(exc, self.request_id)
        self.needs_check = True
        if self.owner is not None:
            self.owner.reconnects += 1
        remaining = self._remaining_s()
        return delay if remaining is None else min(delay, remaining)

    def on_liveness(self, marker_exists: int, stream_exists: int, queued: Any = None) -> str | None:
        """After a reconnect or an idle block: returns RESUBMIT, or None to go on reading. `queued`:
        the XRANGE of the entry in its lane (when its lane and id are known). A request waiting longer than the
        marker's TTL is still queued, and is never resubmitted (a second entry would run it twice)."""
        self.backoff.reset()
        self.needs_check = False
        if marker_exists or stream_exists or queued:
            return None
        if self.prepared is not None and self.resubmit_lost and not self.builder.has_tokens:
            return self.RESUBMIT
        if self.builder.has_tokens:
            why = "tokens were already streamed, so it was not resubmitted"
        elif self.prepared is None:
            why = "this handle did not submit it, so it cannot resubmit it"
        else:
            why = "resubmit_lost is off"
        raise RequestLost(
            f"request {self.request_id} is gone from redis (the server restarted without persistence, "
            f"or the result expired, or no such request was submitted); {why}",
            request_id=self.request_id,
        )

    def on_resubmitted(self, result: EnqueueResult) -> None:
        # The old stream is gone; the new one starts over. Events already seen (at most Started)
        # come again with the same seq and are dropped.
        self.last_id = b"0-0"
        self.entry_id = result.entry_id or self.entry_id
        if self.owner is not None:
            self.owner.resubmits += 1
            self.owner.entry_id = self.entry_id

    def completion(self) -> Completion:
        return self.builder.build(self.finished)


_EVENT_KEY = EVENT_FIELD.encode()


def _entries_of(reply: Any) -> list:
    """Entries of the single stream in an XREAD reply (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return next(iter(reply.values()))[0] if reply else []
    return reply[0][1]
