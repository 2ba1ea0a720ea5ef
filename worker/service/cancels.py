"""Cancels: the control channel (pub/sub) for speed, the cancel flags for certainty.

Pub/sub drops messages while disconnected, so `sweep` also reads the flags of everything in flight
now and then. On Redis Cluster a PUBLISH reaches every node's subscribers: the worker subscribes on
one node, and on another when that one fails. A cancel is remembered for a while, for the request
that is between intake's flag check and the engine when its message arrives. A request the intake
holds for fair share (read, not admitted) is handed to `on_held_cancel`, which answers it at once
instead of at its turn.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable

import redis.asyncio as aioredis

from producer_sdk.contract import keys
from producer_sdk.contract.cluster import is_cluster, node_client
from producer_sdk.contract.redis_errors import is_transient
from producer_sdk.errors import ProtocolError
from producer_sdk.protocol import decode_control
from worker.service.inflight import InFlightTable
from worker.service.logging import get_logger
from worker.service.retry import Backoff

REMEMBERED = 10_000
LISTEN_POLL_S = 1.0


class Cancels:
    def __init__(
        self,
        redis: aioredis.Redis,
        inflight: InFlightTable,
        *,
        model: str,
        consumer: str,
        abort: Callable[[str], None],
        held: Callable[[], list[str]] = list,
        on_held_cancel: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        self.redis = redis
        self.inflight = inflight
        self.model = model
        self.abort = abort
        self.held, self.on_held_cancel = held, on_held_cancel
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.log = get_logger("pagedq.cancels", worker=consumer)

    def recently_cancelled(self, request_id: str) -> bool:
        return request_id in self.recent

    async def listen(self) -> None:
        backoff = Backoff(max_s=5.0)
        channel = keys.control_channel(self.model)
        failures = 0
        while True:
            node = None  # on a cluster: a client of the one node subscribed to
            pubsub = None
            try:
                if is_cluster(self.redis):
                    node = await node_client(self.redis, channel, failures)
                pubsub = (node or self.redis).pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(channel)
                await self.sweep()
                backoff.reset()
                while True:  # short reads: an idle channel must not look like a dead connection
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=LISTEN_POLL_S)
                    if message is not None:
                        self._on_message(message.get("data"))
            except Exception as e:
                if not is_transient(e):
                    raise
                failures += 1
                self.log.warning("control channel lost, resubscribing", error=str(e))
                await asyncio.sleep(backoff.next())
            finally:
                if pubsub is not None:
                    await pubsub.aclose()
                if node is not None:
                    await node.aclose()

    def _on_message(self, data) -> None:
        try:
            msg = decode_control(data)
        except ProtocolError:
            return
        if msg.type != "cancel" or not msg.request_id:
            return
        self.recent[msg.request_id] = None
        while len(self.recent) > REMEMBERED:
            self.recent.popitem(last=False)
        if msg.request_id in self.inflight:
            self.log.info("cancel", request_id=msg.request_id)
            self.abort(msg.request_id)
        elif msg.request_id in self.held():
            self.on_held_cancel(msg.request_id)

    async def sweep(self) -> None:
        held = set(self.held())
        ids = list(self.inflight) + list(held)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.exists(keys.cancel_flag(rid))
        for rid, flagged in zip(ids, await pipe.execute(), strict=True):
            if flagged and rid in self.inflight:
                self.abort(rid)
            elif flagged and rid in held:
                self.on_held_cancel(rid)
