"""One retention decides how long an answer can be fetched (docs/sdk.md, "How long an answer can be
fetched"): it travels with the request, and the worker applies it from the final event on to the
response stream, the submitted marker and the gateway's record, which therefore expire together.

Real processes: the package's worker (default --result-ttl and --max-result-ttl), a gateway of its own
with a short --result-ttl, the SDK, and the session's redis-server.
"""

from __future__ import annotations

from producer_sdk import Client
from producer_sdk.constants import DEFAULT_RESULT_TTL_S, UNFINISHED_TTL_S
from producer_sdk.contract import keys, scripts, steps
from producer_sdk.protocol import GenerateRequest, SamplingParams
from producer_sdk.request_codec import encode_request
from tests.gateway.gateway_proc import GatewayProc, request
from tests.service.worker_proc import wait_until

MODEL = "default"
SHORT_S = 3


def _chat(port: int, rid: str) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "keep"}], "max_tokens": 4}
    status, headers, _ = request(port, "POST", "/v1/chat/completions", body, headers={"X-Request-Id": rid})
    return status, headers


def test_the_gateway_record_and_the_answer_expire_together(gw_worker, gw_redis_url, r):
    gw = GatewayProc(gw_redis_url, "--result-ttl", str(SHORT_S)).start()
    try:
        rid = "retention-gw-0001"
        status, headers = _chat(gw.port, rid)
        assert status == 200 and headers["pagedq-request-id"] == rid
        stream, record = keys.response_stream(rid), keys.gateway_record(rid)
        # Set in one publish step, to the same absolute expiry (ms), of the short retention.
        expire_at = [r.pexpiretime(stream), r.pexpiretime(record)]
        assert expire_at[0] == expire_at[1] > 0, expire_at
        assert 0 < r.pttl(stream) <= SHORT_S * 1000
        assert 0 < r.pttl(keys.submitted_marker(MODEL, rid)) <= SHORT_S * 1000  # the ack's, from the same value
        assert request(gw.port, "GET", f"/v1/chat/completions/chatcmpl-{rid}")[0] == 200  # fetchable now
        # Redis expires them on its own clock: poll until it has, bounded (no sleep to a guessed time).
        wait_until(lambda: not r.exists(stream) and not r.exists(record), timeout=SHORT_S + 10, what="expiry")
        assert request(gw.port, "GET", f"/v1/chat/completions/chatcmpl-{rid}")[0] == 404
    finally:
        gw.stop()


def test_before_it_runs_a_request_outlives_a_short_retention(gw_worker, gw_redis_url, r):
    """The record and the marker of a request that has not finished live at least UNFINISHED_TTL_S: a
    short retention counts from the final event, not from the submit."""
    with Client(gw_redis_url, check_model=False, model="nobody-serves-this", result_ttl_s=SHORT_S) as client:
        handle = client.submit("queued", max_tokens=2)
        ttl = r.pttl(keys.submitted_marker("nobody-serves-this", handle.request_id))
        assert (UNFINISHED_TTL_S - 60) * 1000 < ttl <= UNFINISHED_TTL_S * 1000
        entry = r.xrange(keys.lane_stream("nobody-serves-this"))[0][1]
        assert entry[keys.ENTRY_RETENTION_FIELD.encode()] == str(SHORT_S * 1000).encode()
    for key in (keys.lane_stream("nobody-serves-this"), keys.submitted_marker("nobody-serves-this", handle.request_id)):
        r.delete(key)
    r.delete(keys.tenant_queued("nobody-serves-this"))


def test_the_worker_applies_the_producers_retention_and_caps_it(gw_worker, gw_redis_url, r):
    with Client(gw_redis_url, result_ttl_s=120) as client:
        asked = client.generate("two minutes", max_tokens=2, timeout=60)
    assert 110_000 < r.pttl(keys.response_stream(asked.request_id)) <= 120_000
    with Client(gw_redis_url, result_ttl_s=30 * 86400) as client:
        capped = client.generate("a month", max_tokens=2, timeout=60)
    # The worker's --max-result-ttl (default UNFINISHED_TTL_S, a day) bounds what a request may ask for.
    assert (UNFINISHED_TTL_S - 60) * 1000 < r.pttl(keys.response_stream(capped.request_id)) <= UNFINISHED_TTL_S * 1000
    assert r.pexpiretime(keys.lease(capped.request_id)) == r.pexpiretime(keys.response_stream(capped.request_id))


def test_an_entry_of_an_older_sdk_gets_the_workers_result_ttl(gw_worker, gw_redis_url, r):
    """Entries without the retention field (SDKs before it) are still served, kept --result-ttl."""
    rid = "retention-old-0001"
    payload = encode_request(GenerateRequest(v=1, request_id=rid, prompt="old", sampling=SamplingParams(max_tokens=2)))
    ks, args = scripts.enqueue_call(MODEL, "normal", rid, payload, None, 60_000)  # no retention_ms: no `r`
    assert scripts.read_enqueue(steps.ENQUEUE.run_sync(r, ks, args)).status == "ok"
    with Client(gw_redis_url) as client:
        assert len(client.handle(rid).result(timeout=60).token_ids) == 2
    ttl = r.pttl(keys.response_stream(rid))
    assert (DEFAULT_RESULT_TTL_S - 60) * 1000 < ttl <= DEFAULT_RESULT_TTL_S * 1000
