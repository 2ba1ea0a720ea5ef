"""llama.cpp's `llama-server` as an opt-in system of `pagedq bench serve`.

    pagedq bench serve --llama-cpp-dir ~/llama.cpp                      # the default systems + llama-server
    pagedq bench serve --systems pagedq,llama-server --llama-cpp-dir DIR

Opt-in: it runs when --systems names it, or when --llama-cpp-dir is given without --systems (a binary
merely found on PATH adds nothing to the default run, so a machine's PATH never changes what `pagedq
bench` measures). The binary: --llama-cpp-dir's build/bin (or bin/), else `llama-server` on PATH.
The model: --gguf, else a GGUF of the same weights in the bench's --dtype (float32 -> f32, bfloat16
-> bf16) from the pagedq cache, converted there once by --llama-cpp-dir's `convert_hf_to_gguf.py`
(ops/bench/uniform.py). Without a binary or a GGUF the system is listed as unavailable, with why; it
is never an error and never a number.

The server: `llama-server -m GGUF -np SLOTS -c SLOTS*CTX --cont-batching -t/-tb THREADS`, with one
slot per request of the largest workload (capped at pagedq's max_num_seqs, 256 unless --engine-arg
says otherwise), so every request runs at once as in pagedq, whose KV pool holds them all; CTX: the
longest request + 16, rounded up to 256. Per-slot KV streams (--no-kv-unified). The KV cache keeps
llama.cpp's default type, f16, as in the uniform bench (pagedq's is in --dtype): on this project's
2-core bf16 machine, 24 requests of the `random` workload ran at 207 output tok/s with it and at 172
with a bf16 cache (-ctk/-ctv bf16; one run each), so matching pagedq's KV dtype would handicap
llama.cpp. Off, as pagedq's prefix caching is off in this benchmark: prompt caching
(--no-cache-prompt, and `cache_prompt: false` per request) and the host-memory prompt cache
(--cache-ram 0); --cache-reuse stays at its default 0. Sampling: llama.cpp's default sampler chain at
temperature 0 (greedy); reduced to the temperature sampler alone it was slower (about 480 against
650 tok/s, 64 short requests).

The client: the SAME requests (token-id prompts, `/completion` with n_predict = max_tokens,
ignore_eos, temperature 0, stream) over HTTP with the asyncio SSE client of gateway_proc.py, one
connection per request. Each chunk's tokens: the growth of its `tokens_predicted` (llama-server holds
back a token that ends inside a UTF-8 character, so one chunk can carry two). A request whose
`tokens_evaluated` differs from the prompt sent (a BOS added, say) is recorded as an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from ops.bench.common import REPO, child_env, stop_process
from ops.bench.gateway_proc import SSEStream
from ops.bench.serving import ReqResult
from ops.bench.uniform import GGUF_TYPES, cached_gguf, convert_gguf, find_binary
from ops.bench.workloads import BenchRequest, Workload

SYSTEM = "llama-server"
CTX_PAD = 256  # llama.cpp pads a slot's context to this


# --- what to run ---------------------------------------------------------------------------------------


def slots_and_ctx(workloads: list[Workload], max_seqs: int = 256) -> tuple[int, int]:
    """Slots (one per request of the largest workload, at most `max_seqs`) and the context of one slot."""
    slots = max(1, min(max_seqs, max(len(w) for w in workloads)))
    longest = max((r.total_tokens for w in workloads for r in w.requests), default=1)
    return slots, -(-(longest + 16) // CTX_PAD) * CTX_PAD


def server_cmd(binary: str, gguf: Path, *, port: int, slots: int, ctx: int, threads: int) -> list[str]:
    return [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx),
        "--cont-batching",
        "--no-kv-unified",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--no-cache-prompt",
        "--cache-ram",
        "0",
        "--no-webui",
    ]


def locate(args: argparse.Namespace, model_dir: Path) -> tuple[str, Path] | str:
    """(binary, GGUF), or why llama-server cannot run here."""
    llama_dir = getattr(args, "llama_cpp_dir", None)
    binary = find_binary("llama-server", llama_dir)
    if binary is None:
        where = f"not in {llama_dir}/build/bin nor on PATH" if llama_dir else "not on PATH (give --llama-cpp-dir)"
        return f"llama-server {where}"
    if getattr(args, "gguf", None):
        gguf = Path(args.gguf)
        return (binary, gguf) if gguf.is_file() else f"--gguf {gguf}: no such file"
    if args.dtype not in GGUF_TYPES:
        return f"no GGUF type for dtype {args.dtype}"
    gguf = cached_gguf(model_dir, args.dtype)
    if gguf.exists():
        return binary, gguf
    if llama_dir is None:
        return f"no GGUF at {gguf} (give --gguf, or --llama-cpp-dir to convert the model)"
    try:
        return binary, convert_gguf(model_dir, args.dtype, llama_dir)
    except SystemExit as e:  # convert_gguf's message for the CLI; here it is only a reason
        return f"GGUF conversion failed: {str(e)[-300:]}"


# --- the server process ----------------------------------------------------------------------------------


class LlamaServer:
    """A llama-server process, ready once GET /health answers 200."""

    def __init__(self, binary: str, gguf: Path, *, slots: int, ctx: int, threads: int) -> None:
        from worker.service.redis_proc import free_port

        self.port = free_port()
        self.threads = threads
        self.cmd = server_cmd(binary, gguf, port=self.port, slots=slots, ctx=ctx, threads=threads)
        self.log_path = Path(tempfile.mkstemp(prefix="pagedq-bench-llama-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> LlamaServer:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=child_env(self.threads), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:  # refused, or 503 while the model loads
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"llama-server not ready within {timeout:.0f}s:\n{self.log()}")

    def stop(self) -> None:
        stop_process(self.proc, getattr(self, "_log", None))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


# --- the client -----------------------------------------------------------------------------------------


def request_body(r: BenchRequest) -> dict:
    return {
        "prompt": list(r.prompt),
        "n_predict": r.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "cache_prompt": False,
    }


def apply_event(res: ReqResult, data: bytes, now: float) -> bool:
    """Record one SSE `data:` payload of /completion into `res`; True once the final one came."""
    try:
        ev = json.loads(data)
    except ValueError:
        return False  # not an event of ours ("[DONE]" on the OpenAI routes)
    if "error" in ev:
        err = ev["error"]
        raise RuntimeError(f"llama-server: {err.get('message', err) if isinstance(err, dict) else err}")
    new = int(ev.get("tokens_predicted", 0)) - res.tokens
    if new > 0:
        if not res.chunks:
            res.t_first = now
        res.chunks.append((now, new))
    if not ev.get("stop"):
        return False
    evaluated = ev.get("tokens_evaluated")
    if evaluated is not None and evaluated != res.prompt_len:
        res.error = f"llama-server evaluated {evaluated} prompt tokens, {res.prompt_len} sent"
    return True


async def drive(
    port: int, reqs: list[BenchRequest], arrivals: list[float], *, timeout: float
) -> tuple[list[ReqResult], float, list[dict]]:
    """Send `reqs` at `arrivals` (seconds from start) and stream them back: `serving.drive`'s results."""
    results = [ReqResult(i, r.kind, len(r.prompt), r.max_tokens) for i, r in enumerate(reqs)]
    t0 = time.perf_counter()

    async def stream(res: ReqResult, r: BenchRequest) -> None:
        s = SSEStream(port, "/completion", request_body(r))
        try:
            await s.open()
            async for data in s.events():
                if apply_event(res, data, time.perf_counter()):
                    break
        finally:
            s.close()

    async def one(i: int) -> None:
        res, r = results[i], reqs[i]
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        res.t_submit = time.perf_counter()
        try:
            await asyncio.wait_for(stream(res, r), timeout)
        except Exception as e:  # recorded, the run goes on
            res.error = f"{type(e).__name__}: {e}"
        res.t_end = time.perf_counter()
        if math.isnan(res.t_first) and res.error is None:
            res.error = "no token streamed"

    await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return results, t0, []


def run_load(
    port: int, reqs: list[BenchRequest], arrivals: list[float], *, timeout: float
) -> tuple[list[ReqResult], float, list[dict]]:
    return asyncio.run(drive(port, reqs, arrivals, timeout=timeout))
