"""Moving a single Redis node from the layout before hash tags to the one in `keys` (`pagedq migrate`).

Before: ``pagedq:<model>:requests``, ``pagedq:resp:<id>``, ``pagedq:req:<id>``, ... After: a model's
keys under ``pagedq:{<model>}:``, a request's under ``pagedq:<kind>:{<id>}`` (see `keys`). Run it with
every worker and producer of the old version stopped, then start the new ones: queued and pending
entries keep their consumer group (its name did not change) and are served, unfinished requests are
resumed from their response streams, finished ones stay readable. Renames only (RENAME keeps a
stream's consumer groups and every key's TTL); a key already in the new layout is left alone, so a
second run changes nothing. What is not moved: worker heartbeats and states (rewritten within
seconds by the new workers) and the tenants' cross-model rate windows (the new windows are per
model; they start over).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from producer_sdk.contract import keys
from producer_sdk.contract.replies import as_text

_OLD_MODEL_KEYS = {  # suffix of pagedq:<model>: -> the new key
    "requests": lambda m: keys.lane_stream(m, "normal"),
    "requests:high": lambda m: keys.lane_stream(m, "high"),
    "requests:low": lambda m: keys.lane_stream(m, "low"),
    "dead": keys.dead_letters,
    "config": keys.config,
    "tenant_queued": keys.tenant_queued,
}
_OLD_REQUEST_KEYS = {"resp": keys.response_stream, "cancel": keys.cancel_flag, "gw": keys.gateway_record}
_DROPPED = ("heartbeats", "worker:")  # of a model: rewritten by the new workers


class Migration(msgspec.Struct):
    renamed: list[tuple[str, str]] = msgspec.field(default_factory=list)
    deleted: list[str] = msgspec.field(default_factory=list)
    models: list[str] = msgspec.field(default_factory=list)


def _scan(r: Any, pattern: str) -> Iterator[str]:
    for key in r.scan_iter(match=pattern, count=1000):
        yield as_text(key)


def old_models(r: Any) -> list[str]:
    """Model names with keys in the old layout (or in the served-model registry)."""
    names = {as_text(m) for m in r.zrange(keys.models(), 0, -1)}
    for key in _scan(r, f"{keys.PREFIX}:*:requests*"):
        middle = key[len(keys.PREFIX) + 1 :].rsplit(":requests", 1)[0]
        if middle and "{" not in middle:
            names.add(middle)
    return sorted(names)


def plan(r: Any) -> Migration:
    """What `migrate` would do, without doing it."""
    out = Migration(models=old_models(r))
    for model in out.models:
        old = f"{keys.PREFIX}:{model}:"
        for suffix, new in _OLD_MODEL_KEYS.items():
            if r.exists(old + suffix):
                out.renamed.append((old + suffix, new(model)))
        for dropped in _DROPPED:
            out.deleted += list(_scan(r, old + dropped + ("*" if dropped.endswith(":") else "")))
    for kind, new in _OLD_REQUEST_KEYS.items():
        for key in _scan(r, f"{keys.PREFIX}:{kind}:*"):
            rid = key.split(":", 2)[2]
            if not rid.startswith("{"):
                out.renamed.append((key, new(rid)))
    for key in _scan(r, f"{keys.PREFIX}:req:*"):
        rid = key.split(":", 2)[2]
        out.renamed += [(key, keys.submitted_marker(m, rid)) for m in out.models]  # copied to each model
    for key in _scan(r, f"{keys.PREFIX}:tenant:*"):
        if key.endswith((":rate", ":tokens")):
            out.deleted.append(key)
    return out


def migrate(r: Any) -> Migration:
    """Move the old layout's keys to the new names on a single node (blocking redis-py client)."""
    done = plan(r)
    markers: dict[str, list[str]] = {}
    for old, new in done.renamed:
        if old.startswith(f"{keys.PREFIX}:req:"):
            markers.setdefault(old, []).append(new)
        elif not r.exists(new):
            r.rename(old, new)
    for old, news in markers.items():
        for new in news:
            r.copy(old, new)  # keeps the TTL
        r.delete(old)
    for key in done.deleted:
        r.delete(key)
    return done
