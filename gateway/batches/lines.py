"""An input file's lines, checked one by one, and the output and error lines OpenAI writes.

A line is `{"custom_id", "method": "POST", "url", "body"}`. A wrong line (not JSON, a missing field,
another endpoint's url, a custom_id seen before, a model other than the batch's or one not served, a
body the endpoint refuses) becomes an error line and the batch goes on. The file as a whole is refused
(`FileProblem`: the batch fails) when it is empty, not JSONL at all, or has more than MAX_LINES lines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway import errors
from gateway.batches.endpoints import LINE_ENDPOINTS, PreparedLine
from gateway.json_body import too_deep

MAX_LINES = 50_000  # OpenAI's limit of requests per batch


class FileProblem(Exception):
    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.line = code, message, line

    def error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": "input_file_id", "line": self.line}


@dataclass
class Line:
    index: int  # 0-based line number in the file (blank lines count, and are skipped)
    custom_id: str | None
    prepared: PreparedLine | None = None
    problem: tuple[str, str] | None = None  # (code, message) of a malformed line
    refused: errors.ApiError | None = None  # the 4xx its body got

    @property
    def ok(self) -> bool:
        return self.prepared is not None


def parse(
    data: bytes, endpoint: str, tenant: str | None, check_model: Callable[[str], errors.ApiError | None]
) -> tuple[list[Line], str | None]:
    """The lines of a batch's input file, and the batch's model (its first good line's).
    `check_model(model)` is the refusal of a model (not served, not allowed), or None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileProblem("invalid_file", f"The input file is not UTF-8 text: {e}") from None
    raw_lines = [(i, s) for i, s in enumerate(text.split("\n")) if s.strip()]
    if not raw_lines:
        raise FileProblem("empty_file", "The input file has no lines.")
    if len(raw_lines) > MAX_LINES:
        raise FileProblem("too_many_requests", f"The input file has {len(raw_lines)} lines, more than {MAX_LINES}.")
    lines, seen, model, objects = [], set(), None, 0
    for index, raw in raw_lines:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested beyond the parser's reach
            obj = None
        if isinstance(obj, dict):
            objects += 1
        line = _check(index, obj, endpoint, seen)
        if line.problem is None and line.refused is None:
            try:
                try:
                    body = json.dumps(obj["body"]).encode()
                except RecursionError:
                    raise too_deep("body") from None
                prepared = LINE_ENDPOINTS[endpoint].prepare(body, tenant)
                model = model or prepared.model
                if prepared.model != model:
                    line.problem = (
                        "mismatched_model",
                        f"Line {index + 1}: model {prepared.model!r} differs from the batch's ({model!r}).",
                    )
                else:
                    line.refused = check_model(model)
                    line.prepared = prepared if line.refused is None else None
            except errors.ApiError as e:
                line.refused = e
        lines.append(line)
    if objects == 0:
        raise FileProblem("invalid_json_lines", "The input file is not JSONL: no line is a JSON object.", 1)
    return lines, model


def _check(index: int, obj: Any, endpoint: str, seen: set[str]) -> Line:
    n = index + 1
    if not isinstance(obj, dict):
        return Line(index, None, problem=("invalid_json_line", f"Line {n} is not a JSON object."))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Line(index, None, problem=("missing_custom_id", f"Line {n} has no custom_id (a string)."))
    line = Line(index, cid)
    if cid in seen:
        line.problem = ("duplicate_custom_id", f"Line {n}: custom_id {cid!r} appears on an earlier line.")
        return line
    seen.add(cid)
    if obj.get("method") != "POST":
        line.problem = ("invalid_method", f"Line {n}: method must be POST.")
    elif not isinstance(obj.get("url"), str):
        line.problem = ("missing_url", f"Line {n} has no url.")
    elif obj["url"] != endpoint:
        line.problem = ("mismatched_url", f"Line {n}: url {obj['url']!r} is not the batch's endpoint {endpoint!r}.")
    elif not isinstance(obj.get("body"), dict):
        line.problem = ("missing_body", f"Line {n} has no body (a JSON object).")
    return line


def line_id(batch_id: str, index: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}\x00{index}".encode()).hexdigest()[:32]


def output_line(batch_id: str, index: int, custom_id: str, request_id: str, body: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "id": line_id(batch_id, index),
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None,
        }
    ).encode()


def error_line(
    batch_id: str,
    line: Line,
    code: str,
    message: str,
    *,
    request_id: str | None = None,
    api: errors.ApiError | None = None,
) -> bytes:
    """An error-file line; with `api`, the HTTP answer the request got (its status and body)."""
    response = None
    if api is not None:
        response = {"status_code": api.status, "request_id": request_id, "body": json.loads(api.json())}
    return json.dumps(
        {
            "id": line_id(batch_id, line.index),
            "custom_id": line.custom_id,
            "response": response,
            "error": {"code": code, "message": message},
        }
    ).encode()


def refusal_line(batch_id: str, line: Line) -> bytes:
    """The error line of a line refused before it ran (malformed, or its body a 4xx)."""
    if line.problem is not None:
        return error_line(batch_id, line, *line.problem)
    assert line.refused is not None
    e = line.refused
    return error_line(batch_id, line, e.body.code or "invalid_request", e.body.message, api=e)
