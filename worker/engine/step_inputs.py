"""One step's model inputs as host arrays, built from the scheduler's output (no torch, no device).

`build_step_batch` flattens the scheduled chunks into the arrays the model and the attention
metadata read, from scratch (`input_batch.InputBatch` does the same keeping the block tables between
steps); `pad_decode` lays a decode-only batch out for a captured CUDA graph of a larger
batch size (padded requests: token 0 at position 0, slot -1, length 0, so they write and read
nothing). Both are pure numpy, so the CPU tests cover them whatever device the engine runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.engine.scheduler import ScheduledSeq


@dataclass
class StepBatch:
    """The flattened batch of one step: requests concatenated along the token axis, decodes first."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]
    block_tables: np.ndarray  # int32 [B, W], W = the longest table of the step, zero-padded
    query_lens: list[int]
    num_decodes: int
    # int64 [R]: the hidden-state rows to sample from; None when they are every row, in order.
    logits_rows: np.ndarray | None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        """Every request brings exactly one token (what a decode CUDA graph runs)."""
        return self.num_tokens == self.num_seqs

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def build_step_batch(
    scheduled: Sequence[ScheduledSeq], num_decodes: int, sample_from: Sequence[int], block_size: int
) -> StepBatch:
    """The step's batch built from scratch (the reference `InputBatch` is tested against, and what a step
    without a persistent batch uses). `sample_from`: for each row to sample, the index of its request in
    `scheduled` (a request whose prompt completes with n > 1 samples appears n times)."""
    starts, qlens, tables, ids = [], [], [], []
    for s in scheduled:
        start = s.seq.num_computed_tokens
        starts.append(start)
        qlens.append(s.num_new_tokens)
        ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
        tables.append(s.block_table)
    width = max(len(t) for t in tables)
    table = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return flatten(ids, starts, qlens, table, num_decodes, sample_from, block_size)


def flatten(
    ids: list[int],
    starts: list[int],
    qlens: list[int],
    table: np.ndarray,
    num_decodes: int,
    sample_from: Sequence[int],
    block_size: int,
) -> StepBatch:
    """The batch from its per-request parts: the new tokens' ids (concatenated), where each request's new
    tokens start, how many it has, and the block tables (zero-padded, a row per request)."""
    starts_np = np.asarray(starts, dtype=np.int64)
    num_seqs = len(qlens)
    total = len(ids)
    if total == num_seqs:  # every request brings one token (a decode-only step): no repeat needed
        qsl = np.arange(num_seqs + 1, dtype=np.int64)
        positions = starts_np
        slots = table[np.arange(num_seqs), positions // block_size].astype(np.int64) * block_size
        slots += positions % block_size
        seq_lens = starts_np + 1
    else:
        qlens_np = np.asarray(qlens, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens_np, out=qsl[1:])
        req_of_token = np.repeat(np.arange(num_seqs), qlens_np)
        positions = np.arange(total) - qsl[:-1][req_of_token] + starts_np[req_of_token]
        slots = table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        seq_lens = starts_np + qlens_np
    last = qsl[1:] - 1
    rows = last[np.asarray(sample_from, dtype=np.int64)]
    in_order = len(rows) == total and bool((rows == np.arange(total)).all())
    return StepBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=table,
        query_lens=qlens,
        num_decodes=num_decodes,
        logits_rows=None if in_order else rows,
    )


def pad_decode(batch: StepBatch, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode-only batch of n <= bucket requests as a graph of `bucket` requests reads it:
    int64 `[3, bucket]` (token ids, positions, slots) and int32 `[bucket]` sequence lengths; rows from n
    on are padding (id 0, position 0, slot -1, length 0)."""
    n = batch.num_seqs
    if not batch.decode_only or n > bucket:
        raise ValueError(f"{n} requests with {batch.num_tokens} tokens do not fit a decode graph of {bucket}")
    tokens = np.zeros((3, bucket), dtype=np.int64)
    tokens[2, n:] = -1
    tokens[0, :n] = batch.input_ids
    tokens[1, :n] = batch.positions
    tokens[2, :n] = batch.slot_mapping
    lens = np.zeros(bucket, dtype=np.int32)
    lens[:n] = batch.seq_lens
    return tokens, lens


def warm_up_batch(block_size: int) -> StepBatch:
    """A step that touches every kernel and writes nothing: one decode and one 3-token prefill chunk,
    all slots -1, over block 0 (zeros in a fresh cache). Used before serving so that everything built
    lazily (the CPU extension, Triton compiles, cuBLAS handles) is built at start-up."""
    seq_lens = np.array([1, 3], dtype=np.int32)
    return StepBatch(
        input_ids=np.zeros(4, dtype=np.int64),
        positions=np.array([0, 0, 1, 2], dtype=np.int64),
        slot_mapping=np.full(4, -1, dtype=np.int64),
        query_start_loc=np.array([0, 1, 4], dtype=np.int32),
        seq_lens=seq_lens,
        block_tables=np.zeros((2, -(-3 // block_size)), dtype=np.int32),
        query_lens=[1, 3],
        num_decodes=1,
        logits_rows=np.array([0, 3], dtype=np.int64),
    )
