"""At most one device-to-host read of results per engine step (issue 45), counted on the CPU too.

Every read of a step's results goes through `transfer.to_host`, which counts itself in
`transfer.HOST_READS` (on CUDA it is the step's one synchronisation; tests/gpu/test_cuda_graphs.py counts
the waits there). A mixed workload: prompts in chunks, greedy and seeded random sampling, n = 2 forks,
logprobs, penalties, min_tokens, a stop string, an abort. A step reads once when it sampled a token and
never otherwise.
"""

from __future__ import annotations

import pytest

from worker import LLMEngine, SamplingParams
from worker.engine import transfer


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(model=str(llama_dir), dtype="float32", device="cpu", num_kv_blocks=256, max_num_batched_tokens=24)


def test_one_host_read_per_step_that_samples(engine):
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.9, seed=3, max_tokens=10, n=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=9, logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=30, stop=["a"]),
        SamplingParams(temperature=0, max_tokens=200),
    ]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt_token_ids=[(7 * i + j) % 200 + 3 for j in range(10 + 9 * i)], params=p)
    steps = sampled = 0
    while engine.has_unfinished_requests():
        before = transfer.HOST_READS.count
        outputs = engine.step()
        reads = transfer.HOST_READS.count - before
        new_tokens = any(c.delta_token_ids for o in outputs for c in o.outputs)
        assert reads == (1 if new_tokens else 0), (steps, reads, [o.request_id for o in outputs])
        steps += 1
        sampled += reads
        if steps == 20:
            engine.abort_request("r5")
        assert steps < 500
    assert sampled > 10 and steps > sampled  # prompt-only steps (chunks) happened and read nothing
