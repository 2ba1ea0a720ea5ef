"""Constrained decoding in the engine (xgrammar): JSON schema, regex, choice, EBNF; n > 1; every
scheduling path (chunked prefill, prefix caching, preemption); resume from delivered tokens; stops and
max_tokens; typed errors for bad, slow and unsatisfiable grammars, which end only their own request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from tests.engine.structured_cases import ORDER_SCHEMA
from tests.engine.test_engine_behaviour import drain
from tests.engine.test_engine_equality import assert_clean
from worker import LLMEngine, SamplingParams
from worker.engine.structured.compiler import GrammarCompiler

pytestmark = pytest.mark.slow

JSON = {"json": ORDER_SCHEMA, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=512)


def run(engine: LLMEngine, requests: dict[str, tuple], **kw) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, **kw)
    return drain(engine)


def greedy(max_tokens: int = 200, **so) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs={"disable_any_whitespace": True, **so} if so else JSON
    )


def test_json_schema_answers_validate_at_temperature_one(engine):
    reqs = {
        f"j{i}": (f"order {i}:", SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=JSON))
        for i in range(24)
    }
    outs = run(engine, reqs)
    stopped = [o.outputs[0] for o in outs.values() if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 22
    for c in stopped:
        jsonschema.validate(json.loads(c.text), ORDER_SCHEMA)
    assert len({c.text for c in stopped}) > 1
    assert engine.structured.mask_stats.steps > 0
    assert_clean(engine)


def test_regex_choice_and_ebnf_grammar(engine):
    reqs = {
        "re": (
            "id:",
            SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs={"regex": r"[a-c]{3}-\d{2}"}),
        ),
        "ch": (
            "pick:",
            SamplingParams(
                temperature=1.0, seed=4, max_tokens=40, structured_outputs={"choice": ["yes", "no", "maybe so"]}
            ),
        ),
        "gr": (
            "sum:",
            SamplingParams(
                temperature=1.0,
                seed=5,
                max_tokens=40,
                structured_outputs={"grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'},
            ),
        ),
        "free": ("text:", SamplingParams(temperature=1.0, seed=6, max_tokens=8)),  # unconstrained in the same batch
    }
    outs = run(engine, reqs)
    assert re.fullmatch(r"[a-c]{3}-\d{2}", outs["re"].outputs[0].text)
    assert outs["ch"].outputs[0].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", outs["gr"].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for k, o in outs.items() if k != "free")
    assert outs["free"].outputs[0].finish_reason == "length"
    assert_clean(engine)


def test_each_of_n_samples_follows_its_own_matcher(engine):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=256, structured_outputs=JSON)
    out = run(engine, {"n4": ("orders:", params)})["n4"]
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 3 and len(set(texts)) == len(texts)
    for t in texts:
        jsonschema.validate(json.loads(t), ORDER_SCHEMA)
    assert_clean(engine)


PROMPTS = {f"g{i}": " ".join(["shared prefix of many words"] * 6) + f" request {i}" for i in range(6)}


def greedy_tokens(engine: LLMEngine) -> dict[str, list[int]]:
    outs = run(engine, {rid: (p, greedy()) for rid, p in PROMPTS.items()})
    assert all(o.outputs[0].finish_reason == "stop" for o in outs.values())
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},  # chunked prefill, small chunks
        {"enable_prefix_caching": False},
        {"num_kv_blocks": 48, "block_size": 8},  # too few blocks for all six: preemption by recompute
    ],
    ids=["chunked", "no-prefix-cache", "preempted"],
)
def test_greedy_constrained_output_is_the_same_under_every_schedule(engine, llama_dir, options):
    want = greedy_tokens(engine)
    other = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", **{"num_kv_blocks": 512, **options})
    assert greedy_tokens(other) == want
    if "block_size" in options:
        assert other.snapshot().num_preemptions > 0
    assert_clean(other)


def test_a_resumed_request_replays_its_delivered_tokens_into_a_fresh_matcher(engine):
    prompt = "resume me:"
    full = run(engine, {"whole": (prompt, greedy())})["whole"].outputs[0]
    assert full.finish_reason == "stop"
    for cut in (1, len(full.token_ids) // 2, len(full.token_ids) - 1):
        again = run(engine, {f"r{cut}": (prompt, greedy())}, resume=[full.token_ids[:cut]])[f"r{cut}"].outputs[0]
        assert again.token_ids == full.token_ids and again.text == full.text
    assert_clean(engine)


def test_delivered_tokens_the_grammar_refuses_end_the_request_with_a_typed_error(engine):
    bad = engine.tokenizer("not json", add_special_tokens=False).input_ids
    out = run(engine, {"odd": ("x", greedy())}, resume=[bad])["odd"]
    assert out.error_code == "grammar_unsatisfiable" and out.outputs[0].finish_reason == "abort"
    assert_clean(engine)


def test_stop_strings_and_max_tokens_end_with_the_partial_text(engine):
    full = run(engine, {"f": ("stops:", greedy())})["f"].outputs[0]
    short = run(engine, {"s": ("stops:", greedy(max_tokens=5))})["s"].outputs[0]
    assert short.finish_reason == "length" and full.text.startswith(short.text) and len(short.token_ids) == 5
    params = greedy()
    params.stop = [","]
    cut = run(engine, {"c": ("stops:", params)})["c"].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "," and cut.text == full.text.split(",")[0]
    assert_clean(engine)


def test_a_bad_grammar_ends_only_its_own_request(engine):
    reqs = {
        "bad": ("x", SamplingParams(max_tokens=10, structured_outputs={"grammar": "root ::= ( unclosed"})),
        "ok": ("y", SamplingParams(temperature=0, max_tokens=6)),
    }
    outs = run(engine, reqs)
    assert outs["bad"].error_code == "invalid_grammar" and "compile" in outs["bad"].error
    assert outs["ok"].error is None and outs["ok"].outputs[0].finish_reason == "length"
    assert_clean(engine)


def test_a_grammar_the_model_cannot_satisfy_ends_only_its_own_request(engine):
    # After "a" the grammar allows only EOS, which min_tokens forbids: no token is left.
    stuck = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, structured_outputs={"choice": ["a"]})
    outs = run(engine, {"stuck": ("x", stuck), "ok": ("y", SamplingParams(temperature=0, max_tokens=6))})
    assert outs["stuck"].error_code == "grammar_unsatisfiable"
    assert outs["ok"].error is None and len(outs["ok"].outputs[0].token_ids) == 6
    assert_clean(engine)


def test_a_slow_compile_never_stalls_a_step_and_times_out(llama_dir, monkeypatch):
    """A compile blocked on an event (a fault hook): the unconstrained request runs to the end meanwhile,
    and the constrained one fails with grammar_timeout once the compile deadline passes."""
    release = threading.Event()
    compile_ = GrammarCompiler._compile

    def blocked(self, spec):
        release.wait(30)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", blocked)
    eng = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=128, grammar_compile_timeout=1.0)
    try:
        eng.add_request("slow", "x", greedy())
        eng.add_request("free", "y", SamplingParams(temperature=0, max_tokens=8))
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
                    if o.request_id == "free":
                        assert "slow" not in outs  # finished while the grammar was still compiling
        assert outs["free"].outputs[0].finish_reason == "length"
        assert outs["slow"].error_code == "grammar_timeout"
    finally:
        release.set()
    assert_clean(eng)


def test_equal_schemas_share_one_compile(engine):
    fresh = {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}, "v": {"enum": ["x", "y"]}},
        "required": ["k"],
    }
    reordered = {
        "required": ["k"],
        "properties": {"v": {"enum": ["x", "y"]}, "k": {"type": "integer", "minimum": 0, "maximum": 9}},
        "type": "object",
    }
    before = len(engine.structured.compile_seconds())
    outs = run(engine, {"a": ("p", greedy(40, json=fresh)), "b": ("q", greedy(40, json=reordered))})
    assert len(engine.structured.compile_seconds()) == before + 1
    for o in outs.values():
        jsonschema.validate(json.loads(o.outputs[0].text), fresh)
    assert_clean(engine)


def test_smollm2_answers_follow_the_schema_and_call_tools_validly(smollm2_dir):
    """The real SmolLM2 (with pagedq's Hermes template): JSON answers sampled at temperature 1.0 validate,
    and forced calls pick a tool and valid arguments."""
    from tests.engine.structured_cases import TOOL_MESSAGES, TOOLS, assert_valid_calls
    from worker.models.chat_templates import HERMES_TOOLS

    eng = LLMEngine(
        model=str(smollm2_dir), dtype="float32", device="cpu", num_kv_blocks=1024, chat_template=str(HERMES_TOOLS)
    )
    ask = [{"role": "user", "content": "Write a customer order as JSON."}]
    for i in range(6):
        eng.add_request(
            f"j{i}",
            messages=ask,
            params=SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=JSON),
        )
    for i in range(2):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=200)
        eng.add_request(
            f"t{i}",
            messages=TOOL_MESSAGES,
            params=params,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
        )
    outs = drain(eng)
    for i in range(6):
        c = outs[f"j{i}"].outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), ORDER_SCHEMA)
    for i in range(2):
        c = outs[f"t{i}"].outputs[0]
        assert c.finish_reason == "tool_calls", c.text
        assert_valid_calls(c.tool_calls)
    assert_clean(eng)
