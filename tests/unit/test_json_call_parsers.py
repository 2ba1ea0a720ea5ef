"""Forced tool calls for a model without a tool-call format (worker/engine/tool_parsers/json_calls.py): a
named function's arguments and "required"'s JSON list of calls, parsed however the text is chunked, the
grammar of each accepting exactly its own shape (against xgrammar), and the prompt's preamble and
tool turns as text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.engine.structured_cases import TOOLS
from worker.engine.errors import ToolsUnsupported
from worker.engine.tool_calling import (
    calls_as_text,
    json_call_parser,
    request_parser,
    tool_grammar,
    tools_preamble,
    with_preamble,
)
from worker.engine.tool_parsers import call_id
from worker.engine.tool_parsers.json_calls import JsonCallListParser, NamedArgumentsParser

WEATHER_ARGS = '{"city": "Paris", "unit": "c"}'
ADD_ARGS = '{"a": 1, "b": 2}'
TWO = f'[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}, {{"name": "add", "parameters": {ADD_ARGS}}}]'
NAMED = {"type": "function", "function": {"name": "add"}}


def parse(parser_cls, text: str, seed: int):
    """Feed `text` in random pieces: (content, streamed calls in order, final calls, parser)."""
    rnd = random.Random(seed)
    parser = parser_cls("req-1", 0)
    content, streamed = "", {}
    i = 0
    while i < len(text):
        k = rnd.randint(1, 7)
        d = parser.feed(text[i : i + k])
        i += k
        content += d.content
        for t in d.tool_calls:
            s = streamed.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            assert t.id is None or s["id"] is None  # the id and the name come once
            s["id"], s["name"] = t.id or s["id"], t.name or s["name"]
            s["arguments"] += t.arguments
    content += parser.finish().content
    return content, [streamed[i] for i in sorted(streamed)], parser.tool_calls(), parser


@pytest.mark.parametrize("seed", range(6))
def test_a_list_of_calls_parses_however_it_is_chunked(seed):
    content, streamed, final, parser = parse(JsonCallListParser, TWO, seed)
    assert content == "" and parser.num_complete == 2
    assert [(c.function.name, c.function.arguments) for c in final] == [
        ("get_weather", WEATHER_ARGS),
        ("add", ADD_ARGS),
    ]
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed] == [
        (c.id, c.function.name, c.function.arguments) for c in final
    ]
    assert [c.id for c in final] == [call_id("req-1", 0, 0), call_id("req-1", 0, 1)]


@pytest.mark.parametrize("seed", range(6))
def test_a_named_call_is_the_whole_answer(seed):
    text = '{"a": 1, "b": {"c": "}]"}}'
    content, streamed, final, parser = parse(request_parser(NamedArgumentsParser, NAMED), text, seed)
    assert content == "" and parser.num_complete == 1
    assert [(c.id, c.function.name, c.function.arguments) for c in final] == [(call_id("req-1", 0, 0), "add", text)]
    assert [(s["id"], s["name"], s["arguments"]) for s in streamed] == [(final[0].id, "add", text)]


def test_calls_cut_short_are_partial_and_not_complete():
    _, streamed, final, parser = parse(JsonCallListParser, TWO[:105], 0)
    assert parser.num_complete == 1 and len(final) == 2
    assert final[1].function.name == "add" and streamed[1]["arguments"] == final[1].function.arguments
    _, _, final, parser = parse(request_parser(NamedArgumentsParser, NAMED), '{"a": 1, "b', 0)
    assert parser.num_complete == 0 and final[0].function.arguments == '{"a": 1, "b'


def test_auto_needs_the_models_own_format():
    assert json_call_parser("required") is JsonCallListParser
    assert json_call_parser(NAMED) is NamedArgumentsParser
    for choice in ("auto", None):
        with pytest.raises(ToolsUnsupported, match="--tool-call-parser"):
            json_call_parser(choice)


@pytest.fixture(scope="module")
def compiler(llama_dir):
    from transformers import AutoTokenizer

    from worker.engine.structured.compiler import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(llama_dir)
    return GrammarCompiler(tok, vocab_size=len(tok), stop_token_ids=frozenset([tok.eos_token_id]))


def accepts(compiler, spec, text: str) -> bool:
    m = compiler.matcher(compiler.get(spec).result())
    return m.accept_string(text) and m.is_completed()


def test_the_grammars_accept_exactly_their_shape(compiler):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    one = TWO.split(", {")[0] + "]"
    required = tool_grammar(JsonCallListParser, tools, "required", frozenset())
    single = tool_grammar(JsonCallListParser, tools, "required", frozenset(), parallel=False)
    named = tool_grammar(
        NamedArgumentsParser, tools, {"type": "function", "function": {"name": "get_weather"}}, frozenset()
    )
    assert accepts(compiler, required, one) and accepts(compiler, required, TWO)
    assert accepts(compiler, single, one) and not accepts(compiler, single, TWO)
    assert not accepts(compiler, required, "[]") and not accepts(compiler, required, one.replace('"c"', '"k"'))
    assert accepts(compiler, named, WEATHER_ARGS) and not accepts(compiler, named, one)
    assert not accepts(compiler, named, '{"city": "Paris"}')  # unit is required


def test_the_preamble_and_tool_turns_as_text():
    tools = TOOLS[:2]
    listed = "\n".join(json.dumps(t) for t in tools)
    head = "You can call these functions (their parameters are JSON schemas):\n" + listed + "\n"
    shape = '[{"name": <function name>, "parameters": <arguments>}]'
    assert tools_preamble(tools, "required", True) == head + f"Answer with a JSON list of one or more calls: {shape}"
    assert tools_preamble(tools, "required", False) == head + f"Answer with a JSON list of exactly one call: {shape}"
    assert tools_preamble(tools, NAMED, True) == head + "Call add: answer with its arguments, one JSON object."

    user = {"role": "user", "content": "hi"}
    assert with_preamble([user], "P") == [{"role": "system", "content": "P"}, user]
    assert with_preamble([{"role": "developer", "content": "Be brief."}, user], "P")[0] == {
        "role": "developer",
        "content": "P\n\nBe brief.",
    }

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    turns = calls_as_text([user, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert turns[1] == {"role": "assistant", "content": '[{"name": "add", "parameters": {"a": 1}}]'}
    assert calls_as_text([{"role": "assistant", "content": "Sure.", "tool_calls": [call]}])[0]["content"] == (
        'Sure.\n[{"name": "add", "parameters": {"a": 1}}]'
    )


def test_the_docs_quote_the_preamble_as_the_code_writes_it():
    from worker.engine import tool_calling

    docs = " ".join((Path(__file__).parents[2] / "docs" / "structured-outputs.md").read_text().split())
    first_line = tool_calling.TOOLS_PREAMBLE.split("\n")[0]
    named = tool_calling.ANSWER_NAMED.format(name="NAME")
    for text in (first_line, named, tool_calling.ANSWER_LIST, tool_calling.ANSWER_ONE):
        assert text in docs, text
