"""Turns one scheduled step into a forward pass and sampled tokens.

It owns the model and the KV cache tensors. From the scheduler's output it builds the flattened
batch — token ids, positions, slot mapping, per-request query starts, sequence lengths, block
tables — with one host-to-device copy per array, runs the model, computes logits only at the rows
that will be sampled, and samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kernels import AttentionMetadata, copy_blocks
from worker.engine.kv_cache import blocks_for_bytes
from worker.engine.request import Sequence
from worker.engine.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRow, min_tokens_suppression
from worker.engine.scheduler import SchedulerOutput
from worker.models.loader import LoadedModel

CPU_DEFAULT_KV_BYTES = 1 << 30

# Fault injection for the chaos tests (off unless set): a forward whose batch holds this token id
# raises, standing in for a request that crashes the model path.
_POISON_TOKEN = os.environ.get("PAGEDQ_FAULT_POISON_TOKEN")


@dataclass
class SampleRow:
    """Sample the next token of `seq` from the logits of the last query row of batch entry `batch_index`.

    A request whose prompt completes with n > 1 samples gets n rows on the same logits."""

    batch_index: int
    seq: Sequence


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        eos_token_ids: frozenset[int],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_layers = len(self.model.layers)
        self.num_kv_heads = self.model.num_kv_heads
        self.head_dim = self.model.head_dim
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_blocks = num_kv_blocks or self._size_kv_cache(
            kv_cache_memory, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens
        )
        shape = (self.num_layers, 2, self.num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_layers)]
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids  # masked for rows still under min_tokens

    # --- sizing ------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem * self.block_size

    def _size_kv_cache(
        self, kv_bytes: int | None, utilization: float, max_num_seqs: int, max_num_batched_tokens: int
    ) -> int:
        if kv_bytes is None and self.device.type == "cuda":
            kv_bytes = self._profile_free_cuda_bytes(utilization, max_num_batched_tokens)
        elif kv_bytes is None:
            # Never more than every sequence at full length could use.
            kv_bytes = min(CPU_DEFAULT_KV_BYTES, max_num_seqs * self.max_blocks_per_seq * self.bytes_per_block)
        elem = torch.empty((), dtype=self.dtype).element_size()
        n = blocks_for_bytes(
            kv_bytes,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=elem,
            block_size=self.block_size,
        )
        if n < self.max_blocks_per_seq:
            raise RuntimeError(
                f"the KV cache budget ({kv_bytes / 2**20:.0f} MiB) holds {n} blocks, fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs ({self.max_blocks_per_seq}); raise the budget or lower "
                "--max-model-len"
            )
        return n

    @torch.inference_mode()
    def _profile_free_cuda_bytes(self, utilization: float, max_tokens: int) -> int:
        """Run the largest step once with a scratch cache; what is left under the cap is for KV."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(max_tokens, self.max_model_len)
        scratch_blocks = -(-n // self.block_size)
        scratch = torch.zeros(
            (self.num_layers, 2, scratch_blocks, self.block_size, self.num_kv_heads, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        caches = [(scratch[i, 0], scratch[i, 1]) for i in range(self.num_layers)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(scratch_blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=pos.clone(),
            max_query_len=n,
            max_seq_len=n,
        )
        hidden = self.model(ids, pos, caches, meta)
        self.model.compute_logits(hidden[-min(n, 256) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.numel() * scratch.element_size()
        del scratch, caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * utilization) - peak - used_by_others
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at --gpu-memory-utilization={utilization}: weights and "
                f"activations peak at {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB"
            )
        return budget

    # --- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, rows: list[SampleRow]) -> SamplerOutput | None:
        if sched.block_copies:
            pairs = torch.tensor(sched.block_copies, dtype=torch.long, device=self.device)
            copy_blocks([c for layer in self.kv_caches for c in layer], pairs)
        ids, positions, meta, last_rows = self._prepare(sched)
        if _POISON_TOKEN is not None and bool((ids == int(_POISON_TOKEN)).any()):
            raise RuntimeError(f"fault injection: poison token {_POISON_TOKEN} in the batch")
        hidden = self.model(ids, positions, self.kv_caches, meta)
        if not rows:
            return None
        index = torch.tensor([last_rows[r.batch_index] for r in rows], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return self.sampler(logits, self._sampling_batch(rows))

    def _sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
        sampling_rows = []
        for r in rows:
            p = r.seq.request.sampling_params
            # Token histories are only copied for the rows whose parameters read them.
            needs_output = p.uses_penalties or p.min_tokens > 0
            sampling_rows.append(
                SamplingRow(
                    p,
                    r.seq.request.prompt_token_ids if p.repetition_penalty != 1.0 else (),
                    r.seq.output_token_ids if needs_output else (),
                    r.seq.generator,
                )
            )
        suppress = min_tokens_suppression(sampling_rows, self.eos_token_ids)
        return SamplingBatch.build(sampling_rows, device=self.device, suppress=suppress or None)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        starts, qlens, tables, ids = [], [], [], []
        for s in sched.scheduled:
            start = s.seq.num_computed_tokens
            starts.append(start)
            qlens.append(s.num_new_tokens)
            ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
            tables.append(s.block_table)
        starts_np = np.asarray(starts, dtype=np.int64)
        qlens_np = np.asarray(qlens, dtype=np.int64)
        seq_lens_np = starts_np + qlens_np
        qsl = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens_np, out=qsl[1:])
        total = int(qsl[-1])
        req_of_token = np.repeat(np.arange(len(qlens)), qlens_np)
        positions = np.arange(total) - qsl[:-1][req_of_token] + starts_np[req_of_token]
        width = max(len(t) for t in tables)
        table_np = np.zeros((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table_np[i, : len(t)] = t
        slots = table_np[req_of_token, positions // bs] * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table_np.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(qlens_np.max()),
            max_seq_len=int(seq_lens_np.max()),
            num_decodes=sched.num_decodes,
            query_lens_host=qlens,
            seq_lens_host=seq_lens_np.tolist(),
        )
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(positions).to(dev)
        return ids_t, pos_t, meta, (qsl[1:] - 1).tolist()
