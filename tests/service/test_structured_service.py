"""Structured outputs and tool calling through the SDK and a real worker (tiny model, Hermes template):
schema-valid answers at temperature 1.0, forced tool calls streamed and whole, greedy answers equal to
the offline engine's, typed errors before and after enqueue, and crash-resume of constrained requests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from producer_sdk import AsyncClient, Client, RequestFailed, ValidationError
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Started, ToolCalls
from tests.engine.structured_cases import ORDER_SCHEMA, TOOL_MESSAGES, TOOLS, assert_valid_calls, joined_deltas
from tests.service.worker_proc import WorkerProc, response_events, wait_until
from worker import LLM, SamplingParams, StructuredOutputsParams
from worker.models.chat_templates import HERMES_TOOLS

pytestmark = pytest.mark.slow

TEMPLATE = ("--chat-template", str(HERMES_TOOLS))
ORDER_FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Write an order as JSON."}]


@pytest.fixture
def worker(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "64", "--max-model-len", "2048", *TEMPLATE).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), dtype="float32", device="cpu", max_model_len=2048, chat_template=str(HERMES_TOOLS))


def test_200_nested_schema_answers_at_temperature_one(redis_url, worker):
    with Client(redis_url) as client:
        handles = client.submit_many(
            [{"messages": [{"role": "user", "content": f"Order number {i} as JSON."}]} for i in range(200)],
            response_format=ORDER_FORMAT,
            temperature=1.0,
            max_tokens=256,
        )
        done = [h.result(timeout=300) for h in handles]
    stopped = [c for c in done if c.finish_reason == "stop"]
    assert len(stopped) >= 190, [c.finish_reason for c in done]
    for c in stopped:
        jsonschema.validate(c.json(), ORDER_SCHEMA)
    assert len({c.text for c in stopped}) > 100


def test_required_tool_calls_streamed_and_whole_agree(redis_url, worker):
    kw = dict(messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=300)
    with Client(redis_url) as client:
        for seed in (1, 2, 3):
            whole = client.generate(seed=seed, **kw, timeout=120)
            assert whole.finish_reason in ("tool_calls", "length") and whole.content == ""
            assert_valid_calls(whole.tool_calls, whole.finish_reason)
            deltas = [d for chunk in client.stream(seed=seed, **kw, timeout=120) for d in chunk.tool_calls or []]
            streamed = [(s["name"], s["arguments"]) for _, s in sorted(joined_deltas(deltas).items())]
            assert streamed == [(t.function.name, t.function.arguments) for t in whole.tool_calls]
        one = client.generate(seed=9, parallel_tool_calls=False, **kw, timeout=120)
        assert one.finish_reason == "tool_calls" and len(one.tool_calls) == 1
        events = response_events(redis_url, one.request_id)
        assert any(isinstance(e, ToolCalls) for e in events)


def test_greedy_structured_output_is_the_same_offline_and_through_the_sdk(redis_url, worker, offline):
    json_params = SamplingParams(
        temperature=0,
        max_tokens=256,
        structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA, disable_any_whitespace=True),
    )
    want_json = offline.chat(ASK, json_params, use_tqdm=False)[0].outputs[0]
    tool_params = SamplingParams(temperature=0, max_tokens=300)
    want_call = offline.chat(
        TOOL_MESSAGES, tool_params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, use_tqdm=False
    )[0].outputs[0]
    with Client(redis_url) as client:
        got_json = client.generate(messages=ASK, response_format=ORDER_FORMAT, temperature=0, max_tokens=256)
        got_call = client.generate(
            messages=TOOL_MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=300,
        )
    assert got_json.token_ids == want_json.token_ids and got_json.text == want_json.text
    jsonschema.validate(got_json.json(), ORDER_SCHEMA)
    assert (
        got_call.token_ids == want_call.token_ids and got_call.finish_reason == want_call.finish_reason == "tool_calls"
    )
    assert [(t.function.name, t.function.arguments) for t in got_call.tool_calls] == [
        (t.function.name, t.function.arguments) for t in want_call.tool_calls
    ]


def test_a_bad_schema_is_refused_before_it_is_enqueued_and_a_bad_grammar_by_the_worker(redis_url, worker):
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    with Client(redis_url) as client:
        with pytest.raises(ValidationError) as info:
            client.submit(
                messages=ASK,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            )
        assert info.value.field == "response_format.json_schema.schema"
        assert admin.xlen(keys.lane_stream("default")) == 0
        bad = client.submit("x", structured_outputs={"grammar": "root ::= ( unclosed"}, max_tokens=5)
        good = client.submit("y", max_tokens=4, temperature=0)
        with pytest.raises(RequestFailed) as failed:
            bad.result(timeout=60)
        assert failed.value.code == "invalid_grammar"
        assert good.result(timeout=60).finish_reason == "length"
    admin.close()


def test_sigkill_mid_way_through_constrained_requests_then_resume(llama_dir, redis_url, offline):
    """Greedy constrained requests (JSON schema and forced tool calls) are cut by a SIGKILL mid-generation
    (every step held at 20 ms by a fault hook); another worker resumes them from the delivered tokens:
    the answers are valid and identical to an uninterrupted run."""
    asks = [[{"role": "user", "content": f"Order {i} as JSON, please."}] for i in range(6)]
    json_params = SamplingParams(
        temperature=0,
        max_tokens=256,
        structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA, disable_any_whitespace=True),
    )
    want = [o.outputs[0] for o in offline.chat(asks, json_params, use_tqdm=False)]
    want += [
        o.outputs[0]
        for o in offline.chat(
            [TOOL_MESSAGES, [*TOOL_MESSAGES[:1], {"role": "user", "content": "Add 2 and 40."}]],
            SamplingParams(temperature=0, max_tokens=300),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            use_tqdm=False,
        )
    ]
    slow = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.02"}
    first = WorkerProc(llama_dir, redis_url, *TEMPLATE, name="first", metrics=False, env=slow).start()

    async def main():
        async with AsyncClient(redis_url) as client:
            handles = [
                await client.submit(messages=a, response_format=ORDER_FORMAT, temperature=0, max_tokens=256)
                for a in asks
            ]
            for msgs in (TOOL_MESSAGES, [*TOOL_MESSAGES[:1], {"role": "user", "content": "Add 2 and 40."}]):
                handles.append(
                    await client.submit(
                        messages=msgs,
                        tools=TOOLS,
                        tool_choice="required",
                        parallel_tool_calls=False,
                        temperature=0,
                        max_tokens=300,
                    )
                )

            def mid_flight():
                counts = [
                    sum(len(getattr(e, "token_ids", [])) for e in response_events(redis_url, h.request_id))
                    for h in handles
                ]
                return sum(0 < c < len(w.token_ids) for c, w in zip(counts, want)) >= 4

            results = [asyncio.create_task(h.result(timeout=240)) for h in handles]
            await asyncio.to_thread(wait_until, mid_flight, 120, "constrained requests mid-generation")
            first.kill()
            second = WorkerProc(
                llama_dir, redis_url, *TEMPLATE, "--claim-idle-ms", "1000", name="second", metrics=False
            )
            await asyncio.to_thread(second.start)
            try:
                return handles, await asyncio.gather(*results)
            finally:
                second.stop()

    handles, got = asyncio.run(main())
    first.stop()
    resumed = 0
    for h, g, w in zip(handles, got, want, strict=True):
        assert g.token_ids == w.token_ids and g.text == w.text, f"{h.request_id} differs from the uninterrupted run"
        assert g.finish_reason == w.finish_reason
        if g.tool_calls:
            assert_valid_calls(g.tool_calls)
            assert [(t.function.name, t.function.arguments) for t in g.tool_calls] == [
                (t.function.name, t.function.arguments) for t in w.tool_calls
            ]
        else:
            jsonschema.validate(json.loads(g.text), ORDER_SCHEMA)
        resumed += sum(isinstance(e, Started) for e in response_events(redis_url, h.request_id)) > 1
    assert resumed >= 4


def test_the_tool_calling_example_runs_against_a_real_worker(redis_url, worker):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "tool_calling.py"), "--redis-url", redis_url],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "calling get_weather(" in out.stdout and ") -> finish_reason tool_calls" in out.stdout
    assert "answer:" in out.stdout and ("report: {" in out.stdout or "report cut short" in out.stdout)
