"""The model's generation defaults through the whole path: a producer that leaves a sampling field unset
sends nothing for it, and the worker fills it from the model's generation_config.json; one that sets it,
to vLLM's default value included, gets what it set; a worker started with `--generation-config vllm`
ignores the file. The oracle is transformers' `generate`, which applies the same file."""

from __future__ import annotations

import json
import shutil

import pytest

from producer_sdk import Client
from tests.engine.oracle import hf_greedy
from tests.service.worker_proc import WorkerProc

PROMPTS = [[5, 17, 42, 99, 7, 7, 7, 3], [120, 121, 122, 1, 2, 3, 4]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model_with_defaults(llama_dir, tmp_path_factory):
    """The tiny llama whose generation_config.json asks for greedy decoding with a repetition penalty."""
    folder = tmp_path_factory.mktemp("gen-defaults") / "llama"
    shutil.copytree(llama_dir, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0, "repetition_penalty": 1.8}))
    return folder


def _answers(redis_url: str, **sampling) -> list[list[int]]:
    with Client(redis_url) as client:
        handles = [client.submit(prompt_token_ids=p, max_tokens=MAX_TOKENS, **sampling) for p in PROMPTS]
        return [h.result(timeout=120).token_ids for h in handles]


def test_unset_fields_take_the_models_defaults_and_set_ones_win(model_with_defaults, llama_dir, redis_url):
    penalised, plain = hf_greedy(model_with_defaults, PROMPTS, MAX_TOKENS), hf_greedy(llama_dir, PROMPTS, MAX_TOKENS)
    assert penalised != plain  # the file changes the answers, so this test can fail

    w = WorkerProc(model_with_defaults, redis_url, "--max-model-len", "256").start()
    try:
        assert _answers(redis_url) == penalised  # nothing set: greedy with the file's penalty
        assert _answers(redis_url, repetition_penalty=1.0) == plain  # an explicit 1.0 is sent, and wins
    finally:
        w.stop()

    w = WorkerProc(model_with_defaults, redis_url, "--max-model-len", "256", "--generation-config", "vllm").start()
    try:
        assert _answers(redis_url, temperature=0.0) == plain
    finally:
        w.stop()


@pytest.mark.parametrize(
    ("body", "temperature", "repetition_penalty"),
    [({}, None, None), ({"temperature": 1.0}, 1.0, None), ({"repetition_penalty": 1.0, "temperature": 0}, 0, 1.0)],
)
def test_the_gateway_and_the_sdk_send_only_what_the_client_set(body, temperature, repetition_penalty):
    """An OpenAI body's unset sampling fields reach the worker unset (absent from the payload), and a set
    one, at vLLM's default value too, is on the wire."""
    from gateway import mapping
    from producer_sdk._core import build_request
    from producer_sdk.request_codec import decode_request

    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
    submit = mapping.map_chat(mapping.decode(mapping.CHAT, raw)).submit
    payload = build_request(**submit).payload
    sampling = decode_request(payload).sampling
    assert (sampling.temperature, sampling.repetition_penalty) == (temperature, repetition_penalty)
    assert (b"temperature" in payload) == (temperature is not None)
