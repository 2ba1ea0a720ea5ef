"""Llama 3 RoPE scaling off the CPU (issue 19, item 1) and the model's CUDA path against transformers.

transformers' RoPE init functions return CPU tensors whatever device the model is built on; the
position tables must still end up on the model's device. The "meta" device shows it without a GPU.
On CUDA (marked gpu): fp32 logits and greedy tokens equal transformers'; bf16 is compared by logits
within a tolerance, never by tokens (ties and kernel choices differ legitimately in bf16).
"""

from __future__ import annotations

import pytest
import torch

from ops.bench.gpu_check import run_steps
from worker.models.llama import Rotary
from worker.models.loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    from worker.models.tiny import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("llama3") / "m", seed=3, rope_parameters=LLAMA3_ROPE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _seqs(vocab: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(5)
    lens = [3, 40, 150, 90]  # past original_max_position_embeddings: the scaled frequencies matter
    seqs = [torch.randint(0, vocab, (n + 6,), generator=gen).tolist() for n in lens]
    return seqs, lens


def test_rope_tables_land_on_the_model_device():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=LLAMA3_ROPE)
    with torch.device("meta"):
        rot = Rotary(cfg, 16, 128)
    assert rot.cos.device.type == "meta" and rot.sin.device.type == "meta"
    cpu = Rotary(cfg, 16, 128)
    assert cpu.cos.device.type == "cpu" and cpu.cos.shape == (128, 16)


def test_llama3_rope_matches_transformers_on_cpu(llama3_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama3_dir, dtype=torch.float32).eval()
    ours = load_model(llama3_dir, dtype="float32", device="cpu").model
    seqs, lens = _seqs(hf.config.vocab_size)
    got = run_steps(ours, seqs, lens, "cpu", chunk=32)
    with torch.inference_mode():
        for s, g in zip(seqs, got, strict=True):
            assert _rel(g, hf(torch.tensor([s])).logits[0]) < 1e-4


@pytest.mark.gpu
def test_llama3_rope_model_on_cuda_fp32_logits_and_bf16_within_tolerance(llama3_dir):
    from transformers import AutoModelForCausalLM

    seqs, lens = _seqs(512)
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(llama3_dir, dtype=dtype).to("cuda").eval()
        with torch.inference_mode():
            refs[dtype] = [hf(torch.tensor([s], device="cuda")).logits[0].float().cpu() for s in seqs]
    ours32 = load_model(llama3_dir, dtype="float32", device="cuda").model
    assert ours32.rotary.cos.is_cuda
    for g, want in zip(run_steps(ours32, seqs, lens, "cuda", chunk=32), refs[torch.float32], strict=True):
        assert _rel(g, want) < 1e-4
    ours16 = load_model(llama3_dir, dtype="bfloat16", device="cuda").model
    got16 = run_steps(ours16, seqs, lens, "cuda", chunk=32)
    for g, hf16, hf32 in zip(got16, refs[torch.bfloat16], refs[torch.float32], strict=True):
        # No further from the fp32 logits than transformers' own bf16 run is (plus slack).
        assert _rel(g, hf32) <= 1.5 * _rel(hf16, hf32) + 1e-3
        assert _rel(g, hf16) < 0.05


@pytest.mark.gpu
def test_engine_greedy_tokens_equal_transformers_on_cuda_fp32(llama3_dir):
    from transformers import AutoModelForCausalLM

    from ops.bench.gpu_check_common import hf_greedy
    from worker import LLM, SamplingParams

    seqs, _ = _seqs(512)
    hf = AutoModelForCausalLM.from_pretrained(llama3_dir, dtype=torch.float32).to("cuda").eval()
    want = [hf_greedy(hf, s, 12, "cuda") for s in seqs]
    llm = LLM(
        model=str(llama3_dir), dtype="float32", device="cuda", max_model_len=256,
        max_num_batched_tokens=64, kv_cache_memory=64 << 20,
    )  # fmt: skip
    outs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.gpu
def test_no_kernel_compiles_again_when_per_step_values_change():
    from ops.bench.gpu_check_common import Sizes
    from ops.bench.gpu_check_correctness import recompile_check

    result = recompile_check(Sizes.for_run(dry=False))
    assert result["ok"], result
