"""Every Redis client pagedq creates (SDK, worker, gateway, CLI) comes from `redis_from_url`.

Connection settings are set explicitly, because redis-py's defaults changed between versions (6.x
retries every command three times and uses 5 s socket timeouts): a silent resend of a call that is
not idempotent, or a blocking read with no timeout on a half-open connection after a failover, must
not depend on which redis-py is installed. pagedq retries itself where retrying is safe (its writes
are idempotent by seq and by request id), so the client never does.

Besides redis-py's own URLs (``redis://``, ``rediss://``, ``unix://``) a Sentinel URL is accepted:

    redis+sentinel://[user:password@]host1[:port][,host2[:port],...]/service_name[/db]
        [?sentinel_username=...&sentinel_password=...]

The hosts are the Sentinels (port 26379 unless given); ``user:password`` authenticate to the primary
Sentinel names for `service_name` (as for ``redis://``); ``sentinel_username`` and
``sentinel_password`` authenticate to the Sentinels themselves. The client is redis-py's
``Sentinel.master_for``: each new connection asks the Sentinels for the current primary, and a
connection that meets ``READONLY`` (its server was demoted) is dropped and raises ConnectionError,
which pagedq's retries treat as transient, so the retried call reaches the new primary.

And a Redis Cluster URL, ``redis+cluster://host1:port,host2:port`` (``rediss+cluster://`` for TLS):
see `producer_sdk.contract.cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
import redis.utils
from redis.backoff import NoBackoff

from producer_sdk.contract.cluster import cluster_client, is_cluster_url, parse_cluster_url

KEEPALIVE_CHECK_S = 15  # redis-py PINGs a connection idle this long before using it again
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_TIMEOUT_S = 5.0  # a Sentinel answers at once; one that does not is skipped for the next
_SENTINEL_QUERY = ("sentinel_username", "sentinel_password")


def client_options(
    *, asyncio: bool, socket_timeout: float | None, connect_timeout: float | None = 5.0
) -> dict[str, Any]:
    """Keyword arguments for `redis_from_url` (redis.asyncio's client when `asyncio`).
    `socket_timeout` must exceed the longest BLOCK the client issues."""
    retry_class = redis.asyncio.retry.Retry if asyncio else redis.retry.Retry
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "socket_keepalive": True,
        "health_check_interval": KEEPALIVE_CHECK_S,
        "retry": retry_class(NoBackoff(), 0),
        "retry_on_timeout": False,
        "decode_responses": False,
    }


def connect(
    url: str, *, asyncio: bool, socket_timeout: float | None, connect_timeout: float | None = 5.0, **extra: Any
) -> Any:
    """A client for `url` with pagedq's connection settings (`client_options`), then `extra`."""
    options = client_options(asyncio=asyncio, socket_timeout=socket_timeout, connect_timeout=connect_timeout)
    options.update(extra)
    return redis_from_url(url, asyncio=asyncio, **options)


def redis_from_url(url: str, *, asyncio: bool, **options: Any) -> Any:
    """``Redis.from_url(url, **options)`` (redis.asyncio's when `asyncio`), for a Sentinel URL the
    client of the primary the Sentinels name, for a cluster URL redis-py's cluster client, their
    connections built with the same `options`. As with ``from_url``, what the URL says (credentials,
    db) wins over `options`."""
    if is_cluster_url(url):
        return cluster_client(parse_cluster_url(url), asyncio=asyncio, options=options)
    if is_sentinel_url(url):
        return _sentinel_master(parse_sentinel_url(url), asyncio=asyncio, options=options)
    cls = redis.asyncio.Redis if asyncio else redis.Redis
    return cls.from_url(url, **options)


# --- Sentinel URLs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service_name: str
    db: int | None = None  # None: not in the URL (a `db` option, else 0)
    username: str | None = None  # of the primary (and its replicas)
    password: str | None = None
    sentinel_username: str | None = None  # of the Sentinels
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[user:pass@]host[:port][,host[:port]...]/service[/db][?sentinel_...]``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL: {redact_url(url)}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    sentinels = [_host_port(h, url) for h in hosts.split(",")]
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"a Sentinel URL names /service_name[/db] after its hosts: {redact_url(url)}")
    try:
        db = int(parts[1]) if len(parts) == 2 else None
    except ValueError:
        raise ValueError(f"the db of a Sentinel URL is a number, not {parts[1]!r}") from None
    params = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(params) - set(_SENTINEL_QUERY))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} in a Sentinel URL (it takes {', '.join(_SENTINEL_QUERY)}; "
            "pass other redis-py options as keyword arguments)"
        )
    return SentinelURL(
        sentinels=sentinels,
        service_name=unquote(parts[0]),
        db=db,
        username=username,
        password=password,
        sentinel_username=params.get("sentinel_username", [None])[-1] or None,
        sentinel_password=params.get("sentinel_password", [None])[-1] or None,
    )


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"a Sentinel URL lists host[:port] of each Sentinel, comma-separated: {redact_url(url)}")
    try:
        return host, int(port) if port else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"bad Sentinel port {port!r} in {redact_url(url)}") from None


class _AsyncSentinelMaster(redis.asyncio.Redis):
    """The primary's client; closing it closes its connections to the Sentinels as well."""

    sentinel: redis.asyncio.sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel is not None:
            for node in self.sentinel.sentinels:
                await node.aclose()


class _SentinelMaster(redis.Redis):
    """The primary's client; closing it closes its connections to the Sentinels as well."""

    sentinel: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.sentinel is not None:
            for node in self.sentinel.sentinels:
                node.close()


def _sentinel_master(target: SentinelURL, *, asyncio: bool, options: dict[str, Any]) -> Any:
    master = dict(options)
    if target.db is not None:
        master["db"] = target.db
    if target.username is not None:
        master["username"] = target.username
    if target.password is not None:
        master["password"] = target.password
    timeout = options.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S
    nodes = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "socket_keepalive": True,
        "health_check_interval": options.get("health_check_interval", KEEPALIVE_CHECK_S),
        "retry": (redis.asyncio.retry.Retry if asyncio else redis.retry.Retry)(NoBackoff(), 0),
        "username": target.sentinel_username,
        "password": target.sentinel_password,
    }
    if asyncio:
        sentinel: Any = redis.asyncio.sentinel.Sentinel(target.sentinels, sentinel_kwargs=nodes, **master)
        client = sentinel.master_for(target.service_name, redis_class=_AsyncSentinelMaster)
    else:
        sentinel = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=nodes, **master)
        client = sentinel.master_for(target.service_name, redis_class=_SentinelMaster)
    client.sentinel = sentinel
    return client


# --- logging --------------------------------------------------------------------------------------


def reply_parser() -> str:
    """How redis-py parses Redis's replies here: "hiredis" (in C, when the hiredis package is installed:
    the worker and gateway extras bring it) or "python" (redis-py's own parser, in Python: more CPU a reply)."""
    return "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python"


def redact_url(url: str) -> str:
    """The URL without its passwords (the primary's, and a Sentinel URL's ``sentinel_password``), for logs."""
    scheme, sep, rest = url.partition("://")
    rest, q, query = rest.partition("?")
    creds, at, hostpart = rest.rpartition("@")
    if at and ":" in creds:
        rest = f"{creds.split(':', 1)[0]}:***@{hostpart}"
    if q:
        query = "&".join(_redact_param(p) for p in query.split("&"))
    return f"{scheme}{sep}{rest}{q}{query}"


def _redact_param(pair: str) -> str:
    key, eq, value = pair.partition("=")
    return f"{key}=***" if eq and value and "password" in key.lower() else pair
