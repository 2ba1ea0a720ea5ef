"""`--stream-interval`: fewer, larger Tokens events, the same tokens; resume and retries stay exact."""

from __future__ import annotations

import asyncio

import pytest

from producer_sdk import AsyncClient
from producer_sdk.protocol import Error, Started, Tokens
from tests.service.test_worker_service import check_stream, tokens_of
from tests.service.worker_proc import WorkerProc, response_events, wait_until
from worker import LLM, SamplingParams

INTERVAL = 4


def _offline(llama_dir, prompts, max_tokens):
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


async def _stream_all(redis_url, prompts, max_tokens, prefix, during=None):
    async with AsyncClient(redis_url) as client:
        handles = []
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            prompt = {"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}
            kw = {"max_tokens": m, "temperature": 0, "ignore_eos": True, "request_id": f"{prefix}-{i:04d}"}
            handles.append(await client.submit(**prompt, **kw))

        async def read(h):
            return [t for c in [c async for c in h.stream(timeout=120)] for t in c.token_ids]

        readers = [asyncio.create_task(read(h)) for h in handles]
        if during is not None:
            await during()
        return await asyncio.gather(*readers)


def test_every_token_arrives_in_events_of_at_least_the_interval(llama_dir, redis_url):
    prompts = [[5 + (7 * i + j) % 400 for j in range(3 + i % 9)] for i in range(16)]
    max_tokens = [1, 2, 5, 9, 13, 30, 31, 33] * 2  # not all multiples of the interval
    w = WorkerProc(llama_dir, redis_url, "--stream-interval", str(INTERVAL), metrics=False).start()
    try:
        streamed = asyncio.run(_stream_all(redis_url, prompts, max_tokens, "si-stream"))
    finally:
        w.stop()
    for i, (got, ref) in enumerate(zip(streamed, _offline(llama_dir, prompts, max_tokens), strict=True)):
        assert got == ref
        events = response_events(redis_url, f"si-stream-{i:04d}")
        check_stream(events)
        assert tokens_of(events) == ref
        sizes = [len(e.token_ids) for e in events if isinstance(e, Tokens)]
        assert all(n >= INTERVAL for n in sizes[1:-1]), sizes  # first (TTFT) and last (final) may be short
        if len(ref) > 1 + INTERVAL:
            assert len(sizes) < len(ref)


def test_sigkill_mid_generation_then_resume_is_exact(llama_dir, redis_url):
    prompts = [f"interval crash {i} " * (1 + i % 4) for i in range(12)]
    max_tokens = [90 + i for i in range(12)]
    reference = _offline(llama_dir, prompts, max_tokens)
    flags = ("--stream-interval", str(INTERVAL), "--max-num-seqs", "32")
    first = WorkerProc(llama_dir, redis_url, *flags, name="first", metrics=False).start()

    async def crash_and_resume():
        def some_progress():
            got = [len(tokens_of(response_events(redis_url, f"sk-killed-{i:04d}"))) for i in range(12)]
            return sum(0 < g < 80 for g in got) >= 6

        await asyncio.to_thread(wait_until, some_progress, 60, "tokens in flight")
        first.kill()
        second = WorkerProc(llama_dir, redis_url, *flags, "--claim-idle-ms", "1000", name="second", metrics=False)
        await asyncio.to_thread(second.start)
        crash_and_resume.second = second

    try:
        streamed = asyncio.run(_stream_all(redis_url, prompts, max_tokens, "sk-killed", crash_and_resume))
    finally:
        first.stop()
        if hasattr(crash_and_resume, "second"):
            crash_and_resume.second.stop()
    resumed = 0
    for i, (got, ref) in enumerate(zip(streamed, reference, strict=True)):
        assert got == ref, f"request {i} differs from the uninterrupted run"
        events = response_events(redis_url, f"sk-killed-{i:04d}")
        check_stream(events)
        resumed += sum(isinstance(e, Started) for e in events) > 1
    assert resumed >= 1


def test_failed_step_retries_from_everything_held_back(llama_dir, redis_url):
    """A step fails (a poison request in the batch): its neighbours are retried alone from their
    delivered tokens, which must include the ones the interval was holding back."""
    prompts = [[5 + (11 * i + j) % 300 for j in range(4 + i)] for i in range(6)]
    max_tokens = [40] * 6
    seen = {t for p in prompts for t in p} | {t for ref in _offline(llama_dir, prompts, max_tokens) for t in ref}
    poison = next(t for t in range(5, 512) if t not in seen)
    reference = _offline(llama_dir, prompts, max_tokens)
    w = WorkerProc(
        llama_dir,
        redis_url,
        "--stream-interval",
        str(INTERVAL),
        metrics=False,
        env={"PAGEDQ_FAULT_POISON_TOKEN": str(poison), "PAGEDQ_FAULT_STEP_DELAY_S": "0.02"},
    ).start()

    async def poison_midway():
        await asyncio.to_thread(
            wait_until, lambda: len(tokens_of(response_events(redis_url, "pz-poisoned-0000"))) > 10, 60, "tokens"
        )
        async with AsyncClient(redis_url) as client:
            h = await client.submit(
                prompt_token_ids=[3, 4, poison, 5], max_tokens=4, temperature=0, request_id="pz-poison-req"
            )
            with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a dead-lettered request
                await h.result(timeout=60)

    try:
        streamed = asyncio.run(_stream_all(redis_url, prompts, max_tokens, "pz-poisoned", poison_midway))
    finally:
        w.stop()
    for i, (got, ref) in enumerate(zip(streamed, reference, strict=True)):
        assert got == ref, f"request {i} differs after the retry"
        check_stream(response_events(redis_url, f"pz-poisoned-{i:04d}"))
    assert isinstance(response_events(redis_url, "pz-poison-req")[-1], Error)
