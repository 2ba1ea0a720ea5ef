"""Constants of the wire protocol, shared by its structs and its validation."""

from __future__ import annotations

import re

PROTOCOL_VERSION = 2  # what this side writes when a request needs it (see `validation.min_version`)
SUPPORTED_VERSIONS = (1, 2)  # what this side reads

# How long a finished answer can be fetched, counted from its final event (docs/sdk.md, "How long an
# answer can be fetched"): a producer's `result_ttl_s`, the gateway's --result-ttl.
DEFAULT_RESULT_TTL_S = 3600
# The submitted marker and the gateway's record of a request that has not finished live at least this
# long from submission, whatever the retention.
UNFINISHED_TTL_S = 24 * 3600
FINISH_REASONS = ("stop", "length", "abort", "deadline", "tool_calls")
ROLES = ("system", "developer", "user", "assistant", "tool")
V1_ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")

# W3C Trace Context (https://www.w3.org/TR/trace-context/): version, trace-id, parent-id, flags, all
# lowercase hex; version ff is invalid, and a future version may append "-..." after the flags.
TRACEPARENT_PATTERN = re.compile(r"(?!ff)([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[ -~]*)?")
TRACEPARENT_MAX_CHARS = 256
TRACESTATE_MAX_CHARS = 512  # the length the spec asks every vendor to propagate
# A tenant id is part of Redis key names and a metric label: short, plain characters only.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")
DEFAULT_TENANT = "default"  # the tenant of a request that names none
# A model name is part of Redis key names (inside a cluster hash tag, so never a brace) and of ACL
# key patterns (so no glob characters): printable, no spaces.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9._:/@+=-]{1,128}")
