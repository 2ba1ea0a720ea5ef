"""Weighted fair queuing between tenants, over the request entries a worker holds.

Entries wait here between their read from a lane stream and their admission into the engine. `pop`
takes the highest lane that holds anything, and within it the tenant with the least virtual time,
ties to the entry read first; FIFO within a tenant. A tenant's virtual time grows by
`cost / weight` with each request admitted (cost 1: fair share counts requests, not tokens), so over
many picks tenants with waiting work get admissions in proportion to their weights. A tenant that had
nothing waiting rejoins at the current virtual time: time spent idle banks no credit. Virtual time
is shared by all lanes (a tenant's admissions count wherever they were queued).

Pure bookkeeping, no Redis: the intake reads, holds, renews and hands over the entries.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from worker.service.inflight import Entry, EntryKey

PRUNE_EVERY = 256  # pops between sweeps of the virtual times of tenants with nothing waiting


class FairQueue:
    def __init__(self, lanes: Sequence[str], cost: Callable[[Entry], float] = lambda e: 1.0) -> None:
        self.lanes = list(lanes)  # highest priority first
        self.cost = cost
        self._queues: dict[str, dict[str, deque[tuple[int, Entry]]]] = {lane: {} for lane in self.lanes}
        self._held = Counter[str]()  # tenant -> entries waiting, all lanes
        self._keys: set[EntryKey] = set()
        self.vtime: dict[str, float] = {}
        self.now = 0.0  # virtual time of the last admission (never decreases)
        self._order = itertools.count()
        self._pops = 0

    def __len__(self) -> int:
        return len(self._keys)

    def holds(self, key: EntryKey) -> bool:
        return key in self._keys

    def tenants(self) -> list[str]:
        """Tenants with entries waiting."""
        return list(self._held)

    def push(self, e: Entry) -> None:
        tenant = e.tenant
        if not self._held[tenant]:  # (re)joins: no credit for the time it had nothing waiting
            self.vtime[tenant] = max(self.vtime.get(tenant, self.now), self.now)
        self._held[tenant] += 1
        self._keys.add(e.key)
        self._queues.setdefault(e.lane, {}).setdefault(tenant, deque()).append((next(self._order), e))
        if e.lane not in self.lanes:
            self.lanes.append(e.lane)

    def pop(self, weight: Callable[[str], float], lane_room: Mapping[str, int] | None = None) -> Entry | None:
        """The next entry to admit, or None when nothing waits (in a lane with room left, if limited)."""
        for lane in self.lanes:
            queues = self._queues[lane]
            if not queues or (lane_room is not None and lane_room.get(lane, 1) <= 0):
                continue
            tenant = min(queues, key=lambda t: (self.vtime[t], queues[t][0][0]))
            _, e = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            start = self.vtime[tenant]
            self.now = max(self.now, start)
            self.vtime[tenant] = start + self.cost(e) / max(weight(tenant), 1e-9)
            self._forget(e)
            self._pops += 1
            if self._pops % PRUNE_EVERY == 0:
                self._prune()
            return e
        return None

    def pop_many(
        self, count: int, weight: Callable[[str], float], lane_room: Mapping[str, int] | None = None
    ) -> list[Entry]:
        """Up to `count` entries; at most `lane_room[lane]` from a lane named there."""
        room = dict(lane_room) if lane_room is not None else None
        out: list[Entry] = []
        while len(out) < count:
            e = self.pop(weight, room)
            if e is None:
                break
            if room is not None and e.lane in room:
                room[e.lane] -= 1
            out.append(e)
        return out

    def remove_request(self, request_id: str) -> Entry | None:
        """Take out the entry of this request (cancelled while waiting), if held here."""
        for queues in self._queues.values():
            for tenant, q in queues.items():
                for item in q:
                    if item[1].request_id == request_id:
                        q.remove(item)
                        if not q:
                            del queues[tenant]
                        self._forget(item[1])
                        return item[1]
        return None

    def remove_entries(self, keys: Iterable[EntryKey]) -> list[Entry]:
        """Take out these entries (another worker owns them now)."""
        gone = set(keys) & self._keys
        out: list[Entry] = []
        if not gone:
            return out
        for queues in self._queues.values():
            for tenant in list(queues):
                kept = deque(item for item in queues[tenant] if item[1].key not in gone)
                out += [item[1] for item in queues[tenant] if item[1].key in gone]
                if kept:
                    queues[tenant] = kept
                else:
                    del queues[tenant]
        for e in out:
            self._forget(e)
        return out

    def entries(self) -> list[Entry]:
        """Everything held, in no particular order."""
        return [item[1] for queues in self._queues.values() for q in queues.values() for item in q]

    def drain(self) -> list[Entry]:
        """Take out everything held (the worker stops)."""
        out = self.entries()
        for queues in self._queues.values():
            queues.clear()
        self._held.clear()
        self._keys.clear()
        return out

    def held_by(self) -> Counter[tuple[str, str]]:
        """(lane, tenant) -> entries held."""
        return Counter({(lane, t): len(q) for lane, queues in self._queues.items() for t, q in queues.items()})

    def _forget(self, e: Entry) -> None:
        self._keys.discard(e.key)
        self._held[e.tenant] -= 1
        if self._held[e.tenant] <= 0:
            del self._held[e.tenant]

    def _prune(self) -> None:
        """Drop the virtual times of tenants with nothing waiting that are not ahead of `now`: they
        would rejoin at `now` anyway, so forgetting them changes nothing and bounds the table."""
        for tenant in [t for t, v in self.vtime.items() if v <= self.now and t not in self._held]:
            del self.vtime[tenant]
