"""How producers find `pagedq up`'s stack (producer_sdk.discovery): PAGEDQ_REDIS_URL first, then the
up.json of a `pagedq up` that is still running, then localhost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from producer_sdk import discovery


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGEDQ_REDIS_URL", raising=False)
    return tmp_path


def _write_state(cache, pid: int) -> None:
    state = {"pid": pid, "redis_url": "redis://127.0.0.1:41234/0", "gateway_url": "http://127.0.0.1:8123/v1"}
    (cache / "up.json").write_text(json.dumps(state))


def test_nothing_running_means_localhost(cache):
    assert discovery.state_path() == cache / "up.json"
    assert discovery.running_stack() is None and discovery.discovered_gateway_url() is None
    assert discovery.default_redis_url() == "redis://127.0.0.1:6379/0"


def test_a_running_pagedq_up_is_found(cache):
    _write_state(cache, os.getpid())  # this process stands in for a live `pagedq up`
    assert discovery.default_redis_url() == "redis://127.0.0.1:41234/0"
    assert discovery.discovered_gateway_url() == "http://127.0.0.1:8123/v1"


def test_the_environment_wins(cache, monkeypatch):
    _write_state(cache, os.getpid())
    monkeypatch.setenv("PAGEDQ_REDIS_URL", "redis://elsewhere:6380/1")
    assert discovery.default_redis_url() == "redis://elsewhere:6380/1"


def test_the_file_of_a_stack_that_is_gone_is_ignored(cache):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_state(cache, int(gone.stdout))
    assert discovery.discovered_redis_url() is None
    (cache / "up.json").write_text("{not json")
    assert discovery.running_stack() is None
    (cache / "up.json").write_text("[1, 2]")
    assert discovery.running_stack() is None


def test_the_cli_and_the_sdk_share_one_discovery():
    from worker import local

    assert local.default_redis_url is discovery.default_redis_url
    assert local.state_path is discovery.state_path
