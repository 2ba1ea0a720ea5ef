"""Turns one scheduled step into a forward pass and sampled tokens.

It owns the model and the KV cache tensors. From the scheduler's output it builds the flattened
batch on the host (input_batch.py keeps the block tables between steps; step_inputs.py), moves it to
the device through pinned staging buffers without blocking (transfer.py), runs the model — eagerly,
or for a decode-only step by replaying the CUDA graph of its batch-size bucket (cuda_graphs.py) —
computes logits only at the rows that will be sampled, samples on the device, and brings the sampled
ids (and logprobs) back in one copy: the step's only wait for the device.

Everything built lazily (the CPU decode extension, Triton kernels, the graphs) is built in the
constructor, so the first request runs at the speed of the second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pagedq_kernels import AttentionMetadata, copy_blocks
from pagedq_kernels import cpu as kernels_cpu
from pagedq_kernels.dispatch import backend_for
from worker.engine.cuda_graphs import DecodeGraphs, capture_sizes
from worker.engine.input_batch import InputBatch
from worker.engine.kv_cache import blocks_for_bytes
from worker.engine.request import Sequence
from worker.engine.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRow, min_tokens_suppression
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import SchedulerOutput
from worker.engine.step_inputs import StepBatch, pad_decode, warm_up_batch
from worker.engine.structured import StructuredOutputManager, xgrammar_available
from worker.engine.transfer import Uploader, to_host
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
        enforce_eager: bool = False,
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
        self.vocab_size = self.model.config.vocab_size
        self.max_num_seqs = max_num_seqs
        self.uploader = Uploader(self.device)
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size)
        self._last_sampled: tuple[list[Sequence], SamplingBatch | None] = ([], None)
        seqs, tokens = max_num_seqs, max(max_num_batched_tokens, max_num_seqs)
        self.uploader.reserve({np.int64: 3 * tokens + seqs, np.int32: 2 * seqs + 1 + seqs * self.max_blocks_per_seq})
        self.decode_graphs: DecodeGraphs | None = None
        self.cuda_graphs = False  # decode-only steps replay captured CUDA graphs
        self.grammar: StructuredOutputManager | None = None  # the engine's; fills each step's bitmask
        self._warm_up()
        if self.device.type == "cuda" and not enforce_eager and backend_for(self.kv_cache) == "triton":
            self.capture_decode_graphs()

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

    # --- start-up: build everything lazy now (issue 18: ready means ready) ----------------------

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One tiny step through every path a request will take, writing nothing to the cache: the C++
        decode extension (CPU) or the Triton prefill/decode kernels (CUDA, the decode one also split),
        the LM head, the sampler in its greedy and random modes, the host copies."""
        if backend_for(self.kv_cache) == "cpu":
            kernels_cpu.extension()
        batch = warm_up_batch(self.block_size)
        dev = self.uploader.upload(*self._eager_arrays(batch), batch.logits_rows)
        hidden = self._forward_eager(batch, *dev[:6])
        if backend_for(self.kv_cache) == "triton":
            ids, pos, meta = self._eager_inputs(batch, *dev[:6])
            meta.decode_partitions = 2  # the split decode and its combine kernel
            self.model(ids, pos, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden.index_select(0, dev[6]))
        greedy, spiced = (
            SamplingParams(temperature=0.0),
            SamplingParams(
                temperature=0.8,
                top_k=5,
                top_p=0.9,
                min_p=0.01,
                repetition_penalty=1.1,
                presence_penalty=0.1,
                logprobs=1,
            ),
        )
        gen = torch.Generator(device=self.device).manual_seed(0)
        rows = [SamplingRow(greedy), SamplingRow(spiced, (1, 2), (3,), gen)]
        mask = None
        if xgrammar_available():  # the bitmask kernel (Triton on CUDA), on row 1 only: all tokens allowed
            mask = (torch.full((2, -(-self.vocab_size // 32)), -1, dtype=torch.int32), [1])
        batch = SamplingBatch.build(rows, device=self.device, vocab_size=self.vocab_size, bitmask=mask)
        out = self.sampler(logits, batch)
        to_host([out.token_ids, out.top_token_ids, out.logprobs, out.top_logprobs])

    def capture_decode_graphs(self, *, capture: bool = True) -> None:
        """Build the decode-step graphs (see cuda_graphs.py). `capture=False` keeps the static-buffer
        path but runs it eagerly (the CPU tests of that path)."""
        if capture and (self.device.type != "cuda" or backend_for(self.kv_cache) != "triton"):
            raise RuntimeError("CUDA graphs need a CUDA device and the triton attention backend")
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            sizes=capture_sizes(self.max_num_seqs),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            device=self.device,
            capture=capture,
        )
        self.cuda_graphs = capture

    # --- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, rows: list[SampleRow]) -> SamplerOutput | None:
        """Run one step; the sampled ids (and logprobs) come back as CPU tensors, after the step's only
        wait for the device."""
        logits = self.logits(sched, rows)
        if logits is None:
            return None
        out = self.sampler(logits, self._sampling_batch(rows))
        ids, top_ids, lp, top_lp = to_host([out.token_ids, out.top_token_ids, out.logprobs, out.top_logprobs])
        return SamplerOutput(token_ids=ids, logprobs=lp, top_token_ids=top_ids, top_logprobs=top_lp)

    @torch.inference_mode()
    def logits(self, sched: SchedulerOutput, rows: list[SampleRow], *, eager: bool = False) -> torch.Tensor | None:
        """The step's forward (block copies first, then the graph of its bucket when it is decode-only and
        graphs are on, unless `eager`); the logits `[len(rows), V]` of the rows to sample, left on the
        device and not waited for, or None when no row samples."""
        batch = self.input_batch.prepare(sched.scheduled, sched.num_decodes, [r.batch_index for r in rows])
        bucket = None if eager else self._graph_bucket(batch)
        if bucket is not None:
            arrays = [*pad_decode(batch, bucket), batch.block_tables]
        else:
            arrays = self._eager_arrays(batch)
        copies = np.asarray(sched.block_copies, dtype=np.int64).reshape(-1, 2) if sched.block_copies else None
        extras = [a for a in (copies, batch.logits_rows) if a is not None]
        dev = self.uploader.upload(*arrays, *extras)
        if copies is not None:
            copy_blocks([c for layer in self.kv_caches for c in layer], dev[len(arrays)])
        if _POISON_TOKEN is not None and bool((batch.input_ids == int(_POISON_TOKEN)).any()):
            raise RuntimeError(f"fault injection: poison token {_POISON_TOKEN} in the batch")
        if bucket is not None:
            hidden = self.decode_graphs.run(bucket, *dev[:3])
        else:
            hidden = self._forward_eager(batch, *dev[: len(arrays)])
        if not rows:
            return None
        if batch.logits_rows is not None:
            return self.model.compute_logits(hidden.index_select(0, dev[-1]))
        return self.model.compute_logits(hidden[: len(rows)])

    def _graph_bucket(self, batch: StepBatch) -> int | None:
        graphs = self.decode_graphs
        if graphs is None or not batch.decode_only or batch.block_tables.shape[1] > graphs.block_tables.shape[1]:
            return None
        return graphs.bucket(batch.num_seqs)

    @staticmethod
    def _eager_arrays(batch: StepBatch) -> list[np.ndarray]:
        return [
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
        ]

    def _eager_inputs(self, batch: StepBatch, ids, positions, slots, qsl, seq_lens, tables):
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            max_query_len=max(batch.query_lens),
            max_seq_len=batch.max_seq_len,
            num_decodes=batch.num_decodes,
            query_lens_host=batch.query_lens,
            seq_lens_host=batch.seq_lens.tolist(),
        )
        return ids, positions, meta

    def _forward_eager(self, batch: StepBatch, *device_arrays: torch.Tensor) -> torch.Tensor:
        ids, positions, meta = self._eager_inputs(batch, *device_arrays[:6])
        return self.model(ids, positions, self.kv_caches, meta)

    def _sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
        """The step's sampling tensors. The same sequences as the last step, in the same order, with nothing
        that changes per step (penalties read the outputs, min_tokens' suppression ends, grammars move on):
        the last step's batch again, built once for a whole run of decode steps."""
        seqs = [r.seq for r in rows]
        if seqs == self._last_sampled[0] and self._last_sampled[1] is not None:
            return self._last_sampled[1]
        batch = self._build_sampling_batch(rows)
        static = batch.penalties is None and batch.suppress is None and batch.bitmask is None
        self._last_sampled = (seqs, batch if static else None)
        return batch

    def _build_sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
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
        # The grammars' bitmask is filled here, on the host, while the device runs the forward.
        mask = self.grammar.fill([r.seq for r in rows]) if self.grammar is not None else None
        return SamplingBatch.build(
            sampling_rows, device=self.device, suppress=suppress or None, vocab_size=self.vocab_size, bitmask=mask
        )
