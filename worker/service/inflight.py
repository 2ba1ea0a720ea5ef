"""What the worker remembers about each request it owns, from intake to the final event."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer_sdk.protocol import GenerateRequest


@dataclass
class Entry:
    """A request entry as read from a lane stream."""

    lane: str
    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1


@dataclass
class InFlight:
    request_id: str
    lane: str
    stream: str  # the lane stream key
    entry_id: str
    request: GenerateRequest
    max_events: int  # MAXLEN cap of the response stream
    attempt: int = 1  # 1 + number of workers that ran it before
    deliveries: int = 1  # how many times Redis has handed the entry out
    next_seq: int = 0  # seq of the next event this worker writes
    started: bool = False  # our Started event is written
    delivered: list[list[int]] = field(default_factory=list)  # per sample: tokens in the response stream
    handover: bool = False  # we are giving it up: publish tokens, never a final event or ack
    lost: bool = False  # another worker owns it now: publish nothing
    engine_failures: int = 0  # engine steps that failed while it was running here

    @property
    def live(self) -> bool:
        return not (self.handover or self.lost)


class InFlightTable(dict[str, InFlight]):
    """request id -> InFlight, with lookups by lane for ownership renewal."""

    def by_stream(self) -> dict[str, list[InFlight]]:
        groups: dict[str, list[InFlight]] = {}
        for rec in self.values():
            groups.setdefault(rec.stream, []).append(rec)
        return groups
