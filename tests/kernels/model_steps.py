"""Drive a model over paged steps the way the engine does (chunked prefill, then one token per step,
one-token requests first in each batch, scattered blocks): shared by the fused-model tests and the
GPU check, which compare the logits with transformers'."""

from __future__ import annotations

import torch

from kernels import AttentionMetadata


def run_steps(
    model, seqs: list[list[int]], prompt_lens: list[int], device: str, *, block_size: int = 16, chunk: int = 64
) -> list[torch.Tensor]:
    """Feed each sequence's first `prompt_lens[i]` tokens in chunks of at most `chunk`, the rest one
    per step (teacher forcing). Returns each sequence's logits `[len, V]` in fp32 on the CPU."""
    layers = len(model.layers)
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 2
    shape = (layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    cache = torch.zeros(shape, dtype=model.dtype, device=device)
    caches = [(cache[i, 0], cache[i, 1]) for i in range(layers)]
    free = list(range(num_blocks))[::-1]
    free = free[1::2] + free[::2]  # not in order: block tables jump around
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while True:
        sizes = {}
        for i, s in enumerate(seqs):
            if done[i] < len(s):
                sizes[i] = min(chunk, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
        if not sizes:
            break
        order = sorted(sizes, key=lambda i: sizes[i] != 1)  # decodes first
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for i in order:
            n = sizes[i]
            while len(tables[i]) * block_size < done[i] + n:
                tables[i].append(free.pop())
            for p in range(done[i], done[i] + n):
                ids.append(seqs[i][p])
                pos.append(p)
                slots.append(tables[i][p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(done[i] + n)
        qlens = [sizes[i] for i in order]
        bt = torch.zeros(len(order), max(len(tables[i]) for i in order), dtype=torch.int32)
        for row, i in enumerate(order):
            bt[row, : len(tables[i])] = torch.tensor(tables[i])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            num_decodes=next((j for j, q in enumerate(qlens) if q != 1), len(qlens)),
            query_lens_host=qlens,
            seq_lens_host=seq_lens,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), caches, meta)
            out = model.compute_logits(hidden).float().cpu()
        for i, part in zip(order, out.split(qlens), strict=True):
            logits[i].append(part)
            done[i] += sizes[i]
    return [torch.cat(parts) for parts in logits]
