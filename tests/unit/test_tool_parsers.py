"""Tool-call parsers (hermes, llama3_json, mistral) and the grammar pieces of structured outputs: however
the text is chunked, the streamed deltas add up to the final calls; each format's forced grammar
accepts exactly its own calls; grammar specs hash canonically; the bitmask masks what it should."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.engine.structured_cases import TOOLS
from worker.engine.config import TOOL_PARSER_NAMES
from worker.engine.structured.spec import GrammarSpec, fix_bounded_strings, spec_from_params
from worker.engine.tool_parsers import TOOL_PARSERS, call_id, detect_tool_parser
from worker.engine.tool_parsers.json_scan import JsonCallScanner
from worker.models.chat_templates import HERMES_TOOLS

CALLS = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 1, "b": [2, {"c": "}]"}]}')]

TEXTS = {
    "hermes": "Let me check. <tool_call>\n"
    + "\n</tool_call>\n<tool_call>\n".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in CALLS)
    + "\n</tool_call>",
    "llama3_json": "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in CALLS),
    "mistral": "Let me check. [TOOL_CALLS]["
    + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in CALLS)
    + "]",
}
CONTENT = {"hermes": "Let me check. ", "llama3_json": "", "mistral": "Let me check. "}


def parse(name: str, text: str, seed: int):
    """Feed `text` in random pieces; (content, streamed calls by index, final calls, parser)."""
    rnd = random.Random(seed)
    parser = TOOL_PARSERS[name]("req-1", 0)
    content, streamed = "", {}
    i = 0
    while i < len(text):
        k = rnd.randint(1, 7)
        d = parser.feed(text[i : i + k])
        i += k
        content += d.content
        for t in d.tool_calls:
            s = streamed.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            s["id"], s["name"] = t.id or s["id"], t.name or s["name"]
            s["arguments"] += t.arguments
    content += parser.finish().content
    return content, streamed, parser.tool_calls(), parser


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_add_up_to_the_final_calls_however_the_text_is_chunked(name, seed):
    content, streamed, final, parser = parse(name, TEXTS[name], seed)
    assert content == CONTENT[name] == parser.content
    assert [(c.function.name, c.function.arguments) for c in final] == CALLS
    assert [(s["id"], s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [
        (c.id, c.function.name, c.function.arguments) for c in final
    ]
    assert [c.id for c in final] == [call_id("req-1", 0, 0), call_id("req-1", 0, 1)]
    assert parser.num_complete == 2


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", "No call here, just <tool talk and a dangling <tool_c"),
        ("hermes", "<tool_call> not json"),
        ("llama3_json", "Plain answer with {braces}"),
        ("mistral", "Plain answer [TOOL_CALL"),
    ],
)
def test_text_without_a_call_is_all_content(name, text):
    content, streamed, final, _ = parse(name, text, 0)
    assert final == [] and streamed == {}
    assert content == text


def test_a_call_cut_short_is_partial_streamed_and_final_alike():
    _, streamed, final, parser = parse("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1', 0)
    assert parser.num_complete == 0
    assert streamed[0]["name"] == "add" and streamed[0]["arguments"] == '{"a": 1'
    assert [(c.function.name, c.function.arguments) for c in final] == [("add", '{"a": 1')]


def test_the_json_scanner_finds_name_and_arguments_in_any_order():
    for text, name, args in [
        ('{"arguments": {"x": "\\"}"}, "name": "g"}', "g", '{"x": "\\"}"}'),
        ('{"name": "h", "arguments": 5 }', "h", "5"),
        ('{"name": "h", "arguments": "{\\"a\\": 1}"}', "h", '{"a": 1}'),  # arguments as a JSON string
        ('{"name": "h", "other": [1, {"arguments": 2}], "arguments": []}', "h", "[]"),
    ]:
        s = JsonCallScanner()
        for ch in text:
            s.feed(ch)
        assert s.done and s.name == name and s.arguments() == args


def test_parsers_are_named_as_the_config_names_them_and_detected_from_templates():
    assert tuple(sorted(TOOL_PARSERS)) == tuple(sorted(TOOL_PARSER_NAMES))
    assert detect_tool_parser(HERMES_TOOLS.read_text()) == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None


# --- forced grammars, against xgrammar -------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(llama_dir):
    from transformers import AutoTokenizer

    from worker.engine.structured.compiler import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(llama_dir)
    return GrammarCompiler(tok, vocab_size=len(tok), stop_token_ids=frozenset([tok.eos_token_id]))


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    m = compiler.matcher(compiler.get(spec).result())
    return m.accept_string(text) and m.is_completed()


WEATHER = '{"name": "get_weather", "%s": {"city": "Paris", "unit": "c"}}'
ADD = '{"name": "add", "%s": {"a": 1, "b": [2]}}'
FORCED = {  # (one call, two calls) as each format's grammar writes them
    "hermes": (
        f"<tool_call>\n{WEATHER % 'arguments'}\n</tool_call>",
        f"<tool_call>\n{WEATHER % 'arguments'}\n</tool_call>\n<tool_call>\n{ADD % 'arguments'}\n</tool_call>",
    ),
    "llama3_json": (WEATHER % "parameters", f"{WEATHER % 'parameters'}; {ADD % 'parameters'}"),
    "mistral": (
        f"[TOOL_CALLS][{WEATHER % 'arguments'}]",
        f"[TOOL_CALLS][{WEATHER % 'arguments'}, {ADD % 'arguments'}]",
    ),
}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_each_format_forces_its_own_valid_calls(compiler, name):
    from worker.engine.tool_calling import tool_grammar

    parser = TOOL_PARSERS[name]
    tools = [TOOLS[0], {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    one, two = FORCED[name]
    required = tool_grammar(parser, tools, "required", frozenset())
    single = tool_grammar(parser, tools, "required", frozenset(), parallel=False)
    named = tool_grammar(parser, tools, {"type": "function", "function": {"name": "add"}}, frozenset())
    assert tool_grammar(parser, tools, "auto", frozenset()) is None
    assert accepts(compiler, required, one) and accepts(compiler, required, two)
    assert accepts(compiler, single, one) and not accepts(compiler, single, two)
    assert not accepts(compiler, named, one)  # get_weather is not the named function
    assert not accepts(compiler, required, one.replace('"c"', '"kelvin"'))  # not in the enum
    assert not accepts(compiler, required, "")  # at least one call
    _, _, final, _ = parse(name, two, 1)
    assert [c.function.name for c in final] == ["get_weather", "add"]


def test_grammar_specs_hash_canonically_and_bounded_strings_stay_json():
    a = spec_from_params(_so(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = spec_from_params(_so(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert a == b and a.key == b.key
    assert spec_from_params(_so(json={"type": "object"}, disable_any_whitespace=True)).key != a.key
    fixed = fix_bounded_strings({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    assert "maxLength" not in json.dumps(fixed) and fixed["properties"]["s"]["pattern"].endswith("{0,3}$")
    untouched = {"type": "string", "maxLength": 3, "pattern": "^a+$"}
    assert fix_bounded_strings(untouched) == untouched


def test_bounded_strings_admit_no_raw_control_character(compiler):
    spec = spec_from_params(_so(json={"type": "string", "maxLength": 4}, disable_any_whitespace=True))
    assert accepts(compiler, spec, '"abé"')
    assert not accepts(compiler, spec, '"a\tb"')
    assert not accepts(compiler, spec, '"abcde"')


def test_the_bitmask_masks_exactly_the_forbidden_tokens(compiler):
    from worker.engine.structured.bitmask import apply_bitmask

    m = compiler.matcher(compiler.get(spec_from_params(_so(choice=["yes", "no"]))).result())
    vocab = compiler.info.vocab_size
    mask = torch.zeros(2, -(-vocab // 32), dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 1)
    logits = torch.zeros(2, vocab)
    apply_bitmask(logits, mask, torch.tensor([1], dtype=torch.int32))
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(bool(m.accept_token(t)) for t in allowed[:1])
    assert torch.isfinite(logits[0]).all()  # row 0 is not constrained
    assert len(allowed) < vocab


def _so(**kw):
    from producer_sdk.chat import StructuredOutputsParams

    return StructuredOutputsParams(**kw)
