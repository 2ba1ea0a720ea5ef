"""The hostile clients of `pagedq bench hostile` (ops/bench/hostile.py), each attack in its own process so
that its work lands on neither the gateway's nor the measuring client's event loop:

    python -m ops.bench.hostile_clients stall      --port P --keys K1,K2 --n 500 --path /v1/...?stream=true --fill 64
    python -m ops.bench.hostile_clients slowloris  --port P --keys K1 --n 200
    python -m ops.bench.hostile_clients disconnect --port P --keys K1,K2 --n 8 --model M

It prints JSON lines on stdout: {"event": "ready", ...} once the attack is in its steady state, and
{"event": "done", ...} with its counts after a line "stop" arrives on stdin (or stdin closes).

- stall: `n` connections (a 4 KiB receive buffer each) that send a streamed GET and never read a byte,
  the first `--fill` of them with the first key, the others spread over the rest;
- slowloris: `n` connections sending a byte a second, half inside their headers (an endless header
  line), half inside a POST body (its headers complete, Content-Length 100000); each one the gateway
  closes is counted (with the status it answered, if any) and opened again;
- disconnect: `n` loops that POST a streamed chat completion, read its first token and hang up (every
  other one with a reset), again and again, `--rate` hang-ups a second in all (0: as fast as they can).

Connection i uses key `keys[i % len(keys)]` (`Authorization: Bearer`), but for --fill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import sys
import time
from typing import Any

ATTACKS = ("stall", "slowloris", "disconnect")
SLOW_BODY_BYTES = 100_000


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def request_head(method: str, path: str, port: int, key: str, length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {key}"]
    if length is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def rst(writer: asyncio.StreamWriter) -> None:
    """Hang up with a reset (SO_LINGER 0), as a client killed mid-stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def until_stop() -> None:
    """Returns when stdin says "stop" (or closes)."""
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "stop":
            return


# --- stall: streams nobody reads ---------------------------------------------------------------------------


async def stall(args: argparse.Namespace) -> dict:
    socks = []
    failed = 0
    rest = args.keys[1:] or args.keys
    for i in range(args.n):
        key = args.keys[0] if i < args.fill else rest[(i - args.fill) % len(rest)]
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window throughout
        try:
            s.connect(("127.0.0.1", args.port))
            s.sendall(request_head("GET", args.path, args.port, key))
            socks.append(s)
        except OSError:
            failed += 1
            s.close()
    say("ready", opened=len(socks), failed=failed)
    await until_stop()
    for s in socks:
        s.close()
    return {"opened": len(socks), "failed": failed}


# --- slowloris: a byte a second ------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.opened = 0
        self.closed_by_server = 0
        self.statuses: dict[str, int] = {}
        self.held_s: list[float] = []  # connection opened -> closed by the server
        self.bytes_sent = 0
        self.errors: dict[str, int] = {}

    def error(self, e: BaseException) -> None:
        self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1


async def slow_connection(args: argparse.Namespace, i: int, tally: Tally, stop: asyncio.Event, open_now: list) -> None:
    key = args.keys[i % len(args.keys)]
    in_body = i % 2 == 1
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        except OSError as e:
            tally.error(e)
            await asyncio.sleep(1)
            continue
        tally.opened += 1
        open_now[0] += 1
        t0 = time.monotonic()
        if in_body:
            writer.write(request_head("POST", "/v1/chat/completions", args.port, key, SLOW_BODY_BYTES) + b'{"m')
        else:
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nX-a: ".encode())
        answer = b""
        try:
            while not stop.is_set():
                try:
                    data = await asyncio.wait_for(reader.read(65536), 1.0)
                except asyncio.TimeoutError:
                    writer.write(b"a")  # a byte a second
                    tally.bytes_sent += 1
                    continue
                if not data:  # the server closed it
                    tally.closed_by_server += 1
                    tally.held_s.append(time.monotonic() - t0)
                    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
                    tally.statuses[status] = tally.statuses.get(status, 0) + 1
                    break
                answer += data
        except (ConnectionError, OSError) as e:
            tally.closed_by_server += 1
            tally.held_s.append(time.monotonic() - t0)
            tally.statuses["reset"] = tally.statuses.get("reset", 0) + 1
            tally.error(e)
        finally:
            open_now[0] -= 1
            writer.close()


