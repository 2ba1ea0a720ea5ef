"""What one flattened step tells the attention kernels about its requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeWorkspace:
    """Partial outputs of split decodes: `part_out` fp32 `[rows, Hq, D]`, `part_lse` fp32 `[rows, Hq]`;
    a decode batch of n requests split into P partitions uses rows `[0, n * P)`."""

    part_out: torch.Tensor
    part_lse: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, num_q_heads: int, head_dim: int, device: torch.device | str) -> DecodeWorkspace:
        return cls(
            torch.empty((rows, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((rows, num_q_heads), dtype=torch.float32, device=device),
        )

    @property
    def rows(self) -> int:
        return self.part_out.shape[0]

    def fits(self, rows: int, num_q_heads: int, head_dim: int) -> bool:
        return self.rows >= rows and tuple(self.part_out.shape[1:]) == (num_q_heads, head_dim)


@dataclass
class AttentionMetadata:
    """Batch layout of one forward over the paged cache.

    Requests are concatenated along the token axis. Request i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`; its `seq_lens[i]` tokens (cached context plus this
    chunk, whose K/V `write_kv` has already stored) live in the blocks `block_tables[i, :ceil(seq_lens[i]
    / block_size)]`. Query row j of a chunk of length q sits at absolute position `seq_lens[i] - q + j`
    and sees keys at positions <= its own (and, with a sliding window w, > its own - w).

    The first `num_decodes` requests have exactly one query token (the decode fast path); the rest may
    have any length >= 1. `max_query_len` / `max_seq_len` are host ints so no kernel needs a device sync.

    Inside a CUDA graph the Triton decode path reads only device tensors plus `num_decodes`,
    `decode_partitions` (the split-K grid, fixed per captured batch size: `pagedq_kernels.decode_num_partitions`)
    and `decode_workspace` (the partial-output buffer, allocated once). Padded requests have seq_len 0
    and slot -1: they attend nothing and write nothing to the cache.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]; entries past a request's blocks are ignored
    slot_mapping: torch.Tensor  # int64 [T]; block_id * block_size + offset, < 0 = do not write
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    # Host copies of the per-request lengths (the runner has them anyway; saves a sync per layer).
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # Scratch for a backend to memoise what it derives once per step and reuses in every layer
    # (gather indices, masks). Keyed by the backend's own names.
    derived: dict = field(default_factory=dict)
    # Triton decode split and partial-output buffer; None: chosen from the lengths / a cached buffer.
    decode_partitions: int | None = None
    decode_workspace: DecodeWorkspace | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
