"""`GET /openapi.json` (OpenAPI 3.1, the request schemas generated from the msgspec Structs the
gateway decodes with) and `GET /docs` (a self-contained page: no script from elsewhere)."""

from __future__ import annotations

import html
import json
from functools import lru_cache
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gateway.errors import ErrorBody
from gateway.schemas import ChatCompletionRequest, CompletionRequest

TITLE = "pagedq gateway (OpenAI-compatible)"
_ENDPOINTS = [
    ("post", "/v1/chat/completions", "Create a chat completion (stream=true: SSE, each event with an id)", "chat"),
    ("post", "/v1/completions", "Create a text completion", "completion"),
    ("get", "/v1/chat/completions/{id}", "The finished chat completion; ?stream=true resumes the stream", None),
    ("get", "/v1/completions/{id}", "The finished completion; ?stream=true resumes the stream", None),
    ("get", "/v1/models", "Models that live workers serve, with max_model_len", None),
    ("get", "/v1/models/{model}", "One served model", None),
    ("get", "/health", "The process is up", None),
    ("get", "/ready", "Redis answers", None),
    ("get", "/metrics", "Prometheus metrics", None),
]


@lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    (chat, completion, error), components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ErrorBody], ref_template="#/components/schemas/{name}"
    )
    bodies = {"chat": chat, "completion": completion}
    errors = {
        "description": "OpenAI's error shape",
        "content": {"application/json": {"schema": {"type": "object", "properties": {"error": error}}}},
    }
    paths: dict[str, Any] = {}
    for method, path, summary, body in _ENDPOINTS:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}, "default": errors}}
        if "{id}" in path:
            op["parameters"] = [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "stream", "in": "query", "schema": {"type": "boolean"}},
                {"name": "Last-Event-ID", "in": "header", "schema": {"type": "integer"}},
            ]
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