async def slowloris(args: argparse.Namespace) -> dict:
    tally, stop, open_now = Tally(), asyncio.Event(), [0]
    tasks = [asyncio.create_task(slow_connection(args, i, tally, stop, open_now)) for i in range(args.n)]
    deadline = time.monotonic() + 30
    while open_now[0] < args.n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    say("ready", open=open_now[0])
    await until_stop()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    held = sorted(tally.held_s)
    return {
        "connections": args.n,
        "opened": tally.opened,
        "closed_by_server": tally.closed_by_server,
        "statuses": tally.statuses,
        "held_s_min": held[0] if held else None,
        "held_s_max": held[-1] if held else None,
        "bytes_sent": tally.bytes_sent,
        "errors": tally.errors,
    }


# --- disconnect: hang up mid-stream, in a loop -------------------------------------------------------------


async def disconnect_loop(args: argparse.Namespace, i: int, counts: dict, stop: asyncio.Event) -> None:
    key = args.keys[i % len(args.keys)]
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": f"loop {i}: tell me a long story"}],
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
    }
    data = json.dumps(body).encode()
    n = 0
    pause = args.n / args.rate if args.rate > 0 else 0.0  # each loop's share of the rate
    next_at = time.monotonic()
    while not stop.is_set():
        n += 1
        next_at += pause
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
        except OSError:
            counts["connect_errors"] += 1
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(request_head("POST", "/v1/chat/completions", args.port, key, len(data)) + data)
            status = await asyncio.wait_for(reader.readline(), 30)
            if b" 200 " not in status:
                code = status.split(b" ", 2)[1].decode() if status.startswith(b"HTTP/") else "none"
                counts["refused"][code] = counts["refused"].get(code, 0) + 1
                await asyncio.sleep(0.05)
                continue
            frames = 0
            while frames < 2:  # the role chunk, then the first token
                line = await asyncio.wait_for(reader.readline(), 30)
                if not line:
                    break
                frames += line.startswith(b"data: ")
            counts["cycles"] += 1
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            counts["errors"][type(e).__name__] = counts["errors"].get(type(e).__name__, 0) + 1
        finally:
            if n % 2:
                rst(writer)
            else:
                writer.close()


async def disconnect(args: argparse.Namespace) -> dict:
    counts: dict[str, Any] = {"cycles": 0, "refused": {}, "errors": {}, "connect_errors": 0}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(disconnect_loop(args, i, counts, stop)) for i in range(args.n)]
    say("ready", loops=args.n)
    await until_stop()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"loops": args.n, **counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.bench.hostile_clients", description=__doc__)
    p.add_argument("attack", choices=ATTACKS)
    p.add_argument("--port", type=int, required=True, help="the gateway's port on 127.0.0.1")
    p.add_argument("--keys", type=lambda t: t.split(","), required=True, help="API keys, comma-separated")
    p.add_argument("--n", type=int, required=True, help="connections (stall, slowloris) or loops (disconnect)")
    p.add_argument("--path", default="", help="stall: the streamed GET's path and query")
    p.add_argument("--fill", type=int, default=0, help="stall: connections of the first key before the others")
    p.add_argument("--model", default="default", help="disconnect: the model to ask")
    p.add_argument("--rate", type=float, default=0.0, help="disconnect: hang-ups a second in all (0: no pause)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    result = asyncio.run({"stall": stall, "slowloris": slowloris, "disconnect": disconnect}[args.attack](args))
    say("done", attack=args.attack, seconds=time.monotonic() - t0, **result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
