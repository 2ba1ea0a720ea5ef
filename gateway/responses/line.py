"""A batch line of /v1/responses (`gateway.batches`): the same mapping and rendering as a POST.

A line is answered once, into the batch's output file: it is not a stored response (no record, no
`previous_response_id`: lines run in any order), it neither streams nor runs in the background.
"""

from __future__ import annotations

import time
from typing import Any

from gateway import errors
from gateway.responses import request as rq
from gateway.responses.events import ResponseView, response_object, status_of
from producer_sdk.results import Completion


def prepare(body: bytes, tenant: str | None) -> tuple[str, dict[str, Any], Any, Any, Any]:
    """(model, submit arguments, render, param_of, failure_param) of one line; 4xx when it is wrong."""
    m = rq.map_request(rq.decode(body))
    for name, given in (("stream", m.stream), ("background", m.background), ("previous_response_id", m.previous)):
        if given:
            raise errors.invalid(f"A batch line cannot use {name}.", name)
    submit = dict(m.submit, messages=rq.messages_for(m, []))
    if tenant is not None:
        submit["metadata"] = {**submit.get("metadata", {}), "tenant": tenant}
        submit["tenant"] = tenant
    echo = dict(m.echo, store=False)

    def render(request_id: str, done: Completion) -> dict[str, Any]:
        view = ResponseView(id=rq.ID_PREFIX + request_id, created_at=int(time.time()), model=m.model, echo=echo)
        return response_object(view, status_of(done), done)

    param_of, failure_param = rq.api_error_mappers(m.constraint)
    return m.model, submit, render, param_of, failure_param
