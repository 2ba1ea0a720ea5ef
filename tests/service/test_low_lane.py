"""A batch on the low lane beside an interactive request, with a real worker: the low lane never takes
every seat (the intake leaves a quarter of them to the other lanes), so an interactive request queued
behind a full batch is read at once, and the engine's cap lets it run beside a few batch lines. It
finishes while every batch line is still running; without the low lane's room it would wait in Redis
until a batch line finished."""

from __future__ import annotations

import pytest

from producer_sdk import Client
from producer_sdk.protocol import Finished
from tests.service.worker_proc import WorkerProc, response_events, wait_until

SEATS = 8  # + headroom 1: the intake takes 9; the low lane at most 6
BATCH = {"max_tokens": 300, "temperature": 0, "ignore_eos": True, "priority": -1}


@pytest.mark.parametrize("fair_window", ["0", "2"])
def test_an_interactive_request_passes_a_full_batch(llama_dir, redis_url, fair_window):
    w = WorkerProc(
        llama_dir,
        redis_url,
        "--max-num-seqs",
        str(SEATS),
        "--max-model-len",
        "512",
        "--fair-share-window",
        fair_window,
        env={"PAGEDQ_FAULT_STEP_DELAY_S": "0.01"},
    ).start()
    try:
        with Client(redis_url) as client:
            batch = [h.request_id for h in client.submit_many([{"prompt": f"line {i}", **BATCH} for i in range(20)])]
            wait_until(lambda: w.metric("pagedq_num_requests_running") >= 6, timeout=60, what="the batch to run")
            chat = client.submit("an interactive question", max_tokens=4, temperature=0)
            assert chat.result(timeout=60).finish_reason == "length"
            finished = [rid for rid in batch if any(isinstance(e, Finished) for e in response_events(redis_url, rid))]
            assert finished == []  # it passed them all
            for rid in batch:
                client.cancel(rid)
    finally:
        w.stop()
