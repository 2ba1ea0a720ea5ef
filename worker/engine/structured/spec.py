"""What a request's output must follow, as a hashable spec: the key of the grammar cache.

A spec is built from vLLM's `StructuredOutputsParams` (json, regex, choice, grammar, json_object) or,
for a forced tool call, from the tool parser's structural tag. Its `key` hashes the canonical text
(JSON with sorted keys), so two requests with the same schema share one compiled grammar.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from producer_sdk.chat import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # json | json_object | regex | grammar | structural_tag
    source: str = ""  # the schema / tag as canonical JSON, the regex, or the EBNF text
    any_whitespace: bool = True  # JSON only: whitespace the JSON grammar allows between tokens
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(f"{self.kind}\0{int(self.any_whitespace)}\0{self.source}".encode()).hexdigest()
        object.__setattr__(self, "key", digest)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


_STRING_LIMITS = ("minLength", "maxLength")
_STRING_SHAPES = ("pattern", "format", "enum", "const")
# One JSON string character written as itself: no control character, quote or backslash, and one
# alternative per UTF-8 encoding length (xgrammar 0.2 admits overlong and surrogate encodings within a
# class that spans several). Characters beyond the BMP are left out.
_PLAIN_CHAR = "|".join(
    (
        r"[ !#-\[\]-\x7F]",
        r"[\x80-\u07FF]",
        r"[\u0800-\u0FFF]",
        r"[\u1000-\uCFFF]",
        r"[\uD000-\uD7FF]",
        r"[\uE000-\uFFFF]",
    )
)


def fix_bounded_strings(schema: Any) -> Any:
    """The schema with each length-bounded string (minLength / maxLength, no pattern or format) given as
    the equivalent pattern of plain characters. xgrammar 0.2 compiles a bounded string into a rule that
    admits raw control characters (invalid JSON) and invalid UTF-8; the pattern admits neither."""
    if isinstance(schema, list):
        return [fix_bounded_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: fix_bounded_strings(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or types == ["string"]
    if is_string and any(k in out for k in _STRING_LIMITS) and not any(k in out for k in _STRING_SHAPES):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^({_PLAIN_CHAR}){{{low},{'' if high is None else int(high)}}}$"
    return out


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def spec_from_params(so: StructuredOutputsParams) -> GrammarSpec:
    ws = not so.disable_any_whitespace
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return GrammarSpec("json", canonical_json(fix_bounded_strings(schema)), ws)
    if so.regex is not None:
        return GrammarSpec("regex", so.regex)
    if so.choice is not None:
        return GrammarSpec("grammar", choice_grammar(so.choice))
    if so.grammar is not None:
        return GrammarSpec("grammar", so.grammar)
    return GrammarSpec("json_object", "", ws)


def spec_from_tag(tag: dict[str, Any]) -> GrammarSpec:
    return GrammarSpec("structural_tag", canonical_json(tag))
