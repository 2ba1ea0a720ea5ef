"""Redis Cluster: its URL, its client, and the few calls that differ from one node.

    redis+cluster://[user:password@]host1[:port][,host2[:port],...]      (rediss+cluster:// for TLS)

The hosts are startup nodes (any of the cluster's nodes; port 6379 unless given): the client asks them
for the slot map and follows MOVED and ASK redirects itself. Every pagedq step touches one hash slot
(see `keys`), so the same steps run here as on one node. What differs:

- It needs redis-py >= 6 (`MIN_REDIS_PY`). The client retries nothing on its own (as on one node:
  pagedq retries, its writes are idempotent); after a connection error it reloads the slot map on its
  next call, so the retried call reaches a promoted replica; a MOVED patches the slot map (no periodic
  full reset, which would close connections other tasks are using).
- WAIT covers the writes of one connection to one node: `queue_wait` sends it to the node that owns a
  key's slot, inside the pipeline that wrote there.
- Pub/sub: a PUBLISH reaches the subscribers of every node, so a subscriber connects to one node
  (`node_client`), and moves to another when that one fails.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
import redis.retry
from redis.backoff import NoBackoff

ASYNC_MAX_CONNECTIONS_PER_NODE = 1 << 16  # an asyncio cluster client's pool bound, a node

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
# Connection options a node client takes that the cluster client keeps for it (`node_client`).
_NODE_OPTIONS = "_pagedq_node_options"


@dataclass(frozen=True)
class ClusterURL:
    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterURL:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a redis+cluster:// URL: {_redacted(url)}")
    rest, _, query = rest.partition("?")
    if query:
        raise ValueError("a cluster URL takes no ?options (pass redis-py options as keyword arguments)")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"Redis Cluster has database 0 only, not /{path.strip('/')}: {_redacted(url)}")
    creds, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes = [_host_port(h, url) for h in hosts.split(",")]
    return ClusterURL(nodes=nodes, username=username, password=password, ssl=scheme.lower() == "rediss+cluster")


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"a cluster URL lists host[:port] of startup nodes, comma-separated: {_redacted(url)}")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port {port!r} in {_redacted(url)}") from None


def _redacted(url: str) -> str:
    """The URL without its credentials, for error messages."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


MIN_REDIS_PY = 6  # redis-py 5's cluster client, after a connection error, closes the connections other tasks
# are using (they then fail with AttributeErrors); redis-py 6 only marks them for reconnection.


def cluster_client(target: ClusterURL, *, asyncio: bool, options: dict[str, Any]) -> Any:
    """redis-py's cluster client (asyncio's when `asyncio`) for `target`, with pagedq's connection
    `options`; it retries nothing itself (whatever the redis-py version's defaults), unless `options`
    name a `retry` of their own. Needs redis-py >= 6."""
    if int(redis.__version__.split(".")[0]) < MIN_REDIS_PY:
        raise RuntimeError(
            f"Redis Cluster needs redis-py >= {MIN_REDIS_PY} (this is {redis.__version__}, whose cluster client is "
            "not safe for concurrent use after a connection error): pip install 'redis>=6'"
        )
    # (`retry_on_timeout`: redis-py 6 retries timeouts by what its Retry says, and warns about the flag)
    node_options = {k: v for k, v in options.items() if k not in ("retry", "retry_on_timeout")}
    if target.username is not None:
        node_options["username"] = target.username
    if target.password is not None:
        node_options["password"] = target.password
    if target.ssl:
        node_options["ssl"] = True
    cls = redis.asyncio.cluster.RedisCluster if asyncio else redis.cluster.RedisCluster
    node_cls = redis.asyncio.cluster.ClusterNode if asyncio else redis.cluster.ClusterNode
    retry = options.get("retry") or (redis.asyncio.retry.Retry if asyncio else redis.retry.Retry)(NoBackoff(), 0)
    accepted = set(inspect.signature(cls.__init__).parameters)
    # reinitialize_steps 0: a MOVED patches the slot map instead of, every few, closing every connection,
    # those other tasks are using included.
    kwargs: dict[str, Any] = {"retry": retry, "reinitialize_steps": 0}
    if asyncio and "max_connections" in accepted:
        # Its default, 100 connections a node, raises MaxConnectionsError past it, and every reader
        # blocked in an XREAD holds one: a gateway with 100 open streams (or a batch's lines in flight)
        # on one node would fail the next. A one-node pool has no such bound (2**31) either.
        kwargs["max_connections"] = ASYNC_MAX_CONNECTIONS_PER_NODE
    if asyncio:  # the asyncio client takes its connection options by name only
        kwargs.update({k: v for k, v in node_options.items() if k in accepted})
    else:
        kwargs.update(node_options)
    client = cls(startup_nodes=[node_cls(host, port) for host, port in target.nodes], **kwargs)
    setattr(client, _NODE_OPTIONS, node_options)
    return client


def is_cluster(client: Any) -> bool:
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def socket_timeout(client: Any) -> float | None:
    """The read timeout of a client's connections (one node, Sentinel or cluster)."""
    if is_cluster(client):
        return getattr(client, _NODE_OPTIONS, {}).get("socket_timeout")
    pool = getattr(client, "connection_pool", None)
    return pool.connection_kwargs.get("socket_timeout") if pool is not None else None


def decodes_responses(client: Any) -> bool:
    if is_cluster(client):
        return bool(getattr(client, _NODE_OPTIONS, {}).get("decode_responses"))
    pool = getattr(client, "connection_pool", None)
    return bool(pool is not None and pool.connection_kwargs.get("decode_responses"))


def node_of(client: Any, key: str) -> str:
    """The name of the node owning `key`'s slot ("" for a client of one node)."""
    return client.get_node_from_key(key).name if is_cluster(client) else ""


def queue_wait(pipe: Any, client: Any, key: str, replicas: int, timeout_ms: int) -> None:
    """Queue ``WAIT replicas timeout`` on a pipeline so that it covers the writes to `key` made
    earlier in the same pipeline: on a cluster, sent to the node owning the key's slot."""
    if is_cluster(client):
        pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=client.get_node_from_key(key))
    else:
        pipe.execute_command("WAIT", replicas, timeout_ms)


async def node_client(client: Any, key: str, attempt: int = 0) -> Any:
    """A plain asyncio client of one node of a cluster (the owner of `key`'s slot on the first attempt,
    then the others in turn), for what must stay on one connection (pub/sub). Close it after use."""
    if not is_cluster(client):
        raise TypeError("node_client needs a cluster client")
    if attempt:
        await client.initialize()  # the failed node may be gone: reload the slot map
    nodes = client.get_primaries() + client.get_replicas()
    first = client.get_node_from_key(key)
    order = [first] + [n for n in nodes if n.name != first.name]
    node = order[attempt % len(order)]
    options = {**getattr(client, _NODE_OPTIONS, {}), "retry": redis.asyncio.retry.Retry(NoBackoff(), 0)}
    return redis.asyncio.Redis(host=node.host, port=node.port, **options)
