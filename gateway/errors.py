"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the status
that says what went wrong, and the mapping from the SDK's typed errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec

from producer_sdk import errors as sdk

# Codes of a worker's error event that say the request itself is wrong (a 400, not a 500): the
# protocol's own, a prompt over the model's length, an output constraint that cannot be used, tools
# for a model without a tool-call format.
CLIENT_ERROR_CODES = (
    "invalid",
    "schema",
    "too_large",
    "malformed",
    "invalid_request",
    "prompt_too_long",
    "invalid_grammar",
    "grammar_timeout",
    "grammar_unsatisfiable",
    "tools_unsupported",
)


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class _Envelope(msgspec.Struct):
    error: ErrorBody


_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """An answer other than 200: status, OpenAI error fields, and extra headers (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def json(self) -> bytes:
        return _encoder.encode(_Envelope(self.body))

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.body.message!r}, param={self.body.param!r})"


def invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> ApiError:
    more = f": {why}" if why else ""
    return ApiError(400, f"`{param}` is not supported yet by pagedq{more}", param=param, code="unsupported_parameter")


def model_not_found(model: str, served: list[str]) -> ApiError:
    names = ", ".join(served) if served else "none"
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it (served: {names}).",
        param="model",
        code="model_not_found",
    )


def no_worker(model: str, draining: bool) -> ApiError:
    if draining:
        msg, code = f"Every worker serving `{model}` is shutting down; retry shortly.", "workers_draining"
    else:
        msg, code = f"No live worker serves `{model}` now; retry shortly.", "no_live_worker"
    return ApiError(503, msg, type="server_error", code=code, headers={"Retry-After": "1"})


def queue_full(exc: sdk.QueueFull, retry_after_s: int) -> ApiError:
    return ApiError(
        429,
        f"The queue of this model is full ({exc.length} requests queued, limit {exc.limit}); retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def rate_limited(exc: sdk.RateLimited) -> ApiError:
    """OpenAI's answer to a rate limit: 429, code rate_limit_exceeded, type "requests" (a request
    count, as OpenAI's RPM limits) or "tokens" (tokens_per_minute, as its TPM limits), `Retry-After`
    in whole seconds (rounded up) and `retry-after-ms` (which the `openai` client prefers)."""
    if exc.quota == "tokens_per_minute":  # what a request will use is unknown until it finished
        what, requested, kind = "tokens per min (TPM)", "", "tokens"
    else:
        what = "requests per min (RPM)" if exc.quota == "requests_per_minute" else "requests in the queue"
        requested, kind = ", Requested 1", "requests"
    return ApiError(
        429,
        f"Rate limit reached for tenant {exc.tenant} on {what}: Limit {exc.limit}, Used {exc.used}{requested}. "
        f"Please try again in {exc.retry_after:.3f}s.",
        type=kind,
        code="rate_limit_exceeded",
        headers={
            "Retry-After": str(max(1, math.ceil(exc.retry_after))),
            "retry-after-ms": str(max(1, round(exc.retry_after * 1000))),
        },
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, code: str = "not_found") -> ApiError:
    return ApiError(404, message, code=code)


def deadline(request_id: str) -> ApiError:
    return ApiError(504, f"Request {request_id} reached its deadline.", type="timeout", code="deadline_exceeded")


def idempotency_key_reused() -> ApiError:
    """The request id of this POST (its Idempotency-Key or X-Request-Id) names another request."""
    return ApiError(
        409,
        "This Idempotency-Key (or X-Request-Id) was used for a request to another endpoint; use a new one.",
        code="idempotency_key_reused",
    )


def too_large(message: str) -> ApiError:
    return ApiError(413, message, code="request_too_large")


# --- limits on what one client can hold (docs/gateway.md, "Limits") ------------------------------------
# Each answer that leaves part of the request unread closes its connection (`Connection: close`).
CLOSE = {"Connection": "close"}


def header_timeout(seconds: float) -> ApiError:
    return ApiError(
        408,
        f"The request's headers did not arrive within {seconds:g} s (--header-read-timeout).",
        type="timeout",
        code="header_timeout",
        headers=dict(CLOSE),
    )


class BodyTimeout(ApiError):
    """A body that did not all arrive within --body-read-timeout (counted apart in the metrics)."""


def body_timeout(seconds: float) -> BodyTimeout:
    return BodyTimeout(
        408,
        f"The request's body did not arrive within {seconds:g} s (--body-read-timeout).",
        type="timeout",
        code="body_timeout",
        headers=dict(CLOSE),
    )


def client_closed() -> ApiError:
    """The client left before its request was read (nginx's 499: nobody reads this answer)."""
    return ApiError(499, "The client closed the connection before its request arrived.", code="client_closed_request")


def headers_too_large(limit: int) -> ApiError:
    return ApiError(
        431,
        f"The request line and headers are larger than {limit} bytes (--max-header-bytes).",
        code="headers_too_large",
        headers=dict(CLOSE),
    )


def too_many_connections(limit: int) -> ApiError:
    return ApiError(
        503,
        f"The gateway has more than {limit} connections open (--limit-concurrency); retry shortly.",
        type="server_error",
        code="too_many_connections",
        headers={"Retry-After": "1", **CLOSE},
    )


def too_many_streams(limit: int, retry_after_s: int) -> ApiError:
    return ApiError(
        429,
        f"This API key has {limit} streams open on this gateway, its limit (--max-streams-per-key); "
        "close one or retry later.",
        type="rate_limit_error",
        code="too_many_streams",
        headers={"Retry-After": str(retry_after_s)},
    )


def redis_unavailable(exc: BaseException) -> ApiError:
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # some carry no message
    return ApiError(
        503,
        f"The queue is unreachable: {what}",
        type="server_error",
        code="redis_unavailable",
        headers={"Retry-After": "1"},
    )


def from_sdk(
    exc: BaseException,
    *,
    param_of: Callable[[str], str] | None = None,
    failure_param: Callable[[str], str | None] | None = None,
    retry_after_s: int = 1,
) -> ApiError:
    """The HTTP answer to an SDK error raised while submitting or reading a request.
    `param_of` maps a protocol field path (``sampling.top_p``) to the OpenAI parameter name;
    `failure_param` names the parameter a worker's error event is about, by its code."""
    if isinstance(exc, sdk.PayloadTooLarge):
        return too_large(exc.message)
    if isinstance(exc, sdk.ValidationError):
        param = param_of(exc.field) if param_of and exc.field else exc.field
        return invalid(exc.message, param)
    if isinstance(exc, sdk.QueueFull):
        return queue_full(exc, retry_after_s)
    if isinstance(exc, sdk.RateLimited):
        return rate_limited(exc)
    if isinstance(exc, sdk.ModelNotFound):
        return model_not_found(exc.model, exc.served)
    if isinstance(exc, sdk.DeadlineExceeded):
        return deadline(exc.request_id)
    if isinstance(exc, sdk.RequestLost):
        return not_found(str(exc), code="request_lost")
    if isinstance(exc, sdk.RequestFailed):
        if exc.code in CLIENT_ERROR_CODES:
            param = failure_param(exc.code) if failure_param else None
            return ApiError(400, exc.error_message, param=param, code=exc.code)
        return ApiError(500, exc.error_message, type="server_error", code=exc.code)
    if isinstance(exc, (sdk.ConnectionLost, sdk.AccessDenied)):
        return redis_unavailable(exc)
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error")
