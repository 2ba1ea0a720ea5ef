"""What a batch does with one line of each endpoint: `LINE_ENDPOINTS[url].prepare(body, tenant)`
turns the line's `body` into the model, the SDK's submit arguments and the renderer of the answer.

One entry per endpoint a batch may name: chat and text completions through the gateway's own mapping
and renderer, /v1/responses through `gateway.responses.line`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway import errors, mapping
from gateway.render import Renderer
from gateway.responses import line as responses_line
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
        kind, model, token_ids = self.kind, mapped.model, mapped.token_ids

        def render(request_id: str, done: Completion) -> dict[str, Any]:
            return json.loads(Renderer(kind, request_id, model, int(time.time()), token_ids=token_ids).whole(done))

        return PreparedLine(
            model=model,
            submit=with_tenant(dict(mapped.submit), tenant),
            render=render,
            param_of=lambda f: mapping.param_of(mapped, f),
            failure_param=mapped.failure_param,
        )


class ResponsesEndpoint:
    """/v1/responses: the Responses API's mapping and Response object (`gateway.responses.line`)."""

    def prepare(self, body: bytes, tenant: str | None) -> PreparedLine:
        model, submit, render, param_of, failure_param = responses_line.prepare(body, tenant)
        return PreparedLine(model=model, submit=submit, render=render, param_of=param_of, failure_param=failure_param)


LINE_ENDPOINTS: dict[str, LineEndpoint] = {
    CHAT_URL: OpenAIEndpoint(mapping.CHAT),
    COMPLETIONS_URL: OpenAIEndpoint(mapping.COMPLETION),
    RESPONSES_URL: ResponsesEndpoint(),
}
