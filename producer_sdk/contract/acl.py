"""Redis ACL users for pagedq's roles, derived from the commands each role's code sends (`pagedq acl`).

A role is a list of grants: commands on key patterns (Redis 7 selectors), so that each command is
allowed only on the keys it is sent to. ACLs apply inside scripts too: a Lua step's `redis.call`s
need the same permissions as if the client sent them, and EVAL/EVALSHA itself needs read *and* write
access to every key it is given (its key spec is RW), so the script grants list those keys with `~`.

- producer: the SDK (enqueue, read response streams, cancel, `queue_stats`, served models, the
  tenant's quota);
- gateway: the producer's grants, plus its request records, files and batches;
- worker: lanes, consumer group, leases, publish, dead letters, heartbeats and registry, tenants'
  counters;
- operator: reads only: `pagedq stats`, `pagedq tenant show`, XLEN/XINFO/XPENDING of the lanes,
  the dead letters, INFO.

What ACLs cannot stop is listed in `LIMITS` (and docs/tenants.md). Administration (`pagedq tenant
set/delete/recount`, `pagedq migrate`) is left to an administrator's user.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROLES = ("producer", "gateway", "worker", "operator")
DEFAULT_USERS = {role: f"pagedq-{role}" for role in ROLES}
PASSWORD_ENV = {
    "producer": "PAGEDQ_ACL_PRODUCER_PASSWORD",
    "gateway": "PAGEDQ_ACL_GATEWAY_PASSWORD",
    "worker": "PAGEDQ_ACL_WORKER_PASSWORD",
    "operator": "PAGEDQ_ACL_OPERATOR_PASSWORD",
}

# What every client needs to connect (AUTH, HELLO, PING, SELECT, CLIENT SETNAME/SETINFO, ...), without
# the CLIENT subcommands that act on other connections or the whole server.
CONNECTION = (
    "+@connection",
    "-client|kill",
    "-client|pause",
    "-client|unpause",
    "-client|unblock",
    "-client|list",
    "-client|no-evict",
)
CLUSTER = ("+cluster|slots", "+cluster|shards")  # redis-py's cluster client reads the slot map

LIMITS = (
    "A producer needs XADD on its models' lanes (the enqueue step runs it): it can also XADD entries that "
    "skip the enqueue step (no queue limit, no quota, any tenant field; workers dead-letter what they "
    "cannot decode), and XADD's MAXLEN/MINID options trim a lane as XTRIM would. ACLs cannot allow a "
    "command only inside a script, nor forbid some of its arguments.",
    "A producer reads its models' lanes (XRANGE, to see whether its queued request is still there), so it "
    "can read every queued request of those models, other tenants' prompts included.",
    "Response streams, cancel flags and gateway records are keyed by request id: a producer can read any "
    "response stream and cancel any request whose id it knows. Ids are random (UUID4) and no role may "
    "list keys (KEYS, SCAN).",
    "A producer writes its tenant counters and rate windows (the enqueue step does): it can reset them, "
    "so quotas bind the SDK and the gateway, not holders of Redis credentials.",
    "A worker writes every request's response stream and lease and extends gateway records' expiry: "
    "workers are trusted.",
)


@dataclass(frozen=True)
class Grant:
    """Commands allowed on keys (Redis patterns with their access: `~` read and write, `%R~` read,
    `%W~` write) and pub/sub channels; `why`: what sends them."""

    why: str
    commands: tuple[str, ...]
    keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()

    def rules(self) -> list[str]:
        return [*self.commands, *self.keys, *(f"&{c}" for c in self.channels)]


def glob_escape(text: str) -> str:
    """`text` as a literal in a Redis glob pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class Patterns:
    """The key patterns of keys.py, for every model (`pagedq:{*}:`) or for the named ones only."""

    def __init__(self, models: Sequence[str] = (), tenant: str | None = None) -> None:
        from producer_sdk.contract import keys

        p = keys.PREFIX
        prefixes = [keys.model_prefix(glob_escape(m)) for m in models] or [f"{p}:{{*}}:"]
        t = glob_escape(tenant) if tenant else "*"
        each = lambda suffix: tuple(f"{m}{suffix}" for m in prefixes)
        self.lanes = each("requests*")
        self.marker = each("req:*")
        self.config = each("config")
        self.heartbeats = each("heartbeats")
        self.worker_state = each("worker:*")
        self.wake = each("wake:*")
        self.dead = each("dead")
        self.queued = each("tenant_queued")
        self.rate = each(f"tenant:{t}:rate")
        self.tokens = each(f"tenant:{t}:tokens")
        self.control = each("control")  # a channel
        self.models = (keys.models(),)
        self.tenants = (keys.tenants(),)
        self.quota = (f"{p}:tenant:{t}:quota",)
        self.resp = (f"{p}:resp:*",)
        self.lease = (f"{p}:lease:*",)
        self.cancel = (f"{p}:cancel:*",)
        self.gw = (f"{p}:gw:*",)
        self.file = (f"{p}:file:*",)
        self.files = (f"{p}:files:*",)
        self.batch = (f"{p}:batch:*",)
        self.batches = (f"{p}:batches:*",)


