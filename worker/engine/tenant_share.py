"""Which tenants have had more than their weighted share of the engine's work lately (the scheduler's
fair share between tenants, `fair_share_prefill_tokens`).

A tenant's service is the tokens computed for it, decaying with a half-life of `half_life_s`: what it
has had over the last several seconds, not the sequences it holds at this instant. A tenant whose
requests arrive in a bunch holds many sequences for a moment; counted by sequences it would look like
the flooding tenant exactly when it needs protecting from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from worker.engine.request import Sequence

HALF_LIFE_S = 10.0
# A tenant whose sequences all ended this recently is still there, with nothing in the engine: one that
# sends a request every second or so is between two of them most of the time, and the other tenants'
# prompts must not run uncapped in those gaps, or its next request waits behind them.
TENANT_MEMORY_S = 2.0


@dataclass
class _Tenant:
    weight: float
    seen: float  # last time it had sequences in the engine
    service: float = 0.0  # decayed tokens computed, as of `stamp`
    stamp: float = 0.0
    live: int = 0  # its sequences in the engine now


class TenantShare:
    """Kept up to date by the scheduler: `join` and `leave` as sequences come and go, `charge` with each
    step's tokens, so `over_share` costs one pass over the tenants, not over the sequences."""

    def __init__(
        self,
        half_life_s: float = HALF_LIFE_S,
        memory_s: float = TENANT_MEMORY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decay_per_s = math.log(2) / half_life_s
        self.memory_s = memory_s
        self.clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def _service(self, t: _Tenant, now: float) -> float:
        t.service *= math.exp(-self.decay_per_s * (now - t.stamp))
        t.stamp = now
        return t.service

    def join(self, seq: Sequence) -> None:
        tenant = seq.request.tenant
        if tenant is None:
            return
        now = self.clock()
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(seq.request.tenant_weight, now, 0.0, now)
        t.weight, t.seen = seq.request.tenant_weight, now
        t.live += 1

    def leave(self, seq: Sequence) -> None:
        t = self._tenants.get(seq.request.tenant) if seq.request.tenant is not None else None
        if t is not None and t.live > 0:
            t.live -= 1
            t.seen = self.clock()

    def charge(self, work: Iterable[tuple[Sequence, int]]) -> None:
        """Count the tokens of a step: (sequence, tokens computed for it)."""
        totals: dict[str, int] = {}
        for seq, tokens in work:
            tenant = seq.request.tenant
            if tenant is not None:
                totals[tenant] = totals.get(tenant, 0) + tokens
        now = self.clock()
        for tenant, tokens in totals.items():
            t = self._tenants.get(tenant)
            if t is not None:
                self._service(t, now)
                t.service += tokens

    def over_share(self) -> frozenset[str]:
        """Tenants whose service per weight is above the weighted mean of the tenants present: with
        sequences in the engine, or with some within `memory_s` (none while fewer than two are)."""
        now = self.clock()
        present: dict[str, _Tenant] = {}
        for name, t in list(self._tenants.items()):
            if t.live or now - t.seen <= self.memory_s:
                present[name] = t
            elif self._service(t, now) < 1.0:
                del self._tenants[name]  # gone, and its service has decayed away
        if len(present) < 2:
            return frozenset()
        services = {name: self._service(t, now) for name, t in present.items()}
        mean = sum(services.values()) / sum(t.weight for t in present.values())
        return frozenset(name for name, t in present.items() if services[name] > mean * t.weight)
