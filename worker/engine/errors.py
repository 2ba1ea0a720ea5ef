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


class GrammarError(RequestError):
    """A request's output constraint cannot be used: its grammar does not compile (`invalid_grammar`),
    did not compile within the timeout (`grammar_timeout`), or the model cannot satisfy it
    (`grammar_unsatisfiable`: every token it could write next is forbidden)."""

    code = "invalid_grammar"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ToolsUnsupported(RequestError):
    """A request with tools and tool_choice "auto" for a worker that knows no tool-call format for its
    model (a forced call, "required" or a named function, needs none: it is written as JSON)."""

    code = "tools_unsupported"


class StepFailed(RuntimeError):
    """The forward of one step raised. `request_ids` were in that step (one of them may be a poison
    request); `outputs` are what the step produced before it failed (deadlines, aborts). The engine is
    still usable once the caller `discard`s or retries those requests."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} requests: {cause!r}")
        self.request_ids = request_ids
        self.outputs = outputs
