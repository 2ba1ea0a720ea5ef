"""Hostile clients against a real gateway process (issue 48, item 3): a body sent a byte at a time is a
408 at --body-read-timeout while others are served (one abandoned mid-way a quiet 499); headers that
never end are a 408 at --header-read-timeout, too many header bytes a 431, a silent connection is
closed; a key over --max-streams-per-key gets a 429 with Retry-After until one of its streams closes; a
request beyond --limit-concurrency is a 503 while /health answers; a client that never reads its stream
is dropped at --send-timeout (a resumable request goes on); a loop of clients hanging up mid-stream
leaves no stream or connection open. Limits are small flags here, and every wait polls with a deadline."""

from __future__ import annotations

import json
import socket
import struct
import time
import uuid

import pytest

from tests.gateway.gateway_proc import SSE, GatewayProc, request
from tests.service.worker_proc import wait_until

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG = {"model": "default", "messages": HI, "max_tokens": 400, "ignore_eos": True, "stream": True}
LIMIT_S = 1.0  # the small timeouts of the `limited` gateway


@pytest.fixture(scope="module")
def limited(gw_worker, gw_redis_url):
    g = GatewayProc(
        gw_redis_url,
        "--header-read-timeout",
        str(LIMIT_S),
        "--body-read-timeout",
        str(LIMIT_S),
        "--send-timeout",
        str(LIMIT_S),
        "--write-buffer-bytes",
        "4096",
        "--max-header-bytes",
        "8192",
    ).start()
    yield g
    g.stop()


def closes(g: GatewayProc, reason: str) -> float:
    return g.metric("pagedq_gateway_limit_closes_total", reason=reason)


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the TCP window is small from the handshake on
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    return s


def read_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (EOF or reset), and when that was."""
    s.settimeout(timeout)
    out = b""
    try:
        while data := s.recv(65536):
            out += data
    except ConnectionResetError:
        pass
    return out, time.monotonic()


def head(method: str, path: str, body_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if body_length is not None:
        lines.append(f"Content-Length: {body_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def error_of(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers, error object) of one raw HTTP answer."""
    top, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)["error"]


def test_a_slow_body_is_408_at_the_timeout_and_others_are_served(limited):
    before = closes(limited, "body_timeout")
    body = json.dumps({"model": "default", "messages": HI, "max_tokens": 2}).encode()
    slow = connect(limited.port)
    slow.sendall(head("POST", CHAT, len(body)) + body[:5])
    t0 = time.monotonic()
    for byte in body[5:8]:  # a byte now and then, never the whole body
        slow.sendall(bytes([byte]))
        status, _, answer = request(limited.port, "POST", CHAT, {**json.loads(body), "stream": False})
        assert status == 200 and json.loads(answer)["choices"][0]["finish_reason"] == "length"
    raw, t_closed = read_until_closed(slow, 10)
    status, headers, err = error_of(raw)
    assert status == 408 and headers["connection"] == "close"
    assert (err["type"], err["code"]) == ("timeout", "body_timeout") and "--body-read-timeout" in err["message"]
    assert LIMIT_S <= t_closed - t0 < LIMIT_S + 5
    assert closes(limited, "body_timeout") == before + 1

    # A client that leaves mid-body is a 499 that nobody reads, not a 500 with a traceback in the log.
    failed = limited.metric("pagedq_gateway_requests_total", status="500")
    gone = limited.metric("pagedq_gateway_requests_total", status="499")
    leaving = connect(limited.port)
    leaving.sendall(head("POST", CHAT, len(body)) + body[:5])
    leaving.close()
    wait_until(lambda: limited.metric("pagedq_gateway_requests_total", status="499") == gone + 1, 10, "a 499")
    assert limited.metric("pagedq_gateway_requests_total", status="500") == failed


def test_headers_that_never_end_are_408_too_many_bytes_431_silence_closed(limited):
    before = {r: closes(limited, r) for r in ("header_timeout", "headers_too_large")}
    dribbling, silent = connect(limited.port), connect(limited.port)
    dribbling.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
    t0 = time.monotonic()
    raw, t_closed = read_until_closed(dribbling, 10)
    status, headers, err = error_of(raw)
    assert status == 408 and headers["connection"] == "close" and err["code"] == "header_timeout"
    assert LIMIT_S - 0.1 <= t_closed - t0 < LIMIT_S + 5
    assert read_until_closed(silent, 10)[0] == b""  # no byte of a request: closed without an answer

    big = connect(limited.port)
    big.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for _ in range(5):  # 10 KB of one header line, in pieces
        big.sendall(b"X-Big: " + b"a" * 2000 + b"\r\n")
    status, headers, err = error_of(read_until_closed(big, 10)[0])
    assert status == 431 and err["code"] == "headers_too_large" and "--max-header-bytes" in err["message"]
    assert request(limited.port, "GET", "/health", headers={"X-Fine": "a" * 2000})[0] == 200
    assert closes(limited, "header_timeout") == before["header_timeout"] + 2
    assert closes(limited, "headers_too_large") == before["headers_too_large"] + 1


