"""`pagedq migrate`: move a single Redis node's keys from the layout before hash tags to today's."""

from __future__ import annotations

import argparse
import sys

from worker.local import REDIS_URL_HELP, default_redis_url


def add_migrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    p.add_argument("--dry-run", action="store_true", help="list what would move, change nothing")
    p.set_defaults(func=cmd_migrate)


def cmd_migrate(args: argparse.Namespace) -> int:
    from producer_sdk.contract import migrate
    from producer_sdk.contract.cluster import is_cluster_url
    from producer_sdk.contract.connection import connect, redact_url
    from producer_sdk.contract.redis_errors import REDIS_ERRORS

    url = args.redis_url or default_redis_url()
    if is_cluster_url(url):
        print("nothing to migrate: the old layout never ran on Redis Cluster", file=sys.stderr)
        return 0
    r = connect(url, asyncio=False, socket_timeout=60)
    try:
        done = migrate.plan(r) if args.dry_run else migrate.migrate(r)
    except REDIS_ERRORS as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        r.close()
    verb = ("would rename", "would delete") if args.dry_run else ("renamed", "deleted")
    for old, new in done.renamed:
        print(f"{verb[0]} {old} -> {new}")
    for key in done.deleted:
        print(f"{verb[1]} {key}")
    models = ", ".join(done.models) or "none"
    print(f"{redact_url(url)}: {len(done.renamed)} keys {verb[0]}, {len(done.deleted)} {verb[1]} (models: {models})")
    return 0
