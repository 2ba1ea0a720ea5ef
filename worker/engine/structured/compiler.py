"""Grammar compilation off the engine thread, with a cache keyed by the spec's hash.

`GrammarCompiler.get(spec)` returns at once with a `Future` of the compiled grammar: a compile already
cached or in flight is shared, a new one goes to a small thread pool. The engine polls the future
between steps, so no step ever waits for a compile. xgrammar's compile releases the GIL for its heavy
parts (the token-mask cache of each grammar state), so it overlaps with the engine's work.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from worker.engine.structured.spec import GrammarSpec

CACHE_SIZE = 512  # compiled grammars kept (least recently used go first)
COMPILE_THREADS = 2


class GrammarCompiler:
    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self.cache: OrderedDict[str, Future] = OrderedDict()
        self.lock = threading.Lock()
        self.compile_seconds: deque[float] = deque(maxlen=10_000)  # of finished compiles (benchmarks)

    def get(self, spec: GrammarSpec) -> Future:
        with self.lock:
            fut = self.cache.get(spec.key)
            if fut is not None:
                self.cache.move_to_end(spec.key)
                return fut
            fut = self.pool.submit(self._compile, spec)
            self.cache[spec.key] = fut
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec) -> Any:
        started = time.perf_counter()
        c = self.compiler
        if spec.kind == "json":
            compiled = c.compile_json_schema(spec.source, any_whitespace=spec.any_whitespace, strict_mode=True)
        elif spec.kind == "json_object":
            compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        elif spec.kind == "regex":
            compiled = c.compile_regex(spec.source)
        elif spec.kind == "grammar":
            compiled = c.compile_grammar(spec.source)
        elif spec.kind == "structural_tag":
            compiled = c.compile_structural_tag(spec.source)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
        self.compile_seconds.append(time.perf_counter() - started)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
