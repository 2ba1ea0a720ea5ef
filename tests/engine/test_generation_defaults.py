"""The model's generation_config.json fills the sampling parameters a request leaves unset (vLLM's
`--generation-config auto`); explicit values win; `--generation-config vllm` ignores the file.

The oracle is transformers: its `generate` applies the same file's repetition_penalty to a greedy run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engine.oracle import hf_greedy, mixed_prompts
from worker import LLMEngine, SamplingParams
from worker.engine.config import ConfigError
from worker.engine.generation_defaults import load_generation_defaults

PENALTY = 1.8


def _with_generation_config(src: Path, dst: Path, **values) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return dst


@pytest.fixture(scope="module")
def penalised_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny llama with a generation_config.json that asks for a repetition penalty and top_k."""
    root = tmp_path_factory.mktemp("gen-config")
    return _with_generation_config(llama_dir, root / "llama", repetition_penalty=PENALTY, top_k=7, do_sample=True)


def test_only_the_sampling_fields_the_file_sets_are_taken(tmp_path, llama_dir):
    folder = _with_generation_config(
        llama_dir, tmp_path / "m", temperature=0.6, top_p=0.9, repetition_penalty=1.1, max_new_tokens=5, min_p=None
    )
    expected = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}  # no max_new_tokens, no None
    assert load_generation_defaults("auto", str(folder)) == expected
    assert load_generation_defaults("vllm", str(folder)) == {}
    assert load_generation_defaults("auto", str(llama_dir)) == {}  # eos/bos/pad only: nothing to apply
    assert load_generation_defaults(str(folder), str(llama_dir)) == load_generation_defaults("auto", str(folder))
    assert load_generation_defaults("auto", str(folder / "model.gguf")) == {}  # a GGUF file: no folder to read


def test_a_folder_without_the_file_and_a_value_no_request_could_carry_are_config_errors(tmp_path, llama_dir):
    with pytest.raises(ConfigError, match=r"--generation-config=.*no generation_config\.json"):
        load_generation_defaults(str(tmp_path), str(llama_dir))
    bad = _with_generation_config(llama_dir, tmp_path / "bad", top_p=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        load_generation_defaults("auto", str(bad))


def test_explicit_values_win_and_unset_ones_take_the_model_default():
    defaults = {"temperature": 0.3, "repetition_penalty": 1.2}
    p = SamplingParams(temperature=None, top_p=None, repetition_penalty=1.0, top_k=None).with_defaults(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.3, 1.0, 0, 1.0)
    plain = SamplingParams(temperature=0.0)
    assert plain.with_defaults(defaults) is plain  # nothing unset: nothing to fill


def test_the_engine_applies_the_file_and_transformers_agrees(penalised_dir, llama_dir):
    from transformers import AutoTokenizer

    prompts = mixed_prompts(AutoTokenizer.from_pretrained(llama_dir), 6, seed=3)
    engine = LLMEngine(model=str(penalised_dir), dtype="float32", device="cpu", num_kv_blocks=256)
    unset = SamplingParams(temperature=0.0, repetition_penalty=None, top_k=None, max_tokens=24)
    req = engine.prepare_request("probe", prompt_token_ids=prompts[0], params=unset)
    assert (req.sampling_params.repetition_penalty, req.sampling_params.top_k) == (PENALTY, 7)

    penalised = _generate(engine, prompts, unset)
    explicit = _generate(engine, prompts, SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=24))
    assert penalised == hf_greedy(penalised_dir, prompts, 24)  # transformers reads the same file
    assert explicit == hf_greedy(llama_dir, prompts, 24)  # an explicit 1.0 is not "unset"
    assert penalised != explicit  # the penalty changed something, so the test can fail

    ignoring = LLMEngine(
        model=str(penalised_dir), dtype="float32", device="cpu", num_kv_blocks=256, generation_config="vllm"
    )
    assert _generate(ignoring, prompts, unset) == explicit


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    return [outs[f"r{i}"] for i in range(len(prompts))]
