"""ops/k8s: the Kubernetes manifests are valid (kubernetes-validate's offline schemas, strict), point at
what the worker really serves, and scale on the real queue keys."""

from __future__ import annotations

import os
import re
from pathlib import Path

import kubernetes_validate
import yaml

from producer_sdk.contract import keys
from worker.engine.config import EngineConfig
from worker.service.config import ServiceConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _deployment() -> dict:
    return next(d for d in _docs("worker.yaml") if d["kind"] == "Deployment")


def test_core_resources_validate_against_the_kubernetes_schemas():
    for doc in _docs("worker.yaml"):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_probes_and_env_match_the_worker():
    container = _deployment()["spec"]["template"]["spec"]["containers"][0]
    port = next(p for p in container["ports"] if p["name"] == "metrics")["containerPort"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PAGEDQ_METRICS_PORT"]["value"] == str(port)
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    fields = {f"PAGEDQ_{name.upper()}" for name in ServiceConfig.__dataclass_fields__}
    fields |= {f"PAGEDQ_{name.upper()}" for name in EngineConfig.__dataclass_fields__}
    assert set(env) <= fields, set(env) - fields  # every variable is a real worker option
    drain = float(env["PAGEDQ_DRAIN_TIMEOUT"]["value"])
    assert _deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_keda_scales_the_deployment_on_every_lane_of_the_model():
    scaled = next(d for d in _docs("keda.yaml") if d["kind"] == "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == _deployment()["metadata"]["name"]
    model = next(e["value"] for e in _deployment()["spec"]["template"]["spec"]["containers"][0]["env"]
                 if e["name"] == "PAGEDQ_MODEL_NAME")  # fmt: skip
    triggers = scaled["spec"]["triggers"]
    assert {t["metadata"]["stream"] for t in triggers} == {keys.lane_stream(model, lane) for lane in keys.LANES}
    assert {t["metadata"]["consumerGroup"] for t in triggers} == {keys.group(model)}
    for t in triggers:
        assert t["type"] == "redis-streams" and int(t["metadata"]["lagCount"]) > 0
        assert t["authenticationRef"]["name"] in {d["metadata"]["name"] for d in _docs("keda.yaml")}


def test_the_deployment_runs_the_image_compose_builds_as_its_user():
    """The pod's image is the GPU image docker-compose.yml builds (ops/Dockerfile), run as the Dockerfile's
    unprivileged user, who owns the prebuilt C++ kernels (TORCH_EXTENSIONS_DIR)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    default = re.fullmatch(r"\$\{PAGEDQ_IMAGE:-([^}]+)\}", compose["services"]["worker"]["image"])
    spec = _deployment()["spec"]["template"]["spec"]
    assert default and spec["containers"][0]["image"] == default.group(1)
    dockerfile = (ROOT / "ops" / "Dockerfile").read_text()
    user = re.findall(r"^USER\s+(\d+):(\d+)$", dockerfile, re.M)[-1]
    assert (str(spec["securityContext"]["runAsUser"]), str(spec["securityContext"]["runAsGroup"])) == user
    assert "TORCH_EXTENSIONS_DIR" not in {e["name"] for e in spec["containers"][0]["env"]}, "the image's own"


def test_every_manifest_is_checked():
    assert sorted(os.listdir(K8S)) == ["keda.yaml", "worker.yaml"]
