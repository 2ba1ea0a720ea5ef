"""Batched sampling for one engine step (vLLM semantics).

Per row, in this order, all in float32:

0. grammar-constrained rows (structured outputs) get the tokens their grammar forbids masked to -inf,
   for the whole batch in one xgrammar kernel call, before anything else reads the logits (so the
   logprobs and the greedy argmax see the mask too).
1. logprobs (when asked) are taken from the *raw* logits: ``log_softmax(logits)`` before any penalty,
   temperature or filter, as vLLM does by default ("raw_logprobs").
2. suppressed tokens (``min_tokens``: EOS / stop token ids of rows that must not stop yet) -> -inf.
3. penalties: repetition (tokens of prompt or output: positive logits divided, negative multiplied),
   frequency (``- count * penalty`` over output tokens), presence (``- penalty`` once per output token).
4. greedy rows (temperature 0) take the argmax here.
5. temperature; top-k (0 = off; ties with the k-th logit are kept); top-p over the top-k survivors
   (smallest set whose probability reaches p, the top token always kept); min-p (drop tokens whose
   probability is below ``min_p * max probability``; renormalising does not change that set).
6. sample by an exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per token, which
   picks token i with probability ``probs[i]``. A seeded row draws its ``E`` (one vector of size V per
   step, nothing for greedy rows) from its own `torch.Generator`, so its tokens do not depend on the
   other rows of the batch; unseeded rows draw from torch's default generator.

The all-greedy batch without penalties is a single argmax over the logits as given.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pagedq_kernels.cpu import greedy_argmax
from worker.engine.sampling_params import SamplingParams
from worker.engine.structured.bitmask import apply_bitmask
from worker.engine.transfer import to_device

_NEG_INF = float("-inf")
# exponential_ may return exactly 0; 0/0 would be NaN and argmax would pick it.
_TINY = torch.finfo(torch.float32).tiny


class SamplingRow(NamedTuple):
    """What the sampler needs about one row of the step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()  # read only when the row has a repetition penalty
    output_token_ids: Sequence[int] = ()  # read only for penalties (and by `min_tokens_suppression`)
    generator: torch.Generator | None = None  # the request's own, when it has a seed


@dataclass
class Penalties:
    repetition: Tensor  # [B] float32, 1.0 = off
    frequency: Tensor  # [B] float32, 0.0 = off
    presence: Tensor  # [B] float32, 0.0 = off
    output_ids: Tensor  # [B, Lo] int64, -1 = padding (rows without penalties are all padding)
    prompt_ids: Tensor | None  # [B, Lp] int64, -1 = padding; None when no row has a repetition penalty


