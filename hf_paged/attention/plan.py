"""The per-forward plan: slot mapping, block tables and lengths, computed once and used by every layer.

Built by `Rows.plan_forward` on the first layer of a forward (FlashInfer's plan/run split); every later
layer only writes its K/V through the slots and attends through the block tables. The plan is plain host
data: each backend builds its own device tensors from it once per forward (`memo()`), so no backend is
known here. Token positions of one row::

    block_table:  [ 7 | 2 | 9 ]          block_size = 4
    positions:     0123 4567 89..        seq_len = 10 (6 before this forward, 4 new)
    slots:         28..31 8..11 36 37    slot = block_id * block_size + position % block_size

Padding columns (left padding) get slot -1 and are never stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class GroupPlan:
    """What one layer group needs to write and attend in this forward.

    Attributes:
        tables: per row, the block ids after this forward's allocations: the rows' own lists, read only and
            unchanged while the forward is open (the next change of a table is the next forward's plan).
        write_rows: flattened `batch * q_len` indices of the tokens this group writes.
        write_slots: their slots, same length.
        sliding_window: the group's window, or None.
    """

    tables: list[list[int]]
    write_rows: list[int]
    write_slots: list[int]
    sliding_window: int | None


@dataclass(slots=True)
class ForwardPlan:
    """Everything a layer needs, computed once per forward.

    Attributes:
        q_len: columns of this forward (new tokens per row, padding included).
        query_lens: per row, real new tokens (right-aligned in the columns).
        seq_lens: per row, tokens stored including this forward's.
        groups: per layer group.
        block_size: tokens per block.
        num_layers: layers that must write for the forward to be complete (None: unknown).
        written_mask: bit `i` set once layer `i` wrote in this forward (`has_written`, `mark_written`).
        num_written: layers written so far.
        undo: how to roll the cache back if the forward does not complete (owned by `Rows`).
        identity: per row, the earlier row it duplicates (itself if unique), or None: duplicates share
            blocks and their attention is computed once.
        rows_before: the cache's row count before this forward expanded it (repeated prompt rows), or None.
        column_order: int64 `[batch, q_len]` when some row's real columns are not its last ones (right
            padding, holes): each layer reorders its columns by it so they are, and `column_restore` undoes
            that on the output. None otherwise.
        column_count: with `column_order`, int64 `[batch, q_len]` real columns up to and including each
            (reordered) column, so padding queries see what transformers' masks show them.
        gapped: some row has padding after a real token (right padding, a hole), in any column so far.
        real_tail: the fewest real columns any row has at the end of this forward (`q_len` when all are real).
        mode: `"paged"` (the `"paged"` attention writes and reads the blocks) or `"gather"` (`update()` writes
            and returns gathered K/V) for every layer of this forward.
        previous: the cache's previous forward, committed just before this one began (None otherwise, and None
            once this forward is committed, so plans never chain): a backend may carry a decision over from its
            `memo` after checking that it still holds for this forward.
    """

    q_len: int
    query_lens: list[int]
    seq_lens: list[int]
    groups: list[GroupPlan]
    block_size: int
    num_layers: int | None
    written_mask: int = 0
    num_written: int = 0
    undo: object = None
    identity: list[int] | None = None
    rows_before: int | None = None
    column_order: torch.Tensor | None = None
    column_restore: torch.Tensor | None = None
    column_count: torch.Tensor | None = None
    gapped: bool = False
    real_tail: int = 0
    mode: str | None = None
    previous: ForwardPlan | None = None
    _memo: dict[tuple, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool | None:
        """Whether every layer wrote; None when the number of layers is not known yet."""
        if self.num_layers is None:
            return None
        return self.num_written >= self.num_layers

    def has_written(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` wrote in this forward (so a call for it starts the next forward)."""
        return (self.written_mask >> layer_idx) & 1 == 1

    def mark_written(self, layer_idx: int) -> None:
        """Layer `layer_idx` wrote its K/V. (A bit mask, not a set: no allocation as layers accumulate.)"""
        bit = 1 << layer_idx
        if not self.written_mask & bit:
            self.written_mask |= bit
            self.num_written += 1

    def memo_get(self, key: tuple) -> Any:
        """What `memo()` built for `key` in this forward, or None."""
        return self._memo.get(key)

    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """`build()`'s result, computed once per forward and `key` (a backend's device tensors for a group,
        a window and a device: every later layer of the forward reuses them)."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = build()
        return found
