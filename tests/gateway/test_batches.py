"""The Files and Batch API through the official `openai` client, against a real gateway and worker:
upload, create, poll, download; outputs equal direct requests; bad lines become error lines and the
batch goes on; cancel mid-batch leaves counts that add up; the size limit; tenants never see each
other's files or batches. Also the SDK's `Client.run_batch`."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from producer_sdk import BatchItem, Client
from producer_sdk.contract import keys
from tests.gateway.gateway_proc import GatewayProc
from tests.service.worker_proc import wait_until

MAX_FILE_BYTES = 100_000
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


@pytest.fixture(scope="module")
def keyed(gw_worker, gw_redis_url, tmp_path_factory):
    """A gateway with two tenants' keys, a small file limit and a short batch lease."""
    key_file = tmp_path_factory.mktemp("batch-keys") / "keys.json"
    key_file.write_text(json.dumps({"sk-a": {"tenant": "batch-a"}, "sk-b": {"tenant": "batch-b"}}))
    g = GatewayProc(
        gw_redis_url, "--api-keys", str(key_file), "--max-file-bytes", str(MAX_FILE_BYTES), "--batch-lease", "2"
    ).start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def a(keyed):
    # The openai client's default retries: a 503 on a Redis hiccup (Retry-After) is retried, as users' are.
    return openai.OpenAI(base_url=keyed.base_url, api_key="sk-a", max_retries=2)


@pytest.fixture(scope="module")
def b(keyed):
    return openai.OpenAI(base_url=keyed.base_url, api_key="sk-b", max_retries=2)


