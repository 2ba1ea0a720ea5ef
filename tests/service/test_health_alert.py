"""The alerts that watch a worker's health (ops/prometheus/alerts.yml), evaluated by promtool on series
shaped like a real worker's: one whose engine wedges and that exits, one that stays unhealthy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from worker.service.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS_FILE = ROOT / "ops" / "prometheus" / "alerts.yml"
JOB = "pagedq-worker"
HEALTH_ALERTS = {"PagedqEngineStalled": "pagedq_engine_stalled_seconds", "PagedqWorkerUnhealthy": "pagedq_healthy"}


def _rules() -> dict[str, dict]:
    groups = yaml.safe_load(ALERTS_FILE.read_text(encoding="utf-8"))["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_health_alerts_read_gauges_the_worker_exports():
    rules = _rules()
    exposition = WorkerMetrics("default").render().decode()
    for alert, metric in HEALTH_ALERTS.items():
        assert metric in rules[alert]["expr"], alert
        assert f"# TYPE {metric} gauge" in exposition
        assert rules[alert]["annotations"]["runbook"] == "ops/README.md#engine-stalled"


def _series(name: str, values: str, instance: str) -> dict:
    return {"series": f'{name}{{job="{JOB}", instance="{instance}", model="default"}}', "values": values}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not on PATH (Debian's prometheus package)")
def test_health_alerts_fire_on_a_wedged_worker_and_only_then(tmp_path):
    """Every 10 s: w1's engine stalls for 60 s, then the worker exits (its series goes stale) and comes
    back healthy; w2 never stalls. PagedqEngineStalled fires once the stall passes 30 s and stays up for
    the 10-minute window after the exit. Every minute: w3 fails /health for good while it keeps running;
    PagedqWorkerUnhealthy fires after its 2-minute hold, never for w2."""
    rules = _rules()
    labels = {"severity": "warning", "component": "pagedq", "model": "default"}

    def firing(alert: str, summary: str, **extra: str) -> list[dict]:
        annotations = {**rules[alert]["annotations"], "summary": summary}
        return [{"exp_labels": {**labels, **extra}, "exp_annotations": annotations}]

    stalled_w1 = firing("PagedqEngineStalled", "The engine of w1:9400 made no progress for 1m 0s", instance="w1:9400")
    stalled = {
        "interval": "10s",
        "input_series": [
            _series("pagedq_engine_stalled_seconds", "0x5 10+10x5 stale 0x100", "w1:9400"),
            _series("pagedq_engine_stalled_seconds", "0.05x120", "w2:9400"),
        ],
        "alert_rule_test": [
            {"alertname": "PagedqEngineStalled", "eval_time": "1m"},
            {"alertname": "PagedqEngineStalled", "eval_time": "2m", "exp_alerts": stalled_w1},
            {"alertname": "PagedqEngineStalled", "eval_time": "10m", "exp_alerts": stalled_w1},
            {"alertname": "PagedqEngineStalled", "eval_time": "12m"},
        ],
    }
    unhealthy = {
        "interval": "1m",
        "input_series": [
            _series("pagedq_healthy", "1 1 0x10", "w3:9400"),
            _series("pagedq_healthy", "1x12", "w2:9400"),
        ],
        "alert_rule_test": [
            {"alertname": "PagedqWorkerUnhealthy", "eval_time": "3m"},
            {
                "alertname": "PagedqWorkerUnhealthy",
                "eval_time": "5m",
                "exp_alerts": firing(
                    "PagedqWorkerUnhealthy",
                    "Worker w3:9400 fails /health but keeps running",
                    severity="critical",
                    instance="w3:9400",
                    job=JOB,
                ),
            },
        ],
    }
    spec = {"rule_files": [str(ALERTS_FILE)], "evaluation_interval": "10s", "tests": [stalled, unhealthy]}
    path = tmp_path / "health_alerts_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
