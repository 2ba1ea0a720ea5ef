"""Running the contract's Lua steps (`scripts`) on any redis-py client: one node, Sentinel or Redis
Cluster, async or blocking, alone or in a pipeline.

A step runs as EVALSHA. A server that does not have the script (restarted, a replica promoted, a node
new to the cluster) answers NOSCRIPT: the script is then loaded (on every primary of a cluster) and
the call sent again, so callers never see it. Pipelined calls go out as they are; `run_many` reloads
and resends only those refused with NOSCRIPT.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from producer_sdk.contract import scripts

Call = tuple["Step", Sequence[Any], Sequence[Any]]  # (step, KEYS, ARGV)


class Cmd(tuple):
    """A plain command in a `run_many` batch: ``Cmd("XRANGE", key, "-", "+")``."""

    def __new__(cls, *args: Any) -> Cmd:
        return super().__new__(cls, args)


class Step:
    """One step of the library (its Lua source with its `return <step>(KEYS, ARGV)` line)."""

    def __init__(self, name: str, source: str) -> None:
        self.name, self.source = name, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Add the call to a pipeline (a NOSCRIPT reply then comes back in its results)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    async def run(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)

    def run_sync(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"<Step {self.name} {self.sha[:8]}>"


ENQUEUE = Step("enqueue", scripts.ENQUEUE)
ACQUIRE = Step("acquire", scripts.ACQUIRE)
PUBLISH = Step("publish", scripts.PUBLISH)
ACK = Step("ack", scripts.ACK)
DROP = Step("drop", scripts.DROP)
CLAIM_OWN = Step("claim_own", scripts.CLAIM_OWN)
RECOUNT = Step("recount", scripts.RECOUNT)
ALL = (ENQUEUE, ACQUIRE, PUBLISH, ACK, DROP, CLAIM_OWN, RECOUNT)


def missing(replies: Sequence[Any]) -> bool:
    """Whether a pipeline's results hold a NOSCRIPT refusal (load the steps, then resend those)."""
    return any(isinstance(r, NoScriptError) for r in replies)


async def load(client: Any, steps: Sequence[Step] = ALL) -> None:
    for step in steps:
        await client.script_load(step.source)


def load_sync(client: Any, steps: Sequence[Step] = ALL) -> None:
    for step in steps:
        client.script_load(step.source)


async def run_many(client: Any, calls: Sequence[Call | Cmd], *, resend_all: bool = False) -> list[Any]:
    """Every call in one pipeline; a reply is the step's result or the exception it raised. Calls
    refused with NOSCRIPT are sent again once the steps are loaded; with `resend_all`, the whole
    batch (when its calls depend on each other's order: every call must then be idempotent)."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            _queue(pipe, calls[i])
        for i, reply in zip(todo, await pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
        refused = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not refused or attempt:
            break
        await load(client, _steps_of(calls, refused))
        todo = list(range(len(calls))) if resend_all else refused
    return replies


def run_many_sync(client: Any, calls: Sequence[Call | Cmd], *, resend_all: bool = False) -> list[Any]:
    """`run_many` on a blocking client."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            _queue(pipe, calls[i])
        for i, reply in zip(todo, pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
        refused = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not refused or attempt:
            break
        load_sync(client, _steps_of(calls, refused))
        todo = list(range(len(calls))) if resend_all else refused
    return replies


def _queue(pipe: Any, call: Call | Cmd) -> None:
    if isinstance(call, Cmd):
        pipe.execute_command(*call)
    else:
        step, ks, args = call
        step.queue(pipe, ks, args)


def _steps_of(calls: Sequence[Call | Cmd], indexes: Sequence[int]) -> list[Step]:
    return list({call[0]: None for i in indexes if not isinstance(call := calls[i], Cmd)})
