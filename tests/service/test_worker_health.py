"""A real worker's /health and /ready, its exit when a duty dies or its engine wedges, and capacity counted
in sequences."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

from producer_sdk import Client
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Started, Tokens
from tests.service.worker_proc import WorkerProc, response_events, wait_until
from worker.service.watchdog import STALL_EXIT_CODE


def probe(worker: WorkerProc, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_and_ready_when_serving(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url).start()
    try:
        assert probe(w, "/health")[0] == 200
        _, body = wait_until(lambda: (s := probe(w, "/ready"))[0] == 200 and s, what="ready")
        assert body["redis_ok"] and not body["draining"]
        with Client(redis_url) as client:
            assert len(client.generate("hi", max_tokens=3, ignore_eos=True, timeout=60).token_ids) == 3
        assert probe(w, "/health")[0] == 200
    finally:
        w.stop()


def test_health_fails_while_the_engine_is_wedged(llama_dir, redis_url):
    """Each step hangs for 3 s (a fault hook standing in for a wedged forward): /health says so, and
    with --health-stall-action report the worker only logs it and goes on."""
    args = ("--health-stall-s", "1", "--health-stall-action", "report")
    w = WorkerProc(llama_dir, redis_url, *args, env={"PAGEDQ_FAULT_STEP_DELAY_S": "3"}).start()
    try:
        assert probe(w, "/health")[0] == 200  # idle: the engine loop beats while it waits
        with Client(redis_url) as client:
            handle = client.submit("hang", max_tokens=2, ignore_eos=True)
            _, body = wait_until(lambda: (s := probe(w, "/health"))[0] == 503 and s, what="/health to fail")
            assert body["engine_beat_age_s"] > 1
            # /metrics tells the same (for the alerts): the stall's age, and /health as 0/1
            wait_until(
                lambda: w.metric("pagedq_healthy") == 0 and w.metric("pagedq_engine_stalled_seconds") > 1,
                what="the health gauges to show the stall",
            )
            assert len(handle.result(timeout=60).token_ids) == 2
        wait_until(
            lambda: (
                probe(w, "/health")[0] == 200
                and w.metric("pagedq_healthy") == 1
                and w.metric("pagedq_engine_stalled_seconds") < 1
            ),
            what="/health and the gauges to recover",
        )
        assert w.proc.poll() is None  # still serving
        stalls = [e for e in w.log_events() if e["event"].startswith("engine stalled")]
        assert stalls and all(e["action"] == "report" for e in stalls)
        wait_until(lambda: any(e["event"] == "engine progressing again" for e in w.log_events()), what="the log")
    finally:
        w.stop()


def test_a_wedged_worker_exits_and_another_serves_its_request(llama_dir, redis_url):
    """The engine thread blocks for good after 4 steps (a fault hook: a forward that never returns).
    The worker notices it within --health-stall-s plus one watchdog tick, logs it, hands its request
    over and exits with status 3; a second worker then finishes the request, every token exactly once
    and the same as an undisturbed run."""
    tokens = 24
    with Client(redis_url) as client:
        ref = WorkerProc(llama_dir, redis_url, name="ref").start()
        try:
            want = client.generate("wedge", max_tokens=tokens, temperature=0, ignore_eos=True, timeout=60).token_ids
        finally:
            ref.stop()
        env = {"PAGEDQ_FAULT_WEDGE_AFTER_STEPS": "4", "PAGEDQ_FAULT_STEP_DELAY_S": "0.02"}
        a = WorkerProc(llama_dir, redis_url, "--health-stall-s", "1", name="a", env=env).start()
        b = WorkerProc(llama_dir, redis_url, name="b")
        try:
            handle = client.submit("wedge", max_tokens=tokens, temperature=0, ignore_eos=True)
            assert a.wait(30) == STALL_EXIT_CODE, a.log()
            stalls = [e for e in a.log_events() if e["event"].startswith("engine stalled")]
            assert len(stalls) == 1 and stalls[0]["action"] == "exit", a.log()
            assert 1 < stalls[0]["stalled_s"] < 1 + 2 * 0.25 + 0.5  # noticed within a tick or two
            assert "_run" in (stalls[0]["engine_stack"] or "")  # where the engine thread is stuck
            assert any(e["event"] == "handing over unfinished requests" for e in a.log_events())
            b.start()
            result = handle.result(timeout=120)
        finally:
            a.stop()
            b.stop()
    assert result.worker == "b" and result.token_ids == want
    events = response_events(redis_url, handle.request_id)
    seqs = [e.seq for e in events]
    assert seqs == list(range(len(events)))  # no event twice, none missing
    started = [e for e in events if isinstance(e, Started)]
    assert [(s.worker, s.attempt) for s in started] == [("a", 1), ("b", 2)]
    stored = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert stored == want  # a's tokens, then b's from where a stopped: none lost, none twice


def test_not_ready_while_draining(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url, "--drain-timeout", "30", env={"PAGEDQ_FAULT_STEP_DELAY_S": "0.05"}).start()
    try:
        with Client(redis_url) as client:
            handle = client.submit("long", max_tokens=200, ignore_eos=True)
            wait_until(lambda: probe(w, "/ready")[0] == 200, what="ready")
            wait_until(
                lambda: connect(redis_url, asyncio=False, socket_timeout=10).exists(
                    keys.response_stream(handle.request_id)
                )
            )
            w.signal(signal.SIGTERM)
            _, body = wait_until(lambda: (s := probe(w, "/ready"))[0] == 503 and s, what="not ready")
            assert body["draining"] is True
            assert len(handle.result(timeout=60).token_ids) == 200  # the drain finishes it
        assert w.wait(60) == 0
    finally:
        w.stop()


def test_capacity_counts_sequences_not_requests(llama_dir, redis_url):
    """Requests with n=4 on workers with 4 sequence slots: each worker holds one at a time, so the
    queue is shared instead of hoarded (counted in requests, the first worker would take five)."""
    args = ("--max-num-seqs", "4", "--max-model-len", "256")
    env = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.02"}
    a = WorkerProc(llama_dir, redis_url, *args, name="a", env=env).start()
    b = WorkerProc(llama_dir, redis_url, *args, name="b", env=env).start()
    try:
        with Client(redis_url) as client:
            handles = client.submit_many(["x"] * 6, n=4, max_tokens=30, ignore_eos=True, temperature=1.0, seed=3)
            results = [h.result(timeout=120) for h in handles]
        assert all(len(r.choices) == 4 for r in results)
        by_worker = [r.worker for r in results]
        assert max(by_worker.count("a"), by_worker.count("b")) <= 4, by_worker
    finally:
        a.stop()
        b.stop()


def test_backlog_metrics_for_autoscaling(llama_dir, redis_url):
    """Requests no worker has taken yet show as consumer-group lag and as the age of the oldest one."""
    w = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "1", env={"PAGEDQ_FAULT_STEP_DELAY_S": "0.05"}).start()
    try:
        with Client(redis_url) as client:
            handles = client.submit_many(["x"] * 6, max_tokens=40, ignore_eos=True)
            lag = wait_until(lambda: w.metric("pagedq_queue_lag", lane="normal"), what="lag to show")
            assert 1 <= lag <= 6
            assert wait_until(lambda: w.metric("pagedq_queue_oldest_waiting_seconds", lane="normal") > 0, what="age")
            for h in handles:
                h.result(timeout=120)
        wait_until(lambda: w.metric("pagedq_queue_lag", lane="normal") == 0, what="lag to drain")
        assert w.metric("pagedq_queue_oldest_waiting_seconds", lane="normal") == 0
    finally:
        w.stop()
