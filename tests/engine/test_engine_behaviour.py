"""Engine behaviour beyond greedy equality: aborts, deadlines, priorities, n > 1, stops, text, errors."""

from __future__ import annotations

import time

import pytest
import torch

from tests.engine.oracle import hf_greedy
from tests.engine.test_engine_equality import assert_clean
from worker import LLM, LLMEngine, SamplingParams
from worker.engine.engine import PromptTooLong, RequestError


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=256)


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, object]:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return finals


def test_abort_frees_blocks_within_one_step(engine):
    engine.add_request("a", prompt_token_ids=list(range(1, 60)), params=SamplingParams(temperature=0, max_tokens=500))
    engine.add_request("b", prompt_token_ids=list(range(2, 30)), params=SamplingParams(temperature=0, max_tokens=5))
    for _ in range(3):
        engine.step()
    assert engine.snapshot().num_free_kv_blocks < engine.limits.num_kv_blocks
    engine.abort_request("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    assert not engine.kv.has_seq("a#0")
    finals = drain(engine)
    assert finals["b"].outputs[0].finish_reason == "length"
    assert_clean(engine)


def test_a_suspect_runs_alone_only_until_it_has_sampled_a_token(engine):
    """After a failed step every request of it is re-added isolated: one at a time, each gets a step of
    its own, and once through one (its context computed, a token sampled) it rejoins the batch: a
    poison request fails in its own step, and its neighbours do not run one by one to their end."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for rid in ("s1", "s2"):
        engine.add_request(rid, prompt_token_ids=list(range(3, 25)), params=greedy, isolated=True)
    engine.add_request("plain", prompt_token_ids=list(range(4, 20)), params=greedy)
    sizes = []
    for _ in range(4):
        engine.step()
        sizes.append(engine.snapshot().last_step_seqs)
    assert sizes == [1, 1, 3, 3]  # s1 alone, s2 alone (s1 waits), then all three together
    drain(engine)
    assert_clean(engine)


def test_expired_deadline_finishes_with_deadline_and_no_forward(engine):
    steps_before = engine.snapshot().steps
    engine.add_request("late", prompt="hello", params=SamplingParams(max_tokens=5), deadline=time.time() - 1)
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["deadline"]
    assert engine.snapshot().steps == steps_before  # no forward pass ran
    assert_clean(engine)


def test_deadline_reached_mid_generation(engine):
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    engine.add_request("d", prompt="hello", params=params, deadline=time.time() + 0.3)
    finals = drain(engine)
    out = finals["d"].outputs[0]
    assert out.finish_reason == "deadline" and 0 < len(out.token_ids) < 10_000
    assert_clean(engine)


def test_priority_policy_changes_the_order(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy="priority")
    order = []
    for rid, prio in [("low", -5), ("mid", 0), ("high", 7)]:
        eng.add_request(rid, prompt="abc", params=SamplingParams(temperature=0, max_tokens=3), priority=prio)
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "mid", "low"]
    fcfs = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=1)
    for rid, prio in [("low", -5), ("mid", 0), ("high", 7)]:
        fcfs.add_request(rid, prompt="abc", params=SamplingParams(temperature=0, max_tokens=3), priority=prio)
    assert list(drain(fcfs)) == ["low", "mid", "high"]


def test_parallel_samples_share_the_prompt_prefilled_once(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    prompt = list(range(3, 3 + 40))  # 2.5 blocks: the partial third block is shared, then copied on write
    eng.add_request("p", prompt_token_ids=prompt, params=SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12))
    eng.step()  # prefill + fork
    assert eng.snapshot().prompt_tokens == len(prompt)  # computed once, not three times
    tables = [eng.kv.block_table(f"p#{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert eng.kv.blocks[tables[0][0]].ref_count == 3
    finals = drain(eng)
    outs = finals["p"].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # seeds differ per sample
    assert eng.snapshot().prompt_tokens == len(prompt)
    assert_clean(eng)


def test_parallel_greedy_samples_equal_transformers(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu")
    prompt = list(range(5, 5 + 21))
    eng.add_request("g", prompt_token_ids=prompt, params=SamplingParams(n=2, temperature=0, max_tokens=10))
    outs = drain(eng)["g"].outputs
    want = hf_greedy(llama_dir, [prompt], 10)[0]
    assert outs[0].token_ids == outs[1].token_ids == want
    assert_clean(eng)


def test_seeded_sampling_does_not_depend_on_the_batch(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    eng.add_request("alone", prompt="The quick brown fox", params=params)
    alone = drain(eng)["alone"].outputs[0].token_ids
    for i in range(5):
        eng.add_request(f"noise{i}", prompt="Redis streams " * (i + 1), params=SamplingParams(temperature=1.0))
    eng.add_request("crowd", prompt="The quick brown fox", params=params)
    assert drain(eng)["crowd"].outputs[0].token_ids == alone
    assert_clean(eng)


def test_stop_token_ids_max_tokens_min_tokens_and_ignore_eos(engine):
    probe = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("probe", prompt="Paged attention", params=probe)
    ref = drain(engine)["probe"].outputs[0].token_ids
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    stop_at = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    not_before = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 2)
    engine.add_request("s", prompt="Paged attention", params=stop_at)
    engine.add_request("m", prompt="Paged attention", params=not_before)
    finals = drain(engine)
    s = finals["s"].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop_tok and s.token_ids == ref[: first + 1]
    m = finals["m"].outputs[0]
    assert len(m.token_ids) > first + 1  # the stop token could not be sampled before min_tokens
    assert_clean(engine)


def test_stop_string_cuts_the_text(engine):
    probe = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("probe", prompt="Continuous batching", params=probe)
    text = drain(engine)["probe"].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    engine.add_request("s", prompt="Continuous batching", params=params)
    out = drain(engine)["s"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert_clean(engine)


def test_streamed_text_deltas_add_up_to_the_decode(engine):
    tok = engine.tokenizer
    engine.add_request(
        "zh", prompt="大型语言模型的推理 🚀", params=SamplingParams(temperature=0.9, seed=3, max_tokens=40)
    )
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    ids = final.outputs[0].token_ids
    assert "".join(deltas) == final.outputs[0].text == tok.decode(ids, skip_special_tokens=True)
    assert_clean(engine)


def test_bad_requests_raise_typed_errors(engine):
    with pytest.raises(PromptTooLong):
        engine.add_request("long", prompt_token_ids=[1] * engine.max_model_len)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", prompt_token_ids=[])
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("oov", prompt_token_ids=[1, 10**6])
    engine.add_request("dup", prompt="x", params=SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already"):
        engine.add_request("dup", prompt="x")
    drain(engine)
    assert_clean(engine)


def test_prepared_requests_are_queued_all_together_or_not_at_all(engine):
    p = SamplingParams(temperature=0, max_tokens=1)
    reqs = [engine.prepare_request(f"together-{i}", prompt_token_ids=[3, 4, 5 + i], params=p) for i in range(4)]
    with pytest.raises(RequestError, match="given twice"):
        engine.add_prepared([reqs[0], reqs[1], reqs[0]])
    late = engine.prepare_request("together-late", prompt_token_ids=[7, 8], params=p)
    engine.add_request("together-late", prompt_token_ids=[7, 8], params=p)  # the same id, added meanwhile
    with pytest.raises(RequestError, match="already running"):
        engine.add_prepared([*reqs, late])
    assert engine.get_num_unfinished_requests() == 1  # none of the batch was queued
    drain(engine)
    engine.add_prepared(reqs)
    outs = engine.step()  # one step takes the whole batch: each needs one token
    assert sorted(o.request_id for o in outs if o.finished) == [r.request_id for r in reqs]
    assert_clean(engine)


def test_request_larger_than_the_pool_fails_instead_of_hanging(llama_dir):
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=4, watermark=0.0)
    eng.add_request("big", prompt_token_ids=list(range(1, 100)), params=SamplingParams(max_tokens=4))
    eng.add_request("ok", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, ignore_eos=True))
    finals = drain(eng, max_steps=100)
    assert finals["big"].outputs[0].finish_reason == "abort" and "KV blocks" in finals["big"].error
    assert len(finals["ok"].outputs[0].token_ids) == 4
    assert_clean(eng)


def test_request_metrics(engine):
    engine.add_request(
        "m", prompt="metrics please", params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    m = drain(engine)["m"].metrics
    assert m.queue_time is not None and m.queue_time >= 0
    assert 0 < m.ttft <= m.e2e
    assert len(m.inter_token_latencies) == 5


def test_llm_api_accepts_strings_token_ids_and_chats(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(["Hello", "你好"], greedy, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6] or all(o.outputs[0].finish_reason for o in outs)
    ids = llm.tokenizer("Hello").input_ids
    again = llm.generate([ids], [greedy], use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "Hi there"}], greedy, use_tqdm=False)
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert chat[0].prompt_token_ids == llm.tokenizer(rendered, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="sampling parameter sets"):
        llm.generate(["a", "b"], [greedy], use_tqdm=False)
    assert torch.get_num_threads() == 1


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "解释一下什么是注意力机制。",
        "The key idea of paged attention is",
        "Q: What is 17 times 3?\nA:",
        "Continuous batching improves throughput because",
        "import numpy as np\n",
        "Emoji story: 🚀🌕",
    ]
    prompts = [tok(t).input_ids for t in texts]
    want = hf_greedy(smollm2_dir, prompts, 64)
    llm = LLM(model=str(smollm2_dir), dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want, strict=True)):
        assert o.outputs[0].token_ids == w, f"prompt {i} {texts[i]!r} diverged"
    assert "Paris" in outs[0].outputs[0].text
    assert_clean(llm.engine)


@pytest.mark.parametrize("cut", [0, 1, 7, 19, 20])
def test_resume_continues_exactly_where_delivery_stopped(engine, cut):
    """A request resumed from the tokens a crashed worker delivered ends as the uninterrupted run."""
    from worker.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzz"])
    engine.add_request("ref", prompt="连续批处理 streams", params=params)
    ref = drain(engine)["ref"].outputs[0]
    det = IncrementalDetokenizer.from_sampling_params(engine.tokenizer, None, params)
    delivered_text = "".join(det.update(t) for t in ref.token_ids[:cut])

    engine.add_request("again", prompt="连续批处理 streams", params=params, resume=[ref.token_ids[:cut]])
    new_ids, new_text, final = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            new_ids += out.outputs[0].delta_token_ids
            new_text += out.outputs[0].delta_text
            final = out
    assert final.outputs[0].token_ids == ref.token_ids
    assert new_ids == ref.token_ids[cut:]  # nothing delivered twice
    assert delivered_text + new_text == ref.text
    assert final.outputs[0].finish_reason == "length"
    assert_clean(engine)


def test_resume_of_parallel_samples_keeps_finished_ones_finished(engine):
    eos = min(engine.eos_token_ids)
    params = SamplingParams(n=2, temperature=0, max_tokens=6)
    engine.add_request("r", prompt_token_ids=[5, 6, 7], params=params, resume=[[8, 9, eos], [10]])
    final = drain(engine)["r"]
    a, b = final.outputs
    assert a.token_ids == [8, 9, eos] and a.finish_reason == "stop"
    assert b.token_ids[:1] == [10] and b.finish_reason in ("length", "stop")
    assert_clean(engine)


def test_extreme_seeds_with_parallel_samples(engine):
    """Found by fuzzing: seed + sample index overflowed the generator's 64-bit range."""
    for seed in (2**64 - 1, -(2**63)):
        engine.add_request(f"s{seed}", prompt="x", params=SamplingParams(n=2, seed=seed, max_tokens=3))
    finals = drain(engine)
    assert all(len(c.token_ids) == 3 for o in finals.values() for c in o.outputs)
    assert_clean(engine)


@pytest.mark.parametrize("partials", [1, 2])
def test_long_prompts_take_turns_in_chunked_prefill(llama_dir, partials):
    eng = LLMEngine(
        model=str(llama_dir),
        dtype="float32",
        device="cpu",
        long_prefill_token_threshold=64,
        max_num_partial_prefills=partials,
    )
    for i in range(2):
        eng.add_request(f"long{i}", prompt_token_ids=[5 + i] * 300, params=SamplingParams(max_tokens=2))
    eng.add_request("short", prompt_token_ids=[7] * 20, params=SamplingParams(max_tokens=2))
    eng.step()
    # the short prompt fits whole (not a partial prefill); the long ones chunk 64 at a time
    assert eng.snapshot().last_step_tokens == 20 + 64 * partials
    drain(eng)
    assert_clean(eng)


def test_chat_template_is_sandboxed_and_messages_are_data(engine):
    """Message text that looks like template code is rendered literally; a hostile template cannot
    reach Python internals (jinja2's sandbox) and fails as a typed error of that request only."""
    literal = "{{ 7 * 7 }} {% for x in range(3) %}x{% endfor %}"
    ids = engine.encode_prompt(messages=[{"role": "user", "content": literal}])
    text = engine.tokenizer.decode(ids)
    assert literal in text and "49" not in text
    tok = engine.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
        with pytest.raises(RequestError, match="chat template failed"):
            engine.encode_prompt(messages=[{"role": "user", "content": "hi"}])
        tok.chat_template = "{{ raise_exception('only user and assistant roles') }}"
        with pytest.raises(RequestError, match="only user and assistant roles"):
            engine.encode_prompt(messages=[{"role": "tool", "content": "hi"}])
    finally:
        tok.chat_template = saved
    assert engine.encode_prompt(messages=[{"role": "user", "content": "hi"}])
