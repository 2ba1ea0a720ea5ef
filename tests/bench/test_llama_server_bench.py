"""llama-server as a system of `pagedq bench serve` (ops/bench/llama_server.py).

Without llama.cpp: the command line, the client against a replay of a real llama-server response,
and the system listed as unavailable (never a number) when no binary is found. With llama.cpp (its
binary and a SmolLM2 GGUF present): a few real requests through a real llama-server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from ops.bench import cli, llama_server
from ops.bench.serving import ReqResult, summarize
from ops.bench.uniform import cached_gguf, find_binary
from ops.bench.workloads import BenchRequest, Workload, make_workload

# The raw HTTP response of llama-server (llama.cpp from llama-cpp-python 0.3.36's vendor/llama.cpp,
# SmolLM2-135M bf16) to POST /completion {"prompt": CAPTURED_PROMPT, "n_predict": 4, "ignore_eos":
# true, "temperature": 0, "stream": true, "cache_prompt": false}: chunked transfer encoding, one SSE
# event per token, then the final event (stop: true, no tokens).
CAPTURED = (Path(__file__).parent / "llama_server_stream.http").read_bytes()
CAPTURED_PROMPT = [1500, 2000, 3000, 4000, 5000, 6000]


def _events() -> list[bytes]:
    return [line[6:] for line in CAPTURED.split(b"\n") if line.startswith(b"data: ")]


def test_the_capture_is_what_the_tests_assume():
    head, _, _ = CAPTURED.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and b"text/event-stream" in head
    events = [json.loads(e) for e in _events()]
    assert [e["tokens_predicted"] for e in events] == [1, 2, 3, 4, 4]
    assert [e["stop"] for e in events] == [False] * 4 + [True]
    assert all(e["tokens_evaluated"] == len(CAPTURED_PROMPT) for e in events)  # no BOS added to token ids


def test_events_become_chunks_counted_by_tokens_predicted():
    res = ReqResult(0, "chat", prompt_len=6, max_tokens=4)
    done = [llama_server.apply_event(res, e, now=10.0 + k) for k, e in enumerate(_events())]
    assert done == [False] * 4 + [True]
    assert res.chunks == [(10.0, 1), (11.0, 1), (12.0, 1), (13.0, 1)]  # the final event adds none
    assert res.t_first == 10.0 and res.tokens == 4 and res.error is None

    # A token ending inside a UTF-8 character is held back and comes with the next one: one chunk, 2 tokens.
    held = ReqResult(0, "chat", prompt_len=6, max_tokens=4)
    first, _, third, fourth, final = _events()
    for k, e in enumerate([first, third, fourth, final]):
        llama_server.apply_event(held, e, now=float(k))
    assert held.chunks == [(0.0, 1), (1.0, 2), (2.0, 1)] and held.ok


def test_a_prompt_evaluated_differently_and_errors_are_recorded():
    res = ReqResult(0, "chat", prompt_len=7, max_tokens=4)  # 7 sent, 6 evaluated
    for e in _events():
        llama_server.apply_event(res, e, now=1.0)
    assert res.error == "llama-server evaluated 6 prompt tokens, 7 sent" and not res.ok
    assert llama_server.apply_event(res, b"[DONE]", now=2.0) is False
    with pytest.raises(RuntimeError, match="context size"):
        llama_server.apply_event(res, b'{"error": {"code": 400, "message": "exceeds the context size"}}', 3.0)


async def _replay(response: bytes, piece: int, bodies: list[dict]) -> asyncio.Server:
    """A TCP server answering every request with `response`, written `piece` bytes at a time."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        bodies.append(json.loads(await reader.readexactly(length)))
        for k in range(0, len(response), piece):
            writer.write(response[k : k + piece])
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("piece", [len(CAPTURED), 7])
async def test_the_client_streams_a_replayed_llama_server_response(piece):
    bodies: list[dict] = []
    server = await _replay(CAPTURED, piece, bodies)
    port = server.sockets[0].getsockname()[1]
    reqs = [BenchRequest(CAPTURED_PROMPT, 4), BenchRequest([7] * 6, 4), BenchRequest([7] * 5, 4)]
    async with server:
        results, t0, samples = await llama_server.drive(port, reqs, [0.0, 0.0, 0.01], timeout=30)
    assert samples == []
    assert [r.ok for r in results] == [True, True, False]  # the third sent 5 prompt tokens; 6 came back
    assert "evaluated 6 prompt tokens, 5 sent" in results[2].error
    for r in results:
        assert r.tokens == 4 and len(r.chunks) == 4
        assert t0 <= r.t_submit < r.t_first <= r.t_end
    assert sorted(b["prompt"] for b in bodies) == sorted(r.prompt for r in reqs)
    assert {(b["n_predict"], b["ignore_eos"], b["temperature"], b["stream"], b["cache_prompt"]) for b in bodies} == {
        (4, True, 0.0, True, False)
    }
    s = summarize(results, slo_ttft=10.0, slo_tpot=10.0)
    assert s["ok"] == 2 and s["tokens_per_chunk"] == 1.0 and not math.isnan(s["ttft_s"]["p50"])


