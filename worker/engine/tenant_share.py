"""Which tenants hold more than their weighted share of the engine's decoding sequences (the scheduler's
fair share between tenants, `fair_share_prefill_tokens`).

Only sequences past their prompt count: they are the service a tenant has had. A tenant whose requests
arrive in a bunch has its new prompts waiting, and were they counted, it would look as big as the
tenant it needs protecting from exactly then."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from worker.engine.request import Sequence

# A tenant whose sequences all ended this recently still counts, holding none. One that sends a request
# every second or so has nothing in the engine between two of them most of the time; were it forgotten
# at once, another tenant's prompts would run uncapped in those gaps and its next request would wait
# behind them.
TENANT_MEMORY_S = 2.0


class TenantShare:
    def __init__(self, memory_s: float = TENANT_MEMORY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_s = memory_s
        self.clock = clock
        self._seen: dict[str, tuple[float, float]] = {}  # tenant -> (last seen with sequences, weight)

    def over_share(self, seqs: Iterable[Sequence]) -> frozenset[str]:
        """Tenants holding more than their weighted share of the decoding sequences among `seqs`, between
        the tenants that have sequences there or had some within `memory_s` (none while there are fewer
        than two; sequences without a tenant are not counted)."""
        now = self.clock()
        counts: dict[str, int] = {}
        for seq in seqs:
            tenant = seq.request.tenant
            if tenant is not None:
                counts[tenant] = counts.get(tenant, 0) + (seq.num_output_tokens > 0)
                self._seen[tenant] = (now, seq.request.tenant_weight)
        weights: dict[str, float] = {}
        for tenant, (seen, weight) in list(self._seen.items()):
            if now - seen > self.memory_s:
                del self._seen[tenant]
            else:
                weights[tenant] = weight
                counts.setdefault(tenant, 0)
        if len(counts) < 2:
            return frozenset()
        total, weight_sum = sum(counts.values()), sum(weights.values())
        return frozenset(t for t, c in counts.items() if c * weight_sum > total * weights[t])
