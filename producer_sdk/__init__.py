"""pagedq producer SDK: send generation requests to pagedq workers through Redis.

    from producer_sdk import AsyncClient
    async with AsyncClient("redis://localhost:6379/0", model="default") as client:
        completion = await client.generate("Hello", max_tokens=32)

Only redis-py and msgspec are needed. The clients are imported on first use, so
`import producer_sdk.protocol` (what the worker does) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from producer_sdk.errors import (
    AccessDenied,
    AuthenticationFailed,
    Cancelled,
    ConnectionLost,
    DeadlineExceeded,
    ModelNotFound,
    PagedqError,
    PermissionDenied,
    ProtocolError,
    QueueFull,
    RateLimited,
    RequestFailed,
    RequestLost,
    RequestTimeout,
    StreamDiverged,
    ValidationError,
)

if TYPE_CHECKING:
    from producer_sdk.batch import BatchItem
    from producer_sdk.chat import Message, ResponseFormat, StructuredOutputsParams, Tool, ToolCall, ToolCallDelta
    from producer_sdk.client import AsyncClient, Handle
    from producer_sdk.protocol import SamplingParams, Timings, Usage, WorkerState
    from producer_sdk.results import Choice, Chunk, Completion, QueueStats
    from producer_sdk.sync import Client, SyncHandle
    from producer_sdk.validation import Limits

__version__ = "0.1.0"

_LAZY = {
    "AsyncClient": "producer_sdk.client",
    "Handle": "producer_sdk.client",
    "BatchItem": "producer_sdk.batch",
    "Client": "producer_sdk.sync",
    "SyncHandle": "producer_sdk.sync",
    "Chunk": "producer_sdk.results",
    "Choice": "producer_sdk.results",
    "Completion": "producer_sdk.results",
    "QueueStats": "producer_sdk.results",
    "Limits": "producer_sdk.validation",
    "Message": "producer_sdk.chat",
    "ResponseFormat": "producer_sdk.chat",
    "StructuredOutputsParams": "producer_sdk.chat",
    "Tool": "producer_sdk.chat",
    "ToolCall": "producer_sdk.chat",
    "ToolCallDelta": "producer_sdk.chat",
    "SamplingParams": "producer_sdk.protocol",
    "Timings": "producer_sdk.protocol",
    "Usage": "producer_sdk.protocol",
    "WorkerState": "producer_sdk.protocol",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'producer_sdk' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AccessDenied",
    "AsyncClient",
    "AuthenticationFailed",
    "BatchItem",
    "Cancelled",
    "Choice",
    "Chunk",
    "Client",
    "Completion",
    "ConnectionLost",
    "DeadlineExceeded",
    "Handle",
    "Limits",
    "Message",
    "ModelNotFound",
    "PagedqError",
    "PermissionDenied",
    "ProtocolError",
    "QueueFull",
    "QueueStats",
    "RateLimited",
    "RequestFailed",
    "RequestLost",
    "RequestTimeout",
    "ResponseFormat",
    "SamplingParams",
    "StreamDiverged",
    "StructuredOutputsParams",
    "SyncHandle",
    "Timings",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "ValidationError",
    "WorkerState",
]
