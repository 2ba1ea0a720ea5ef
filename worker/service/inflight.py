"""What the worker holds: request entries as read from Redis, and the requests it owns until their
final event is written. Touched only on the event loop thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from producer_sdk.constants import DEFAULT_TENANT, REQUEST_ID_PATTERN, TENANT_PATTERN
from producer_sdk.contract.keys import ENTRY_DATA_FIELD, ENTRY_ID_FIELD, ENTRY_RETENTION_FIELD, ENTRY_TENANT_FIELD
from producer_sdk.contract.scripts import lease_epoch
from producer_sdk.protocol import GenerateRequest

EntryKey = tuple[str, str]
"""(lane, entry id): what tells entries apart. Stream ids are per stream, so two lanes hand out the
same id to entries added in the same millisecond."""


@dataclass
class Entry:
    """A request entry as read from a lane stream."""

    lane: str
    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1
    read_at: float = field(default_factory=time.time)  # when this worker read it from Redis (unix s)

    @property
    def key(self) -> EntryKey:
        return self.lane, self.entry_id

    @property
    def request_id(self) -> str | None:
        """The id field outside the payload, when it is a valid request id."""
        raw = self.fields.get(ENTRY_ID_FIELD.encode(), b"")
        rid = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return rid if REQUEST_ID_PATTERN.fullmatch(rid) else None

    @property
    def tenant(self) -> str:
        """The tenant field (DEFAULT_TENANT when absent, from an older SDK, or malformed)."""
        raw = self.fields.get(ENTRY_TENANT_FIELD.encode(), b"")
        tenant = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return tenant if TENANT_PATTERN.fullmatch(tenant) else DEFAULT_TENANT

    @property
    def retention_ms(self) -> int | None:
        """The retention its producer asked for (field `r`, ms); None when absent (an older SDK's) or
        malformed."""
        raw = self.fields.get(ENTRY_RETENTION_FIELD.encode())
        try:
            value = int(raw) if raw is not None else None
        except ValueError:
            return None
        return value if value is not None and value > 0 else None

    @property
    def epoch(self) -> str:
        """The lease epoch of this delivery: what the worker writes the request's stream under."""
        return lease_epoch(self.entry_id, self.deliveries)


@dataclass
class InFlight:
    request_id: str
    lane: str
    stream: str  # the lane stream key
    entry_id: str
    request: GenerateRequest
    max_events: int  # MAXLEN cap of the response stream
    tenant: str = DEFAULT_TENANT  # the entry's tenant field
    retention_ms: int | None = None  # the entry's retention field (None: the worker's --result-ttl)
    attempt: int = 1  # 1 + number of attempts before this one
    deliveries: int = 1  # how many times Redis has handed the entry out
    next_seq: int = 0  # seq of the next event this worker writes
    started: bool = False  # our Started event is written
    delivered: list[list[int]] = field(default_factory=list)  # per sample: tokens in the response stream
    handover: bool = False  # we are giving it up: publish tokens, never a final event or ack
    lost: bool = False  # another worker owns it now: publish nothing
    final_written: bool = False  # its final event is stored; the ack of its entry may still be due
    engine_failures: int = 0  # engine steps that failed while it was running here
    resumed_tokens: int = 0  # tokens earlier attempts had delivered when this one began
    read_at: float = 0.0  # when its entry was read from Redis (unix s)
    added_at: float | None = None  # when the engine accepted it (tokenized, queued)

    @property
    def key(self) -> EntryKey:
        return self.lane, self.entry_id

    @property
    def live(self) -> bool:
        return not (self.handover or self.lost or self.final_written)

    @property
    def epoch(self) -> str:
        return lease_epoch(self.entry_id, self.deliveries)

    @property
    def seats(self) -> int:
        """Sequences it occupies in the engine (one per sample)."""
        return self.request.sampling.n

    def entry(self) -> Entry:
        return Entry(self.lane, self.stream, self.entry_id, self.fields(), self.deliveries, self.read_at)

    def fields(self, payload: bytes | None = None) -> dict[bytes, bytes]:
        """Entry fields rebuilt from what the worker holds (tenant, retention, and the payload if given)."""
        fields = {ENTRY_TENANT_FIELD.encode(): self.tenant.encode()}
        if self.retention_ms is not None:
            fields[ENTRY_RETENTION_FIELD.encode()] = str(self.retention_ms).encode()
        if payload is not None:
            fields[ENTRY_DATA_FIELD.encode()] = payload
        return fields


InFlightTable = dict[str, InFlight]