def test_a_client_that_never_reads_is_dropped_at_the_send_timeout(limited):
    before = closes(limited, "send_timeout")
    rid = f"stall-{uuid.uuid4().hex[:12]}"
    # Large chunks (20 alternatives a token), a small receive window, never read.
    body = {**LONG, "max_tokens": 800, "logprobs": True, "top_logprobs": 20}
    data = json.dumps(body).encode()
    stalled = connect(limited.port, rcvbuf=4096)
    stalled.sendall(head("POST", CHAT, len(data))[:-2] + f"X-Request-Id: {rid}\r\n\r\n".encode() + data)
    wait_until(lambda: limited.metric("pagedq_gateway_stalled_connections") == 1, 30, "the write buffer to fill")
    wait_until(lambda: closes(limited, "send_timeout") == before + 1, 10, "the send timeout to drop it")
    wait_until(lambda: limited.metric("pagedq_gateway_open_streams") == 0, 10, "the stream to end")
    assert limited.metric("pagedq_gateway_stalled_connections") == 0
    with pytest.raises((ConnectionResetError, BrokenPipeError)):  # aborted: a reset, not a clean end
        stalled.settimeout(10)
        while stalled.recv(1 << 20):
            pass
        stalled.sendall(b"x")
    # Dropped like any client that left: its request (not resumable) was cancelled.
    status, _, answer = request(limited.port, "GET", f"{CHAT}/{rid}")
    assert status == 200 and json.loads(answer)["choices"][0]["finish_reason"] == "abort"


def test_a_resumable_stream_goes_on_after_its_reader_is_dropped(limited):
    rid = f"stall-{uuid.uuid4().hex[:12]}"
    body = {**LONG, "max_tokens": 120, "logprobs": True, "top_logprobs": 20}
    data = json.dumps(body).encode()
    stalled = connect(limited.port, rcvbuf=4096)
    extra = f"X-Request-Id: {rid}\r\npagedq-resumable: true\r\n\r\n".encode()
    stalled.sendall(head("POST", CHAT, len(data))[:-2] + extra + data)
    before = closes(limited, "send_timeout")
    wait_until(lambda: closes(limited, "send_timeout") >= before + 1, 30, "the send timeout to drop it")
    stalled.close()
    status, _, answer = request(limited.port, "GET", f"{CHAT}/{rid}")
    done = json.loads(answer)
    assert status == 200 and done["choices"][0]["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 120


def test_a_disconnect_loop_leaves_no_stream_or_connection_open(limited, gw_worker):
    cancels = limited.metric("pagedq_gateway_disconnect_cancels_total")
    for i in range(20):
        s = SSE(limited.port, "POST", CHAT, LONG)
        assert s.status == 200
        for n, _ in enumerate(s.events()):
            if n == 1:
                break
        if i % 2:  # half of them reset the connection rather than close it
            s.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    wait_until(lambda: limited.metric("pagedq_gateway_open_streams") == 0, 15, "every stream to end")
    wait_until(lambda: limited.metric("pagedq_gateway_open_connections") == 1, 15, "only /metrics's connection")
    wait_until(lambda: limited.metric("pagedq_gateway_disconnect_cancels_total") == cancels + 20, 15, "20 cancels")
    wait_until(lambda: gw_worker.metric("pagedq_num_requests_running") == 0, 15, "the worker to stop them all")


def test_a_key_over_its_stream_limit_is_429_until_one_closes(gw_worker, gw_redis_url, tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"sk-a": {"tenant": "team-a"}, "sk-b": {"tenant": "team-a"}}))
    g = GatewayProc(
        gw_redis_url, "--api-keys", str(key_file), "--max-streams-per-key", "2", "--limit-concurrency", "8"
    ).start()
    a, b = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
    held: list[SSE] = []
    try:
        held += [SSE(g.port, "POST", CHAT, LONG, headers=a) for _ in range(2)]
        assert [s.status for s in held] == [200, 200]
        refused = SSE(g.port, "POST", CHAT, LONG, headers=a)
        assert refused.status == 429 and int(refused.headers["retry-after"]) >= 1
        err = json.loads(refused.resp.read())["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "too_many_streams")
        rid = held[0].headers["pagedq-request-id"]
        resumed = SSE(g.port, "GET", f"{CHAT}/{rid}?stream=true", headers=a)  # a resumed stream counts too
        assert resumed.status == 429
        held.append(SSE(g.port, "POST", CHAT, LONG, headers=b))  # another key of the same tenant
        assert held[-1].status == 200
        assert g.metric("pagedq_gateway_streams_refused_total") == 2

        held.pop(0).close()

        def admitted() -> bool:
            s = SSE(g.port, "POST", CHAT, LONG, headers=a)
            if s.status == 200:
                held.append(s)
            return s.status == 200

        wait_until(admitted, 15, "a slot to come back to sk-a", interval=0.1)

        # Beyond --limit-concurrency (8 connections): a 503 in OpenAI's shape; /health still answers.
        idle = [connect(g.port) for _ in range(6)]
        try:
            status, headers, body = request(g.port, "GET", "/v1/models", headers=a)
            err = json.loads(body)["error"]
            assert status == 503 and headers["retry-after"] == "1" and err["code"] == "too_many_connections"
            assert request(g.port, "GET", "/health")[0] == 200
        finally:
            for s in idle:
                s.close()
        wait_until(lambda: request(g.port, "GET", "/v1/models", headers=a)[0] == 200, 10, "room again")
    finally:
        for s in held:
            s.close()
        g.stop()
