"""Reading what earlier attempts of a request left in its response stream, to resume it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer_sdk.contract import keys
from producer_sdk.errors import ProtocolError
from producer_sdk.protocol import Error, Finished, Started, Tokens, decode_event


class CorruptStream(Exception):
    """A response stream holds an entry that is no event: the request cannot be resumed from it."""


@dataclass
class Resume:
    """Where a new attempt picks up."""

    next_seq: int
    attempt: int  # the new attempt's number
    delivered: list[list[int]]  # per sample: the tokens already in the stream
    finished: bool  # a final event is there already
    used_tokens: int = 0  # a Finished event's prompt + completion tokens (what its tenant is charged)

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self.delivered)


def replay(raw: Sequence[Any], request_id: str) -> Resume:
    """Replay a response stream (its XRANGE). Events of types this version does not know are skipped
    (their seq counted: a newer worker wrote them); an entry that does not decode raises `CorruptStream`."""
    next_seq, attempt, finished, used = 0, 0, False, 0
    delivered: list[list[int]] = []
    for entry_id, fields in raw:
        data = fields.get(keys.EVENT_FIELD.encode())
        try:
            if data is None:
                raise ProtocolError("the entry holds no event")
            ev = decode_event(data)
        except ProtocolError as err:
            raise CorruptStream(f"response entry {entry_id!r} of request {request_id}: {err}") from None
        if ev.seq != next_seq:  # written twice by an old, unfenced writer: the first copy counts
            continue
        next_seq += 1
        if isinstance(ev, Started):
            attempt = max(attempt, ev.attempt)
        elif isinstance(ev, Tokens):
            while len(delivered) <= ev.index:
                delivered.append([])
            delivered[ev.index].extend(ev.token_ids)
        elif isinstance(ev, (Finished, Error)):
            finished = True
            if isinstance(ev, Finished):
                used = ev.usage.prompt_tokens + ev.usage.completion_tokens
    return Resume(next_seq=next_seq, attempt=attempt + 1, delivered=delivered, finished=finished, used_tokens=used)
