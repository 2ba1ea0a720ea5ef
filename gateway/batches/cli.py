"""`pagedq batch run IN.jsonl OUT.jsonl`: a batch file (OpenAI's batch input format) run straight on
the queue through the SDK, no gateway in between, like `vllm run-batch`.

Each line goes on the low lane under a request id derived from the batch id (`--batch-id`, default:
a digest of the input file) and its line number, and its result is stored in Redis
(`keys.batch_results`, kept RESULTS_TTL_S after the last one) as it arrives. Running the command again
with the same batch id (after a crash, or Ctrl-C) skips the lines stored and attaches to the requests
already submitted: no line runs twice. The output file is written at the end, in input order.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from gateway import errors
from gateway.batches import lines as batch_lines
from gateway.batches.endpoints import CHAT_URL, LINE_ENDPOINTS
from producer_sdk.batch import DEFAULT_WINDOW, BatchItem, batch_request_id
from producer_sdk.client import AsyncClient
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.errors import Cancelled
from producer_sdk.results import Completion

RESULTS_TTL_S = 7 * 24 * 3600  # a run's stored results, from its last one: how long it can be resumed


def add_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `batch run` subcommand under `parser`; returns the `run` parser (the caller sets `func`)."""
    sub = parser.add_subparsers(dest="batch_command", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="run a batch file (OpenAI's batch JSONL) and write the output lines")
    run.add_argument("input", help="input JSONL: one {custom_id, method, url, body} per line")
    run.add_argument("output", help="output JSONL (OpenAI's batch output lines; error lines too, unless --error-file)")
    run.add_argument("--redis-url", default=None, help="Redis of the queue (env PAGEDQ_REDIS_URL)")
    run.add_argument(
        "--batch-id",
        default=None,
        help="the run's id; run again with the same id to resume (default: a digest of the input file)",
    )
    run.add_argument("--error-file", default=None, help="write the failed lines here instead of into OUTPUT")
    run.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="requests in flight at once")
    run.add_argument("--tenant", default=None, help="the tenant the requests count under (its quota applies)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return run


def default_batch_id(data: bytes) -> str:
    return "run-" + hashlib.sha256(data).hexdigest()[:32]


def _endpoint(data: bytes) -> str:
    """The url of the file's first JSON line naming one (lines naming another then fail)."""
    for raw in data.splitlines():
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError, RecursionError):
            continue
        if isinstance(url, str):
            return url
    return CHAT_URL


def cmd_batch_run(args: argparse.Namespace, redis_url: str) -> int:
    try:
        return asyncio.run(run_file(args, redis_url))
    except KeyboardInterrupt:
        print("interrupted: run again with the same --batch-id to resume", file=sys.stderr)
        return 130


async def run_file(args: argparse.Namespace, redis_url: str) -> int:
    data = Path(args.input).read_bytes()
    batch_id = args.batch_id or default_batch_id(data)
    endpoint = _endpoint(data)
    if endpoint not in LINE_ENDPOINTS:
        print(f"error: batches of {endpoint} are not supported here", file=sys.stderr)
        return 2
    redis = connect(redis_url, asyncio=True, socket_timeout=30)
    try:
        served = {m.decode() for m in await redis.zrange(keys.models(), 0, -1)}

        def refuse(model: str) -> errors.ApiError | None:
            return None if model in served else errors.model_not_found(model, sorted(served))

        try:
            lines, model = batch_lines.parse(data, endpoint, args.tenant, refuse)
        except batch_lines.FileProblem as p:
            print(f"error: {args.input}: {p.message}", file=sys.stderr)
            return 2
        print(f"batch {batch_id}: {len(lines)} lines, {endpoint}, model {model}", file=sys.stderr)
        results = await _run(redis, batch_id, lines, model, args)
    finally:
        await redis.aclose()
    ok = [v[1:] for i, v in sorted(results.items()) if v[:1] == b"o"]
    failed = [v[1:] for i, v in sorted(results.items()) if v[:1] == b"e"]
    out = b"".join(x + b"\n" for x in ok)
    if args.error_file:
        Path(args.error_file).write_bytes(b"".join(x + b"\n" for x in failed))
    else:
        out += b"".join(x + b"\n" for x in failed)
    Path(args.output).write_bytes(out)
    print(f"batch {batch_id}: {len(ok)} completed, {len(failed)} failed", file=sys.stderr)
    return 0


async def _run(redis: Any, batch_id: str, lines: list[batch_lines.Line], model: str | None, args: Any) -> dict:
    results_key = keys.batch_results(batch_id)

    async def store(index: int, value: bytes) -> None:
        async with redis.pipeline(transaction=False) as p:
            p.hsetnx(results_key, index, value)
            p.expire(results_key, RESULTS_TTL_S)
            await p.execute()

    stored = {int(i) for i in await redis.hkeys(results_key)}
    for line in lines:
        if not line.ok and line.index not in stored:
            await store(line.index, b"e" + batch_lines.refusal_line(batch_id, line))
    todo = [line for line in lines if line.ok and line.index not in stored]
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(lines), initial=len(lines) - len(todo), desc="batch", unit="req", file=sys.stderr)
    if todo and model is not None:
        client = AsyncClient(redis, model=model, check_model=False, result_ttl_s=RESULTS_TTL_S)
        by_id = {line.custom_id: line for line in todo}
        items = [BatchItem(line.custom_id, line.prepared.submit, line.index) for line in todo]  # type: ignore[union-attr]
        async for custom_id, outcome in client.run_batch(items, batch_id=batch_id, window=args.window):
            line = by_id[custom_id]
            rid = batch_request_id(batch_id, line.index)
            p = line.prepared
            assert p is not None
            if isinstance(outcome, Completion):
                body = p.render(rid, outcome)
                value = b"o" + batch_lines.output_line(batch_id, line.index, custom_id, rid, body)
            elif isinstance(outcome, Cancelled):
                value = b"e" + batch_lines.error_line(
                    batch_id, line, "request_cancelled", "The request was cancelled.", request_id=rid
                )
            else:
                api = errors.from_sdk(outcome, param_of=p.param_of, failure_param=p.failure_param)
                value = b"e" + batch_lines.error_line(
                    batch_id, line, api.body.code or "error", api.body.message, request_id=rid, api=api
                )
            await store(line.index, value)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {int(k): v for k, v in (await redis.hgetall(results_key)).items()}
