"""`pagedq tenant set|show|delete|recount`: tenant quotas in Redis (the SDK, no torch)."""

from __future__ import annotations

import argparse
import sys

import msgspec

from worker.local import REDIS_URL_HELP, default_redis_url


def add_tenant_args(tenant: argparse.ArgumentParser) -> None:
    actions = tenant.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help)
        p.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
        p.set_defaults(func=cmd_tenant)
        return p

    s = action("set", help="set a tenant's quota (the next submit applies it)")
    s.add_argument("name", help="tenant id ([A-Za-z0-9_-], at most 32 characters)")
    s.add_argument("--max-queued", type=int, default=None, help="outstanding requests per model (0: unlimited)")
    s.add_argument(
        "--requests-per-minute", type=int, default=None, help="requests accepted per minute, per model (0: unlimited)"
    )
    s.add_argument(
        "--tokens-per-minute",
        type=int,
        default=None,
        help="prompt + completion tokens of finished requests per minute, per model; a submit is refused once "
        "the minute's reach it (0: unlimited)",
    )
    s.add_argument(
        "--weight",
        type=float,
        default=None,
        help="fair-share weight against other tenants waiting on a worker (default 1; workers read it within 5 s)",
    )
    show = action("show", help="quotas and current use of each tenant")
    show.add_argument("name", nargs="*", help="only these tenants (default: those with a quota or requests)")
    show.add_argument("--model-name", action="append", default=None, help="count these models (default: all served)")
    show.add_argument("--json", action="store_true")
    d = action("delete", help="remove a tenant's quota (it becomes unlimited)")
    d.add_argument("name")
    rc = action("recount", help="count a model's outstanding requests per tenant again from its queue")
    rc.add_argument("--model-name", default="default", help="the model (key namespace)")


def _limit(n: int) -> str:
    return str(n) if n else "-"


def _per_model(u) -> str:
    """Per model: outstanding requests, and this minute's requests and tokens where counted."""
    models = sorted(set(u.queued) | set(u.requests_this_minute or {}) | set(u.tokens_this_minute or {}))
    parts = []
    for m in models:
        use = [f"queued {u.queued.get(m, 0)}"]
        if u.requests_this_minute is not None:
            use.append(f"{u.requests_this_minute.get(m, 0)} req this min")
        if u.tokens_this_minute is not None:
            use.append(f"{u.tokens_this_minute.get(m, 0)} tok this min")
        parts.append(f"{m}: {', '.join(use)}")
    return "; ".join(parts) or "nothing queued"


def render(rows: list) -> str:
    lines = [f"{'tenant':<32} {'max queued':>10} {'req/min':>8} {'tok/min':>10}  use per model"]
    for u in rows:
        lines.append(
            f"{u.tenant:<32} {_limit(u.quota.max_queued):>10} {_limit(u.quota.requests_per_minute):>8} "
            f"{_limit(u.quota.tokens_per_minute):>10}  {_per_model(u)}"
        )
    if not rows:
        lines.append("(no tenant has a quota or outstanding requests)")
    return "\n".join(lines)


def cmd_tenant(args: argparse.Namespace) -> int:
    from producer_sdk import PagedqError, tenants
    from producer_sdk.contract.connection import connect
    from producer_sdk.contract.redis_errors import REDIS_ERRORS

    r = connect(args.redis_url or default_redis_url(), asyncio=False, socket_timeout=30)
    try:
        if args.tenant_command == "set":
            if args.weight is not None:
                tenants.validate_weight(args.weight)  # before anything is written
            q = tenants.set_quota(
                r,
                args.name,
                max_queued=args.max_queued,
                requests_per_minute=args.requests_per_minute,
                tokens_per_minute=args.tokens_per_minute,
            )
            print(
                f"tenant {q.tenant}: max queued {_limit(q.max_queued)} per model, "
                f"{_limit(q.requests_per_minute)} requests per minute, {_limit(q.tokens_per_minute)} tokens per minute"
            )
            if args.weight is not None:
                print(f"tenant {q.tenant}: fair-share weight {tenants.set_weight(r, args.name, args.weight):g}")
        elif args.tenant_command == "show":
            rows = tenants.usage(r, args.model_name, args.name or None)
            print(msgspec.json.encode(rows).decode() if args.json else render(rows))
        elif args.tenant_command == "delete":
            if not tenants.delete_quota(r, args.name):
                print(f"tenant {args.name} had no quota", file=sys.stderr)
        else:
            counts = tenants.recount(r, args.model_name)
            print(", ".join(f"{t} {n}" for t, n in sorted(counts.items())) or "no outstanding requests")
    except (PagedqError, ValueError, *REDIS_ERRORS) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        r.close()
    return 0
