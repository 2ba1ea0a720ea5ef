"""Tool calls on a worker started with no tool flags (no --tool-call-parser, and the tiny model's own chat
template, which renders no tools), read with the official `openai` client: a named function and
"required" are served as plain JSON under a grammar (vLLM's way), returned as `tool_calls` exactly as
the parser path returns them, whole and streamed; the prompt shows the tools in pagedq's preamble (the
prompt's token count is transformers' rendering of the documented text); a tool turn sent back is
rendered as text; "auto" is still a 400 naming `tools`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.gateway_proc import request
from tests.service.worker_proc import WorkerProc

MODEL = "no-tool-flags"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 100},
                "b": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris, in celsius?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BASE = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120)
# The system turn a forced call gets when the chat template renders no tools (docs/structured-outputs.md).
TOOL_LINES = "\n".join(json.dumps(t) for t in TOOLS)
PREAMBLE_NAMED = (
    "You can call these functions (their parameters are JSON schemas):\n"
    f"{TOOL_LINES}\nCall get_weather: answer with its arguments, one JSON object."
)


@pytest.fixture(scope="module")
def plain_worker(llama_dir, gw_redis_url):
    """The tiny model with no tool flags, under a model name of its own."""
    w = WorkerProc(llama_dir, gw_redis_url, "--max-model-len", "1024", name="plain", model=MODEL).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def client(gateway, plain_worker):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused")


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


def prompt_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def assert_valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def streamed(client, **kw):
    """(the calls assembled from `delta.tool_calls`, the content streamed, the last finish_reason)."""
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls: dict[int, dict] = {}
    for d in (d for c in chunks for d in c.choices[0].delta.tool_calls or []):
        call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id is not None:
            assert call["id"] is None and d.type == "function"  # id and name come once, first
            call["id"], call["name"] = d.id, d.function.name
        call["arguments"] += d.function.arguments or ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return [calls[i] for i in sorted(calls)], content, chunks[-1].choices[0].finish_reason


def as_tuples(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


def test_a_named_call_whole_and_streamed(client, tokenizer):
    reply = client.chat.completions.create(**BASE, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid([call])
    # The prompt: the chat with the preamble first in its system turn, as transformers renders it.
    system = {"role": "system", "content": f"{PREAMBLE_NAMED}\n\n{MESSAGES[0]['content']}"}
    assert reply.usage.prompt_tokens == prompt_tokens(tokenizer, [system, *MESSAGES[1:]])

    calls, content, finish = streamed(client, **BASE, tool_choice=NAMED)
    assert [(c["name"], c["arguments"]) for c in calls] == as_tuples([call])  # greedy: the same call
    assert calls[0]["id"].startswith("call_") and content == "" and finish == "tool_calls"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_with_two_functions(client, parallel):
    kw = dict(**BASE, tool_choice="required", parallel_tool_calls=parallel)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert_valid(calls)
    assert len({c.id for c in calls}) == len(calls)
    if not parallel:
        assert len(calls) == 1

    got, content, finish = streamed(client, **kw)
    assert [(c["name"], c["arguments"]) for c in got] == as_tuples(calls)
    assert content == "" and finish == "tool_calls"


def test_required_at_temperature_one_validates_every_call(client):
    """Sampled (seeds 0..5): each call names one of the two functions with valid arguments; with
    parallel calls off, always exactly one."""
    for seed in range(6):
        for parallel in (False, True):
            kw = dict(BASE, temperature=1.0, seed=seed, parallel_tool_calls=parallel, tool_choice="required")
            choice = client.chat.completions.create(**kw).choices[0]
            calls = choice.message.tool_calls
            if choice.finish_reason == "length":  # a random model may go on calling: the last one is partial
                calls = calls[:-1]
            else:
                assert choice.finish_reason == "tool_calls"
            if calls:
                assert_valid(calls)
            if not parallel:
                assert len(choice.message.tool_calls) == 1


def test_a_full_tool_round_trip(client, tokenizer):
    called = client.chat.completions.create(**BASE, tool_choice=NAMED).choices[0].message
    call = called.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    answer = client.chat.completions.create(
        **{**BASE, "max_tokens": 8, "messages": [*MESSAGES, called, result]}, tool_choice="none"
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    # The assistant turn's call is rendered as the JSON list a forced call answers with.
    listed = json.dumps(
        [{"name": "get_weather", "parameters": json.loads(call.function.arguments)}], ensure_ascii=False
    )
    turn = {"role": "assistant", "content": listed}
    assert answer.usage.prompt_tokens == prompt_tokens(tokenizer, [*MESSAGES, turn, result])


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_without_a_parser_is_still_a_400(gateway, plain_worker, choice):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8}
    if choice is not None:
        body["tool_choice"] = choice
    status, _, reply = request(gateway.port, "POST", "/v1/chat/completions", body)
    err = json.loads(reply)["error"]
    assert (status, err["code"], err["param"]) == (400, "tools_unsupported", "tools")
    assert "--tool-call-parser" in err["message"]