def chat_body(i: int, max_tokens: int = 6) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": f"batch prompt number {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def line(custom_id: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def upload(client: openai.OpenAI, rows: list, name: str = "in.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="batch")


def run_to_end(client: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    done = ("completed", "failed", "expired", "cancelled")
    return wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in done and b,
        timeout=timeout,
        what=f"batch {batch_id} to finish",
    )


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines() if x.strip()]


def test_a_chat_batch_end_to_end_equals_direct_requests(a, r):
    rows = [line(f"req-{i}", chat_body(i)) for i in range(6)]
    f = upload(a, rows)
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch"
    assert f.bytes == len(jsonl(rows)) and f.filename == "in.jsonl" and f.created_at > 0
    assert a.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in a.files.list()]
    assert a.files.content(f.id).content == jsonl(rows)

    batch = a.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.object == "batch" and batch.metadata == {"job": "nightly"}
    assert batch.status in ("validating", "in_progress") and batch.endpoint == CHAT
    done = run_to_end(a, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 6 and done.request_counts.completed == 6 and done.request_counts.failed == 0
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert done.expires_at == done.created_at + 24 * 3600
    out = lines_of(a, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in rows)
    assert a.files.retrieve(done.output_file_id).purpose == "batch_output"
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["request_id"] == f"{batch.id}-{o['custom_id'].split('-')[1]}"
    # The same lines as direct requests (temperature 0) answer the same.
    for i in range(6):
        direct = a.chat.completions.create(**chat_body(i))
        got = next(o for o in out if o["custom_id"] == f"req-{i}")["response"]["body"]
        assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert got["choices"][0]["finish_reason"] == direct.choices[0].finish_reason
        assert got["usage"]["completion_tokens"] == direct.usage.completion_tokens
    # Nothing of the batch is left to drive, and its per-line results made way for the files.
    assert not r.sismember(keys.batches_active(), batch.id)
    assert not r.exists(keys.batch_results(batch.id))

    listed = a.batches.list(limit=100)
    assert batch.id in [x.id for x in listed.data]
    page = a.batches.list(limit=1)
    assert len(page.data) == 1 and page.has_more in (True, False)

    assert a.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)


def test_a_completions_batch(a):
    rows = [
        line(
            f"c-{i}",
            {"model": "default", "prompt": f"once upon {i}", "max_tokens": 4, "temperature": 0},
            "/v1/completions",
        )
        for i in range(3)
    ]
    batch = a.batches.create(input_file_id=upload(a, rows).id, endpoint="/v1/completions", completion_window="24h")
    done = run_to_end(a, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    out = lines_of(a, done.output_file_id)
    direct = a.completions.create(model="default", prompt="once upon 0", max_tokens=4, temperature=0)
    first = next(o for o in out if o["custom_id"] == "c-0")["response"]["body"]
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == direct.choices[0].text


def test_bad_lines_become_error_lines_and_the_batch_goes_on(a):
    rows = [
        line("good-1", chat_body(1)),
        b"this is not json",
        {"method": "POST", "url": CHAT, "body": chat_body(2)},  # no custom_id
        line("wrong-url", {"model": "default", "prompt": "x"}, "/v1/completions"),
        line("good-1", chat_body(3)),  # a duplicate custom_id
        line("other-model", {**chat_body(4), "model": "another-model"}),
        line("bad-param", {**chat_body(5), "frobnicate": 1}),
        {"custom_id": "no-body", "method": "POST", "url": CHAT},
        {"custom_id": "get", "method": "GET", "url": CHAT, "body": chat_body(6)},
        line("good-2", chat_body(7)),
    ]
    batch = a.batches.create(input_file_id=upload(a, rows).id, endpoint=CHAT, completion_window="24h")
    done = run_to_end(a, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 10
    assert done.request_counts.completed == 2 and done.request_counts.failed == 8
    out = lines_of(a, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["good-1", "good-2"]
    errs = lines_of(a, done.error_file_id)
    assert len(errs) == 8
    codes = {(e["custom_id"], e["error"]["code"]) for e in errs}
    assert (None, "invalid_json_line") in codes and (None, "missing_custom_id") in codes
    assert ("wrong-url", "mismatched_url") in codes and ("good-1", "duplicate_custom_id") in codes
    assert ("other-model", "mismatched_model") in codes and ("no-body", "missing_body") in codes
    assert ("get", "invalid_method") in codes
    bad = next(e for e in errs if e["custom_id"] == "bad-param")
    assert bad["error"]["code"] == "unknown_parameter" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "frobnicate"


def test_a_model_not_served_fails_its_lines(a):
    rows = [line(f"m-{i}", {**chat_body(i), "model": "not-served-here"}) for i in range(2)]
    done = run_to_end(a, a.batches.create(input_file_id=upload(a, rows).id, endpoint=CHAT, completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.failed == 2 and done.output_file_id is None
    assert {e["error"]["code"] for e in lines_of(a, done.error_file_id)} == {"model_not_found"}


def test_a_file_that_is_not_jsonl_fails_the_batch(a):
    f = a.files.create(file=("x.jsonl", io.BytesIO(b"hello\nworld\n")), purpose="batch")
    done = run_to_end(a, a.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id)
    assert done.status == "failed" and done.failed_at and done.errors.data[0].code == "invalid_json_lines"
    assert done.output_file_id is None and done.error_file_id is None


def test_create_refuses_bad_arguments(a):
    f = upload(a, [line("x", chat_body(0))])
    with pytest.raises(openai.BadRequestError) as e:
        a.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as e:
        a.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        a.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        a.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


def test_a_file_over_the_limit_is_413(a):
    with pytest.raises(openai.APIStatusError) as e:
        a.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["param"] == "file"
    assert e.value.body["code"] == "request_too_large"


def test_another_tenants_file_and_batch_are_404(a, b):
    f = upload(a, [line("t-1", chat_body(0))])
    batch = a.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    for call in (
        lambda: b.files.retrieve(f.id),
        lambda: b.files.content(f.id),
        lambda: b.files.delete(f.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list(limit=100).data]
    done = run_to_end(a, batch.id)
    assert done.status == "completed"


def test_cancel_mid_batch_leaves_counts_that_add_up(a):
    rows = [line(f"k-{i}", {**chat_body(i, max_tokens=40), "ignore_eos": True}) for i in range(100)]
    batch = a.batches.create(input_file_id=upload(a, rows).id, endpoint=CHAT, completion_window="24h")
    wait_until(lambda: a.batches.retrieve(batch.id).request_counts.completed >= 1, timeout=60, what="a first line")
    cancelling = a.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = run_to_end(a, batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    counts = done.request_counts
    assert counts.total == 100 and 1 <= counts.completed < 100
    assert counts.completed + counts.failed <= counts.total
    out, errs = lines_of(a, done.output_file_id), lines_of(a, done.error_file_id)
    assert len(out) == counts.completed and len(errs) == counts.failed
    assert len({o["custom_id"] for o in out + errs}) == len(out) + len(errs)
    assert a.batches.cancel(batch.id).status == "cancelled"  # a finished batch stays as it is


def test_a_responses_batch_answers_each_line_with_the_response_object(a):
    """Lines of /v1/responses: each output body is the Response object a direct POST gives (greedy);
    a line that asks to chain, stream or run in the background is an error-file line."""
    ask = {"model": "default", "input": "hi there", "max_output_tokens": 5, "temperature": 0}
    rows = [
        line("r-1", ask, RESPONSES),
        line("r-2", {**ask, "instructions": "Be brief."}, RESPONSES),
        line("r-bad", {**ask, "previous_response_id": "resp_x"}, RESPONSES),
    ]
    done = run_to_end(
        a, a.batches.create(input_file_id=upload(a, rows).id, endpoint=RESPONSES, completion_window="24h").id
    )
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = {o["custom_id"]: o["response"]["body"] for o in lines_of(a, done.output_file_id)}
    for cid, body in (("r-1", ask), ("r-2", {**ask, "instructions": "Be brief."})):
        direct = a.responses.create(**body)
        assert out[cid]["object"] == "response" and out[cid]["status"] == direct.status
        assert out[cid]["output"][0]["content"][0]["text"] == direct.output_text
        assert out[cid]["usage"]["output_tokens"] == direct.usage.output_tokens
    error = lines_of(a, done.error_file_id)[0]
    assert error["custom_id"] == "r-bad" and error["response"]["body"]["error"]["param"] == "previous_response_id"


def test_the_sync_sdk_runs_a_batch_and_attaches_when_run_again(gw_worker, gw_redis_url):
    items = [BatchItem(f"s-{i}", {"prompt": f"sync batch {i}", "max_tokens": 4, "temperature": 0}) for i in range(5)]
    batch_id = f"sdk-batch-{time.time_ns()}"
    with Client(gw_redis_url) as client:
        first = dict(client.run_batch(items, batch_id=batch_id, window=2))
        assert sorted(first) == [f"s-{i}" for i in range(5)]
        assert all(c.request_id == f"{batch_id}-{i}" for i, c in enumerate(first[f"s-{i}"] for i in range(5)))
        again = dict(client.run_batch(items, batch_id=batch_id, window=5))
        assert {k: v.token_ids for k, v in again.items()} == {k: v.token_ids for k, v in first.items()}
        handle = client.submit("anything", request_id=f"{batch_id}-0")
        assert handle.duplicate  # the batch's requests are the ones attached to
