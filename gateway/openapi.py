"""`GET /openapi.json` (OpenAPI 3.1, the request schemas generated from the msgspec Structs the
gateway decodes with) and `GET /docs` (a self-contained page: no script from elsewhere)."""

from __future__ import annotations

import html
import json
import re
from functools import lru_cache
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gateway.errors import ErrorBody
from gateway.responses.request import ResponsesRequest
from gateway.schemas import ChatCompletionRequest, CompletionRequest

_RESUME = (("stream", "query", "boolean"), ("Last-Event-ID", "header", "integer"))
PARAMS = {  # query and header parameters beyond the path's id
    ("get", "/v1/chat/completions/{id}"): _RESUME,
    ("get", "/v1/completions/{id}"): _RESUME,
    ("get", "/v1/responses/{id}"): (("stream", "query", "boolean"), ("starting_after", "query", "integer")),
    ("get", "/v1/responses/{id}/input_items"): (
        ("order", "query", "string"),
        ("after", "query", "string"),
        ("limit", "query", "integer"),
    ),
}
BATCH_BODY = {
    "type": "object",
    "properties": {
        "input_file_id": {"type": "string"},
        "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/responses"]},
        "completion_window": {"const": "24h"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["input_file_id", "endpoint", "completion_window"],
}
TITLE = "pagedq gateway (OpenAI-compatible)"
_ENDPOINTS = [
    ("post", "/v1/chat/completions", "Create a chat completion (stream=true: SSE, each event with an id)", "chat"),
    ("post", "/v1/completions", "Create a text completion", "completion"),
    ("get", "/v1/chat/completions/{id}", "The finished chat completion; ?stream=true resumes the stream", None),
    ("get", "/v1/completions/{id}", "The finished completion; ?stream=true resumes the stream", None),
    ("post", "/v1/responses", "Create a response (stream, background, previous_response_id)", "responses"),
    ("get", "/v1/responses/{id}", "A stored response; ?stream=true&starting_after=N resumes its events", None),
    ("delete", "/v1/responses/{id}", "Delete a stored response", None),
    ("post", "/v1/responses/{id}/cancel", "Cancel a background response", None),
    ("get", "/v1/responses/{id}/input_items", "The input items of a stored response", None),
    ("post", "/v1/files", "Upload a JSONL file (multipart: file, purpose=batch)", None),
    ("get", "/v1/files", "The caller's files", None),
    ("get", "/v1/files/{id}", "One file", None),
    ("get", "/v1/files/{id}/content", "A file's bytes", None),
    ("delete", "/v1/files/{id}", "Delete a file", None),
    ("post", "/v1/batches", "Create a batch from an uploaded file", "batch"),
    ("get", "/v1/batches", "The caller's batches (after, limit)", None),
    ("get", "/v1/batches/{id}", "One batch", None),
    ("post", "/v1/batches/{id}/cancel", "Cancel a batch", None),
    ("get", "/v1/models", "Models that live workers serve, with max_model_len", None),
    ("get", "/v1/models/{model}", "One served model", None),
    ("get", "/health", "The process is up", None),
    ("get", "/ready", "Redis answers", None),
    ("get", "/metrics", "Prometheus metrics", None),
]


@lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    (chat, completion, responses, error), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ResponsesRequest, ErrorBody],
        ref_template="#/components/schemas/{name}",
    )
    bodies = {"chat": chat, "completion": completion, "responses": responses, "batch": BATCH_BODY}
    errors = {
        "description": "OpenAI's error shape",
        "content": {"application/json": {"schema": {"type": "object", "properties": {"error": error}}}},
    }
    paths: dict[str, Any] = {}
    for method, path, summary, body in _ENDPOINTS:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}, "default": errors}}
        names = re.findall(r"{(\w+)}", path)
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
        params += [{"name": n, "in": where, "schema": {"type": t}} for n, where, t in PARAMS.get((method, path), ())]
        if params:
            op["parameters"] = params
        if body:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": bodies[body]}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }


async def openapi_json(request: Request) -> Response:
    return Response(msgspec.json.encode(document()), media_type="application/json")


async def docs_page(request: Request) -> Response:
    rows = "".join(
        f"<tr><td>{m.upper()}</td><td><code>{html.escape(p)}</code></td><td>{html.escape(s)}</td></tr>"
        for m, p, s, _ in _ENDPOINTS
    )
    schemas = html.escape(json.dumps(document()["components"]["schemas"], indent=2))
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{TITLE}</title></head><body>"
        f"<h1>{TITLE}</h1><p>The machine-readable description: <a href='/openapi.json'>/openapi.json</a>.</p>"
        f"<table border='1' cellpadding='4'>{rows}</table><h2>Request bodies</h2><pre>{schemas}</pre></body></html>"
    )
    return HTMLResponse(page)


def docs_routes() -> list[Route]:
    return [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs_page, methods=["GET"])]
