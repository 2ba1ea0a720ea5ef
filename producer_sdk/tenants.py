"""Tenant quotas: set, read and repair them (what `pagedq tenant ...` runs), on a blocking redis-py client.

A quota lives in Redis (`keys.tenant_quota`); producers read it at each submit and the enqueue step
enforces it atomically with the submit, per model (as OpenAI's rate limits are): at most `max_queued`
outstanding requests (queued or running), at most `requests_per_minute` requests accepted per minute
(fixed windows of the Redis clock), and no new request once `tokens_per_minute` tokens (prompt +
completion of the tenant's requests finished in the current window, counted by the worker's ack)
are used. 0 or absent: unlimited. A tenant with no quota is unlimited. Per model, because each
model's counters live in its own hash slot (Redis Cluster).

A tenant's fair-share `weight` lives in the same hash (field `weight`, default 1): workers that hold
entries beyond their free seats admit them in proportion to the weights of the tenants waiting.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from producer_sdk.contract import keys, scripts, steps
from producer_sdk.contract.replies import as_text
from producer_sdk.validation import validate_tenant


class TenantQuota(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    max_queued: int = 0  # outstanding requests per model; 0: unlimited
    requests_per_minute: int = 0  # per model; 0: unlimited
    tokens_per_minute: int = 0  # prompt + completion tokens of finished requests, per model; 0: unlimited


class TenantUsage(msgspec.Struct, kw_only=True):
    tenant: str
    quota: TenantQuota
    queued: dict[str, int]  # model -> outstanding requests (queued or running)
    requests_this_minute: dict[str, int] | None  # model -> count; None: not counted (no such quota)
    tokens_this_minute: dict[str, int] | None = None  # model -> tokens; None: not counted (no such quota)


def _int(raw: Any) -> int:
    try:
        return max(0, int(raw))
    except (TypeError, ValueError):
        return 0


def set_quota(
    r: Any,
    tenant: str,
    *,
    max_queued: int | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> TenantQuota:
    """Set a tenant's quota (a field left None keeps its value; 0 means unlimited). Takes effect
    with the next submit."""
    tenant = validate_tenant(tenant)
    given = {
        "max_queued": max_queued,
        "requests_per_minute": requests_per_minute,
        "tokens_per_minute": tokens_per_minute,
    }
    fields = {name: value for name, value in given.items() if value is not None}
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0: unlimited), not {value!r}")
    if fields:
        r.hset(keys.tenant_quota(tenant), mapping=fields)
    r.sadd(keys.tenants(), tenant)
    return get_quota(r, tenant)


def delete_quota(r: Any, tenant: str) -> bool:
    """Remove a tenant's quota (it becomes unlimited); False if it had none."""
    tenant = validate_tenant(tenant)
    deleted = r.delete(keys.tenant_quota(tenant))
    removed = r.srem(keys.tenants(), tenant)
    for model in served_models(r):  # each key alone: they live in different hash slots
        r.delete(keys.tenant_rate(model, tenant))
        r.delete(keys.tenant_tokens(model, tenant))
    return bool(deleted or removed)


def get_quota(r: Any, tenant: str) -> TenantQuota:
    values = r.hmget(keys.tenant_quota(validate_tenant(tenant)), list(scripts.QUOTA_FIELDS))
    return TenantQuota(tenant=tenant, **{n: _int(v) for n, v in zip(scripts.QUOTA_FIELDS, values)})


def quota_tenants(r: Any) -> list[str]:
    """The tenants that have a quota, sorted."""
    return sorted(as_text(t) for t in r.smembers(keys.tenants()))


def served_models(r: Any) -> list[str]:
    return sorted(as_text(m) for m in r.zrange(keys.models(), 0, -1))


def usage(r: Any, models: Iterable[str] | None = None, tenants: Iterable[str] | None = None) -> list[TenantUsage]:
    """Quota and use of each tenant: those given, else those with a quota or with outstanding
    requests of one of `models` (default: the models workers serve)."""
    models = served_models(r) if models is None else list(models)
    counts: dict[str, dict[str, int]] = {}
    for model in models:
        for tenant, n in r.hgetall(keys.tenant_queued(model)).items():
            if _int(n) > 0:
                counts.setdefault(as_text(tenant), {})[model] = _int(n)
    names = sorted(set(quota_tenants(r)) | set(counts)) if tenants is None else [validate_tenant(t) for t in tenants]
    seconds, micros = r.time()
    window = (int(seconds) * 1000 + int(micros) // 1000) // scripts.RATE_WINDOW_MS
    out = []
    for tenant in names:
        quota = get_quota(r, tenant)
        used = tokens = None
        if quota.requests_per_minute:
            used = {m: _in_window(r, keys.tenant_rate(m, tenant), window) for m in models}
        if quota.tokens_per_minute:
            tokens = {m: _in_window(r, keys.tenant_tokens(m, tenant), window) for m in models}
        queued = counts.get(tenant, {})
        out.append(
            TenantUsage(tenant=tenant, quota=quota, queued=queued, requests_this_minute=used, tokens_this_minute=tokens)
        )
    return out


def _in_window(r: Any, key: str, window: int) -> int:
    """The count of a fixed-window hash (fields w, n) in `window`: 0 when it holds an older one."""
    w, n = r.hmget(key, ["w", "n"])
    return _int(n) if w is not None and _int(w) == window else 0


def recount(r: Any, model: str) -> dict[str, int]:
    """Count the model's outstanding requests per tenant again from its lanes and store the result
    (repairs the counts max_queued reads after entries were deleted by hand or lost)."""
    ks, args = scripts.recount_call(model)
    return scripts.read_recount(steps.RECOUNT.run_sync(r, ks, args))


# --- fair-share weight --------------------------------------------------------------------------

WEIGHT_FIELD = "weight"  # of keys.tenant_quota(tenant); workers read it, the enqueue step does not
DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1_000_000.0


def parse_weight(raw: Any) -> float:
    """A stored weight, or DEFAULT_WEIGHT when absent or not a number in (0, MAX_WEIGHT]."""
    try:
        w = float(as_text(raw)) if raw is not None else DEFAULT_WEIGHT
    except ValueError:
        return DEFAULT_WEIGHT
    return w if 0 < w <= MAX_WEIGHT else DEFAULT_WEIGHT


def validate_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise ValueError(f"weight must be a number > 0 and <= {MAX_WEIGHT:g}, not {weight!r}")
    return float(weight)


def set_weight(r: Any, tenant: str, weight: float) -> float:
    """Set a tenant's fair-share weight (> 0; 1 is the default). Workers apply it within seconds."""
    tenant, weight = validate_tenant(tenant), validate_weight(weight)
    r.hset(keys.tenant_quota(tenant), WEIGHT_FIELD, repr(weight))
    r.sadd(keys.tenants(), tenant)
    return get_weight(r, tenant)


def get_weight(r: Any, tenant: str) -> float:
    return parse_weight(r.hget(keys.tenant_quota(validate_tenant(tenant)), WEIGHT_FIELD))