async def test_a_refused_connection_is_an_error_not_a_number():
    from worker.service.redis_proc import free_port

    (res,), _, _ = await llama_server.drive(free_port(), [BenchRequest([7] * 6, 4)], [0.0], timeout=5)
    assert res.error and "Connect" in res.error and res.tokens == 0
    assert summarize([res], 1.0, 1.0)["ok"] == 0


def test_server_command_and_slots():
    wl = make_workload("random", 64, seed=0, vocab_size=49152)
    small = Workload("random", 0, wl.requests[:24])
    slots, ctx = llama_server.slots_and_ctx([wl, small])
    longest = max(r.total_tokens for r in wl.requests)
    assert slots == 64 and ctx % 256 == 0 and longest + 16 <= ctx < longest + 16 + 256
    assert llama_server.slots_and_ctx([wl], max_seqs=16)[0] == 16
    cmd = llama_server.server_cmd("/x/llama-server", Path("/m.gguf"), port=1234, slots=4, ctx=512, threads=2)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"]
    flags = dict(itertools.pairwise(cmd))  # each option and the word after it
    assert flags["--port"] == "1234" and flags["-np"] == "4" and flags["-c"] == "2048"
    assert flags["-t"] == flags["-tb"] == "2"
    assert flags["--cache-ram"] == "0"
    assert {"--cont-batching", "--no-kv-unified", "--no-cache-prompt"} <= set(cmd)
    assert "-ctk" not in cmd and "-ctv" not in cmd  # llama.cpp's default f16 KV cache


def test_llama_server_is_opt_in():
    assert cli.serve_systems(None, None) == ["pagedq", "pagedq-nochunk", "hf-static"]
    assert cli.serve_systems(None, Path("/opt/llama.cpp")) == ["pagedq", "pagedq-nochunk", "hf-static", "llama-server"]
    assert cli.serve_systems(["llama-server", "pagedq"], None) == ["llama-server", "pagedq"]
    assert cli.serve_systems(["pagedq", "hf-cb"], Path("/opt/llama.cpp")) == ["pagedq"]  # --systems is exact


