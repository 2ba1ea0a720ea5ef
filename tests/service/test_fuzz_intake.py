"""Hostile entries against a real worker: arbitrary bytes, and requests that pass the protocol's
checks but push every parameter to its edge. Each must end with a terminal event (or a dead letter
when no request id can be read), and the worker must stay up and keep serving."""

from __future__ import annotations

import time
import uuid

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from producer_sdk import Client
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Error, Finished, GenerateRequest, Message, SamplingParams
from producer_sdk.request_codec import encode_request
from producer_sdk.validation import DEFAULT_LIMITS
from tests.service.worker_proc import WorkerProc, response_events, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.single_node]  # a module-scoped worker on the session server

text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
floats = st.floats(allow_nan=False, allow_infinity=False)

sampling = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    max_tokens=st.one_of(st.none(), st.integers(1, 24)),
    min_tokens=st.integers(0, 3),
    temperature=st.one_of(st.just(0.0), st.floats(1e-6, 1e6)),
    top_p=st.floats(1e-9, 1.0).filter(lambda x: x > 0),
    top_k=st.one_of(st.just(-1), st.integers(0, 10**9)),
    min_p=st.floats(0.0, 1.0),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    stop=st.lists(text, max_size=4),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    ignore_eos=st.booleans(),
    repetition_penalty=st.floats(1e-6, 1e6),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    skip_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans(),
).filter(lambda s: s.max_tokens is None or s.min_tokens <= s.max_tokens)

prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=300)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.builds(
                    Message, role=st.sampled_from(["system", "user", "assistant", "tool"]), content=st.text(max_size=60)
                ),
                min_size=1,
                max_size=4,
            )
        }
    ),
)

requests = st.builds(
    lambda p, s, prio, meta: GenerateRequest(
        v=1, request_id=f"fuzz-{uuid.uuid4().hex}", sampling=s, priority=prio, metadata=meta, **p
    ),
    prompts,
    sampling,
    st.integers(-100, 100),
    st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=3),
)


@pytest.fixture(scope="module")
def fuzz_worker(llama_dir, redis_server):
    w = WorkerProc(
        llama_dir, redis_server.url, "--max-model-len", "256", "--max-num-seqs", "16", name="fuzz", metrics=False
    ).start()
    yield w
    w.stop()


def _wait_terminal(url: str, request_id: str, timeout: float = 60.0):
    def done():
        events = response_events(url, request_id)
        return events if events and isinstance(events[-1], (Finished, Error)) else None

    return wait_until(done, timeout, f"a terminal event for {request_id}")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(requests, min_size=1, max_size=4))
def test_hostile_but_valid_requests_all_end_and_the_worker_survives(fuzz_worker, redis_server, batch):
    url = redis_server.url
    r = connect(url, asyncio=False, socket_timeout=10)
    sent = []
    for req in batch:
        data = encode_request(req, DEFAULT_LIMITS)  # valid as far as the protocol goes
        r.xadd(keys.lane_stream("default", req.lane), {"id": req.request_id, "d": data})
        sent.append(req.request_id)
    for rid in sent:
        events = _wait_terminal(url, rid)
        assert [e.seq for e in events] == list(range(len(events)))
    assert fuzz_worker.proc.poll() is None, fuzz_worker.log()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    payload=st.one_of(
        st.binary(max_size=300),
        st.builds(
            msgspec.msgpack.encode,
            st.recursive(
                st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20),
                lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                max_leaves=12,
            ),
        ),
    )
)
def test_arbitrary_bytes_are_dead_lettered(fuzz_worker, redis_server, payload):
    url = redis_server.url
    r = connect(url, asyncio=False, socket_timeout=10)
    before = r.xlen(keys.dead_letters("default"))
    r.xadd(keys.lane_stream("default"), {"id": "fuzz-bytes-0001", "d": payload})
    wait_until(lambda: r.xlen(keys.dead_letters("default")) > before, 30, "a dead letter")
    assert fuzz_worker.proc.poll() is None, fuzz_worker.log()


def test_worker_still_serves_after_the_fuzzing(fuzz_worker, redis_server):
    with Client(redis_server.url) as client:
        t0 = time.monotonic()
        res = client.generate("still alive?", max_tokens=5, temperature=0, ignore_eos=True, timeout=60)
    assert res.finish_reason == "length" and len(res.token_ids) == 5 and time.monotonic() - t0 < 60
