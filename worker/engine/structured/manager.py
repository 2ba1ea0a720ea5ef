"""Structured outputs in the engine: grammars for requests, one matcher per sample, one bitmask per step.

* `prepare` (caller's thread, at add_request) turns a request's constraint into a `GrammarSpec` and asks
  the compiler for it; the request holds the compile's `Future` and a deadline.
* `status` (engine thread) says whether the grammar is ready, still compiling, or failed; the engine
  keeps the request out of the scheduler until it is ready, so a step never waits for a compile.
* `attach` gives a sample its own `GrammarMatcher`; `replay` feeds it the tokens a previous worker
  delivered (crash resume); `accept` advances it with each sampled token.
* `fill` writes the step's bitmask (one row per sampled row, only the constrained rows filled) into a
  reused host buffer; the runner uploads it without blocking and the sampler applies it to the logits in
  one `apply_token_bitmask_inplace` call.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker.engine.errors import GrammarError, RequestError
from worker.engine.structured.spec import GrammarSpec

if TYPE_CHECKING:
    from worker.engine.request import Request, Sequence

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class MaskStats:
    """Host time the engine thread spent on grammars, summed over the steps that had constrained rows:
    filling bitmasks (`seconds`) and advancing matchers with the sampled tokens (`accept_seconds`)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    accept_seconds: float = 0.0


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, *, vocab_size: int, eos_token_ids: frozenset[int], compile_timeout: float
    ) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self.compiler = None
        if xgrammar_available():
            from worker.engine.structured.compiler import GrammarCompiler

            self.compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.words = -(-vocab_size // 32)
        self._host = torch.empty(0, self.words, dtype=torch.int32)
        self.mask_stats = MaskStats()

    # --- requests (any thread) ---------------------------------------------------------------------

    def prepare(self, req: Request, spec: GrammarSpec) -> None:
        if self.compiler is None:
            raise RequestError("structured outputs need xgrammar on the worker (pip install 'pagedq[worker]')")
        req.grammar = self.compiler.get(spec)
        req.grammar_deadline = time.monotonic() + self.compile_timeout

    # --- engine thread -----------------------------------------------------------------------------

    @staticmethod
    def status(req: Request) -> str | GrammarError:
        """ "ready", "waiting", or the error that ends the request."""
        fut: Future = req.grammar
        if fut.done():
            err = fut.exception()
            if err is None:
                return "ready"
            return GrammarError(f"the grammar does not compile: {_XGRAMMAR_PREFIX.sub('', str(err)).strip()}")
        if time.monotonic() > req.grammar_deadline:
            return GrammarError(
                "the grammar did not compile within the worker's --grammar-compile-timeout: simplify the schema",
                code="grammar_timeout",
            )
        return "waiting"

    def attach(self, seq: Sequence) -> None:
        assert self.compiler is not None
        seq.matcher = self.compiler.matcher(seq.request.grammar.result())

    def replay(self, seq: Sequence, tokens: Seq[int]) -> bool:
        """Feed tokens already delivered (a resumed sample); False if the grammar refuses one."""
        m = seq.matcher
        return all(m.accept_token(t) for t in tokens)

    def accept(self, seq: Sequence, token: int) -> bool:
        started = time.perf_counter()
        ok = seq.matcher.accept_token(token)
        self.mask_stats.accept_seconds += time.perf_counter() - started
        return ok

    @staticmethod
    def terminated(seq: Sequence) -> bool:
        """The grammar is complete and its stop token was taken: nothing more may follow."""
        return seq.matcher.is_terminated()

    def fill(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The step's bitmask on the host ([len(seqs), words] int32, rows of unconstrained sequences
        left as they are) and the constrained rows; None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        started = time.perf_counter()
        if self._host.shape[0] < len(seqs):
            pinned = torch.cuda.is_available()
            size = max(len(seqs), 2 * self._host.shape[0], 8)
            self._host = torch.empty(size, self.words, dtype=torch.int32, pin_memory=pinned)
        host = self._host[: len(seqs)]
        for i in rows:
            seqs[i].matcher.fill_next_token_bitmask(host, i)
        st = self.mask_stats
        st.steps += 1
        st.rows += len(rows)
        st.seconds += time.perf_counter() - started
        return host, rows

    def compile_seconds(self) -> list[float]:
        return list(self.compiler.compile_seconds) if self.compiler is not None else []

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
