"""Reading Redis replies: redis-py returns bytes (the clients keep `decode_responses=False`, since
payloads are msgpack), while key names, entry ids and members are text."""

from __future__ import annotations

from typing import Any


def as_text(x: Any) -> str:
    """A reply value as text: bytes decoded as UTF-8, anything else through str()."""
    return x.decode() if isinstance(x, bytes) else str(x)
