"""A tenant's quota through the gateway: the API key names the tenant, a tenant over its quota gets
OpenAI's 429 (the `openai` client raises RateLimitError), another tenant goes on, and the worker's
ack gives the slot back, with the tenant on its metrics and its `request finished` line; over
tokens_per_minute the 429 is of type "tokens"."""

from __future__ import annotations

import json
import time

import openai
import pytest

from producer_sdk import Client, tenants
from producer_sdk.contract import keys
from tests.gateway.gateway_proc import GatewayProc
from tests.service.worker_proc import wait_until

HI = [{"role": "user", "content": "hi"}]


def test_a_tenant_over_its_quota_is_429_and_others_go_on(gw_worker, gw_redis_url, r, tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"sk-a": {"tenant": "team-a"}, "sk-b": {"tenant": "team-b"}}))
    tenants.set_quota(r, "team-a", max_queued=1)
    g = GatewayProc(gw_redis_url, "--api-keys", str(key_file)).start()
    aborted = lambda: gw_worker.metric(
        "pagedq_tenant_requests_finished_total", tenant="team-a", finished_reason="abort"
    )
    aborted_before = aborted()
    try:
        a = openai.OpenAI(base_url=g.base_url, api_key="sk-a", max_retries=0)
        b = openai.OpenAI(base_url=g.base_url, api_key="sk-b", max_retries=0)
        with Client(gw_redis_url, tenant="team-a") as sdk:
            busy = sdk.submit("keep team-a busy", max_tokens=400, ignore_eos=True)
            try:
                with pytest.raises(openai.RateLimitError) as e:
                    a.chat.completions.create(model="default", messages=HI, max_tokens=2)
                assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
                assert e.value.type == "requests" and "team-a" in e.value.message
                headers = e.value.response.headers
                assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
                done = b.chat.completions.create(model="default", messages=HI, max_tokens=2)  # unaffected
                assert done.choices[0].finish_reason == "length"
            finally:
                busy.cancel()
            assert busy.result(timeout=30, partial_ok=True).finish_reason == "abort"
        # The worker's ack of the busy request gave team-a's slot back.
        wait_until(lambda: not r.hexists(keys.tenant_queued("default"), "team-a"), what="team-a's count to drop")
        assert a.chat.completions.create(model="default", messages=HI, max_tokens=2).choices[0].finish_reason
        wait_until(lambda: aborted() == aborted_before + 1, what="the tenant's metric")
        wait_until(
            lambda: any(
                ev.get("event") == "request finished"
                and ev.get("request_id") == busy.request_id
                and ev.get("tenant") == "team-a"
                for ev in gw_worker.log_events()
            ),
            what="the request finished line with its tenant",
        )
    finally:
        g.stop()
        tenants.delete_quota(r, "team-a")


def test_a_tenant_over_its_tokens_per_minute_is_429_type_tokens(gw_worker, gw_redis_url, r, tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"sk-t": {"tenant": "team-t"}, "sk-u": {"tenant": "team-u"}}))
    tenants.set_quota(r, "team-t", tokens_per_minute=3)
    g = GatewayProc(gw_redis_url, "--api-keys", str(key_file)).start()
    try:
        t = openai.OpenAI(base_url=g.base_url, api_key="sk-t", max_retries=0)
        u = openai.OpenAI(base_url=g.base_url, api_key="sk-u", max_retries=0)
        seconds, micros = r.time()
        left_ms = 60_000 - (seconds * 1000 + micros // 1000) % 60_000
        if left_ms < 20_000:  # the two requests below must fall in one window of the Redis clock
            time.sleep(left_ms / 1000 + 0.05)
        first = t.chat.completions.create(model="default", messages=HI, max_tokens=2)  # admitted: 0 used
        used = first.usage.prompt_tokens + first.usage.completion_tokens
        with pytest.raises(openai.RateLimitError) as e:
            t.chat.completions.create(model="default", messages=HI, max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded" and e.value.type == "tokens"
        assert f"tokens per min (TPM): Limit 3, Used {used}." in e.value.message
        headers = e.value.response.headers
        assert 1 <= int(headers["retry-after"]) <= 60 and 0 < int(headers["retry-after-ms"]) <= 60_000
        assert u.chat.completions.create(model="default", messages=HI, max_tokens=2).choices[0].finish_reason
    finally:
        g.stop()
        tenants.delete_quota(r, "team-t")
