"""Long prompts while others decode: the chunks are sized by attention cost (scheduler.py), and greedy
outputs still equal transformers' token for token (fp32): chunking never changes a token."""

from __future__ import annotations

from tests.engine.oracle import hf_greedy, mixed_prompts
from tests.engine.test_engine_equality import assert_clean, run
from worker import LLMEngine, SamplingParams
from worker.engine.scheduler import affordable_tokens

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
