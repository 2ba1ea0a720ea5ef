"""Every example, as the README tells a user to run it: `pagedq up` with its defaults (its own
redis-server on a free port, the bundled SmolLM2-135M-Instruct, one worker), then
`python examples/<name>.py` with no URL: the example finds the stack through `up.json`.

Two departures from a user's machine, both for running beside other tests: PAGEDQ_CACHE is a folder of
this test's (its `models/` links to the SmolLM2 folder the session prepared once, so nothing is
prepared again), and the gateway gets a free port instead of 8000. The real model, not a tiny random
one: what is checked is what a user sees (answers that are not empty, a tool from the list on every
call, a valid tool call), which only a trained model gives.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.models.prepare import KNOWN_MODELS
from worker.service.redis_proc import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def _agent_tools() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("agent_backend", ROOT / "examples" / "agent_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOOLS


@pytest.fixture(scope="module")
def up_stack(smollm2_dir, tmp_path_factory):
    """`pagedq up` with its defaults; yields the environment a user's shell would have."""
    cache = tmp_path_factory.mktemp("pagedq-cache")
    (cache / "models").mkdir()
    (cache / "models" / KNOWN_MODELS["smollm2"]["folder"]).symlink_to(smollm2_dir, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PAGEDQ_REDIS_URL"}
    env.update(PAGEDQ_CACHE=str(cache), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "worker.cli", "up", "--gateway-port", str(free_port())]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("or:  python" in x for x in lines):
            line = up.stdout.readline()
            if (not line and up.poll() is not None) or time.monotonic() > deadline:
                pytest.fail("pagedq up did not start:\n" + "".join(lines))
            lines.append(line)
        assert (cache / "up.json").exists()
        assert f"python {os.path.relpath(ROOT / 'examples' / 'sync_client.py')}" in "".join(lines)
        yield env
    finally:
        up.send_signal(signal.SIGINT)
        rc = up.wait(60)
        up.stdout.close()
    assert rc == 0


def _run(script: str, env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, f"{script}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_every_example_is_tested_here():
    tested = {name for name in dir(sys.modules[__name__]) if name.startswith("test_")}
    for example in EXAMPLES:
        assert f"test_{example.removesuffix('.py')}" in tested, f"examples/{example} has no test"


@pytest.mark.slow
def test_sync_client(up_stack):
    out = _run("sync_client.py", up_stack, "Why is the sky blue?")
    answer, _, rest = out.partition("\n[")
    usage = re.search(r"completion_tokens=(\d+)", rest)
    assert answer.strip() and usage and int(usage[1]) > 1, out  # a chat answer, not a lone EOS
    streamed = rest.split("\n", 1)[1].strip()
    assert streamed, out


@pytest.mark.slow
def test_agent_backend(up_stack):
    out = _run("agent_backend.py", up_stack)
    streamed = re.search(r"^\[(stop|length)\] (\d+) tokens", out, re.M)
    assert streamed and int(streamed[2]) > 1, out
    picks = re.findall(r"^.*\(case \d\): (.*)$", out, re.M)
    assert len(picks) == 20, out
    assert set(picks) <= set(_agent_tools()), out  # a tool from the list on every call
    assert "cancelled after" in out


@pytest.mark.slow
def test_tool_calling(up_stack):
    out = _run("tool_calling.py", up_stack)
    call = re.search(r"calling get_weather\((.*)\) -> finish_reason tool_calls", out, re.S)
    assert call, out
    arguments = json.loads(call[1])  # streamed as written: valid against the tool's parameters
    assert arguments["unit"] in ("c", "f") and 0 < len(arguments["city"]) <= 40
    answer = re.search(r"^answer: (.+)$", out, re.M)
    assert answer and answer[1].strip(), out
    report = re.search(r"^report: (\{.*\})$", out, re.M)
    assert report, out
    assert set(ast.literal_eval(report[1])) == {"city", "temperature", "summary"}


def _readme_gateway_code() -> str:
    """The Python blocks of the README's gateway section, in order: the client, then the tool call."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## OpenAI-compatible gateway", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


@pytest.mark.slow
def test_the_readme_gateway_tool_example(up_stack):
    """The README's tool call through the `openai` client, as written, against `pagedq up` with no flags
    (the one change: the gateway's port, a free one here instead of 8000)."""
    code = _readme_gateway_code()
    assert "tool_choice=" in code and 'base_url="http://127.0.0.1:8000/v1"' in code
    gateway_url = json.loads((Path(up_stack["PAGEDQ_CACHE"]) / "up.json").read_text())["gateway_url"]
    code = code.replace("http://127.0.0.1:8000/v1", gateway_url)  # up.json's: http://127.0.0.1:PORT/v1
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=up_stack, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    finish, name, arguments = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (finish, name) == ("tool_calls", "get_weather"), done.stdout
    arguments = ast.literal_eval(arguments)  # printed as a dict: valid against the tool's parameters
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f") and len(arguments["city"]) <= 40


def _repeats(text: str, n: int = 5) -> list[str]:
    """The n-word sequences that occur more than once in `text` (what a looping answer is made of)."""
    words = re.findall(r"\w+", text.lower())
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
    return sorted({g for g in grams if grams.count(g) > 1})


@pytest.mark.slow
def test_the_demo_answers_do_not_loop(up_stack, smollm2_dir):
    """`make demo`'s three questions, with its sampling on the bundled model (greedy, and a repetition
    penalty, since SmolLM2's generation_config.json sets none): no answer repeats itself. Without the
    penalty the haiku was "... a never-ending cycle of endless tasks, a never-ending cycle of endless tasks"."""
    from producer_sdk import Client
    from worker.demo import QUESTIONS, SYSTEM, demo_sampling

    sampling = demo_sampling(str(smollm2_dir))
    assert sampling["repetition_penalty"] > 1.0
    url = json.loads((Path(up_stack["PAGEDQ_CACHE"]) / "up.json").read_text())["redis_url"]
    with Client(url) as client:
        for question in QUESTIONS:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            answer = client.generate(messages=messages, max_tokens=96, timeout=120, **sampling)
            assert answer.text.strip() and not _repeats(answer.text), (question, answer.text)
