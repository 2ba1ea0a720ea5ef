"""`make compose-check`: build the CPU compose stack and run it for real.

    .venv/bin/python -m ops.compose_check [--keep] [--no-pull] [--debian-mirror URL]

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
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

from ops.compose_check.prepare import (
    PORTS,
    choose_ports,
    container_reaches_indexes,
    fill_wheels,
    host_torch_spec,
    resolve_base_images,
)
from ops.compose_check.shell import (
    COMPOSE,
    FACTS,
    PROJECT,
    ROOT,
    TIMINGS,
    CheckFailed,
    build,
    check,
    fact,
    phase,
    run,
    say,
)
from ops.compose_check.stack import KERNELS_UNAVAILABLE, Stack, chat_body, http_json, sse, stream_text

IMAGE_LIMIT_BYTES = 2_500_000_000

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
    parser = argparse.ArgumentParser(prog="python -m ops.compose_check", description=__doc__.split("\n\n")[0])
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
