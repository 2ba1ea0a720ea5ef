"""Which Redis errors a retry can cure: the one classification the SDK and the worker share."""

from __future__ import annotations

import re

import redis.exceptions as rex

# The connection itself failed: Redis is down, restarting, or unreachable.
CONNECTION_ERRORS = (rex.ConnectionError, rex.TimeoutError, OSError)

# Server replies that mean "not now" rather than "never": busy with a script, loading its data, a
# replica after a failover, persistence failing (MISCONF), out of memory under noeviction, a
# script cache emptied by a restart, a cluster reconfiguring (a failover, a slot migrating).
_TRANSIENT_CLASSES = (
    rex.ReadOnlyError,
    rex.BusyLoadingError,
    rex.NoScriptError,
    rex.OutOfMemoryError,
    rex.ClusterError,  # ClusterDownError, MasterDownError, and redis-py's "TTL exhausted" after redirects
    rex.TryAgainError,
    rex.SlotNotCoveredError,
)
_TRANSIENT_CODES = re.compile(
    r"\b(BUSY|LOADING|READONLY|MISCONF|OOM|TRYAGAIN|CLUSTERDOWN|NOSCRIPT|MASTERDOWN|NOREPLICAS|UNBLOCKED)\b"
)
# What redis-py's cluster client raises (not a RedisError) when no node it knows answers, or its
# nodes do not yet agree on the slot map: the cluster is failing over.
_CLUSTER_UNREACHABLE = ("cannot be connected", "could not agree", "slots are not covered", "no node")

REDIS_ERRORS = (rex.RedisError, rex.RedisClusterException)  # everything a redis-py call raises of its own

# redis-py's asyncio client can write to a connection that was closed under it (by the peer, or by a
# cluster client resetting its connections after a failover while another task used one) and then
# leak the transport's own error instead of a ConnectionError (redis-py issue #4287). Such an error is
# a dropped connection: a retry on a new one cures it.
_CLOSED_TRANSPORT = re.compile(
    r"'NoneType' object (has no attribute '(writelines|write|_add_writer|drain|read)'|is not callable)"
)
# What the retry loops catch, for `is_transient` to decide: redis-py's errors and those leaks.
RETRY_CANDIDATES = (*REDIS_ERRORS, AttributeError, TypeError)


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, CONNECTION_ERRORS) or _closed_transport(exc)


def _closed_transport(exc: BaseException) -> bool:
    return isinstance(exc, (AttributeError, TypeError)) and _CLOSED_TRANSPORT.search(str(exc)) is not None


def is_transient(exc: BaseException) -> bool:
    """A connection error, or a server error that goes away by itself (retry with backoff)."""
    if isinstance(exc, CONNECTION_ERRORS + _TRANSIENT_CLASSES) or _closed_transport(exc):
        return True
    if isinstance(exc, rex.ResponseError):
        # redis-py strips the code of the classes it knows; errors raised inside a script keep it.
        return _TRANSIENT_CODES.search(str(exc)[:200]) is not None or str(exc).startswith("command not allowed")
    if isinstance(exc, rex.RedisClusterException):
        return any(s in str(exc) for s in _CLUSTER_UNREACHABLE)
    return False
