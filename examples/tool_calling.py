"""Tool calling and schema-valid JSON answers through pagedq.

    pagedq up                            # a local stack: redis-server + SmolLM2 + one worker
    python examples/tool_calling.py      # in another terminal: finds that stack by itself

SmolLM2's own chat template renders no tools; `pagedq model prepare smollm2` (which `pagedq up` runs)
gives the prepared model pagedq's Hermes template for chats with tools (chats without tools render
with SmolLM2's own). The forced call below (tool_choice "required") works on any model: a worker that
knows no tool-call format for its model writes it as JSON under the grammar of the tools' parameters,
with the tools in a preamble of the prompt (docs/structured-outputs.md). For tool_choice "auto" on a
model whose template renders no tools, start its worker with pagedq's Hermes template:

    pagedq worker --model PATH --chat-template worker/models/templates/hermes_tools.jinja

The Redis URL comes from --redis-url, else PAGEDQ_REDIS_URL, else the running `pagedq up`
(`producer_sdk.discovery`), else redis://127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import json

from producer_sdk import Client
from producer_sdk.discovery import default_redis_url


def get_weather(city: str, unit: str = "c") -> dict:
    """A stand-in for a real weather service."""
    celsius = 21
    return {"city": city, "temperature": celsius if unit == "c" else celsius * 9 / 5 + 32, "unit": unit}


FUNCTIONS = {"get_weather": get_weather}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current temperature in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]
REPORT = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "temperature": {"type": "integer", "minimum": -80, "maximum": 80},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["city", "temperature", "summary"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--redis-url", default=None, help="default: PAGEDQ_REDIS_URL, a running `pagedq up`, localhost:6379"
    )
    parser.add_argument("--model", default="default")
    args = parser.parse_args()

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
    ]
    with Client(args.redis_url or default_redis_url(), args.model) as client:
        # 1. The model must call a tool: the grammar makes it write one call whose arguments are valid
        #    against the tool's parameters. The call streams as it is written.
        handle = client.submit(
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0.0,
        )
        for chunk in handle.stream(timeout=120):
            for delta in chunk.tool_calls or []:
                if delta.name:
                    print(f"calling {delta.name}(", end="")
                print(delta.arguments, end="", flush=True)
        call = handle.result().tool_calls[0]
        print(f") -> finish_reason {handle.finish_reason}")

        # 2. Run the function, hand its result back in a tool turn, and let the model answer.
        result = FUNCTIONS[call.function.name](**json.loads(call.function.arguments))
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [as_message_call(call)]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
        ]
        answer = client.generate(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0.0)
        print("answer:", answer.content.strip())

        # 3. An answer that follows a JSON schema (OpenAI's response_format).
        report = client.generate(
            messages=[*messages[:2], {"role": "user", "content": f"Report this as JSON: {json.dumps(result)}"}],
            response_format={"type": "json_schema", "json_schema": {"name": "weather_report", "schema": REPORT}},
            max_tokens=200,
            temperature=0.0,
        )
        if report.finish_reason == "stop":
            print("report:", report.json())
        else:  # max_tokens cut it: the text is the partial JSON
            print(f"report cut short ({report.finish_reason}): {report.text}")


def as_message_call(call) -> dict:
    """A tool call of a Completion as a plain message dict (the shape `messages` takes)."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


if __name__ == "__main__":
    main()
