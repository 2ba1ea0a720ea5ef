"""The "before" picture: a Redis worker that speaks pagedq's protocol but generates with transformers
static batching.

    python -m ops.bench.baseline_worker --model DIR --redis-url URL [--model-name default]
        [--consumer NAME] [--dtype float32] [--device cpu] [--threads 2] [--batch-size 16]

It is a consumer of the same group on the same lane streams, decodes entries with the protocol's
strict `decode_request`, and answers on the same response streams: `Started`, one `Tokens` event per
token, then `Finished`, with contiguous `seq`. Each step's events go out in one MULTI, so a request's
final event, the XACK and the XDEL of its entry are atomic. It heartbeats like a pagedq worker, model
registry included (so the SDK accepts its requests and its queue stats see it).

What makes it "before": it takes up to `--batch-size` queued requests, left-pads them into one batch and
runs `generate` until its longest request is done; a request arriving meanwhile waits for the whole batch.

Scope: greedy decoding only (temperature 0), n=1, `max_tokens`, `ignore_eos`, `stop_token_ids`, deadlines,
cancels. Other options (sampling, stop strings, penalties, logprobs) are refused with an `Error` event (code
"unsupported"), never silently ignored. No crash recovery: entries of a dead baseline worker stay pending.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec
import redis
from redis.exceptions import ResponseError

from producer_sdk.constants import REQUEST_ID_PATTERN
from producer_sdk.contract import keys
from producer_sdk.contract.keys import ENTRY_DATA_FIELD, ENTRY_ID_FIELD, EVENT_FIELD
from producer_sdk.errors import ProtocolError
from producer_sdk.protocol import (
    Error,
    Finished,
    GenerateRequest,
    Started,
    Timings,
    Tokens,
    Usage,
    WorkerState,
    encode_event,
)
from producer_sdk.request_codec import decode_request

STREAM_CAP = 100_000
DEFAULT_MAX_TOKENS = 256


def _ms(t: float) -> float:
    return round(t * 1000, 3)


@dataclass
class Row:
    """One request of the running batch."""

    request_id: str
    stream: str
    entry_id: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: frozenset[int]
    deadline: float | None
    created: float
    seq: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token: float | None = None
    finished: str | None = None

    @property
    def resp(self) -> str:
        return keys.response_stream(self.request_id)


class BaselineWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model_name = args.model_name
        self.consumer = args.consumer or f"baseline-{socket.gethostname()}-{os.getpid()}"
        self.group = keys.group(self.model_name)
        self.streams = [keys.lane_stream(self.model_name, lane) for lane in keys.LANES]
        self.redis = redis.Redis.from_url(args.redis_url)
        self.ttl_ms = args.result_ttl * 1000
        self.stopping = threading.Event()
        self.running = 0
        self.finished = 0
        self.started_ms = int(time.time() * 1000)

    # --- setup ------------------------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoTokenizer

        from ops.bench.hf_baselines import load_hf_model, static_generate

        torch.set_num_threads(self.args.threads)
        self.model = load_hf_model(self.args.model, self.args.dtype, self.args.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        self.eos_ids = self.model.pagedq_eos_ids
        static_generate(self.model, [[1, 2, 3, 4]], [2])  # warm-up

    def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def heartbeat_loop(self) -> None:
        r = redis.Redis.from_url(self.args.redis_url)
        while not self.stopping.is_set():
            now = int(time.time() * 1000)
            state = WorkerState(
                worker=self.consumer,
                host=socket.gethostname(),
                pid=os.getpid(),
                model=self.model_name,
                started_ms=self.started_ms,
                ts_ms=now,
                running=self.running,
                max_num_seqs=self.args.batch_size,
                requests_finished=self.finished,
            )
            try:
                r.zadd(keys.heartbeats(self.model_name), {self.consumer: now})
                r.zadd(keys.models(), {self.model_name: now})
                r.set(keys.worker_state(self.model_name, self.consumer), msgspec.json.encode(state), px=6000)
            except redis.RedisError:
                pass
            self.stopping.wait(2.0)
        try:
            r.zrem(keys.heartbeats(self.model_name), self.consumer)
            r.delete(keys.worker_state(self.model_name, self.consumer))
        except redis.RedisError:
            pass
        r.close()

    # --- intake -----------------------------------------------------------------------------------

    def pull(self) -> list[tuple[str, str, dict]]:
        """What is queued now, up to a batch (high lane first); block briefly when nothing is."""
        room, got = self.args.batch_size, []
        for stream in self.streams:
            if len(got) >= room:
                break
            got += self._entries(self.redis.xreadgroup(self.group, self.consumer, {stream: ">"}, count=room - len(got)))
        if got:
            return got
        reply = self.redis.xreadgroup(
            self.group, self.consumer, dict.fromkeys(self.streams, ">"), count=room, block=500
        )
        return self._entries(reply)

    @staticmethod
    def _entries(reply) -> list[tuple[str, str, dict]]:
        out = []
        for stream, items in reply or []:
            s = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in items:
                out.append((s, entry_id.decode() if isinstance(entry_id, bytes) else entry_id, fields or {}))
        return out

    def admit(self, entries: list[tuple[str, str, dict]]) -> list[Row]:
        rows = []
        for stream, entry_id, fields in entries:
            rid = fields.get(ENTRY_ID_FIELD.encode(), b"").decode(errors="replace")
            rid = rid if REQUEST_ID_PATTERN.fullmatch(rid) else None
            try:
                payload = fields.get(ENTRY_DATA_FIELD.encode())
                if payload is None:
                    raise ValueError(f"entry has no '{ENTRY_DATA_FIELD}' field")
                req = decode_request(payload)
            except (ProtocolError, ValueError) as e:
                self._answer(stream, entry_id, rid, Error(seq=0, code=getattr(e, "code", "malformed"), message=str(e)))
                continue
            problem = self._unsupported(req)
            if problem:
                self._answer(stream, entry_id, req.request_id, Error(seq=0, code="unsupported", message=problem))
                continue
            if self.redis.exists(keys.cancel_flag(req.request_id)):
                self._answer(stream, entry_id, req.request_id, Finished(seq=0, finish_reason="abort"))
                continue
            now = time.time()
            if req.deadline_ms is not None and req.deadline_ms / 1000 <= now:
                self._answer(stream, entry_id, req.request_id, Finished(seq=0, finish_reason="deadline"))
                continue
            prompt = self._prompt_ids(req)
            max_tokens = req.sampling.max_tokens or DEFAULT_MAX_TOKENS
            if not prompt or len(prompt) + max_tokens > self.max_len:
                msg = f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds the model's {self.max_len}"
                self._answer(stream, entry_id, req.request_id, Error(seq=0, code="invalid", message=msg))
                continue
            rows.append(
                Row(
                    req.request_id,
                    stream,
                    entry_id,
                    prompt,
                    max_tokens,
                    req.sampling.ignore_eos,
                    frozenset(req.sampling.stop_token_ids),
                    req.deadline_ms / 1000 if req.deadline_ms is not None else None,
                    req.created_ms / 1000 if req.created_ms else now,
                )
            )
        return rows

    @staticmethod
    def _unsupported(req: GenerateRequest) -> str | None:
        s = req.sampling
        # Unset fields: vLLM's values (the baseline reads no generation_config.json).
        temperature = 1.0 if s.temperature is None else s.temperature
        penalty = 1.0 if s.repetition_penalty is None else s.repetition_penalty
        checks = [
            (temperature > 0, f"temperature={temperature} (greedy only)"),
            (s.n != 1, f"n={s.n}"),
            (s.logprobs is not None, "logprobs"),
            (bool(s.stop), "stop strings"),
            (penalty != 1.0 or s.presence_penalty or s.frequency_penalty, "penalties"),
            (s.min_tokens > 0, "min_tokens"),
        ]
        bad = [why for cond, why in checks if cond]
        return "the static-batching baseline worker does not support: " + ", ".join(bad) if bad else None

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt, tokenize=False
            )
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return self.tokenizer(req.prompt).input_ids

    def _answer(self, stream: str, entry_id: str, request_id: str | None, event) -> None:
        """A final event (when addressable) with the ack and delete of the entry, in one MULTI."""
        pipe = self.redis.pipeline(transaction=True)
        if request_id is not None:
            resp = keys.response_stream(request_id)
            pipe.xadd(resp, {EVENT_FIELD: encode_event(event)}, maxlen=STREAM_CAP, approximate=True)
            pipe.pexpire(resp, self.ttl_ms)
        pipe.xack(stream, self.group, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    # --- a batch ----------------------------------------------------------------------------------

    def run_batch(self, rows: list[Row]) -> None:
        from ops.bench.hf_baselines import static_generate

        t_batch = time.time()
        pipe = self.redis.pipeline(transaction=True)
        for row in rows:
            pipe.xadd(
                row.resp,
                {EVENT_FIELD: encode_event(Started(seq=0, worker=self.consumer))},
                maxlen=STREAM_CAP,
                approximate=True,
            )
            pipe.pexpire(row.resp, self.ttl_ms)
            row.seq = 1
        pipe.execute()
        self.running = len(rows)
        steps = [0]

        def on_step(tokens: list[int]) -> list[bool]:
            steps[0] += 1
            self._step(rows, tokens, t_batch, check_cancels=steps[0] % 8 == 0)
            return [row.finished is not None for row in rows]

        static_generate(self.model, [r.prompt for r in rows], [r.max_tokens for r in rows], on_step=on_step)
        leftovers = [r for r in rows if r.finished is None]
        if leftovers:  # generate stopped early (cannot happen with EOS off): end them cleanly
            pipe = self.redis.pipeline(transaction=True)
            for row in leftovers:
                self._finish(pipe, row, "length", t_batch, time.time())
            pipe.execute()
        self.running = 0

    def _step(self, rows: list[Row], tokens: list[int], t_batch: float, *, check_cancels: bool) -> None:
        now = time.time()
        live = [r for r in rows if r.finished is None]
        cancelled: set[str] = set()
        if check_cancels and live:
            flags = self.redis.pipeline(transaction=False)
            for r in live:
                flags.exists(keys.cancel_flag(r.request_id))
            cancelled = {r.request_id for r, f in zip(live, flags.execute(), strict=True) if f}
        pipe = self.redis.pipeline(transaction=True)
        for row, tok in zip(rows, tokens, strict=True):
            if row.finished is not None:
                continue
            if row.request_id in cancelled or (row.deadline is not None and now >= row.deadline):
                self._finish(pipe, row, "abort" if row.request_id in cancelled else "deadline", t_batch, now)
                continue
            row.ids.append(tok)
            if row.first_token is None:
                row.first_token = now
            reason = None
            if (not row.ignore_eos and tok in self.eos_ids) or tok in row.stop_token_ids:
                reason = "stop"
            elif len(row.ids) >= row.max_tokens:
                reason = "length"
            pipe.xadd(
                row.resp,
                {EVENT_FIELD: encode_event(Tokens(seq=row.seq, token_ids=[tok], text=self._delta(row)))},
                maxlen=STREAM_CAP,
                approximate=True,
            )
            row.seq += 1
            if reason is not None:
                self._finish(pipe, row, reason, t_batch, now)
            else:
                pipe.pexpire(row.resp, self.ttl_ms)
        pipe.execute()

    def _delta(self, row: Row) -> str:
        """New text since the last event; a trailing incomplete UTF-8 sequence waits for its next token."""
        text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, row.text = text[len(row.text) :], text
        return delta

    def _finish(self, pipe, row: Row, reason: str, t_batch: float, now: float) -> None:
        row.finished = reason
        event = Finished(
            seq=row.seq,
            finish_reason=reason,
            finish_reasons=[reason],
            usage=Usage(prompt_tokens=len(row.prompt), completion_tokens=len(row.ids)),
            timings=Timings(
                queue_ms=_ms(max(t_batch - row.created, 0.0)),
                ttft_ms=_ms(row.first_token - row.created) if row.first_token else None,
                e2e_ms=_ms(now - row.created),
            ),
        )
        row.seq += 1
        pipe.xadd(row.resp, {EVENT_FIELD: encode_event(event)}, maxlen=STREAM_CAP, approximate=True)
        pipe.pexpire(row.resp, self.ttl_ms)
        pipe.xack(row.stream, self.group, row.entry_id)
        pipe.xdel(row.stream, row.entry_id)
        self.finished += 1

    # --- main loop --------------------------------------------------------------------------------

    def run(self) -> int:
        self.load()
        self.ensure_groups()
        beat = threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        print(
            f"baseline worker {self.consumer} serving pagedq:{self.model_name}:* (static batches of "
            f"{self.args.batch_size})",
            file=sys.stderr,
            flush=True,
        )
        while not self.stopping.is_set():
            entries = self.pull()
            if not entries:
                continue
            rows = self.admit(entries)
            if rows:
                self.run_batch(rows)
        beat.join(timeout=5)
        self.redis.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--redis-url", default=os.environ.get("PAGEDQ_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--model-name", default="default", help="key namespace pagedq:{name}:*")
    ap.add_argument("--consumer", default=None)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--result-ttl", type=int, default=86400, help="seconds a response stream is kept")
    args = ap.parse_args(argv)
    worker = BaselineWorker(args)
    for sig in (signal.SIGTERM, signal.SIGINT):  # finish the current batch, then leave
        signal.signal(sig, lambda *_: worker.stopping.set())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
