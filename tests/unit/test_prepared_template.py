"""The prepared model's chat template: the model's own without tools (rendered byte for byte as before),
pagedq's Hermes template with tools, so `pagedq up`'s bundled model serves tool calls."""

from __future__ import annotations

import shutil

import pytest

from worker.engine.tool_parsers import detect_tool_parser
from worker.models.chat_templates import HERMES_TOOLS
from worker.models.prepare import TEMPLATE_FILE, TOOLS_MARK, ensure_tool_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
    ],
]


def _render(tok, chat, **kw) -> str:
    return tok.apply_chat_template(chat, tokenize=False, **kw)


@pytest.fixture(scope="module")
def wrapped(llama_dir, tmp_path_factory):
    """The tiny model's tokenizer before and after `ensure_tool_template` (on a copy)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("wrapped") / "m"
    shutil.copytree(llama_dir, folder)
    before = AutoTokenizer.from_pretrained(folder)
    ensure_tool_template(folder)
    text = (folder / TEMPLATE_FILE).read_text()
    ensure_tool_template(folder)  # a second run changes nothing
    assert (folder / TEMPLATE_FILE).read_text() == text
    return before, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_chat_without_tools_renders_exactly_as_the_models_own_template(wrapped, chat, add_generation_prompt):
    before, after = wrapped
    assert after.chat_template.startswith(TOOLS_MARK) and not before.chat_template.startswith(TOOLS_MARK)
    kw = {"add_generation_prompt": add_generation_prompt}
    assert _render(after, chat, **kw) == _render(before, chat, **kw)
    assert _render(after, chat, tools=None, **kw) == _render(before, chat, **kw)


@pytest.mark.parametrize("chat", CHATS)
def test_a_chat_with_tools_renders_as_the_hermes_template(wrapped, chat):
    before, after = wrapped
    hermes = HERMES_TOOLS.read_text()
    expected = before.apply_chat_template(
        chat, tools=TOOLS, chat_template=hermes, add_generation_prompt=True, tokenize=False
    )
    rendered = _render(after, chat, tools=TOOLS, add_generation_prompt=True)
    assert rendered == expected and "<tools>" in rendered and "get_weather" in rendered
    assert detect_tool_parser(after.chat_template) == "hermes" and detect_tool_parser(before.chat_template) is None


def test_the_bundled_smollm2_keeps_its_default_system_prompt_and_gains_tools(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template.startswith(TOOLS_MARK)
    plain = _render(tok, CHATS[0], add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in plain  # SmolLM2's own template, as before
    with_tools = _render(tok, CHATS[0], tools=TOOLS, add_generation_prompt=True)
    assert "<tools>" in with_tools and "get_weather" in with_tools
