"""Structured outputs (JSON schema, regex, choice, EBNF grammar, forced tool calls) with xgrammar."""

from __future__ import annotations

from worker.engine.structured.manager import MaskStats, StructuredOutputManager, xgrammar_available
from worker.engine.structured.spec import GrammarSpec, spec_from_params, spec_from_tag

__all__ = [
    "GrammarSpec",
    "MaskStats",
    "StructuredOutputManager",
    "spec_from_params",
    "spec_from_tag",
    "xgrammar_available",
]
