"""Constants of the wire protocol, shared by its structs and its validation."""

from __future__ import annotations

import re

PROTOCOL_VERSION = 1

DEFAULT_RESULT_TTL_S = 24 * 3600
FINISH_REASONS = ("stop", "length", "abort", "deadline")
ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")
