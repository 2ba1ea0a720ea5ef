"""What a batch does with one line of each endpoint: `LINE_ENDPOINTS[url].prepare(body, tenant)`
turns the line's `body` into the model, the SDK's submit arguments and the renderer of the answer.

/v1/chat/completions and /v1/completions are registered here; /v1/responses is registered by
`gateway.responses` with `register_line_endpoint(RESPONSES_URL, ...)`. Until then a /v1/responses
batch fails each line with `endpoint_unsupported` (`unsupported_line`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway import errors, mapping
from gateway.render import Renderer
from producer_sdk.results import Completion

CHAT_URL, COMPLETIONS_URL, RESPONSES_URL = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BATCH_URLS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)  # what POST /v1/batches accepts as `endpoint`


@dataclass
class PreparedLine:
    """One line, ready to submit: its model, `AsyncClient.submit` keyword arguments, and how to turn
    its request id and Completion into the response body (a dict)."""

    model: str
    submit: dict[str, Any]
    render: Callable[[str, Completion], dict[str, Any]]
    param_of: Callable[[str], str] = field(default=lambda f: f)  # protocol field -> OpenAI parameter
    failure_param: Callable[[str], str | None] = field(default=lambda code: None)


class LineEndpoint(Protocol):
    def prepare(self, body: bytes, tenant: str | None) -> PreparedLine:
        """The line's body (JSON bytes) prepared; raises errors.ApiError (a 4xx) when it is wrong."""
        ...


def with_tenant(submit: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """The tenant of the batch on a line's request, as `Gateway.create` does: its quota and fair share
    apply, and the worker's metrics and logs name it."""
    if tenant is not None:
        submit["metadata"] = {**submit.get("metadata", {}), "tenant": tenant}
        submit["tenant"] = tenant
    return submit


class OpenAIEndpoint:
    """/v1/chat/completions or /v1/completions: the gateway's own mapping and renderer."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def prepare(self, body: bytes, tenant: str | None) -> PreparedLine:
        m = mapping.decode(self.kind, body)
        mapped = mapping.map_chat(m) if self.kind == mapping.CHAT else mapping.map_completion(m)
        if mapped.stream:
            raise errors.invalid("A batch line cannot stream: set stream to false or leave it out.", "stream")
        kind, model = self.kind, mapped.model

        def render(request_id: str, done: Completion) -> dict[str, Any]:
            return json.loads(Renderer(kind, request_id, model, int(time.time())).whole(done))

        return PreparedLine(
            model=model,
            submit=with_tenant(dict(mapped.submit), tenant),
            render=render,
            param_of=lambda f: mapping.param_of(mapped, f),
            failure_param=mapped.failure_param,
        )


LINE_ENDPOINTS: dict[str, LineEndpoint] = {
    CHAT_URL: OpenAIEndpoint(mapping.CHAT),
    COMPLETIONS_URL: OpenAIEndpoint(mapping.COMPLETION),
    # RESPONSES_URL: registered by gateway.responses (register_line_endpoint)
}


def register_line_endpoint(url: str, endpoint: LineEndpoint) -> None:
    """Make batches of `url` runnable (`url` must be one of BATCH_URLS)."""
    if url not in BATCH_URLS:
        raise ValueError(f"{url} is not a batch endpoint ({', '.join(BATCH_URLS)})")
    LINE_ENDPOINTS[url] = endpoint


def unsupported_line(url: str) -> errors.ApiError:
    """The error of each line of a batch whose endpoint has no LineEndpoint registered yet."""
    return errors.ApiError(
        400, f"Batches of {url} are not supported by this gateway yet.", param="url", code="endpoint_unsupported"
    )
