"""The clients' Redis operations as plans, written once for both clients (sans-IO).

A plan is a generator: it yields each Redis call it needs as a function of the client (`Call`), gets
the call's reply back, and returns the operation's result. `AsyncClient` awaits each call, `Client`
runs it as it is (`run_sync` / `run_async`); both retry a whole plan, started afresh, on a connection
error. The request building, reply parsing and retry policy the plans use live in `_core`, `_stats`
and `ClientOptions.backoff`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

from redis.exceptions import NoPermissionError

from producer_sdk import _core
from producer_sdk._stats import StatsReader
from producer_sdk._stream import Follower
from producer_sdk.contract import keys, scripts
from producer_sdk.results import QueueStats

T = TypeVar("T")
Call = Callable[[Any], Any]  # one Redis call on a client; on redis.asyncio it returns an awaitable
Plan = Generator[Call, Any, T]


def pipelined(fill: Callable[[Any], None]) -> Call:
    """One round trip: a non-transactional pipeline that `fill` queues its commands on."""

    def call(redis: Any) -> Any:
        pipe = redis.pipeline(transaction=False)
        fill(pipe)
        return pipe.execute()

    return call


def queue_stats(model: str) -> Plan[QueueStats]:
    """Lane lengths, dead letters and live workers; heartbeats of workers gone are pruned (where the
    user may: an operator's read-only user leaves them)."""
    s = StatsReader(model)
    state_keys = s.after_reads((yield pipelined(s.queue_reads)))
    gone = s.after_states((yield lambda r: r.mget(state_keys)) if state_keys else [])
    if gone:
        yield _unless_refused(lambda r: r.zrem(s.heartbeats, *gone))
    return s.stats()


def _unless_refused(call: Call) -> Call:
    """`call`, whose refusal by the ACL (an operator's read-only user) is no error: None instead."""

    def guarded(redis: Any) -> Any:
        try:
            reply = call(redis)
        except NoPermissionError:
            return None
        if not inspect.isawaitable(reply):
            return reply

        async def wait() -> Any:
            try:
                return await reply
            except NoPermissionError:
                return None

        return wait()

    return guarded


def cancel(model: str, request_id: str, ttl_s: float) -> Plan[None]:
    for command in _core.cancel_commands(model, request_id, ttl_s):
        yield lambda r, command=command: r.execute_command(*command)


def served_models() -> Plan[Any]:
    """The registry's members with their scores (`ModelRegistryView.update` reads them)."""
    return (yield lambda r: r.zrange(keys.models(), 0, -1, withscores=True))


def liveness(f: Follower) -> Plan[list[Any]]:
    """The reads `Follower.on_liveness` takes: is a request that sent nothing for a while still there?"""
    return (yield pipelined(lambda pipe: _core.queue_liveness(pipe, f)))


def quotas(tenants: Iterable[str]) -> Plan[dict[str, scripts.Quota]]:
    """The tenants' quotas as they are now (read before each enqueue, which applies them)."""
    names = sorted(tenants)
    replies = yield pipelined(lambda pipe: _core.queue_quota_reads(pipe, names))
    return _core.read_quotas(names, replies)


def run_sync(plan: Plan[T], redis: Any) -> T:
    try:
        call = next(plan)
        while True:
            call = plan.send(call(redis))
    except StopIteration as done:
        return done.value


async def run_async(plan: Plan[T], redis: Any) -> T:
    try:
        call = next(plan)
        while True:
            call = plan.send(await call(redis))
    except StopIteration as done:
        return done.value
