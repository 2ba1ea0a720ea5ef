"""`pagedq batch run IN.jsonl OUT.jsonl` end to end against the real worker: a progress bar, OpenAI's
output lines, error lines to --error-file, and a second run with the same --batch-id runs nothing
again (the worker finishes no more requests), even with a line's stored result gone (it attaches)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from producer_sdk.contract import keys
from tests.gateway.gateway_proc import ROOT
from tests.service.worker_proc import wait_until

FINISHED = "pagedq_request_success_total"


def _without_created(text: str) -> list[dict]:
    lines = [json.loads(x) for x in text.splitlines()]
    for x in lines:
        x["response"]["body"].pop("created")
    return lines


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "worker.cli", "batch", "run", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_pagedq_batch_run_end_to_end_and_resumed(gw_worker, gw_redis_url, r, tmp_path):
    rows = [
        {
            "custom_id": f"cli-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": f"cli prompt {i}", "max_tokens": 4, "temperature": 0},
        }
        for i in range(6)
    ]
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in rows) + '{"custom_id": "bad"}\n')
    batch_id = f"cli-{time.time_ns()}"
    args = (str(src), str(out), "--redis-url", gw_redis_url, "--batch-id", batch_id, "--error-file", str(err))
    before = gw_worker.metric(FINISHED)
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert "7/7" in done.stderr and "6 completed, 1 failed" in done.stderr  # tqdm's bar, then the summary
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"cli-{i}" for i in range(6)]
    for i, x in enumerate(lines):
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert x["response"]["status_code"] == 200 and x["response"]["request_id"] == f"{batch_id}-{i}"
        assert x["response"]["body"]["object"] == "text_completion"
    errors = [json.loads(x) for x in err.read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("bad", "invalid_method")]
    ran = wait_until(lambda: gw_worker.metric(FINISHED) - before == 6 and 6, what="the worker's count of the 6")

    # Run it again after "a crash" that lost one stored result: nothing runs twice.
    r.hdel(keys.batch_results(batch_id), 2)
    first = out.read_text()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert _without_created(out.read_text()) == _without_created(first)  # line 2 was rendered again
    assert gw_worker.metric(FINISHED) - before == ran
