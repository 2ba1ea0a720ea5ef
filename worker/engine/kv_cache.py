"""The memory half of PagedAttention: a pool of fixed-size KV blocks and per-sequence block tables.

A sequence's KV lives in blocks taken on demand as its tokens are scheduled; logical block i of a
sequence is `table[i]`, anywhere in the pool. Blocks are reference counted so sequences can share
them (a common prompt prefix, or the `n` samples of one prompt). A shared block is never written:
a sequence about to write into a shared partial block gets a private copy first, and the copy is
queued for the model runner (`take_copies`).

Prefix caching: once a full block's tokens are computed its content is named by a chained hash of
(parent block hash, its token ids, extra key). A new sequence adopts the longest run of cached full
blocks of its prompt. A freed block keeps its hash and can be revived until the pool reuses it; the
pool hands out never-cached blocks first, then the least recently freed cached ones (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its tokens computed; kept after free until evicted.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of the first len(hashes) full blocks
    num_tokens: int = 0  # slots the table currently holds tokens for


@dataclass
class KVCacheStats:
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int  # free blocks that still hold reusable prefix content
    usage: float  # used / total
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    waste: float  # allocated slots holding no live token, over allocated slots


def hash_block(parent: int | None, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
    return hash((parent, tuple(token_ids), extra_key))


def blocks_for_bytes(
    budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int
) -> int:
    """How many blocks a byte budget holds: K and V for every layer, `block_size` tokens a block."""
    per_block = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * block_size
    return budget_bytes // per_block


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: front = next to reuse. OrderedDict gives O(1) removal
        # when a cached free block is revived by a prefix hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._seqs: dict[Hashable, SeqBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # --- questions ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id].table

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def num_seqs(self) -> int:
        return len(self._seqs)

    def match_prefix(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[int]:
        """Block ids of the longest cached run of full blocks starting the prompt.

        At least one prompt token is left uncached: its logits are needed to sample, so it must be
        computed (and writing it must not touch a shared block).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = None
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = tuple(token_ids[start : start + bs])
            h = hash_block(parent, chunk, extra_key)
            bid = self._cached.get(h)
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.token_ids != chunk or blk.parent_hash != parent:  # a hash collision, not a hit
                break
            hits.append(bid)
            parent = h
        return hits

    def blocks_needed(self, seq_id: Hashable, num_tokens: int, hits: Sequence[int] = ()) -> int:
        """New blocks taking `seq_id` to `num_tokens` slots would cost (hits adopted first)."""
        seq = self._seqs.get(seq_id)
        have = len(seq.table) if seq else len(hits)
        need = -(-num_tokens // self.block_size) - have
        revived = 0 if seq else sum(1 for b in hits if self.blocks[b].ref_count == 0)
        cow = 1 if seq and self._needs_cow(seq) else 0
        return max(need, 0) + revived + cow

    def fits(self, seq_id: Hashable, num_tokens: int) -> bool:
        """`allocate(seq_id, num_tokens)` without touching the pool: True (and done) when the sequence's
        table already holds `num_tokens` slots and its last block is its own; False means call `allocate`.
        The decode step's fast path: a new block is needed once every `block_size` tokens."""
        seq = self._seqs.get(seq_id)
        if seq is None or num_tokens > len(seq.table) * self.block_size or self._needs_cow(seq):
            return False
        if num_tokens > seq.num_tokens:
            seq.num_tokens = num_tokens
        return True

    def can_allocate(self, num_new_blocks: int, *, keep_watermark: bool) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_free_blocks - num_new_blocks >= reserve

    # --- changes -----------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        num_tokens: int,
        hits: Sequence[int] = (),
        *,
        keep_watermark: bool = False,
    ) -> bool:
        """Make `seq_id`'s table hold `num_tokens` slots; False (and no change) if blocks are short.

        The first call for a sequence adopts the prefix-cache `hits`. Writing into a shared partial
        last block first replaces it with a private copy (queued in `take_copies`).
        """
        need = self.blocks_needed(seq_id, num_tokens, hits)
        if not self.can_allocate(need, keep_watermark=keep_watermark):
            return False
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = SeqBlocks()
            for bid in hits:
                self._take(bid)
                seq.table.append(bid)
                seq.hashes.append(self.blocks[bid].block_hash)  # type: ignore[arg-type]
            seq.num_tokens = len(hits) * self.block_size
        elif self._needs_cow(seq):
            old = seq.table[-1]
            new = self._pop_free()
            self.blocks[old].ref_count -= 1
            seq.table[-1] = new
            self._copies.append((old, new))
        while len(seq.table) * self.block_size < num_tokens:
            seq.table.append(self._pop_free())
        seq.num_tokens = max(seq.num_tokens, num_tokens)
        return True

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int, extra_key: Hashable = None):
        """Name the sequence's full blocks whose `num_computed` tokens are in the cache, for reuse."""
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(seq.table))
        if full <= len(seq.hashes):  # no block filled since the last commit (most steps)
            return
        for i in range(len(seq.hashes), full):
            parent = seq.hashes[-1] if seq.hashes else None
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, chunk, extra_key)
            seq.hashes.append(h)
            blk = self.blocks[seq.table[i]]
            if blk.block_hash is None and h not in self._cached:
                blk.block_hash, blk.parent_hash, blk.token_ids = h, parent, chunk
                self._cached[h] = blk.block_id

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """`child_id` shares every block of `parent_id` (copy-on-write when either writes)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self._seqs[parent_id]
        for bid in parent.table:
            self.blocks[bid].ref_count += 1
        self._seqs[child_id] = SeqBlocks(list(parent.table), list(parent.hashes), parent.num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks. Cached ones stay revivable; the tail is evicted first."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for bid in reversed(seq.table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None
                if blk.block_hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(bid, last=False)

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the model runner must perform before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their content, just lose their names)."""
        for blk in self.blocks:
            blk.block_hash, blk.parent_hash, blk.token_ids = None, None, ()
        self._cached.clear()
        for seq in self._seqs.values():
            seq.hashes.clear()

    # --- internals ---------------------------------------------------------------------------

    def _needs_cow(self, seq: SeqBlocks) -> bool:
        """The next token lands in the last block, and another sequence shares that block."""
        if not seq.table or seq.num_tokens >= len(seq.table) * self.block_size:
            return False
        return self.blocks[seq.table[-1]].ref_count > 1

    def _take(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self._free[bid]
        blk.ref_count += 1

    def _pop_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.block_hash is not None:  # evict its cached content
            del self._cached[blk.block_hash]
            blk.block_hash, blk.parent_hash, blk.token_ids = None, None, ()
        blk.ref_count = 1
        return bid

    # --- stats -------------------------------------------------------------------------------

    def waste(self) -> float:
        """Allocated slots holding no live token, over allocated slots (walks every block table)."""
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, bid in enumerate(seq.table):
                held = min(self.block_size, max(seq.num_tokens - i * self.block_size, 0))
                fill[bid] = max(fill.get(bid, 0), held)
        allocated = len(fill) * self.block_size
        return 1.0 - sum(fill.values()) / allocated if allocated else 0.0

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - len(self._free)
        cached = sum(1 for b in self._free if self.blocks[b].block_hash is not None)
        return KVCacheStats(
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=len(self._free),
            cached_blocks=cached,
            usage=used / self.num_blocks,
            prefix_queries_tokens=self.prefix_queries_tokens,
            prefix_hits_tokens=self.prefix_hits_tokens,
            waste=self.waste(),
        )
