"""Benchmark workloads: lists of (prompt token ids, output length), deterministic from a seed.

Prompts are random token ids (like vLLM's `random` dataset), drawn above the special-token range, so
every system gets exactly the same tokens and lengths with no tokenizer in the way. Every request is
generated with EOS ignored, so each system produces exactly `max_tokens` tokens.

    random         prompt 32..256, output 16..256 (uniform)
    sharegpt-like  long-tailed (log-normal) prompt and output lengths, like ShareGPT conversations
    long-prompt    short chats with a few 2k-4k token prompts arriving among them
    shared-prefix  one 512-token system prompt shared by every request, then a short user turn
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORKLOADS = ("random", "sharegpt-like", "long-prompt", "shared-prefix")
SYSTEM_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    kind: str = "chat"  # "chat", or "long" for the long prompts of `long-prompt`

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.max_tokens


@dataclass
class Workload:
    name: str
    seed: int
    requests: list[BenchRequest] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def subset(self, indices: list[int]) -> Workload:
        return Workload(self.name, self.seed, [self.requests[i] for i in indices])

    def describe(self) -> dict:
        p = [len(r.prompt) for r in self.requests]
        o = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "seed": self.seed,
            "requests": len(self.requests),
            "prompt_tokens": sum(p),
            "output_tokens": sum(o),
            "prompt_len_min_mean_max": [min(p), round(sum(p) / len(p), 1), max(p)] if p else [],
            "output_len_min_mean_max": [min(o), round(sum(o) / len(o), 1), max(o)] if o else [],
            "long_prompts": sum(r.kind == "long" for r in self.requests),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(
            json.dumps({"name": self.name, "seed": self.seed, "requests": [asdict(r) for r in self.requests]})
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        data = json.loads(Path(path).read_text())
        return cls(data["name"], data["seed"], [BenchRequest(**r) for r in data["requests"]])


def _token_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw prompts from: above the special tokens (they sit at the start of the vocabularies here)."""
    return min(1000, vocab_size // 4), vocab_size


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = _token_range(vocab_size)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def make_workload(name: str, n: int, seed: int, vocab_size: int, max_model_len: int = 8192) -> Workload:
    """`n` requests of workload `name`; every prompt + output fits `max_model_len`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    rng = random.Random(f"{name}:{seed}")  # one stream per (workload, seed)
    reqs: list[BenchRequest] = []
    if name == "random":
        for _ in range(n):
            p, o = rng.randint(32, 256), rng.randint(16, 256)
            reqs.append(BenchRequest(_tokens(rng, p, vocab_size), o))
    elif name == "sharegpt-like":
        # ShareGPT-like shape: median prompt ~110 and output ~150 tokens, with a long tail.
        for _ in range(n):
            p = _lognormal_int(rng, 110, 1.0, 4, min(2048, max_model_len // 2))
            o = _lognormal_int(rng, 150, 0.8, 4, min(1024, max_model_len - p - 1))
            reqs.append(BenchRequest(_tokens(rng, p, vocab_size), o))
    elif name == "long-prompt":
        n_long = max(1, n // 16)
        long_at = {round((k + 1) * n / (n_long + 1)) for k in range(n_long)}
        hi = min(4096, max_model_len - 65)
        lo = min(2048, hi // 2)
        for i in range(n):
            if i in long_at:
                reqs.append(BenchRequest(_tokens(rng, rng.randint(lo, hi), vocab_size), rng.randint(16, 64), "long"))
            else:
                reqs.append(BenchRequest(_tokens(rng, rng.randint(32, 128), vocab_size), rng.randint(64, 128)))
    else:  # shared-prefix
        system = _tokens(rng, SYSTEM_PROMPT_TOKENS, vocab_size)
        for _ in range(n):
            user = _tokens(rng, rng.randint(16, 64), vocab_size)
            reqs.append(BenchRequest(system + user, rng.randint(16, 64)))
    return Workload(name, seed, reqs)


def warmup_requests(vocab_size: int, n: int = 2, prompt_len: int = 24, max_tokens: int = 4) -> list[BenchRequest]:
    """Short requests that share nothing with any workload (their own random stream)."""
    rng = random.Random("warmup")
    return [BenchRequest(_tokens(rng, prompt_len, vocab_size), max_tokens) for _ in range(n)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds, first at 0) of a Poisson process of `rate` requests/s; rate <= 0 or
    inf: all at once."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}:{rate:.6f}")
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if i + 1 < n:
            t += rng.expovariate(rate)
    return out


def mean_context(workload: Workload) -> float:
    """Mean number of keys a processed token attends to (prompt + fed-back output positions)."""
    total = count = 0
    for r in workload.requests:
        n = len(r.prompt) + r.max_tokens - 1  # positions run through the model
        total += n * (n + 1) // 2
        count += n
    return total / count if count else 0.0
