"""The HTTP protocol the gateway serves with: uvicorn's own (httptools when installed, else h11) with
limits on what one connection can hold, for clients that never finish sending a request or never read
their answer (docs/gateway.md, "Limits"):

- a request's line and headers must arrive within `header_read_timeout_s` of the connection opening or
  of its previous answer (uvicorn has no such timeout: its keep-alive timer starts only after an answer
  and stops at the next byte), and be at most `max_header_bytes` long (httptools has no limit of its
  own; h11 gets this one as its `h11_max_incomplete_event_size`);
- the transport's write buffer takes no more of an answer once it holds `write_buffer_bytes`, nor does
  the socket's (`cap_write_buffers`): uvicorn's `send` waits for them to drain, so the SSE pump stops
  reading Redis too; a connection whose buffer stays full for `send_timeout_s`, or still holds a
  finished answer that long, is dropped with its buffer (a client that never reads a stream holds those
  buffers and about one frame, for that long);
- a request arriving while more than `limit_concurrency` connections are open is a 503 (uvicorn's own
  limit answers in plain text, and refuses /health too);
- a connection closed after an answer lingers (`_linger`): a client still sending reads its answer
  rather than a reset.

A body's deadline is the app's (`json_body.read_capped`): only the app knows when it reads one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from gateway import errors
from gateway.metrics import GatewayMetrics

# Answered however many connections are open: probes and scrapes must see a gateway under load.
EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics"})
LINGER_S = 1.0  # after an answer that ends its connection, how long what the client sends is dropped


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one connection (0 or None: none); `GatewayConfig` holds them as flags."""

    header_read_timeout_s: float | None = None
    max_header_bytes: int = 0
    send_timeout_s: float | None = None
    write_buffer_bytes: int = 0  # 0: the transport's own high-water mark
    limit_concurrency: int | None = None


