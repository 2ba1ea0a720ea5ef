"""Background responses through a gateway SIGKILL and a worker SIGKILL: every response completes, a
client that re-attaches with `starting_after` (to another gateway) gets each remaining event once
(sequence numbers contiguous from 0), and the outputs equal an uninterrupted run's (greedy)."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from tests.chaos.harness import wait_for, worker
from tests.gateway.gateway_proc import SSE, GatewayProc
from worker.models.chat_templates import HERMES_TOOLS
from worker.service.redis_proc import RedisProcess

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

N, MAX_TOKENS = 16, 40
ASK = dict(model="default", temperature=0, max_output_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})


class Reader(threading.Thread):
    """Reads one response's event stream until it ends or its gateway dies; keeps (seq, event)."""

    def __init__(self, port: int, response_id: str, after: int = -1) -> None:
        super().__init__(daemon=True)
        query = "stream=true" + (f"&starting_after={after}" if after >= 0 else "")
        self.sse = SSE(port, "GET", f"/v1/responses/{response_id}?{query}", timeout=120)
        self.events: list[dict] = []

    def run(self) -> None:
        try:
            for _, data in self.sse.events():
                self.events.append(json.loads(data))
        except OSError:
            pass  # the gateway died under it


def test_background_responses_survive_a_gateway_and_a_worker_sigkill(llama_dir):
    with RedisProcess(appendonly=True) as redis_server:
        url = redis_server.url
        args = ("--chat-template", str(HERMES_TOOLS))
        first, second = worker(llama_dir, url, "first", *args).start(), worker(llama_dir, url, "second", *args)
        gw_a, gw_b = GatewayProc(url).start(), GatewayProc(url)
        try:
            a = openai.OpenAI(base_url=gw_a.base_url, api_key="unused", max_retries=0)
            created = [a.responses.create(input=f"Story number {i}.", background=True, **ASK) for i in range(N)]
            readers = [Reader(gw_a.port, r.id) for r in created]
            for t in readers:
                t.start()

            def mid_way() -> bool:
                deltas = [sum(e["type"] == "response.output_text.delta" for e in t.events) for t in readers]
                return sum(0 < d < MAX_TOKENS for d in deltas) >= 8

            import asyncio

            asyncio.run(wait_for(mid_way, 60, "8 responses mid-generation"))
            gw_a.kill()
            first.kill()
            for t in readers:
                t.join(10)
            gw_b.start()
            second.start()
            seen = [[e["sequence_number"] for e in t.events] for t in readers]
            assert all(s == list(range(len(s))) for s in seen)  # what was read before the faults
            resumed = [Reader(gw_b.port, r.id, after=len(s) - 1) for r, s in zip(created, seen)]
            for t in resumed:
                t.start()
            for t in resumed:
                t.join(120)
            b = openai.OpenAI(base_url=gw_b.base_url, api_key="unused", max_retries=0)
            for r, before, after in zip(created, readers, resumed):
                events = before.events + after.events
                assert [e["sequence_number"] for e in events] == list(range(len(events))), r.id
                assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
                text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
                assert text == b.responses.retrieve(r.id).output_text
            # The uninterrupted run: the same requests, answered by the surviving worker in one go.
            for i, r in enumerate(created):
                direct = b.responses.create(input=f"Story number {i}.", **ASK)
                assert b.responses.retrieve(r.id).output_text == direct.output_text
                assert b.responses.retrieve(r.id).usage.output_tokens == MAX_TOKENS
        finally:
            for p in (gw_a, gw_b, first, second):
                p.stop()
