"""Applying a step's grammar bitmask to the logits: one xgrammar kernel call for the whole batch
(CPU kernel on the host, Triton on CUDA)."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, for `rows` (all rows if None).
    `bitmask` has a row per logits row, on the logits' device."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
