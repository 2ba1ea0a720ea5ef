"""Sampler: greedy, penalties, filtered distributions (chi-square), seeds, logprobs, batching."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from worker.engine.sampler import (
    Penalties,
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    min_tokens_suppression,
)
from worker.engine.sampling_params import SamplingParams

sampler = Sampler()

# Fixed, well separated logits over a small vocabulary (softmax probabilities from ~0.3 down to ~0.003).
LOGITS = [2.0, 1.6, 1.1, 0.9, 0.3, 0.0, -0.4, -0.9, -1.5, -2.2, 1.3, -3.0]
V = len(LOGITS)
N_DRAWS = 20_000


def sample(logits: torch.Tensor, rows: list[SamplingRow], **kw) -> torch.Tensor:
    return sampler(logits, SamplingBatch.build(rows, **kw)).token_ids


# --- an independent reference of the filtered distribution (float64, plain loops) --------------


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(len(x), dtype=bool)
    if top_k:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep &= x >= kth
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        mass = 0.0
        for i in sorted(range(len(x)), key=lambda i: -p[i]):
            if mass >= top_p:
                keep[i] = False
            # keep the reference away from ties with float32 rounding at the boundary
            assert abs(mass - top_p) > 1e-3, "top_p sits on a cumulative-probability boundary"
            mass += p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 tail."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def fits(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Chi-square goodness of fit at the 1e-4 level; any draw outside the support fails."""
    n = counts.sum()
    support = probs > 0
    if counts[~support].any():
        return False
    expected = probs[support] * n
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    return df == 0 or stat < chi2_critical(df)


def draw_counts(params: SamplingParams, seed: int = 0, logits=LOGITS) -> np.ndarray:
    torch.manual_seed(seed)
    rows = [SamplingRow(params)] * N_DRAWS
    x = torch.tensor(logits, dtype=torch.float32).expand(N_DRAWS, -1)
    ids = sample(x, rows)
    return np.bincount(ids.numpy(), minlength=len(logits))


FILTER_CASES = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "top_k_top_p": dict(temperature=0.9, top_k=6, top_p=0.75),
    "top_k_binds_with_top_p": dict(top_k=3, top_p=0.9),
    "top_p_renormalised_after_top_k": dict(top_k=5, top_p=0.7),  # keeps 3; over the full softmax: 4
    "all": dict(temperature=1.3, top_k=8, top_p=0.85, min_p=0.1),
}


@pytest.mark.parametrize("case", FILTER_CASES, ids=list(FILTER_CASES))
def test_sampled_distribution_matches_filtered_softmax(case):
    kw = FILTER_CASES[case]
    counts = draw_counts(SamplingParams(**kw), seed=len(case))
    probs = reference_probs(LOGITS, **kw)
    assert fits(counts, probs), (counts, np.round(probs * N_DRAWS))
    # every token the filters keep does get drawn
    assert (counts[probs > 0.01] > 0).all()


def test_chi_square_check_can_fail():
    """The test above has power: near-miss distributions are rejected."""
    counts = draw_counts(SamplingParams(temperature=0.7), seed=1)
    assert fits(counts, reference_probs(LOGITS, temperature=0.7))
    assert not fits(counts, reference_probs(LOGITS, temperature=0.8))
    counts = draw_counts(SamplingParams(top_p=0.6), seed=2)
    assert not fits(counts, reference_probs(LOGITS, top_p=0.7))  # one more token kept
    counts = draw_counts(SamplingParams(top_k=4), seed=3)
    assert not fits(counts, reference_probs(LOGITS, top_k=5))


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]]).expand(200, -1)
    ids = sample(logits, [SamplingRow(SamplingParams(top_p=0.01))] * 200)
    assert (ids == 0).all()


def test_top_k_one_and_huge_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    assert torch.equal(sample(logits, [SamplingRow(SamplingParams(top_k=1))] * 64), logits.argmax(-1))
    counts = draw_counts(SamplingParams(top_k=10_000), seed=5)  # k >= V: off
    assert fits(counts, reference_probs(LOGITS))