def rw(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"~{k}" for g in groups for k in g)


def ro(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"%R~{k}" for g in groups for k in g)


def wo(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"%W~{k}" for g in groups for k in g)


def producer_grants(k: Patterns) -> list[Grant]:
    return [
        Grant("load the Lua steps, read Redis's clock (rate windows)", ("+script|load", "+time")),
        Grant(
            "the enqueue step (EVALSHA needs read and write access to every key it is given)",
            ("+evalsha",),
            rw(k.lanes, k.marker, k.config, k.queued, k.rate, k.tokens),
        ),
        Grant(
            "enqueue (XADD), queue limit (XLEN), is my entry still queued (XRANGE)",
            ("+xadd", "+xlen", "+xrange"),
            rw(k.lanes),
        ),
        Grant("the submitted marker: duplicate check and set", ("+exists", "+set"), rw(k.marker)),
        Grant("the queue limit the workers publish", ("+hget",), ro(k.config)),
        Grant("outstanding requests per tenant", ("+hget", "+hincrby"), rw(k.queued)),
        Grant("the tenant's request window", ("+hmget", "+hset", "+pexpire"), rw(k.rate)),
        Grant("the tenant's token window (the worker counts it)", ("+hmget",), ro(k.tokens)),
        Grant("the tenant's quota, read before each submit", ("+hmget",), ro(k.quota)),
        Grant(
            "read response streams, with the client's own wake stream in the same XREAD",
            ("+xread", "+xrange", "+xrevrange", "+exists"),
            ro(k.resp, k.wake),
        ),
        Grant("wake a blocked XREAD of this client", ("+xadd", "+pexpire"), rw(k.wake)),
        Grant("cancel: the request's cancel flag", ("+set",), wo(k.cancel)),
        Grant("cancel: tell the worker that runs it", ("+publish",), channels=k.control),
        Grant("served models", ("+zrange",), ro(k.models)),
        Grant("queue_stats: lanes and dead letters", ("+xlen",), ro(k.dead)),
        Grant("queue_stats: live workers (and prune those gone)", ("+zrange", "+zrem"), rw(k.heartbeats)),
        Grant("queue_stats: worker states", ("+mget",), ro(k.worker_state)),
    ]


def gateway_grants(k: Patterns) -> list[Grant]:
    return [
        *producer_grants(k),
        Grant("the gateway's request records", ("+set", "+get", "+del"), rw(k.gw)),
        Grant("files", ("+hset", "+hget", "+hmget", "+del"), rw(k.file)),
        Grant("file indexes", ("+zadd", "+zrem", "+zrevrange"), rw(k.files)),
        Grant("batches' atomic steps (EVAL: read and write access to its keys)", ("+eval",), rw(k.batch)),
        Grant(
            "batches: record, line results, lease",
            ("+hget", "+hset", "+hsetnx", "+hincrby", "+hgetall", "+hkeys", "+get", "+set", "+del"),
            rw(k.batch),
        ),
        Grant("batches: expiry of results and lease", ("+expire", "+pexpire"), rw(k.batch)),
        Grant(
            "batch indexes, active batches",
            ("+zadd", "+zrevrange", "+zrange", "+sadd", "+srem", "+smembers"),
            rw(k.batches),
        ),
        Grant("the model registry's live workers", ("+zrange",), ro(k.heartbeats)),
    ]


