"""The engine's waiting queue: FIFO for `fcfs`, a heap on (priority, arrival) for `priority`."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from worker.engine.request import Sequence


class WaitQueue:
    """Waiting sequences: FIFO for `fcfs`, a heap on (priority, arrival) for `priority`.

    `push_front` (preempted sequences) puts a sequence first among its equals: ahead of everything
    under fcfs, ahead of later arrivals of its priority under `priority`.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[tuple, int, Sequence]] = []
        self._tie = itertools.count()

    def _key(self, seq: Sequence) -> tuple:
        return (*seq.request.sort_key(self.policy), seq.index)

    def push(self, seq: Sequence) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (self._key(seq), next(self._tie), seq))
        else:
            self._fifo.append(seq)

    def push_front(self, seq: Sequence) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (self._key(seq), -next(self._tie), seq))
        else:
            self._fifo.appendleft(seq)

    def peek(self) -> Sequence:
        return self._heap[0][2] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[2] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, seq: Sequence) -> bool:
        if self.policy == "priority":
            for i, item in enumerate(self._heap):
                if item[2] is seq:
                    self._heap[i] = self._heap[-1]
                    self._heap.pop()
                    heapq.heapify(self._heap)
                    return True
            return False
        try:
            self._fifo.remove(seq)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting sequences, in no particular order."""
        return iter([item[2] for item in self._heap] if self.policy == "priority" else list(self._fifo))