# --- greedy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 300) * 3).to(dtype)
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 16
    batch = SamplingBatch.build(rows)
    assert batch.plain_greedy
    assert torch.equal(sampler(logits, batch).token_ids, logits.float().argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(10, 40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.9) for i in range(10)]
    ids = sample(logits, [SamplingRow(p) for p in params])
    assert torch.equal(ids[1::2], logits[1::2].argmax(-1))


def test_logits_are_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    sample(logits, [SamplingRow(params, [1, 2], [3, 4])] * 4)
    assert torch.equal(logits, before)


# --- penalties -----------------------------------------------------------------------------------


def penalised(logits: list[float], params: SamplingParams, prompt, output) -> list[float]:
    x = torch.tensor([logits])
    batch = SamplingBatch.build([SamplingRow(params, prompt, output)])
    assert batch.penalties is not None
    apply_penalties(x, batch.penalties)
    return x[0].tolist()


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    out = penalised(logits, SamplingParams(repetition_penalty=2.0), prompt=[0, 4], output=[1, 1, 3])
    assert out == pytest.approx([1.0, -2.0, 0.5, 1.5, -4.0, 0.0])


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = penalised(logits, params, prompt=[0, 2], output=[1, 1, 3, 1])
    # token 1: 3 times -> -1 - 1.5 - 0.25; token 3: once -> 3 - 0.5 - 0.25; prompt tokens untouched
    assert out == pytest.approx([2.0, -2.75, 0.5, 2.25, -2.0, 0.0])


def test_penalties_combined_and_rows_without_penalties_untouched():
    logits = [[1.0, 2.0, -1.0, 0.5]] * 3
    x = torch.tensor(logits)
    rows = [
        SamplingRow(SamplingParams(), [0, 1], [1]),  # no penalties: ids are not even read
        SamplingRow(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), [0], [1, 2, 2]),
        SamplingRow(SamplingParams(presence_penalty=-0.5), [3], [3, 3]),
    ]
    batch = SamplingBatch.build(rows)
    apply_penalties(x, batch.penalties)
    assert x[0].tolist() == pytest.approx(logits[0])
    assert x[1].tolist() == pytest.approx([1 / 1.5, 2 / 1.5 - 1.0, -1.5 - 2.0, 0.5])
    assert x[2].tolist() == pytest.approx([1.0, 2.0, -1.0, 1.0])


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = SamplingParams(temperature=0.0)
    assert sample(logits, [SamplingRow(plain, [], [0])]).item() == 0
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert sample(logits, [SamplingRow(params, [], [0])]).item() == 1


def test_penalised_sampling_distribution():
    params = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.3)
    prompt, output = [0, 5], [1, 6, 6]
    torch.manual_seed(11)
    x = torch.tensor(LOGITS).expand(N_DRAWS, -1)
    ids = sample(x, [SamplingRow(params, prompt, output)] * N_DRAWS)
    expected = reference_probs(penalised(LOGITS, params, prompt, output), temperature=0.9)
    assert fits(np.bincount(ids.numpy(), minlength=V), expected)


def test_penalties_empty_pad_tensor_shapes():
    batch = SamplingBatch.build([SamplingRow(SamplingParams(presence_penalty=1.0), [], [])])
    pen = batch.penalties
    assert isinstance(pen, Penalties) and pen.prompt_ids is None and pen.output_ids.shape == (1, 0)
    x = torch.zeros(1, 5)
    apply_penalties(x, pen)
    assert x.tolist() == [[0.0] * 5]


# --- min_tokens ----------------------------------------------------------------------------------


def test_suppressed_tokens_are_never_sampled():
    eos = 2
    logits = torch.tensor([[0.0, 0.5, 6.0, 1.0]]).expand(400, -1)
    rows = [SamplingRow(SamplingParams(temperature=t)) for t in [0.0, 1.0] * 200]
    ids = sample(logits, rows, suppress=[(i, [eos]) for i in range(0, 400, 2)] + [(1, [eos, 99])])
    assert (ids[0::2] == 3).all()  # greedy rows fall back to the next best
    assert ids[1].item() != eos
    assert (ids[3::2] == eos).float().mean() > 0.9  # unsuppressed rows still pick it