def worker_grants(k: Patterns) -> list[Grant]:
    return [
        Grant("load the Lua steps, Redis's clock, --wait-replicas", ("+script|load", "+time", "+wait")),
        Grant(
            "the acquire, publish, ack, drop and claim_own steps (EVALSHA: read and write access to their keys)",
            ("+evalsha",),
            rw(k.lanes, k.dead, k.queued, k.marker, k.tokens, k.resp, k.lease, k.gw),
        ),
        Grant(
            "lanes: consumer group, read, claim, ack and delete entries",
            (
                "+xgroup|create",
                "+xreadgroup",
                "+xautoclaim",
                "+xclaim",
                "+xack",
                "+xdel",
                "+xpending",
                "+xrange",
                "+xlen",
                "+xinfo|groups",
            ),
            rw(k.lanes),
        ),
        Grant("dead letters", ("+xadd",), rw(k.dead)),
        Grant("outstanding requests per tenant", ("+hincrby", "+hdel"), rw(k.queued)),
        Grant("tenants' token windows", ("+hmget", "+hset", "+pexpire"), rw(k.tokens)),
        Grant("submitted markers expire with the result", ("+exists", "+pexpire"), rw(k.marker)),
        Grant("limits producers read", ("+hset",), rw(k.config)),
        Grant("heartbeats", ("+zadd", "+zrem"), rw(k.heartbeats)),
        Grant("worker states", ("+set", "+del", "+exists"), rw(k.worker_state)),
        Grant("the served-model registry", ("+zadd", "+zremrangebyscore"), rw(k.models)),
        Grant(
            "response streams: read back, write events, expire",
            ("+xrange", "+xrevrange", "+xadd", "+exists", "+pexpire", "+pexpireat"),
            rw(k.resp),
        ),
        Grant("leases", ("+hmget", "+hset", "+pexpire", "+pexpireat"), rw(k.lease)),
        Grant("gateway records expire with their response stream", ("+pexpire", "+pexpireat"), rw(k.gw)),
        Grant("cancel flags", ("+exists",), ro(k.cancel)),
        Grant("tenants' fair-share weights", ("+hget",), ro(k.quota)),
        Grant("cancel notifications", ("+subscribe", "+unsubscribe"), channels=k.control),
    ]


def operator_grants(k: Patterns) -> list[Grant]:
    return [
        Grant("server stats (INFO), tenants' windows (TIME)", ("+info", "+time")),
        Grant(
            "lanes: length, groups, consumers, pending entries (not their payloads)",
            ("+xlen", "+xinfo|stream", "+xinfo|groups", "+xinfo|consumers", "+xpending"),
            ro(k.lanes),
        ),
        Grant("dead letters", ("+xlen", "+xrange", "+xrevrange", "+xinfo|stream"), ro(k.dead)),
        Grant("registry and heartbeats", ("+zrange", "+zscore", "+zcard"), ro(k.models, k.heartbeats)),
        Grant("worker states", ("+mget", "+get", "+pttl"), ro(k.worker_state)),
        Grant("limits the workers publish", ("+hget", "+hgetall"), ro(k.config)),
        Grant("tenants with a quota", ("+smembers",), ro(k.tenants)),
        Grant("quotas and use", ("+hget", "+hmget", "+hgetall"), ro(k.quota, k.queued, k.rate, k.tokens)),
    ]


GRANTS = {"producer": producer_grants, "gateway": gateway_grants, "worker": worker_grants, "operator": operator_grants}


