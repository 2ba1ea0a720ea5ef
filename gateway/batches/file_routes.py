"""POST /v1/files (multipart: `file`, `purpose`), GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}: OpenAI's Files API for batch input files.

An upload is read whole, up to `--max-file-bytes` of file content (larger: 413, param `file`) within
`--body-read-timeout` (408 after it), and its bytes stored in Redis (`files.FileStore`)."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import errors
from gateway.batches.files import BATCH, FileStore

MULTIPART_SLACK = 64 << 10  # the form's headers and boundaries around the file's bytes
UPLOAD_PURPOSES = (BATCH,)


class FileRoutes:
    def __init__(self, gw: Any, files: FileStore) -> None:
        self.gw, self.files = gw, files

    @property
    def limit(self) -> int:
        return self.gw.config.max_file_bytes

    def _too_large(self, size: str) -> errors.ApiError:
        e = errors.too_large(f"The file is {size}, more than the limit of {self.limit} bytes (--max-file-bytes).")
        e.body.param = "file"
        return e

    async def _body(self, request: Request) -> bytes:
        cap = self.limit + MULTIPART_SLACK
        return await self.gw.read_body(
            request,
            cap,
            lambda declared: self._too_large(f"about {declared} bytes" if declared else f"more than {cap} bytes"),
        )

    async def upload(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        body = await self._body(request)

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=1, max_fields=8, max_part_size=1 << 20)
        except (MultiPartException, HTTPException) as e:
            detail = getattr(e, "message", None) or getattr(e, "detail", "")
            raise errors.invalid(f"The body is not a multipart form: {detail}", "file") from None
        try:
            purpose = form.get("purpose")
            if not isinstance(purpose, str) or not purpose:
                raise errors.invalid("purpose is required", "purpose", "missing_required_parameter")
            if purpose not in UPLOAD_PURPOSES:
                raise errors.invalid(
                    f"Invalid purpose {purpose!r}: pagedq accepts files for {', '.join(UPLOAD_PURPOSES)} only.",
                    "purpose",
                )
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise errors.invalid("file is required (a multipart file part)", "file", "missing_required_parameter")
            data = await upload.read()
            if len(data) > self.limit:
                raise self._too_large(f"{len(data)} bytes")
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise errors.invalid("The file must be JSONL in UTF-8.", "file") from None
            obj = await self.files.create(caller.tenant, upload.filename or "upload.jsonl", purpose, data)
        finally:
            await form.close()
        return JSONResponse(obj)

    async def list(self, request: Request) -> Response:
        caller = self.gw.caller(request)
        data = await self.files.list(caller.tenant, purpose=request.query_params.get("purpose"))
        return JSONResponse({"object": "list", "data": data, "has_more": False})

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self.files.get(self.gw.caller(request).tenant, request.path_params["id"]))

    async def content(self, request: Request) -> Response:
        data = await self.files.content(self.gw.caller(request).tenant, request.path_params["id"])
        return Response(data, media_type="application/jsonl")

    async def delete(self, request: Request) -> Response:
        return JSONResponse(await self.files.delete(self.gw.caller(request).tenant, request.path_params["id"]))
