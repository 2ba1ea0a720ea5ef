"""Hugging Face transformers baselines: one request at a time, static batching, continuous batching.

Every runner generates greedily with EOS ignored (each request produces exactly its `max_tokens`),
so its token ids can be compared with pagedq's. Token ids go in; token ids come out, in request order.

- `run_single`: `model.generate` per request, batch of one.
- `run_static`: batches of `batch_size` in arrival order, left padding; each batch runs until its
  longest request is done (the others' extra tokens are computed and thrown away), the next batch
  starts only then. `static_generate` is one such batch, with an optional per-step hook (the
  baseline Redis worker streams tokens from it).
- `HFContinuousBatching`: transformers' own continuous batching manager (`generate_batch`'s engine),
  fed each request with its own `max_new_tokens`; sizes from `CB_PRESETS`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ops.bench.workloads import BenchRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Continuous batching sizes tried on the project's 2-core CPUs (SmolLM2-135M). The query/KV padding
# intervals exist for CUDA graphs; on the CPU they only add work, so they are set to 1 (no padding).
# `num_blocks` is derived from the same KV token budget pagedq gets (see `cb_config`).
CB_PRESETS: dict[str, dict[str, Any]] = {
    "p32-t1024": {
        "page_size": 32,
        "max_batch_tokens": 1024,
        "q_padding_interval_size": 1,
        "kv_padding_interval_size": 1,
    },
    "p32-t512": {"page_size": 32, "max_batch_tokens": 512, "q_padding_interval_size": 1, "kv_padding_interval_size": 1},
    "p64-t2048": {
        "page_size": 64,
        "max_batch_tokens": 2048,
        "q_padding_interval_size": 1,
        "kv_padding_interval_size": 1,
    },
    "auto": {},  # transformers' own defaults (sizes the KV cache from free memory: a large RSS)
}
DEFAULT_CB_PRESET = "p32-t1024"


def load_hf_model(model_dir: str, dtype: str, device: str = "cpu"):
    """The model, eval mode, with EOS removed from its generation config: `generate` fills unset
    fields of the config it is given from the model's, so EOS can only be switched off there. The
    EOS ids are kept in `model.pagedq_eos_ids` (the baseline worker stops on them itself)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    model.pagedq_eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    model.generation_config.eos_token_id = None
    return model.to(device).eval()


def pad_id_of(model) -> int:
    for v in (model.generation_config.pad_token_id, model.config.pad_token_id, model.config.eos_token_id, 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def greedy_config(model, max_new_tokens: int):
    """The model's generation config, made greedy, with EOS off: every row runs `max_new_tokens`."""
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.temperature = gc.top_p = gc.top_k = None
    gc.num_beams = 1
    gc.max_new_tokens = max_new_tokens
    gc.min_new_tokens = None
    gc.max_length = None
    gc.eos_token_id = None  # stays None only because load_hf_model removed it from the model's config
    gc.pad_token_id = pad_id_of(model)
    return gc


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- one at a time -------------------------------------------------------------------------------


@torch.inference_mode()
def run_single(model, reqs: Sequence[BenchRequest]) -> list[list[int]]:
    outs = []
    dev = model.device
    for r in reqs:
        x = torch.tensor([r.prompt], device=dev)
        y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=greedy_config(model, r.max_tokens))
        outs.append(y[0, len(r.prompt) : len(r.prompt) + r.max_tokens].tolist())
    return outs


# --- static batching -----------------------------------------------------------------------------


def _step_criteria(hook: Callable[[list[int]], list[bool] | None]):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepHook(StoppingCriteria):
        """Called by `generate` after every step with the sequences so far: hands the new column
        to `hook`, which may mark rows finished (their later tokens are padding)."""

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
            done = hook(input_ids[:, -1].tolist())
            if done is None:
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StepHook()])


@torch.inference_mode()
def static_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    on_step: Callable[[list[int]], list[bool] | None] | None = None,
) -> list[list[int]]:
    """One left-padded batch, run until its longest request is done; row i's first `max_tokens[i]`
    generated tokens. `on_step(new_tokens)` sees each step's tokens and may return per-row
    "finished" flags (the batch still ends only when every row is finished)."""
    pad = pad_id_of(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    dev = model.device
    kwargs: dict[str, Any] = {}
    if on_step is not None:
        kwargs["stopping_criteria"] = _step_criteria(on_step)
    y = model.generate(
        ids.to(dev), attention_mask=mask.to(dev), generation_config=greedy_config(model, max(max_tokens)), **kwargs
    )
    return [y[i, width : width + n].tolist() for i, n in enumerate(max_tokens)]


def run_static(model, reqs: Sequence[BenchRequest], batch_size: int = 16) -> list[list[int]]:
    outs: list[list[int]] = []
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start : start + batch_size]
        outs += static_generate(model, [r.prompt for r in batch], [r.max_tokens for r in batch])
    return outs


# --- transformers' continuous batching -----------------------------------------------------------


def cb_config(preset: str | dict, kv_tokens: int | None):
    """A ContinuousBatchingConfig from a preset name (or a dict of its fields); `num_blocks` holds
    `kv_tokens` tokens unless the preset sets it (or is "auto")."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = dict(CB_PRESETS[preset]) if isinstance(preset, str) else dict(preset)
    if fields and kv_tokens and "num_blocks" not in fields:
        fields["num_blocks"] = math.ceil(kv_tokens / fields.get("page_size", 256))
    return ContinuousBatchingConfig(**fields)


class HFContinuousBatching:
    """transformers' continuous batching manager, kept running across `generate` calls (so a warm-up
    call pays the set-up once)."""

    def __init__(self, model, preset: str | dict = DEFAULT_CB_PRESET, kv_tokens: int | None = None) -> None:
        self.model = model
        self.config = cb_config(preset, kv_tokens)
        self._cm = None
        self.manager = None
        self._count = 0

    def __enter__(self) -> HFContinuousBatching:
        gc = greedy_config(self.model, 16)
        gc.eos_token_id = -1  # "no EOS" in the manager's terms
        self._cm = self.model.continuous_batching_context_manager(
            generation_config=gc, continuous_batching_config=self.config, block=True, timeout=30
        )
        self.manager = self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)

    def resolved_config(self) -> dict:
        cfg = getattr(self.manager, "continuous_batching_config", self.config)
        keep = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_async_batching")
        return {k: getattr(cfg, k, None) for k in keep}

    @torch.inference_mode()
    def generate(self, reqs: Sequence[BenchRequest], timeout: float = 3600.0) -> list[list[int]]:
        assert self.manager is not None, "use HFContinuousBatching as a context manager"
        ids = []
        for r in reqs:
            rid = f"r{self._count}"
            self._count += 1
            ids.append(rid)
            self.manager.add_request(list(r.prompt), request_id=rid, max_new_tokens=r.max_tokens, eos_token_id=-1)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ids):
            res = self.manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed on {res.request_id}: {res.error}")
                got[res.request_id] = res
            elif res is None and not self.manager.is_running():
                raise RuntimeError("transformers continuous batching: the generation thread died")
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers continuous batching: {len(ids) - len(got)} requests unfinished")
        return [list(got[rid].generated_tokens)[: r.max_tokens] for rid, r in zip(ids, reqs, strict=True)]
