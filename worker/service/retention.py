"""How long a finished request's answer stays in Redis: one retention per request.

The producer decides (the SDK's `result_ttl_s`, the gateway's --result-ttl); it travels in the entry's
`r` field, and the worker applies it, from the final event on, to the response stream, its lease, the
gateway's record (one publish step) and the submitted marker (the ack). A worker caps it at
--max-result-ttl, so that no producer can fill Redis with answers kept for a year; an entry of an
older SDK, without `r`, gets the worker's --result-ttl. docs/sdk.md, "How long an answer can be
fetched", is the one place that explains it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    default_ms: int  # --result-ttl: for entries that carry no retention
    max_ms: int  # --max-result-ttl

    def ms(self, asked_ms: int | None) -> int:
        """The retention applied to a request that asked for `asked_ms` (None: nothing asked)."""
        return max(1, min(asked_ms if asked_ms is not None else self.default_ms, self.max_ms))