def test_suppression_is_filtered_on_the_host_when_the_vocab_is_known():
    """With `vocab_size` (what the runner passes) ids past the vocabulary are dropped at build time, so
    the device never needs a boolean mask (a sync on CUDA); the draws are the same either way."""
    logits = torch.tensor([[0.0, 0.5, 6.0, 1.0]]).expand(6, -1)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=i), generator=torch.Generator().manual_seed(i))
            for i, t in enumerate([0.0, 1.0] * 3)]  # fmt: skip
    pairs = [(0, [2, 99]), (1, [2]), (3, [99, 4000]), (4, [1, 2, 3])]
    filtered = SamplingBatch.build(rows, suppress=pairs, vocab_size=4)
    assert filtered.suppress_vocab == 4
    assert filtered.suppress[0].tolist() == [0, 1, 4, 4, 4] and filtered.suppress[1].tolist() == [2, 2, 1, 2, 3]
    unfiltered = SamplingBatch.build(rows, suppress=pairs)
    assert unfiltered.suppress_vocab is None and 99 in unfiltered.suppress[1].tolist()
    for r in rows:
        r.generator.manual_seed(0)
    a = sampler(logits, filtered).token_ids
    for r in rows:
        r.generator.manual_seed(0)
    b = sampler(logits, unfiltered).token_ids
    assert a.tolist() == b.tolist() and a[0] == 3 and a[4] == 0
    assert SamplingBatch.build(rows, suppress=[(2, [99])], vocab_size=4).suppress is None


def test_min_tokens_suppression_helper():
    rows = [
        SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=[7]), output_token_ids=[1]),
        SamplingRow(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[7]), output_token_ids=[]),
        SamplingRow(SamplingParams(min_tokens=2), output_token_ids=[1, 2]),  # reached min_tokens
        SamplingRow(SamplingParams(), output_token_ids=[]),
        SamplingRow(SamplingParams(min_tokens=1, ignore_eos=True), output_token_ids=[]),
    ]
    assert min_tokens_suppression(rows, eos_token_ids=[2, 0]) == [(0, [2, 0, 7]), (1, [7])]


# --- seeds and batch independence -----------------------------------------------------------------


def step_logits(steps: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(vocab, generator=g) * 2 for _ in range(steps)]


TARGET = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)


def test_seeded_row_does_not_depend_on_the_batch():
    steps, vocab = 12, 97
    target_logits = step_logits(steps, vocab, seed=0)

    gen_alone = torch.Generator().manual_seed(1234)
    alone = [sample(x[None], [SamplingRow(TARGET, generator=gen_alone)]).item() for x in target_logits]

    rng = random.Random(0)
    torch.manual_seed(99)
    gen = torch.Generator().manual_seed(1234)
    others_gens = [torch.Generator().manual_seed(s) for s in range(5)]
    in_batches = []
    for x in target_logits:
        n_other = rng.randrange(0, 6)
        other_rows = []
        for j in range(n_other):
            kind = rng.choice(["greedy", "unseeded", "seeded", "min_p"])
            if kind == "greedy":
                other_rows.append(SamplingRow(SamplingParams(temperature=0.0)))
            elif kind == "unseeded":
                other_rows.append(SamplingRow(SamplingParams(temperature=1.2, top_k=5)))
            elif kind == "seeded":
                other_rows.append(SamplingRow(SamplingParams(top_p=0.5, seed=j), generator=others_gens[j]))
            else:
                other_rows.append(SamplingRow(SamplingParams(min_p=0.3, presence_penalty=0.5), [1], [2]))
        pos = rng.randrange(0, n_other + 1)
        rows = [*other_rows[:pos], SamplingRow(TARGET, generator=gen), *other_rows[pos:]]
        logits = torch.randn(len(rows), vocab) * 2
        logits[pos] = x
        in_batches.append(sample(logits, rows)[pos].item())

    assert in_batches == alone
    assert torch.equal(gen.get_state(), gen_alone.get_state())  # same amount of randomness drawn


