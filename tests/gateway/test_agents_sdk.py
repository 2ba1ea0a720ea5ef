"""The `openai-agents` SDK, unmodified, on its default model (the Responses API) against the gateway:
an `Agent` with a function tool runs to a final answer, plain and streamed. The tiny test model is
random, so the tool's arguments are enums (a free string could run past any max_tokens), the agent
forces its tool (`tool_choice`) and stops at the tool's result (`tool_use_behavior=
"stop_on_first_tool"`): the run still goes through the SDK's own request building, response
parsing, tool dispatch and (streamed) event handling."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

CALLS: list[dict] = []


@function_tool
def get_weather(city: Literal["Oslo", "Paris"], unit: Literal["c", "f"]) -> str:
    """Current weather in a city.

    Args:
        city: the city.
        unit: c or f.
    """
    CALLS.append({"city": city, "unit": unit})
    return f"sunny in {city}"


def _agent() -> Agent:
    return Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model="default",
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200),
    )


@pytest.fixture
def base_url(gateway):
    set_tracing_disabled(True)  # no export to OpenAI's servers
    return gateway.base_url


def _use_gateway(base_url: str) -> None:
    """The SDK's default client: one per event loop (each test runs its own)."""
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0))


def test_the_default_agent_calls_its_tool_and_answers(base_url):
    CALLS.clear()

    async def run():
        _use_gateway(base_url)
        return await Runner.run(_agent(), "What is the weather in Oslo?")

    result = asyncio.run(run())
    assert len(CALLS) == 1 and result.final_output == f"sunny in {CALLS[0]['city']}"
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert json.loads(calls[0].raw_item.arguments) == CALLS[0]


def test_the_default_agent_streamed(base_url):
    CALLS.clear()

    async def run() -> tuple[object, list[str]]:
        _use_gateway(base_url)
        streamed = Runner.run_streamed(_agent(), "What is the weather in Oslo?")
        kinds = [e.type async for e in streamed.stream_events()]
        return streamed, kinds

    streamed, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(CALLS) == 1 and streamed.final_output == f"sunny in {CALLS[0]['city']}"
