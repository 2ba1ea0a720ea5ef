"""Typed errors of the producer SDK and of the wire protocol.

Every error the SDK raises on purpose derives from `PagedqError`. They pickle (arq ships a failed
job's exception back to the caller that way), keeping their attributes.

Protocol errors carry a short `code` that the worker also writes into `Error` events and dead
letters, so the producer and the operator read the same word for the same problem.
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class PagedqError(Exception):
    """Base of every pagedq error."""

    def __reduce__(self):
        # Exceptions pickle as cls(*args) by default, which breaks for keyword-only constructors.
        return _rebuild, (type(self), self.args, dict(self.__dict__))


# --- wire protocol --------------------------------------------------------------------------------


class ProtocolError(PagedqError):
    """A payload or an event broke the wire protocol.

    `code` is a stable short word (see the subclasses); `field` is the dotted path of the offending
    field when one is known (``sampling.top_p``), else None.
    """

    code = "protocol_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class MalformedPayload(ProtocolError):
    """The bytes are not (complete, valid) msgpack."""

    code = "malformed"


class SchemaError(ProtocolError):
    """Valid msgpack of the wrong shape: wrong type, missing field, unknown field, unknown event."""

    code = "schema"


class UnsupportedVersion(ProtocolError):
    """The request's protocol version `v` is not the one this side speaks."""

    code = "unsupported_version"

    def __init__(self, got: object, supported: int) -> None:
        super().__init__(
            f"request protocol version {got!r} is not supported: this side speaks version {supported} "
            f"(and reads the versions before it) (upgrade the older of producer_sdk and the worker)",
            field="v",
        )
        self.got = got
        self.supported = supported


class ValidationError(ProtocolError):
    """Well-formed request whose values break a rule or a limit (see `validation.Limits`)."""

    code = "invalid"


class PayloadTooLarge(ValidationError):
    code = "too_large"


# --- client side ----------------------------------------------------------------------------------


class ModelNotFound(PagedqError):
    """No worker has ever served this model name here (a typo, or workers not started yet).
    `served` lists the names that are served. Clients built with ``check_model=False`` skip the
    check (for deployments that enqueue before their workers start)."""

    def __init__(self, model: str, served: list[str]) -> None:
        names = ", ".join(served) if served else "none yet"
        super().__init__(
            f"model {model!r} is not served here (served: {names}); pass check_model=False to enqueue "
            "for workers that have not started yet"
        )
        self.model = model
        self.served = served


class QueueFull(PagedqError):
    """The model's queue (all priority lanes together) holds `length` outstanding requests, at or
    above its `limit`; `lane` is the lane this request was for.

    From `submit_many`, `handles` lists one entry per input: the Handle of a request that was
    enqueued, or None for one refused (the others went through).
    """

    def __init__(self, lane: str, length: int, limit: int, *, handles: list | None = None) -> None:
        super().__init__(f"queue full: {length} requests queued (limit {limit}); this one was for lane {lane!r}")
        self.lane = lane
        self.length = length
        self.limit = limit
        self.handles = handles


class RateLimited(PagedqError):
    """The request's tenant is over its quota: `quota` "max_queued" (outstanding requests of this
    model, `used` of `limit`), "requests_per_minute" (requests accepted in the current minute) or
    "tokens_per_minute" (tokens of the tenant's requests finished in the current minute).
    Nothing was enqueued; `retry_after` is when to try again, in seconds (for max_queued a hint:
    a slot frees when one of the tenant's requests finishes).

    From `submit_many`, `handles` lists one entry per input, as for QueueFull.
    """

    def __init__(
        self, tenant: str, quota: str, used: int, limit: int, retry_after: float, *, handles: list | None = None
    ) -> None:
        super().__init__(
            f"tenant {tenant!r} is over its quota {quota} ({used} of {limit}); retry in {retry_after:.3f}s"
        )
        self.tenant = tenant
        self.quota = quota
        self.used = used
        self.limit = limit
        self.retry_after = retry_after
        self.handles = handles


class RequestError(PagedqError):
    """An error about one request; `request_id` names it."""

    def __init__(self, message: str, *, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class _Ended(RequestError):
    """The request ended early; `completion` holds what it produced before (a Completion)."""

    def __init__(self, message: str, *, request_id: str, completion: Any = None) -> None:
        super().__init__(message, request_id=request_id)
        self.completion = completion


class Cancelled(_Ended):
    """The request was cancelled (finish_reason "abort")."""


class DeadlineExceeded(_Ended):
    """The worker stopped the request at its deadline (finish_reason "deadline")."""


class RequestFailed(RequestError):
    """The worker answered with an `Error` event (bad request, engine failure, dead-lettered...)."""

    def __init__(self, code: str, message: str, *, request_id: str) -> None:
        super().__init__(f"request {request_id} failed: [{code}] {message}", request_id=request_id)
        self.code = code
        self.error_message = message


class RequestTimeout(RequestError, TimeoutError):
    """A waiting call ran past its client-side `timeout=`; the request itself goes on (unless
    `cancel_on_timeout=True` was passed)."""

    def __init__(self, request_id: str, timeout: float, *, cancelled: bool = False) -> None:
        more = " (cancel sent)" if cancelled else " (the request keeps running)"
        super().__init__(f"request {request_id}: no result within {timeout:g}s{more}", request_id=request_id)
        self.timeout = timeout
        self.cancelled = cancelled


class RequestLost(RequestError):
    """Neither the request nor its response stream exists any more in Redis: the server lost its
    data (a restart without persistence) or the result expired (`result_ttl_s`)."""


class StreamDiverged(RequestError):
    """The response stream was restarted by a new attempt that did not see events this reader had
    already read (Redis lost writes in a failover): the text so far cannot be continued. Reading
    the request again from the start gives the new attempt's consistent output."""


class ConnectionLost(PagedqError, ConnectionError):
    """Redis stayed unreachable through every reconnect attempt."""

    def __init__(self, message: str, *, attempts: int, request_id: str | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.request_id = request_id


class AccessDenied(PagedqError):
    """Redis refused us: bad credentials or missing ACL permissions."""


class AuthenticationFailed(AccessDenied):
    """Wrong user name or password (or the ACL user is disabled)."""


class PermissionDenied(AccessDenied):
    """The ACL user may not run a command or touch a key/channel the SDK needs."""


__all__ = [
    "AccessDenied",
    "AuthenticationFailed",
    "Cancelled",
    "ConnectionLost",
    "DeadlineExceeded",
    "MalformedPayload",
    "ModelNotFound",
    "PagedqError",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProtocolError",
    "QueueFull",
    "RateLimited",
    "RequestError",
    "RequestFailed",
    "RequestLost",
    "RequestTimeout",
    "SchemaError",
    "StreamDiverged",
    "UnsupportedVersion",
    "ValidationError",
]
