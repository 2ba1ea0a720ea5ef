"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of n requests replays the graph of the smallest bucket >= n. The graphs read static
buffers sized for the largest bucket: token ids, positions and slots (`tokens`, int64 `[3, *]`),
sequence lengths, the constant `query_start_loc = arange` and block tables of a fixed width (the
blocks of a max_model_len sequence). Rows past n are padding: token 0 at position 0, slot -1 (no KV
write), length 0 (no attention). The decode kernel's split-K grid is fixed per bucket
(`pagedq_kernels.decode_num_partitions` at max_model_len) and its partial outputs go to one workspace, so
nothing in a captured step depends on the host's view of the lengths.

Capture happens once, at engine start, after the KV cache exists: largest bucket first, all graphs in
one memory pool, each preceded by an eager run of the same shapes so that Triton compiles outside the
capture. `capture=False` runs the same static-buffer forward eagerly: it lets the CPU tests (Triton
interpreter) cover everything here but the capture itself.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Sequence

import torch
from torch import Tensor

import pagedq_kernels
from pagedq_kernels import AttentionMetadata, DecodeWorkspace

# vLLM's default cap too: past a few hundred requests a decode step is no longer launch-bound.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs (itself a bucket) or `limit`."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds n requests; None when n is past the largest (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and n >= 1 else None


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[Tensor, Tensor]],
        *,
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.device = device
        self.captured = capture
        top = self.sizes[-1]
        width = -(-max_model_len // block_size)
        row = -(-top // 8) * 8  # each row of `tokens` starts 64-byte aligned (Triton specialises on it)
        i32 = dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros((3, row), dtype=torch.int64, device=device)
        self.tokens[2].fill_(-1)
        self.seq_lens = torch.zeros(top, **i32)
        self.query_start_loc = torch.arange(top + 1, **i32)
        self.block_tables = torch.zeros((top, width), **i32)
        attn = model.layers[0].self_attn
        hkv = kv_caches[0][0].shape[2]
        parts = {b: pagedq_kernels.decode_num_partitions(b, hkv, device, max_model_len) for b in self.sizes}
        self.partitions = parts
        rows = max(b * p for b, p in parts.items())
        workspace = DecodeWorkspace.allocate(rows, attn.num_heads, attn.head_dim, device)
        self.metas = {
            b: AttentionMetadata(
                query_start_loc=self.query_start_loc[: b + 1],
                seq_lens=self.seq_lens[:b],
                block_tables=self.block_tables[:b],
                slot_mapping=self.tokens[2, :b],
                max_query_len=1,
                max_seq_len=max_model_len,
                num_decodes=b,
                decode_partitions=parts[b],
                decode_workspace=workspace,
            )
            for b in self.sizes
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.replays = 0
        self.capture_seconds = 0.0
        if capture:
            start = time.perf_counter()
            self._capture_all()
            self.capture_seconds = time.perf_counter() - start

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def _forward(self, b: int) -> Tensor:
        return self.model(self.tokens[0, :b], self.tokens[1, :b], self.kv_caches, self.metas[b])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Each capture starts with a gc.collect(); with the objects already alive frozen it scans only
        # the few new ones, instead of the whole heap per bucket.
        gc.collect()
        gc.freeze()
        try:
            for b in reversed(self.sizes):
                self._forward(b)  # eager, same shapes: every kernel variant compiles here, not in the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b)
                self.graphs[b] = graph
                self.outputs[b] = out
        finally:
            gc.unfreeze()
        torch.cuda.synchronize(self.device)

    def run(self, bucket: int, tokens: Tensor, seq_lens: Tensor, block_tables: Tensor) -> Tensor:
        """Load one step (device tensors: int64 `[3, bucket]` padded ids / positions / slots, int32
        `[bucket]` padded lengths, int32 `[n, w]` the live requests' tables) and run it; returns the
        hidden states `[bucket, hidden]` (rows past n are padding)."""
        n, w = block_tables.shape
        self.tokens[:, :bucket].copy_(tokens)
        self.seq_lens[:bucket].copy_(seq_lens)
        self.block_tables[:n, :w].copy_(block_tables)  # entries past a request's blocks are never read
        self.replays += 1
        if not self.captured:
            return self._forward(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket]