def test_seeded_rows_reproduce_and_differ_by_seed():
    x = torch.tensor(LOGITS).expand(64, -1)

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + i) for i in range(64)]
        return sample(x, [SamplingRow(SamplingParams(seed=seed), generator=g) for g in gens])

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_seeded_greedy_row_draws_nothing():
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    sample(torch.randn(1, 20), [SamplingRow(SamplingParams(temperature=0.0, seed=3), generator=gen)])
    assert torch.equal(gen.get_state(), state)


def diverse_rows(n: int) -> list[tuple[SamplingParams, list[int], list[int], int]]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
            top_k=rng.choice([0, 3, 20]),
            top_p=rng.choice([1.0, 0.8]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            frequency_penalty=rng.choice([0.0, 0.4]),
            presence_penalty=rng.choice([0.0, -0.3]),
            logprobs=rng.choice([None, 0, 2, 5]),
            seed=100 + i,
        )
        prompt = [rng.randrange(64) for _ in range(rng.randrange(0, 9))]
        output = [rng.randrange(64) for _ in range(rng.randrange(0, 9))]
        out.append((params, prompt, output, 100 + i))
    return out


def test_batched_equals_row_by_row():
    torch.manual_seed(0)
    spec = diverse_rows(24)
    logits = torch.randn(len(spec), 64) * 2

    def rows(start, stop):
        return [SamplingRow(p, pr, o, torch.Generator().manual_seed(s)) for p, pr, o, s in spec[start:stop]]

    batched = sampler(logits, SamplingBatch.build(rows(0, len(spec))))
    for i, (params, *_rest) in enumerate(spec):
        single = sampler(logits[i : i + 1], SamplingBatch.build(rows(i, i + 1)))
        assert single.token_ids.item() == batched.token_ids[i].item(), i
        k = params.logprobs
        if k is not None:
            assert single.logprobs.item() == pytest.approx(batched.logprobs[i].item())
            assert torch.equal(single.top_token_ids[0, :k], batched.top_token_ids[i, :k])


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = (torch.randn(6, 50) * 2).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, logprobs=5),
        SamplingParams(temperature=1.0, top_p=0.3),  # no logprobs; gets them anyway, ignores them
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, min_p=0.5, logprobs=1),
        SamplingParams(temperature=0.0, logprobs=5, presence_penalty=2.0),
    ]
    out = sampler(logits, SamplingBatch.build([SamplingRow(p, [1], [2, 3]) for p in params]))
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.top_token_ids.shape == (6, 5) and out.top_logprobs.shape == (6, 5)
    expected_chosen = ref.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, expected_chosen)
    top = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_token_ids, top.indices)
    assert out.token_ids[0].item() == out.top_token_ids[0, 0].item()  # greedy: the top token


def test_no_logprobs_unless_asked_and_k_zero():
    logits = torch.randn(2, 10)
    out = sampler(logits, SamplingBatch.build([SamplingRow(SamplingParams())] * 2))
    assert out.logprobs is None and out.top_token_ids is None
    out = sampler(logits, SamplingBatch.build([SamplingRow(SamplingParams(logprobs=0))] * 2))
    assert out.logprobs.shape == (2,) and out.top_token_ids.shape == (2, 0)


def test_batch_flags_skip_unused_work():
    batch = SamplingBatch.build([SamplingRow(SamplingParams(temperature=0.0, top_p=0.5, top_k=3))] * 3)
    assert batch.all_greedy and batch.top_p is None and batch.top_k is None and batch.temperature is None
    batch = SamplingBatch.build([SamplingRow(SamplingParams())] * 3)
    assert not batch.all_greedy and batch.greedy is None
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None and batch.penalties is None


def test_empty_batch():
    out = sampler(torch.empty(0, 10), SamplingBatch.build([]))
    assert out.token_ids.shape == (0,)


def test_wrong_shape_is_refused():
    with pytest.raises(ValueError):
        sampler(torch.randn(3, 10), SamplingBatch.build([SamplingRow(SamplingParams())] * 2))