def grants(role: str, *, models: Sequence[str] = (), tenant: str | None = None) -> list[Grant]:
    if role not in GRANTS:
        raise ValueError(f"unknown role {role!r}; choose from {ROLES}")
    if tenant and role != "producer":
        raise ValueError("--tenant narrows a producer's user only (the others serve every tenant)")
    return GRANTS[role](Patterns(models, tenant))


def rules(
    role: str,
    password: str | None,
    *,
    models: Sequence[str] = (),
    tenant: str | None = None,
    cluster: bool = False,
) -> list[str]:
    """The ACL rules of a role's user (what follows `ACL SETUSER <name>`): `reset` first, so that the
    same line updates an existing user; the password as its SHA-256 (`#...`). Without a password the
    user is written `off` (it cannot log in until one is set). Root permissions: connecting (and
    key-less commands); every keyed command in a selector with the keys it is for."""
    out = ["reset", "on" if password else "off"]
    if password:
        out.append("#" + hashlib.sha256(password.encode()).hexdigest())
    out += ["resetkeys", "resetchannels", "-@all", *CONNECTION, *(CLUSTER if cluster else ())]
    for g in grants(role, models=models, tenant=tenant):
        if not g.keys:  # key-less commands and channels: root permissions
            out += g.rules()
        else:
            out.append("(" + " ".join(g.rules()) + ")")
    return out


def _quote(rule: str) -> str:
    return f'"{rule}"' if any(c in rule for c in " {}\"'") else rule


def setuser_lines(users: dict[str, list[str]]) -> str:
    """`ACL SETUSER` commands, one a line, for `redis-cli` (quoted as its input needs)."""
    return "".join(f"ACL SETUSER {name} {' '.join(_quote(r) for r in rs)}\n" for name, rs in users.items())


def aclfile_lines(users: dict[str, list[str]]) -> str:
    """`user` lines of an ACL file (`aclfile` in redis.conf)."""
    return "".join(f"user {name} {' '.join(rs)}\n" for name, rs in users.items())


def add_acl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--role",
        action="append",
        choices=ROLES,
        help="a role to write a user for (repeat; default: all four)",
    )
    parser.add_argument(
        "--format",
        choices=("setuser", "aclfile"),
        default="setuser",
        help="`ACL SETUSER` lines (pipe them into redis-cli) or `user` lines of an aclfile (default: setuser)",
    )
    parser.add_argument(
        "--user",
        action="append",
        default=[],
        metavar="ROLE=NAME",
        help="the user name of a role (default: pagedq-<role>)",
    )
    parser.add_argument(
        "--model-name",
        action="append",
        default=[],
        help="give access to these models' keys only (repeat; default: every model)",
    )
    parser.add_argument(
        "--tenant",
        default=None,
        help="the producer submits as this tenant only (its quota and rate windows; one model per tenant "
        "isolates the queues too: docs/tenants.md)",
    )
    parser.add_argument("--redis-cluster", action="store_true", help="add what clients of a Redis Cluster need")
    return parser


def cmd_acl(args: argparse.Namespace) -> int:
    """Print the users; passwords from PAGEDQ_ACL_<ROLE>_PASSWORD (a user without one is `off`)."""
    names = dict(DEFAULT_USERS)
    for item in args.user:
        role, sep, name = item.partition("=")
        if not sep or role not in ROLES or not name or any(c.isspace() for c in name):
            print(f"error: --user takes ROLE=NAME with ROLE one of {', '.join(ROLES)}", file=sys.stderr)
            return 2
        names[role] = name
    users = {}
    try:
        for role in args.role or ROLES:
            password = os.environ.get(PASSWORD_ENV[role]) or None
            if password is None:
                print(f"note: {PASSWORD_ENV[role]} is not set: user {names[role]} is off", file=sys.stderr)
            users[names[role]] = rules(
                role, password, models=args.model_name, tenant=args.tenant, cluster=args.redis_cluster
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(aclfile_lines(users) if args.format == "aclfile" else setuser_lines(users))
    return 0
