"""The producer's current W3C Trace Context, when OpenTelemetry is in use (no dependency on it).

`current()` returns the `traceparent` / `tracestate` of the span current in this thread or task, as
OpenTelemetry's W3C propagator writes them, or ``(None, None)``. It imports nothing of OpenTelemetry
before the application has imported `opentelemetry.trace` (without it no span can be current), so an
application that does not trace pays one dictionary lookup per request.
"""

from __future__ import annotations

import sys
from typing import Any

_propagator: Any = None


def current() -> tuple[str | None, str | None]:
    """(traceparent, tracestate) of the current span; (None, None) when there is none (or no
    OpenTelemetry in this process)."""
    global _propagator
    if "opentelemetry.trace" not in sys.modules:
        return None, None
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate") or None