def test_without_a_binary_llama_server_is_unavailable(llama_dir, tmp_path, monkeypatch):
    """Listed but not found: no numbers, a reason, and the other systems measured as ever."""
    empty, bin_dir = tmp_path / "llama.cpp", tmp_path / "bin"
    empty.mkdir()
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(shutil.which("redis-server"))
    monkeypatch.setenv("PATH", str(bin_dir))  # redis-server, and no llama-server anywhere
    out = tmp_path / "results"
    argv = ["serve", "--quick", "--model", str(llama_dir), "--dtype", "float32", "--systems", "pagedq,llama-server"]
    argv += ["--requests", "4", "--serve-requests", "4", "--long-requests", "0", "--rates", "1"]
    argv += ["--llama-cpp-dir", str(empty), "--threads", "1", "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    res = json.loads((out / "latest" / "serve.json").read_text())
    assert list(res["systems"]) == ["pagedq", "llama-server"]
    assert res["systems"]["llama-server"] == {"unavailable": f"llama-server not in {empty}/build/bin nor on PATH"}
    pq = res["systems"]["pagedq"]
    assert [r["ok"] for r in pq["saturation"]["runs"]] == [4] and pq["saturation"]["req_s"] > 0
    assert res["saturation_rate_req_s"] == pq["saturation"]["req_s"]
    (point,) = pq["sweep"]
    assert point["ok"] == 4 and point["rate_req_s"] == res["saturation_rate_req_s"]
    summary = (out / "latest" / "summary.md").read_text()
    assert "| llama-server | n/a | n/a | - | unavailable: llama-server not in" in summary
    assert "| pagedq | 1x (" in summary and "llama-server |" not in summary.split("| pagedq | 1x (")[1]


def _real_llama() -> tuple[str, Path] | None:
    env = os.environ.get("PAGEDQ_LLAMA_CPP_DIR")
    binary = find_binary("llama-server", Path(env) if env else None)
    gguf = cached_gguf(Path("SmolLM2-135M-Instruct"), "float32")
    return (binary, gguf) if binary and gguf.exists() else None


@pytest.mark.skipif(
    _real_llama() is None, reason="needs llama-server (PATH or $PAGEDQ_LLAMA_CPP_DIR) and SmolLM2's f32 GGUF"
)
def test_real_llama_server_streams_every_token():
    binary, gguf = _real_llama()
    wl = make_workload("random", 3, seed=0, vocab_size=49152)
    reqs = [BenchRequest(r.prompt[:40], 6) for r in wl.requests]
    slots, ctx = llama_server.slots_and_ctx([Workload("x", 0, reqs)])
    srv = llama_server.LlamaServer(binary, gguf, slots=slots, ctx=ctx, threads=1)
    try:
        srv.start(timeout=120)
        results, _, _ = llama_server.run_load(srv.port, reqs, [0.0, 0.0, 0.2], timeout=120)
    finally:
        srv.stop()
    assert [r.error for r in results] == [None] * 3
    assert all(r.ok and r.tokens == 6 and r.ttft > 0 for r in results)
    assert summarize(results, 60.0, 60.0)["ok"] == 3


@pytest.mark.skipif(
    _real_llama() is None, reason="needs llama-server (PATH or $PAGEDQ_LLAMA_CPP_DIR) and SmolLM2's f32 GGUF"
)
def test_real_llama_server_through_bench_serve(smollm2_dir, tmp_path):
    binary, gguf = _real_llama()
    out = tmp_path / "results"
    argv = ["serve", "--model", str(smollm2_dir), "--dtype", "float32", "--systems", "llama-server"]
    argv += ["--requests", "4", "--serve-requests", "3", "--long-requests", "0", "--rates", "1", "--threads", "1"]
    argv += ["--llama-cpp-dir", str(Path(binary).parents[2]), "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    res = json.loads((out / "latest" / "serve.json").read_text())
    entry = res["systems"]["llama-server"]
    assert entry["gguf"] == str(gguf) and entry["slots"] == 4 and "error" not in entry
    (sat,) = entry["saturation"]["runs"]
    assert sat["ok"] == 4 and sat["errors"] == [] and res["saturation_rate_req_s"] == sat["req_s"] > 0
    (point,) = entry["sweep"]
    assert point["ok"] == 3 and point["ttft_s"]["p50"] > 0 and point["itl_s"]["p50"] > 0
    summary = (out / "latest" / "summary.md").read_text()
    assert "| llama-server | 1x (" in summary and "llama-server: llama.cpp's HTTP server" in summary
