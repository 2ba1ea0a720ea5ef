"""The shared fixtures do what every other test assumes they do."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import redis
import torch

from producer_sdk.contract import keys
from worker.models.tiny import FAMILIES


def test_redis_fixture_serves_streams_and_survives_a_restart(redis_server, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create("s", "g", id="0", mkstream=True)
    r.xadd("s", {"k": "v1"})
    got = r.xreadgroup("g", "c", {"s": ">"}, count=10)
    assert got[0][1][0][1] == {b"k": b"v1"}
    redis_server.restart()  # a crash: nothing is kept on disk in this fixture
    r2 = redis.Redis.from_url(redis_url)
    assert r2.ping() and r2.xlen("s") == 0
    r2.xadd("s", {"k": "v2"})
    assert r2.xlen("s") == 1
    r.close()
    r2.close()


def test_redis_url_starts_empty(redis_url):
    """Empty but for the registry that says model "default" is served (producers may enqueue for it)."""
    r = redis.Redis.from_url(redis_url)
    assert r.keys("*") == [keys.models().encode()] and r.zrange(keys.models(), 0, -1) == [b"default"]
    r.set("left-behind", 1)  # the next test must not see it
    r.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_load_and_generate_in_transformers(tiny_model_dirs, family):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dirs[family]
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == family and cfg.vocab_size == len(tok)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok("你好, paged attention 🚀", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert tok.decode(tok("héllo 世界").input_ids) == "héllo 世界"  # byte-level: lossless


def test_tiny_families_differ_where_they_should(tiny_model_dirs):
    from transformers import AutoConfig

    cfgs = {f: AutoConfig.from_pretrained(p) for f, p in tiny_model_dirs.items()}
    assert cfgs["qwen2"].tie_word_embeddings and not cfgs["llama"].tie_word_embeddings
    assert cfgs["llama"].num_key_value_heads < cfgs["llama"].num_attention_heads  # GQA
    assert cfgs["qwen3"].head_dim * cfgs["qwen3"].num_attention_heads != cfgs["qwen3"].hidden_size


def test_torch_uses_one_thread_in_tests():
    assert torch.get_num_threads() == 1


@pytest.mark.slow
def test_smollm2_completes_the_capital_of_france(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
    assert tok.chat_template  # the chat template travelled with the tokenizer


def test_model_prepare_cli_is_idempotent(smollm2_dir):
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "model", "prepare", "smollm2", "--out", str(smollm2_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == str(smollm2_dir)


def test_logs_are_json_lines_with_the_bound_request_id():
    from worker.service.logging import configure_logging, get_logger

    stream = io.StringIO()
    configure_logging("INFO", json=None, stream=stream)  # not a TTY: JSON
    get_logger("t", request_id="req-1").info("token batch", tokens=3)
    line = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert line["request_id"] == "req-1" and line["event"] == "token batch" and line["level"] == "info"
    configure_logging("INFO", json=False, stream=stream)
    get_logger("t").info("readable")
    assert "readable" in stream.getvalue().splitlines()[-1] and not stream.getvalue().splitlines()[-1].startswith("{")
