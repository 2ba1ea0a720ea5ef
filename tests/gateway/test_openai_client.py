"""The official `openai` client, unmodified (only base_url and api_key), against a real gateway, worker
and redis-server: greedy text equals the offline LLM's, usage equals the SDK's."""

from __future__ import annotations

import asyncio

import openai
import pytest

from producer_sdk import AsyncClient, Client
from tests.gateway.conftest import MAX_MODEL_LEN
from worker import SamplingParams

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a paged KV cache?"},
]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused")


def offline_text(offline, prompt, **sampling) -> tuple[str, str, list[int]]:
    out = offline.generate([prompt], SamplingParams(**sampling), use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason, out.token_ids


def test_chat_and_completions_sync_match_the_offline_llm(client, offline, gw_redis_url):
    want, reason, ids = offline_text(offline, MESSAGES, temperature=0, max_tokens=12)
    with Client(gw_redis_url) as sdk:
        sdk.generate(messages=MESSAGES, max_tokens=12, temperature=0)  # warm the prefix cache for both
    got = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-") and got.model == "default"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason == reason
    with Client(gw_redis_url) as sdk:
        done = sdk.generate(messages=MESSAGES, max_tokens=12, temperature=0)
    assert done.token_ids == ids
    assert got.usage.prompt_tokens == done.usage.prompt_tokens
    assert got.usage.completion_tokens == done.usage.completion_tokens == len(ids)
    assert got.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert got.usage.prompt_tokens_details.cached_tokens == done.usage.cached_tokens

    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    want, reason, _ = offline_text(offline, PROMPT, temperature=0, max_tokens=10)
    whole = client.completions.create(model="default", prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == want
    assert whole.choices[0].finish_reason == reason
    streamed = list(
        client.completions.create(model="default", prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == reason


def test_async_client_streams_n_choices_and_usage(gateway, offline, gw_redis_url):
    prompt = [5, 17, 33, 120, 7, 9]  # token ids, as the completions API allows
    want, _, ids = offline_text(offline, prompt, temperature=0, max_tokens=9, ignore_eos=True)

    async def main():
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused")
        stream = await client.completions.create(
            model="default",
            prompt=prompt,
            max_tokens=9,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        chat = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=6, temperature=0)
        async with AsyncClient(gw_redis_url) as sdk:
            done = await sdk.generate(prompt_token_ids=prompt, max_tokens=9, temperature=0, n=2, ignore_eos=True)
        await client.close()
        return chunks, chat, done

    chunks, chat, done = asyncio.run(main())
    for index in (0, 1):
        text = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
        assert text == want
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens == 2 * len(ids)
    assert chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == offline_text(offline, MESSAGES, temperature=0, max_tokens=6)[0]


def test_sampling_parameters_reach_the_engine(client, offline):
    # seed: the same seeded sample as the offline engine's
    want = offline_text(offline, PROMPT, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)[0]
    got = client.completions.create(
        model="default", prompt=PROMPT, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10
    )
    assert got.choices[0].text == want
    # vLLM's extra body fields, with vLLM's names
    want = offline_text(offline, PROMPT, temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True, top_k=5)[0]
    got = client.completions.create(
        model="default",
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        extra_body={"min_tokens": 8, "ignore_eos": True, "top_k": 5, "repetition_penalty": 1.0, "priority": 0},
    )
    assert got.choices[0].text == want and got.usage.completion_tokens == 8
    # stop strings end the text with finish_reason "stop" and name the string (vLLM's stop_reason)
    full = client.completions.create(model="default", prompt=PROMPT, temperature=0, max_tokens=20).choices[0].text
    stop = next(full[i : i + 2] for i in range(2, len(full) - 1) if len(full[i : i + 2].strip()) == 2)
    want_text, reason, _ = offline_text(offline, PROMPT, temperature=0, max_tokens=20, stop=[stop])
    got = client.completions.create(model="default", prompt=PROMPT, temperature=0, max_tokens=20, stop=stop)
    assert got.choices[0].text == want_text and got.choices[0].finish_reason == reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop and stop not in got.choices[0].text


def test_logprobs_as_the_protocol_carries_them(client, gw_redis_url):
    got = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    with Client(gw_redis_url) as sdk:
        done = sdk.generate(messages=MESSAGES, max_tokens=5, temperature=0, logprobs=3)
    assert [e.logprob for e in content] == pytest.approx(done.logprobs)
    assert [e.token for e in content] == done.choices[0].token_texts  # texts: tests/gateway/test_logprobs_text.py
    assert [bytes(e.bytes) for e in content] == done.choices[0].token_bytes
    assert all(len(e.top_logprobs) == 3 for e in content)
    legacy = client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_models_list_the_live_workers(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["default"]
    assert models[0].max_model_len == MAX_MODEL_LEN and models[0].owned_by == "pagedq"
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
