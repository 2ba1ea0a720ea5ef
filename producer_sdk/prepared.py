"""A request checked and encoded for the enqueue script, and what enqueueing it returned: the types the
clients' shared logic (`_core.py`) and the stream follower (`_stream.py`) both use."""

from __future__ import annotations

import msgspec

from producer_sdk.constants import DEFAULT_TENANT
from producer_sdk.protocol import GenerateRequest


class Prepared(msgspec.Struct):
    """A checked, encoded request, ready for the enqueue script, and the tenant it counts under (it
    travels in the entry, next to the payload)."""

    request: GenerateRequest
    payload: bytes
    tenant: str = DEFAULT_TENANT

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def lane(self) -> str:
        return self.request.lane


class EnqueueResult(msgspec.Struct):
    duplicate: bool
    entry_id: str | None
