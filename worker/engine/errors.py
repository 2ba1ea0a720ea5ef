"""Typed errors of the engine (importable from `worker.engine.engine` too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.outputs import RequestOutput


class RequestError(ValueError):
    """A request cannot be accepted (empty or too long prompt, duplicate id, bad parameters)."""

    code = "invalid_request"


class PromptTooLong(RequestError):
    code = "prompt_too_long"


class StepFailed(RuntimeError):
    """The forward of one step raised. `request_ids` were in that step (one of them may be a poison
    request); `outputs` are what the step produced before it failed (deadlines, aborts). The engine is
    still usable once the caller `discard`s or retries those requests."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids
        self.outputs = outputs
