"""Logprobs as text (issue 47): the official `openai` client against the real gateway, worker (tiny Llama,
byte-level BPE) and redis-server. Each logprobs entry's `token` is the token's text and `bytes` its UTF-8
bytes; the texts concatenate to the output text, the bytes to its UTF-8 bytes, also where a character is
split over two tokens; `token_id:N` only with vLLM's `return_tokens_as_token_ids` (request field or
gateway flag)."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from producer_sdk import AsyncClient, Client
from tests.gateway.gateway_proc import GatewayProc

# Forced with structured_outputs: characters of 2, 3 and 4 UTF-8 bytes, which the tiny tokenizer (512
# byte-level tokens) splits over several tokens.
FORCED = "café 日本語 🚀!"
MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused")


@pytest.fixture(scope="module")
def special_texts(llama_dir) -> set[str]:
    """Special tokens keep their own text in logprobs (as vLLM shows them) where the output text skips them."""
    tok = AutoTokenizer.from_pretrained(llama_dir)
    return set(tok.all_special_tokens)


def _forced(**kw):
    return {"structured_outputs": {"choice": [FORCED]}, **kw}


def _split_somewhere(entries) -> bool:
    """Some entry's bytes are not a whole character (its text holds less than its bytes)."""
    return any(e_bytes and e_text.encode() != bytes(e_bytes) for e_text, e_bytes in entries)


def _check_chat(entries, text, special):
    """entries: the chat logprobs content of one choice (whole, or every chunk's joined)."""
    body = [e for e in entries if e.token not in special]
    assert "".join(e.token for e in body) == text
    assert b"".join(bytes(e.bytes) for e in body).decode() == text
    assert _split_somewhere([(e.token, e.bytes) for e in body])


def test_chat_whole_and_streamed(client, special_texts):
    got = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=_forced(),
    )
    text = got.choices[0].message.content
    assert text == FORCED
    content = got.choices[0].logprobs.content
    _check_chat(content, text, special_texts)
    for e in content:  # each alternative has its text (what it would have added there) and bytes
        assert len(e.top_logprobs) == 2
        assert all(not t.token.startswith("token_id:") and t.bytes is not None for t in e.top_logprobs)

    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body=_forced(),
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FORCED
    _check_chat(streamed, FORCED, special_texts)
    assert [(e.token, e.bytes, e.logprob) for e in streamed] == [(e.token, e.bytes, e.logprob) for e in content]


def test_top_logprobs_texts_greedy(client):
    """Greedy and unconstrained: the sampled token is the first alternative, with the same text and bytes."""
    got = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    for e in got.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 3
        assert (e.top_logprobs[0].token, e.top_logprobs[0].bytes) == (e.token, e.bytes)
        assert all(not t.token.startswith("token_id:") and t.bytes is not None for t in e.top_logprobs)


def test_completions_whole_and_streamed(client, special_texts):
    got = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=2, extra_body=_forced()
    )
    choice = got.choices[0]
    assert choice.text == FORCED
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    body = [t for t in lp.tokens if t not in special_texts]
    assert "".join(body) == FORCED and "" in body, "a character split over tokens: its first part shows nothing yet"
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(top) >= 1 and not any(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)

    chunks = list(
        client.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            logprobs=2,
            stream=True,
            extra_body=_forced(),
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == FORCED
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_token_ids_when_the_request_asks(client, gw_redis_url):
    with Client(gw_redis_url) as sdk:
        done = sdk.generate(messages=MESSAGES, max_tokens=6, temperature=0, logprobs=1)
    ids = [f"token_id:{t}" for t in done.token_ids]
    extra = {"return_tokens_as_token_ids": True}
    got = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body=extra,
    )
    content = got.choices[0].logprobs.content
    assert [e.token for e in content] == ids
    assert [bytes(e.bytes) for e in content] == done.choices[0].token_bytes  # the token's own bytes
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in content)
    legacy = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, extra_body=extra
    )
    assert all(t.startswith("token_id:") for t in legacy.choices[0].logprobs.tokens)


def test_token_ids_with_the_gateway_flag(gw_redis_url, gateway):
    g = GatewayProc(gw_redis_url, "--return-tokens-as-token-ids").start()
    try:
        flagged = openai.OpenAI(base_url=g.base_url, api_key="unused")
        got = flagged.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
        )
        chunks = list(
            flagged.completions.create(
                model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, stream=True
            )
        )
    finally:
        g.stop()
    assert all(e.token.startswith("token_id:") for e in got.choices[0].logprobs.content)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)


def test_sdk_chunks_and_choices_carry_texts(gw_redis_url, special_texts):
    opts = dict(messages=MESSAGES, max_tokens=40, temperature=0, logprobs=2, structured_outputs={"choice": [FORCED]})
    with Client(gw_redis_url) as sdk:
        done = sdk.generate(**opts)
        chunks = list(sdk.stream(**opts))
    choice = done.choices[0]
    assert choice.text == FORCED
    n = len(choice.token_ids)
    assert len(choice.token_texts) == len(choice.token_bytes) == len(choice.top_token_texts) == n
    keep = [i for i, t in enumerate(choice.token_texts) if t not in special_texts]
    assert "".join(choice.token_texts[i] for i in keep) == FORCED
    assert b"".join(choice.token_bytes[i] for i in keep) == FORCED.encode()
    assert [len(t) for t in choice.top_token_texts] == [len(t) for t in choice.top_logprobs]
    assert [len(b) for b in choice.top_token_bytes] == [len(t) for t in choice.top_logprobs]
    assert [t for c in chunks for t in c.token_texts or []] == choice.token_texts
    assert [b for c in chunks for b in c.token_bytes or []] == choice.token_bytes


async def test_sdk_without_logprobs_sends_no_texts(gw_redis_url):
    async with AsyncClient(gw_redis_url) as sdk:
        done = await sdk.generate(messages=MESSAGES, max_tokens=3)
    assert done.choices[0].token_texts is None and done.choices[0].top_token_texts is None
