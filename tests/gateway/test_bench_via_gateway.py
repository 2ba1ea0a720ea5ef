"""`pagedq bench serve --via gateway` runs end to end (small: the tiny model, 8 requests, 50 streams)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gateway.gateway_proc import ROOT


@pytest.mark.slow
def test_bench_serve_via_gateway(llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "ops.bench", "serve", "--via", "gateway", "--quick", "--no-progress"]
    cmd += ["--model", str(llama_dir), "--gateway-streams", "50", "--threads", "1", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[serve via gateway] saturation: SDK" in run.stderr
    (path,) = tmp_path.glob("serve-gateway-*.json")
    result = json.loads(path.read_text())
    assert "error" not in result, result.get("error")
    sat = result["saturation"]
    assert sat["sdk"]["runs"][0]["ok"] == sat["gateway"]["runs"][0]["ok"] == 8
    assert result["single"]["sdk_ttft_s"]["n"] == result["single"]["gateway_ttft_s"]["n"] == 24
    streams = result["streams"]
    assert streams["failed"] == 0 and streams["open_streams_gauge"] == 50 and streams["probe_ok"]
    assert len(result["goals"]) == 3 and result["goals"][0]["goal"] == "saturation throughput, gateway vs SDK"
