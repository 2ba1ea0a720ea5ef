"""Tool calling in the engine: tools rendered by the chat template, forced calls through the grammar
(tool_choice "required" or a named function), finish_reason "tool_calls", streamed deltas that add up
to the final calls, follow-up turns with role "tool", and typed errors for models without a format."""

from __future__ import annotations

import pytest

from tests.engine.structured_cases import TOOL_MESSAGES, TOOLS, assert_valid_calls, joined_deltas
from tests.engine.test_engine_equality import assert_clean
from worker import LLM, LLMEngine, SamplingParams
from worker.engine.errors import ToolsUnsupported
from worker.models.chat_templates import HERMES_TOOLS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(
        model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=512, chat_template=str(HERMES_TOOLS)
    )


def stream(engine: LLMEngine, requests: dict[str, dict]) -> tuple[dict, dict]:
    """Run to the end; the final outputs, and per request and sample every tool-call delta streamed."""
    for rid, kw in requests.items():
        engine.add_request(rid, **kw)
    finals, deltas = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                deltas.setdefault(out.request_id, {}).setdefault(c.index, []).extend(c.delta_tool_calls)
            if out.finished:
                finals[out.request_id] = out
    return finals, deltas


def test_the_tool_format_is_detected_from_the_chat_template(engine, llama_dir):
    assert engine.input_processor.tool_parser.name == "hermes"
    prompt = engine.tokenizer.decode(engine.encode_prompt(messages=TOOL_MESSAGES, tools=TOOLS))
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    plain = LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    assert plain.input_processor.tool_parser is None
    with pytest.raises(ToolsUnsupported, match="--tool-call-parser"):
        plain.add_request("t", messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="auto")


def test_required_calls_validate_and_their_deltas_add_up(engine):
    """With parallel calls (the default) a random model may keep calling until max_tokens: every complete
    call still validates, and what was streamed adds up to it."""
    reqs = {
        f"t{i}": dict(
            messages=TOOL_MESSAGES,
            params=SamplingParams(temperature=1.0, seed=i, max_tokens=300),
            tools=TOOLS,
            tool_choice="required",
        )
        for i in range(6)
    }
    finals, deltas = stream(engine, reqs)
    for rid, out in finals.items():
        c = out.outputs[0]
        assert out.error is None and c.text.startswith("<tool_call>\n{") and c.content == ""
        assert c.finish_reason in ("tool_calls", "length")
        assert_valid_calls(c.tool_calls, c.finish_reason)
        streamed = [(s["id"], s["name"], s["arguments"]) for _, s in sorted(joined_deltas(deltas[rid][0]).items())]
        assert streamed == [(t.id, t.function.name, t.function.arguments) for t in c.tool_calls]
    assert_clean(engine)


def test_without_parallel_calls_required_is_one_call(engine):
    reqs = {
        f"p{i}": dict(
            messages=TOOL_MESSAGES,
            params=SamplingParams(temperature=1.0, seed=i, max_tokens=300),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        for i in range(4)
    }
    finals, _ = stream(engine, reqs)
    for out in finals.values():
        c = out.outputs[0]
        assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1
        assert_valid_calls(c.tool_calls)
    assert_clean(engine)


def test_a_named_function_is_the_one_call(engine):
    choice = {"type": "function", "function": {"name": "add"}}
    finals, _ = stream(
        engine,
        {
            f"n{i}": dict(
                messages=TOOL_MESSAGES,
                params=SamplingParams(temperature=1.0, seed=i, max_tokens=200),
                tools=TOOLS,
                tool_choice=choice,
            )
            for i in range(4)
        },
    )
    for out in finals.values():
        c = out.outputs[0]
        assert c.finish_reason == "tool_calls" and [t.function.name for t in c.tool_calls] == ["add"]
        assert_valid_calls(c.tool_calls)
    assert_clean(engine)


def test_n_samples_make_their_own_calls_with_their_own_ids(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=300)
    req = dict(messages=TOOL_MESSAGES, params=params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    finals, _ = stream(engine, {"n": req})
    calls = [c.tool_calls for c in finals["n"].outputs]
    assert len(calls) == 3 and all(c.finish_reason == "tool_calls" for c in finals["n"].outputs)
    for sample in calls:
        assert_valid_calls(sample)
    ids = [t.id for sample in calls for t in sample]
    assert len(ids) == len(set(ids))
    assert_clean(engine)


def test_auto_leaves_the_model_free_and_none_parses_nothing(engine):
    auto = dict(messages=TOOL_MESSAGES, params=SamplingParams(temperature=0, max_tokens=12), tools=TOOLS)
    finals, _ = stream(engine, {"auto": auto, "none": {**auto, "tool_choice": "none"}})
    for rid in ("auto", "none"):
        c = finals[rid].outputs[0]
        assert c.finish_reason == "length" and c.tool_calls is None  # a random model writes no call
    assert finals["auto"].outputs[0].content == finals["auto"].outputs[0].text
    assert finals["none"].outputs[0].content is None  # nothing parsed
    assert_clean(engine)


def test_a_tool_turn_follows_up(engine):
    first, _ = stream(
        engine,
        {
            "ask": dict(
                messages=TOOL_MESSAGES,
                params=SamplingParams(temperature=0, max_tokens=200),
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
        },
    )
    call = first["ask"].outputs[0].tool_calls[0]
    follow = [
        *TOOL_MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    prompt = engine.tokenizer.decode(engine.encode_prompt(messages=follow, tools=TOOLS))
    assert "<tool_response>" in prompt and prompt.count('"name": "get_weather"') == 2  # the tool and the call
    second, _ = stream(
        engine, {"reply": dict(messages=follow, params=SamplingParams(temperature=0, max_tokens=5), tools=TOOLS)}
    )
    assert second["reply"].error is None and len(second["reply"].outputs[0].token_ids) == 5
    assert_clean(engine)


def test_the_offline_llm_chats_with_tools(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=128, chat_template=str(HERMES_TOOLS))
    out = llm.chat(
        TOOL_MESSAGES,
        SamplingParams(temperature=0, max_tokens=200),
        tools=TOOLS,
        tool_choice="required",
        use_tqdm=False,
    )[0]
    assert out.outputs[0].finish_reason in ("tool_calls", "length")
    assert_valid_calls(out.outputs[0].tool_calls, out.outputs[0].finish_reason)
