"""pagedq worker: the inference engine and the Redis-facing service.

`from worker import LLM, SamplingParams, EngineConfig` — imported lazily so that `pagedq --help`
and the service's light paths do not pay for torch at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "LLM",
    "EngineConfig",
    "EngineLimits",
    "EngineSnapshot",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

_EXPORTS = {
    "LLM": "worker.engine.llm",
    "LLMEngine": "worker.engine.engine",
    "EngineConfig": "worker.engine.config",
    "EngineLimits": "worker.engine.stats",
    "EngineSnapshot": "worker.engine.stats",
    "SamplingParams": "worker.engine.sampling_params",
    "StructuredOutputsParams": "worker.engine.sampling_params",
    "RequestOutput": "worker.engine.outputs",
}

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine.llm import LLM
    from worker.engine.outputs import RequestOutput
    from worker.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from worker.engine.stats import EngineLimits, EngineSnapshot


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
