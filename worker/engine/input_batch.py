"""The step's inputs kept between steps (vLLM V1's persistent `InputBatch`, for the host arrays).

Every step of a long decode carries the same sequences with the same block tables, except that a
table gains a block once every `block_size` tokens (or swaps its last block for a private copy).
Building the step's `[B, W]` block table from the scheduler's lists costs a Python-level copy of every
table at every step. `InputBatch` keeps a row per sequence holding its table and rewrites only what
changed: a new row for a sequence it has not seen (or whose table is a new list: it was preempted and
admitted again, or forked), the appended tail, or a replaced last block. The step's table is then one
gather of the rows. The other inputs (ids, positions, slots) are read from the step's chunks, as
`step_inputs.build_step_batch` reads them, and flattened by the same code, so the two give equal
batches (tests/engine/test_input_batch.py checks that after every step of random schedules).

A row mirrors one list object of the KV manager, which only ever grows at its end or replaces its
last entry while the sequence holds its blocks (kv_cache.py); a freed sequence's list is never
reused. Rows of sequences not in a step are released at the end of that step, so two steps' sequences
(at most twice `max_num_seqs`) are the most rows ever held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engine.scheduler import ScheduledSeq
from worker.engine.step_inputs import StepBatch, flatten


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        rows = 2 * max(max_num_seqs, 1)
        self.tables = np.zeros((rows, max(max_blocks_per_seq, 1)), dtype=np.int32)
        # Per row, plain lists (faster than numpy scalars one at a time): entries written, the last one,
        # and the KV manager's list the row mirrors.
        self.lengths = [0] * rows
        self.lasts = [0] * rows
        self.owners: list[list[int] | None] = [None] * rows
        self.row_of: dict[str, int] = {}
        self._free = list(range(len(self.tables) - 1, -1, -1))
        self.rows_written = 0  # whole rows (re)written, for the tests and the bench
        self.entries_written = 0  # table entries written

    def prepare(self, scheduled: Sequence[ScheduledSeq], num_decodes: int, sample_from: Sequence[int]) -> StepBatch:
        """The step's batch, equal to `build_step_batch(scheduled, num_decodes, sample_from, block_size)`."""
        row_of, owners, lengths, lasts = self.row_of, self.owners, self.lengths, self.lasts
        rows, starts, qlens, ids = [], [], [], []
        width = 0
        for s in scheduled:
            seq, table, n = s.seq, s.block_table, s.num_new_tokens
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq.seq_id)
            size = len(table)
            if owners[row] is not table or size < lengths[row]:
                self._write_row(row, table)
            elif size != lengths[row]:
                self._append(row, table)
            elif size and lasts[row] != table[-1]:  # the last block was swapped for a private copy
                self.tables[row, size - 1] = lasts[row] = table[-1]
                self.entries_written += 1
            rows.append(row)
            if size > width:
                width = size
            start = seq.num_computed_tokens
            starts.append(start)
            qlens.append(n)
            if n == 1:
                ids.append(seq.token_ids[start])
            else:
                ids.extend(seq.token_ids[start : start + n])
        if len(row_of) > len(scheduled):
            self._release_absent(scheduled)
        step_table = self.tables[np.asarray(rows, dtype=np.int64), :width]
        return flatten(ids, starts, qlens, step_table, num_decodes, sample_from, self.block_size)

    def _assign(self, seq_id: str) -> int:
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.row_of[seq_id] = row
        return row

    def _write_row(self, row: int, table: list[int]) -> None:
        self._fit(len(table))
        old = self.lengths[row]
        if old > len(table):
            self.tables[row, len(table) : old] = 0  # the step's table is zero-padded, as a fresh one is
        self.tables[row, : len(table)] = table
        self.lengths[row] = len(table)
        self.lasts[row] = table[-1] if table else 0
        self.owners[row] = table
        self.rows_written += 1
        self.entries_written += len(table)

    def _append(self, row: int, table: list[int]) -> None:
        """The table grew at its end (and its old last block may have been swapped for a copy)."""
        self._fit(len(table))
        have = self.lengths[row]
        start = have - 1 if have and self.lasts[row] != table[have - 1] else have
        self.tables[row, start : len(table)] = table[start:]
        self.lengths[row] = len(table)
        self.lasts[row] = table[-1]
        self.entries_written += len(table) - start

    def _fit(self, width: int) -> None:
        """Room for a table of `width` blocks (never expected: tables stop at max_model_len)."""
        if width > self.tables.shape[1]:
            extra = np.zeros((len(self.tables), width - self.tables.shape[1]), dtype=np.int32)
            self.tables = np.concatenate([self.tables, extra], axis=1)

    def _release_absent(self, scheduled: Sequence[ScheduledSeq]) -> None:
        """Free the rows of sequences not in this step (finished, preempted, or waiting for blocks)."""
        present = {s.seq.seq_id for s in scheduled}
        for seq_id in [i for i in self.row_of if i not in present]:
            row = self.row_of.pop(seq_id)
            self.owners[row] = None
            self._free.append(row)

    def _grow_rows(self) -> None:
        """More rows than planned (never expected: two steps hold at most 2 * max_num_seqs sequences)."""
        n = len(self.tables)
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.lengths += [0] * n
        self.lasts += [0] * n
        self.owners += [None] * n
        self._free.extend(range(2 * n - 1, n - 1, -1))