@dataclass
class SamplingBatch:
    """Per-step sampling tensors; fields a step does not need are None, so it skips their work."""

    num_rows: int
    all_greedy: bool
    greedy: Tensor | None  # [B] bool; only for batches mixing greedy and random rows
    temperature: Tensor | None  # [B] float32 (1.0 on greedy rows); None when all greedy
    top_k: Tensor | None  # [B] int64, 0 = off; None when no random row uses top-k
    max_top_k: int
    top_p: Tensor | None  # [B] float32, +inf = off; None when no random row uses top-p
    min_p: Tensor | None  # [B] float32, 0.0 = off; None when no random row uses min-p
    penalties: Penalties | None
    suppress: tuple[Tensor, Tensor] | None  # (row index, token id) pairs to mask, flat int64
    suppress_vocab: int | None  # the vocabulary the pairs were filtered for on the host (None: not filtered)
    generators: dict[int, torch.Generator]  # random rows with their own generator
    unseeded: Tensor | None  # [R] int64: random rows drawing from the default generator (mixed case)
    num_logprobs: list[int | None]  # per row, as requested
    max_num_logprobs: int | None  # None: no row wants logprobs
    bitmask: Tensor | None = None  # [B, ceil(V / 32)] int32 on the device: the grammars' allowed tokens
    bitmask_rows: Tensor | None = None  # int32: the constrained rows (None: every row)

    @property
    def plain_greedy(self) -> bool:
        """One argmax over the raw logits is the whole job."""
        return self.all_greedy and self.penalties is None and self.suppress is None

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        *,
        device: torch.device | str = "cpu",
        suppress: Iterable[tuple[int, Sequence[int]]] | None = None,
        vocab_size: int | None = None,
        bitmask: tuple[Tensor, list[int]] | None = None,
    ) -> SamplingBatch:
        """Gather per-row parameters into tensors on `device` (copied from pinned memory without blocking
        the host, on CUDA).

        `suppress`: (row, token ids) pairs masked to -inf for this step, e.g. EOS and stop token ids of
        rows still under `min_tokens` (see `min_tokens_suppression`). Token ids >= vocab are ignored;
        given `vocab_size` they are dropped here, on the host, and the sampler needs no device sync.
        `bitmask`: the step's grammar bitmask on the host (a row per row) and the constrained rows.
        """
        params = [r.params for r in rows]
        n = len(rows)
        greedy = [p.greedy for p in params]
        random_rows = [i for i in range(n) if not greedy[i]]
        all_greedy = not random_rows

        def vec(values: list, dtype: torch.dtype = torch.float32) -> Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        temperature = top_k = top_p = min_p = greedy_mask = unseeded = None
        max_top_k = 0
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = vec([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            if len(random_rows) < n:
                greedy_mask = vec(greedy, torch.bool)
            ks = [0 if g else p.top_k for p, g in zip(params, greedy)]
            if any(ks):
                top_k, max_top_k = vec(ks, torch.int64), max(ks)
            ps = [float("inf") if g or p.top_p >= 1.0 else p.top_p for p, g in zip(params, greedy)]
            if any(p != float("inf") for p in ps):
                top_p = vec(ps)
            mps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
            if any(mps):
                min_p = vec(mps)
            generators = {i: rows[i].generator for i in random_rows if rows[i].generator is not None}
            if generators:
                rest = [i for i in random_rows if i not in generators]
                unseeded = vec(rest, torch.int64) if rest else None

        logprobs = [p.logprobs for p in params]
        wanted = [k for k in logprobs if k is not None]
        mask = mask_rows = None
        if bitmask is not None:
            mask = to_device(bitmask[0], device)
            if len(bitmask[1]) < n:
                mask_rows = to_device(torch.tensor(bitmask[1], dtype=torch.int32), device)
        return cls(
            num_rows=n,
            all_greedy=all_greedy,
            greedy=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            penalties=_build_penalties(rows, device),
            suppress=_build_suppress(suppress, device, vocab_size),
            suppress_vocab=vocab_size,
            generators=generators,
            unseeded=unseeded,
            num_logprobs=logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
            bitmask=mask,
            bitmask_rows=mask_rows,
        )


def _padded(seqs: list[Sequence[int]], device: torch.device | str) -> Tensor:
    """[len(seqs), longest] int64, right-padded with -1, built with one masked assignment."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    width = int(lengths.max()) if len(seqs) else 0
    out = torch.full((len(seqs), width), -1, dtype=torch.int64)
    if width:
        flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
        out[torch.arange(width) < lengths[:, None]] = flat
    return to_device(out, device)


def _build_penalties(rows: Sequence[SamplingRow], device: torch.device | str) -> Penalties | None:
    used = [r.params.uses_penalties for r in rows]
    if not any(used):
        return None
    rep = [r.params.repetition_penalty for r in rows]
    output = [r.output_token_ids if u else () for r, u in zip(rows, used)]
    prompt = None
    if any(x != 1.0 for x in rep):
        prompt = _padded([r.prompt_token_ids if x != 1.0 else () for r, x in zip(rows, rep)], device)
    factors = torch.tensor(
        [rep, [r.params.frequency_penalty for r in rows], [r.params.presence_penalty for r in rows]],
        dtype=torch.float32,
    )
    factors = to_device(factors, device)
    return Penalties(
        repetition=factors[0],
        frequency=factors[1],
        presence=factors[2],
        output_ids=_padded(output, device),
        prompt_ids=prompt,
    )


def _build_suppress(
    pairs: Iterable[tuple[int, Sequence[int]]] | None, device: torch.device | str, vocab_size: int | None
) -> tuple[Tensor, Tensor] | None:
    if pairs is None:
        return None
    rows: list[int] = []
    ids: list[int] = []
    for row, token_ids in pairs:
        kept = [t for t in token_ids if vocab_size is None or t < vocab_size]
        rows.extend([row] * len(kept))
        ids.extend(kept)
    if not ids:
        return None
    both = to_device(torch.tensor([rows, ids], dtype=torch.int64), device)
    return both[0], both[1]


def min_tokens_suppression(rows: Sequence[SamplingRow], eos_token_ids: Iterable[int]) -> list[tuple[int, list[int]]]:
    """The `suppress` pairs for rows that have fewer than `min_tokens` output tokens (vLLM): their EOS
    ids (unless `ignore_eos`) and `stop_token_ids` may not be sampled yet."""
    eos = list(eos_token_ids)
    out = []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            ids = list(p.stop_token_ids) if p.ignore_eos else [*eos, *p.stop_token_ids]
            if ids:
                out.append((i, ids))
    return out


@dataclass
class SamplerOutput:
    """Sampled ids, plus logprobs of the raw distribution when some row asked for them.

    A row that asked for ``logprobs=k`` reads ``top_token_ids[row, :k]`` / ``top_logprobs[row, :k]``.
    """

    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None = None  # [B] float32, of the sampled token
    top_token_ids: Tensor | None = None  # [B, K] int64, K = the largest k asked
    top_logprobs: Tensor | None = None  # [B, K] float32, descending


def apply_penalties(logits: Tensor, penalties: Penalties) -> None:
    """Apply repetition / frequency / presence penalties to float32 `logits` [B, V] in place."""
    batch, vocab = logits.shape
    output_ids = penalties.output_ids.masked_fill(penalties.output_ids < 0, vocab)
    counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    present = counts > 0
    if penalties.prompt_ids is not None:
        prompt_ids = penalties.prompt_ids.masked_fill(penalties.prompt_ids < 0, vocab)
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | present
        rep = penalties.repetition[:, None]
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, scaled, logits))
    logits -= counts * penalties.frequency[:, None] + present * penalties.presence[:, None]


def _apply_top_k_top_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Mask (-inf) what top-k and top-p drop; returns the (possibly new) logits tensor."""
    vocab = logits.shape[1]
    if batch.top_p is None:  # top-k alone: a partial sort up to the largest k
        assert batch.top_k is not None
        k = batch.top_k.clamp(max=vocab)
        values = logits.topk(min(batch.max_top_k, vocab), dim=-1).values
        kth = values.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth.masked_fill_((k == 0)[:, None], _NEG_INF)
        return logits.masked_fill_(logits < kth, _NEG_INF)
    ordered, order = logits.sort(dim=-1, descending=True)
    if batch.top_k is not None:
        k = batch.top_k.clamp(max=vocab)
        kth = ordered.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth.masked_fill_((k == 0)[:, None], _NEG_INF)
        ordered.masked_fill_(ordered < kth, _NEG_INF)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= batch.top_p[:, None]  # never the top token: its mass_before is 0 < p
    ordered.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are the same device when 0 is the current one (a generator made for
    `torch.device("cuda")` may report either)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _exponential_noise(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """Exp(1) noise shaped like `probs`: seeded rows from their own generator, V draws each."""
    if not batch.generators:
        return probs.new_empty(probs.shape).exponential_()
    vocab = probs.shape[1]
    noise = probs.new_ones(probs.shape)
    if batch.unseeded is not None:
        noise[batch.unseeded] = probs.new_empty(len(batch.unseeded), vocab).exponential_()
    host_rows, host_gens = [], []
    for row, gen in batch.generators.items():
        if _same_device(gen.device, probs.device):
            noise[row].exponential_(generator=gen)
        else:
            host_rows.append(row)
            host_gens.append(gen)
    if host_rows:  # e.g. CPU generators for CUDA logits: draw on the host, one copy
        drawn = torch.empty(len(host_rows), vocab, dtype=probs.dtype)
        for j, gen in enumerate(host_gens):
            drawn[j].exponential_(generator=gen)
        noise[to_device(torch.tensor(host_rows), probs.device)] = to_device(drawn, probs.device)
    return noise


class Sampler:
    """Stateless; `sampler(logits, batch)` samples one token per row. See the module doc for the order."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {batch.num_rows} rows")
        if batch.bitmask is not None:
            apply_bitmask(logits, batch.bitmask, batch.bitmask_rows)
        if batch.num_rows == 0:
            token_ids = torch.empty(0, dtype=torch.int64, device=logits.device)
        elif batch.plain_greedy:
            token_ids = greedy_argmax(logits)
        else:
            token_ids = self._sample(logits.to(torch.float32, copy=True), batch)
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_num_logprobs is not None:
            self._logprobs(logits, batch.max_num_logprobs, out)
        return out

    @staticmethod
    def _sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.suppress is not None:
            rows, ids = batch.suppress
            if batch.suppress_vocab != logits.shape[1]:  # not filtered on the host (a boolean mask syncs on CUDA)
                keep = ids < logits.shape[1]
                rows, ids = rows[keep], ids[keep]
            logits[rows, ids] = _NEG_INF
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        if batch.all_greedy:
            return greedy_argmax(logits)
        greedy_ids = greedy_argmax(logits) if batch.greedy is not None else None
        assert batch.temperature is not None
        logits.div_(batch.temperature[:, None])
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
            probs.masked_fill_(probs < threshold, 0.0)  # the race needs no renormalisation
        noise = _exponential_noise(probs, batch).clamp_(min=_TINY)
        token_ids = probs.div_(noise).argmax(dim=-1)
        if greedy_ids is not None:
            token_ids = torch.where(batch.greedy, greedy_ids, token_ids)
        return token_ids

    @staticmethod
    def _logprobs(logits: Tensor, k: int, out: SamplerOutput) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, out.token_ids[:, None])
        out.logprobs = chosen.squeeze(1)
        k = min(k, logprobs.shape[1])
        out.top_logprobs, out.top_token_ids = logprobs.topk(k, dim=-1)