def raw_response(e: errors.ApiError) -> bytes:
    """An error answer as bytes on the wire, for the answers written outside any request's ASGI cycle."""
    body = e.json()
    lines = [f"HTTP/1.1 {e.status} {HTTPStatus(e.status).phrase}", "content-type: application/json"]
    lines += [f"content-length: {len(body)}", *(f"{k.lower()}: {v}" for k, v in e.headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def cap_write_buffers(transport: Any, n: int) -> None:
    """At most about 3n bytes of answers wait for one client: n in the transport's buffer (its high-water
    mark: uvicorn's `send` waits below it) and the kernel's send buffer (SO_SNDBUF n, which Linux doubles;
    left alone, it grows to net.ipv4.tcp_wmem's maximum, 4 MiB by default, for a client that never reads)."""
    transport.set_write_buffer_limits(high=n)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, n)


def reset(transport: Any) -> None:
    """Close at once, unsent bytes dropped: the client gets a reset (SO_LINGER 0), and the kernel keeps no
    orphaned socket trying to deliver them to a client that does not read."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _LingeringClose:
    """The transport as a request's cycle sees it: its close() (uvicorn's after an answer with
    `Connection: close`, a 408 for a body too slow, a 503 over --limit-concurrency) lingers."""

    def __init__(self, transport: Any, linger: Any) -> None:
        self._transport, self._linger = transport, linger

    def close(self) -> None:
        self._linger()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def limited_protocol(limits: ConnectionLimits, metrics: GatewayMetrics, base: type = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol class `base` with `limits` (pass it as `uvicorn.Config(http=...)`)."""

    class LimitedProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._send_timer: asyncio.TimerHandle | None = None
            self._in_headers = False  # between a request's first byte and the end of its headers (httptools)
            self._header_bytes = 0  # of the request line and headers parsed so far
            self._unparsed_bytes = 0  # of the reads that ended inside the headers
            self._too_large = False
            self._lingering = False  # hanging up after an answer: what arrives is dropped
            self._stalled = False  # the write buffer is over its high-water mark
            if limits.limit_concurrency:
                self._app = self.app
                self.app = self._admit

        # --- the connection ------------------------------------------------------------------------

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            metrics.open_connections.inc()
            if limits.write_buffer_bytes:
                cap_write_buffers(transport, limits.write_buffer_bytes)
            self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel(header=True, send=True)
            self._set_stalled(False)
            metrics.open_connections.dec()
            super().connection_lost(exc)

        def _cancel(self, *, header: bool = False, send: bool = False) -> None:
            if header and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if send and self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _refuse(self, e: errors.ApiError, reason: str) -> None:
            """Answer `e` (outside any request's cycle) and hang up."""
            if self._lingering:
                return
            metrics.limit_closes.labels(reason).inc()
            self.transport.write(raw_response(e))
            self._cancel(header=True)
            self._linger()

        def _linger(self) -> None:
            """Hang up gracefully (what every close of an answered connection does): the write side is
            shut after the answer, and what the client still sends is read and dropped for LINGER_S, so
            that bytes of its crossing the answer do not make the kernel reset the connection before
            the client has read the answer. An answer not yet all handed to the kernel is closed as
            asyncio closes (after the buffer drains, within --send-timeout)."""
            if self._lingering or self.transport.is_closing():
                return
            self._lingering = True
            if self.transport.get_write_buffer_size() or not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

        # --- the request's line and headers ------------------------------------------------------------

        def _await_request(self) -> None:
            """From now on the next request's headers have `header_read_timeout_s` to arrive."""
            self._cancel(header=True)
            if limits.header_read_timeout_s:
                self._header_timer = self.loop.call_later(limits.header_read_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not (self.cycle is None or self.cycle.response_complete):
                return  # a request is being answered: the body's deadline is the app's
            if self._in_headers:
                self._refuse(errors.header_timeout(limits.header_read_timeout_s or 0), "header_timeout")
            else:  # not a byte of a request yet: hang up without a word, as after a keep-alive
                metrics.limit_closes.labels("header_timeout").inc()
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # refused: the rest is dropped
            cycle = self.cycle
            super().data_received(data)
            if self._lingering or self.transport.is_closing():
                return
            if self.cycle is not cycle:  # a request's headers are complete: its app runs
                self._cancel(header=True)
            if self._in_headers and limits.max_header_bytes:
                # httptools keeps a header line until it ends, calling nobody: count the reads too.
                self._unparsed_bytes += len(data)
                if self._unparsed_bytes > limits.max_header_bytes:
                    self._too_large = True
                    self.send_400_response("")

        # httptools' callbacks; h11 has its own limit (h11_max_incomplete_event_size).

        def on_message_begin(self) -> None:  # the first byte of a request
            super().on_message_begin()
            self._in_headers, self._header_bytes, self._unparsed_bytes = True, 0, 0

        def on_url(self, url: bytes) -> None:
            self._count_header(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header(len(name) + len(value) + 4)  # ": " and CRLF
            super().on_header(name, value)

        def _count_header(self, n: int) -> None:
            self._header_bytes += n
            if limits.max_header_bytes and self._header_bytes > limits.max_header_bytes:
                self._too_large = True
                raise OverflowError("headers too large")  # the parser stops: uvicorn answers send_400_response

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()
            if self.cycle is not None and not isinstance(self.cycle.transport, _LingeringClose):
                self.cycle.transport = _LingeringClose(self.transport, self._linger)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request the parser refused: a 431 when it was ours."""
            if self._too_large:
                self._refuse(errors.headers_too_large(limits.max_header_bytes), "headers_too_large")
            else:
                super().send_400_response(msg)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # (not while a pipelined one waits)
                self._await_request()
            if self._send_timer is None:
                self._owed()

        # --- a client that does not read -----------------------------------------------------------------

        def pause_writing(self) -> None:
            super().pause_writing()
            self._set_stalled(True)
            self._cancel(send=True)
            if limits.send_timeout_s:
                self._send_timer = self.loop.call_later(limits.send_timeout_s, self._send_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._set_stalled(False)
            self._cancel(send=True)
            if self.cycle is not None and self.cycle.response_complete:
                self._owed()

        def _owed(self) -> None:
            """A finished answer not all taken yet: the client gets as long to take it as a stalled one."""
            if limits.send_timeout_s and self.transport.get_write_buffer_size():
                self._send_timer = self.loop.call_later(limits.send_timeout_s, self._send_timeout)

        def _set_stalled(self, stalled: bool) -> None:
            if stalled != self._stalled:
                self._stalled = stalled
                metrics.stalled_connections.inc() if stalled else metrics.stalled_connections.dec()

        def _send_timeout(self) -> None:
            """Still stalled, or a finished answer still unread: drop the connection and its buffers (a
            plain close would wait for them to drain, that is forever). The app sees a disconnect."""
            self._send_timer = None
            if self._stalled or self.transport.get_write_buffer_size():
                metrics.limit_closes.labels("send_timeout").inc()
                reset(self.transport)

        # --- connections over the limit --------------------------------------------------------------

        async def _admit(self, scope: dict, receive: Any, send: Any) -> None:
            limit = limits.limit_concurrency or 0
            if scope["type"] != "http" or len(self.connections) <= limit or scope.get("path") in EXEMPT_PATHS:
                await self._app(scope, receive, send)
                return
            metrics.limit_closes.labels("too_many_connections").inc()
            e = errors.too_many_connections(limit)
            headers = [(b"content-type", b"application/json")]
            headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
            await send({"type": "http.response.start", "status": e.status, "headers": headers})
            await send({"type": "http.response.body", "body": e.json()})

    return LimitedProtocol
