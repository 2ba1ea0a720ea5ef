"""API keys (optional): `--api-keys FILE` maps each key to a tenant and the models it may use.

The file is JSON, one entry per key::

    {
      "sk-team-a-1": {"tenant": "team-a", "models": ["default"]},
      "sk-ops":      {"tenant": "ops"}
    }

`models` absent (or containing "*") means every model. A tenant is a tenant id of the SDK
(`[A-Za-z0-9_-]`, at most 32 characters): its requests count against that tenant's quota
(`pagedq tenant set`). Keys are kept only as SHA-256 digests, and a presented key is looked up by
its digest. Without a file every request is let in, with no tenant (the SDK's "default").
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from gateway import errors
from producer_sdk.constants import TENANT_PATTERN


class KeyEntry(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    models: list[str] | None = None


class Caller(msgspec.Struct, frozen=True):
    """Who is calling: the tenant (None without keys), the models it may use (None: all), and an id of
    its API key (a prefix of the key's digest, never the key; None without keys): what per-key limits
    count under."""

    tenant: str | None = None
    models: frozenset[str] | None = None
    key_id: str | None = None

    def allowed(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def allowed_or_none(self):
        return None if self.models is None else self.allowed


ANONYMOUS = Caller()


class KeyFileError(ValueError):
    pass


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    def __init__(self, entries: dict[str, KeyEntry]) -> None:
        self._by_digest: dict[bytes, Caller] = {}
        for key, e in entries.items():
            if not key or not e.tenant:
                raise KeyFileError("every key and every tenant must be a non-empty string")
            if not TENANT_PATTERN.fullmatch(e.tenant):
                raise KeyFileError(f"tenant {e.tenant!r} must match {TENANT_PATTERN.pattern}")
            models = None if e.models is None or "*" in e.models else frozenset(e.models)
            digest = _digest(key)
            self._by_digest[digest] = Caller(e.tenant, models, key_id=digest.hex()[:16])

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise KeyFileError(f"cannot read the API key file {path}: {e}") from None
        try:
            entries = msgspec.json.decode(raw, type=dict[str, KeyEntry])
        except msgspec.MsgspecError as e:
            raise KeyFileError(f'{path}: {e} (expected {{"<key>": {{"tenant": "...", "models": [...]}}}})') from None
        return cls(entries)

    def __len__(self) -> int:
        return len(self._by_digest)

    def caller(self, authorization: str | None) -> Caller:
        """The caller of an `Authorization: Bearer <key>` header; 401 if missing or unknown."""
        if not authorization:
            raise errors.unauthorized("Missing API key: send the header `Authorization: Bearer <key>`.")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise errors.unauthorized("Malformed Authorization header: expected `Bearer <key>`.")
        found = self._by_digest.get(_digest(key.strip()))
        if found is None:
            raise errors.unauthorized("Incorrect API key provided.")
        return found
