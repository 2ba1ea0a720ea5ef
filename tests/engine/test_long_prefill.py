"""Long prompts while others decode: the chunks are sized by attention cost (scheduler.py), and greedy
outputs still equal transformers' token for token (fp32): chunking never changes a token."""

from __future__ import annotations

from tests.engine.oracle import hf_greedy, mixed_prompts
from tests.engine.test_engine_equality import assert_clean, run
from worker import LLMEngine, SamplingParams
from worker.engine.prefill_cost import affordable_tokens

TIGHT = {  # small, cost-sized chunks; one long prompt at a time, two more partial slots for short ones
    "long_prefill_token_threshold": 24,
    "long_prefill_budget": 6,
    "max_num_partial_prefills": 3,
    "max_long_partial_prefills": 1,
    "max_num_batched_tokens": 96,
}


def test_greedy_equals_transformers_with_cost_sized_chunks(llama_dir):
    from transformers import AutoTokenizer

    prompts = mixed_prompts(AutoTokenizer.from_pretrained(llama_dir), 16, seed=3)
    max_new = [6 + i % 9 for i in range(len(prompts))]
    want = hf_greedy(llama_dir, prompts, max_new)
    engine = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", **TIGHT)
    got = run(engine, prompts, max_new)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert_clean(engine)


def test_a_long_prompt_arriving_during_decodes_is_fed_by_its_cost(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", **TIGHT)
    context = eng.scheduler_config.attention_cost_context
    eng.add_request("chat", prompt_token_ids=[5] * 8, params=SamplingParams(max_tokens=400, ignore_eos=True))
    eng.step()
    eng.add_request("long", prompt_token_ids=[7] * 300, params=SamplingParams(max_tokens=1))
    chunks: list[int] = []
    done = False
    while not done:
        done = any(o.request_id == "long" and o.finished for o in eng.step())
        chunks.append(eng.snapshot().last_step_tokens - 1)  # the chat's decode is the other token
    position = 0
    for n in chunks:
        assert n == min(24, 300 - position, affordable_tokens(position, 6, context) or 1)
        position += n
    assert position == 300
    assert chunks[0] > chunks[-2]  # they shrank as the context grew
    eng.abort_request("chat")
    while eng.has_unfinished_requests():
        eng.step()
    assert_clean(eng)


def test_fair_share_between_tenants_changes_no_token_and_puts_the_other_tenants_prompt_first(llama_dir):
    """One tenant holds most sequences; another's prompt arrives behind one of its prompts. The other
    tenant's prompt is computed in a step with no prompt of the first (its decodes still run), the first's
    prompts move on in chunks of at most `fair_share_prefill_tokens`, and every output still equals
    transformers' greedy one."""
    from transformers import AutoTokenizer

    prompts = mixed_prompts(AutoTokenizer.from_pretrained(llama_dir), 7, seed=5)
    max_new = [12] * len(prompts)
    want = hf_greedy(llama_dir, prompts, max_new)
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", fair_share_prefill_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=12)
    for i in range(4):
        eng.add_request(f"noisy{i}", prompt_token_ids=prompts[i], params=params, tenant="noisy")
    eng.step()
    eng.add_request("noisy4", prompt_token_ids=prompts[4], params=params, tenant="noisy")
    eng.add_request("calm5", prompt_token_ids=prompts[5], params=params, tenant="calm", tenant_weight=1.0)
    eng.add_request("calm6", prompt_token_ids=prompts[6], params=params, tenant="calm")
    got: dict[str, list[int]] = {}
    prompt_steps: list[set[str]] = []
    while eng.has_unfinished_requests():
        before = {r: req.seqs[0].num_computed_tokens for r, req in eng.requests.items()}
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        computed = {r: req.seqs[0].num_computed_tokens - before.get(r, 0) for r, req in eng.requests.items()}
        prompt_steps.append({r for r, n in computed.items() if n > 1})
    assert [got[f"noisy{i}"] for i in range(5)] + [got["calm5"], got["calm6"]] == want
    calm_steps = [s for s in prompt_steps if s & {"calm5", "calm6"}]
    assert calm_steps and all(not any(r.startswith("noisy") for r in s) for s in calm_steps)
    assert any("noisy4" in s for s in prompt_steps)  # it moved on once the calm prompts were in
    assert_clean(eng)
