"""OpenAI-compatible HTTP gateway onto the pagedq queue (`pagedq gateway`; extra `gateway`).

A producer like the SDK, in its own process: it turns `POST /v1/chat/completions` and
`POST /v1/completions` into pagedq requests and streams the answers back as OpenAI's objects and
SSE chunks. It is stateless (all state lives in Redis), so any number can run side by side, and a
stream one gateway began can be resumed on another. It imports the SDK and its HTTP stack
(Starlette, uvicorn, prometheus-client), never torch or `worker`.

    from gateway.app import create_app      # the ASGI app
    from gateway.server import run, main    # a process
"""
