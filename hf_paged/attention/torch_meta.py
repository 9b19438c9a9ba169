"""Inputs of the PyTorch path for one forward: `TorchMeta` (gather index, mask, leading blocks) and the
write index, built from a `ForwardPlan` once per group, window and device and reused by every layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from .host_ints import device_ints

if TYPE_CHECKING:
    from .plan import ForwardPlan


@dataclass(slots=True)
class TorchMeta:
    """Per-forward, per-group inputs of `torch_paged_attention`.

    Attributes:
        direct: attend the new K/V directly (no row has history).
        gather_table: int64 `[batch, num_gather]` block ids to gather (None when direct or when
            `contiguous_start` is set).
        contiguous_start: first block id when each row's blocks are consecutive and the rows lie `row_stride`
            blocks apart (read as one view of the pool, no gather).
        num_gather: blocks each row reads (0 when direct).
        mask: bool `[batch, 1, q_len, kv_len]`, True where attention is allowed; None for plain causal.
        is_causal: use SDPA's causal flag instead of a mask.
        leading: the rows' leading blocks, read in place and attended apart (cascade), or None; the gather
            then starts after them.
        unique_rows: int64 `[num_unique]` rows whose attention is computed when some rows duplicate others
            (identical prefill rows); the other fields then describe only these rows. None: all rows.
        row_source: int64 `[batch]` index into `unique_rows` giving each row's output.
        kv_valid: decode of rows with equally many visible keys from one offset: attend the `kv_valid` gathered
            keys from `kv_from` and no mask (the common, unpadded case), else None.
        kv_from: with `kv_valid`, the first visible key among the gathered ones (a sliding window's start).
        row_stride: with `contiguous_start` and more than one row, blocks from one row's first block to the next
            row's.
    """

    direct: bool
    gather_table: torch.Tensor | None
    contiguous_start: int | None
    mask: torch.Tensor | None
    is_causal: bool
    leading: LeadingBlocks | None = None
    num_gather: int = 0
    unique_rows: torch.Tensor | None = None
    row_source: torch.Tensor | None = None
    kv_valid: int | None = None
    row_stride: int = 0
    kv_from: int = 0

    def rows(self, start: int, stop: int) -> TorchMeta:
        """The meta of rows `start .. stop - 1` alone (a gather over each row's own blocks: no leading blocks,
        no duplicate rows)."""
        if self.leading is not None or self.unique_rows is not None or self.gather_table is None:
            raise ValueError("TorchMeta.rows() splits a gather over each row's own blocks only.")
        return TorchMeta(
            False, self.gather_table[start:stop], None, None if self.mask is None else self.mask[start:stop],
            self.is_causal, None, self.num_gather, kv_valid=self.kv_valid, kv_from=self.kv_from,
        )


@dataclass(slots=True)
class LeadingBlocks:
    """The first blocks of every row, attended apart from the rest of the row and merged with it by their
    log-sum-exp (cascade attention), so that they are read where they are stored instead of gathered.

    Two layouts qualify: blocks every row's table holds (beams, samples, a common prompt; `row_stride` 0), read
    once for all rows' queries; and rows whose leading blocks are consecutive and a constant number of blocks
    apart from one row to the next (`row_stride` > 0: the rows of one batched prefill on a fresh pool), read as
    one strided view of the pool.

    Attributes:
        block_ids: row 0's leading block ids, in order.
        contiguous_start: first id when they are consecutive (read as a view), else None (only when shared).
        table: int64 `[num_blocks]` ids to gather once when shared and not consecutive, else None.
        row_stride: blocks from one row's leading blocks to the next row's; 0 when all rows share them.
    """

    block_ids: list[int]
    contiguous_start: int | None
    table: torch.Tensor | None
    row_stride: int = 0

    @staticmethod
    def of(block_tables: list[list[int]], limit: int, device: torch.device) -> LeadingBlocks | None:
        """The leading blocks (at most `limit` per row, at least 2) of at least 2 rows read in place or once:
        shared by all rows, else consecutive in every row at a constant stride from row to row; else None."""
        if len(block_tables) < 2 or limit < 2:
            return None
        first = block_tables[0]
        valid = next((j for j, block in enumerate(first[:limit]) if block < 0), min(limit, len(first)))
        shared = _leading_count(block_tables, valid, lambda row, count: first[:count])
        if shared >= 2:
            ids = first[:shared]
            start = consecutive_start(ids)
            return LeadingBlocks(ids, start, None if start is not None else device_ints(ids, device))
        if not first or first[0] < 0 or len(block_tables[1]) == 0:
            return None
        start, row_stride = first[0], block_tables[1][0] - first[0]
        if row_stride <= 0:
            return None

        def consecutive(row: int, count: int) -> list[int]:
            return list(range(start + row * row_stride, start + row * row_stride + count))

        count = _leading_count(block_tables, limit, consecutive)
        if count < 2:
            return None
        return LeadingBlocks(first[:count], start, None, row_stride)


def _leading_count(block_tables: list[list[int]], limit: int, expected: Callable[[int, int], list[int]]) -> int:
    """How many leading blocks (at most `limit`) every row holds as `expected(row, count)` lists them (whole
    lists compared, so the common case costs one list comparison per row)."""
    count = limit
    for row, table in enumerate(block_tables):
        want, got = expected(row, count), table[:count]
        if got != want:
            count = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            if count == 0:
                return 0
    return count


def build_torch_meta(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    q_len: int,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    identity: list[int] | None = None,
    q_count: torch.Tensor | None = None,
) -> TorchMeta:
    """Builds the gather index and mask for one group of one forward.

    Args:
        block_tables: per row, block ids (-1 for freed blocks, which are never gathered).
        seq_lens: per row, tokens stored including this forward's.
        query_lens: per row, real new tokens (right-aligned in the `q_len` columns).
        q_len: columns of this forward.
        block_size: tokens per block.
        sliding_window: keys at positions `p - sliding_window < k <= p` are visible; None for all.
        device: where the tensors go.
        identity: per row, the earlier row it duplicates (itself if unique), or None.
        q_count: int64 `[batch, q_len]` real columns up to and including each column, in the column order the
            queries arrive in (given when a forward's real columns were reordered: right padding, holes);
            None when the real columns are each row's last ones.
    """
    if identity is not None and any(i != b for b, i in enumerate(identity)):
        unique = [b for b, i in enumerate(identity) if i == b]
        position = {b: n for n, b in enumerate(unique)}
        meta = build_torch_meta(
            [block_tables[b] for b in unique], [seq_lens[b] for b in unique], [query_lens[b] for b in unique],
            q_len, block_size, sliding_window, device, None, None if q_count is None else q_count[unique],
        )
        meta.unique_rows = device_ints(unique, device)
        meta.row_source = device_ints([position[i] for i in identity], device)
        return meta
    batch = len(seq_lens)
    direct = all(s == n for s, n in zip(seq_lens, query_lens, strict=True))
    leading = gather_table = contiguous_start = runs = None
    row_stride = 0
    if direct:  # keys are the new columns themselves: column j holds position seq - q_len + j
        first_pos = [s - q_len for s in seq_lens]
        kv_len = q_len
    else:
        lowest = [s - n for s, n in zip(seq_lens, query_lens, strict=True)]  # first new position per row
        if sliding_window is not None:
            first_block = [max(0, low - sliding_window + 1) // block_size for low in lowest]
        else:
            # Leading blocks read in place end before the block of every row's last stored token: each query (a
            # padding one too) then sees every leading key and a key of its own rest, and the "nothing visible"
            # rule below never makes it attend padding slots that the cascade would merge with the leading blocks.
            # (not when every row's blocks are one run at a stride: the rows are then read whole, in place)
            whole = [table[: -(-s // block_size)] for table, s in zip(block_tables, seq_lens, strict=True)]
            runs = row_runs(whole) if batch > 1 else None
            if runs is None:
                leading = LeadingBlocks.of(block_tables, max(0, min(lowest) - 1) // block_size, device)
            first_block = [len(leading.block_ids) if leading else 0] * batch
        num_gather = max(max(-(-s // block_size) - f for s, f in zip(seq_lens, first_block, strict=True)), 1)
        own = [table[start : start + num_gather] for table, start in zip(block_tables, first_block, strict=True)]
        if runs is None:  # (a run per row: read as a view, no gather)
            runs = (consecutive_start(own[0]), 0) if batch == 1 else row_runs(own)
        contiguous_start, row_stride = runs if runs is not None else (None, 0)
        if contiguous_start is None:
            rows = []
            for ids in own:
                if sliding_window is not None:  # blocks out of the window may be freed (-1): read block 0, masked
                    ids = [max(i, 0) for i in ids]
                rows.append(ids + [0] * (num_gather - len(ids)) if len(ids) < num_gather else ids)
            gather_table = device_ints(chain.from_iterable(rows), device).view(batch, num_gather)
        first_pos = [f * block_size for f in first_block]
        kv_len = num_gather * block_size
        if q_len == 1 and all(n == 1 for n in query_lens):
            # each row's visible keys: from its window's first (or its first) to its new token
            since = [
                max(f, s - sliding_window) if sliding_window else f for s, f in zip(seq_lens, first_pos, strict=True)
            ]
            visible = {s - a for s, a in zip(seq_lens, since, strict=True)}
            offset = {a - f for a, f in zip(since, first_pos, strict=True)}
            if len(visible) == 1 and len(offset) == 1:  # one query per row, its keys one range: slice, no mask
                return TorchMeta(
                    False, gather_table, contiguous_start, None, False, leading, num_gather, kv_valid=visible.pop(),
                    row_stride=row_stride, kv_from=offset.pop(),
                )
    if direct and sliding_window is None and all(n == q_len for n in query_lens):
        return TorchMeta(True, None, None, None, q_len > 1)  # plain causal
    seq = torch.tensor(seq_lens, dtype=torch.int64, device="cpu")  # (the mask is built on the host, then moved)
    cols = torch.arange(q_len, dtype=torch.int64, device="cpu")
    lens = torch.tensor(query_lens, dtype=torch.int64, device="cpu")
    q_real = cols[None, :] >= (q_len - lens)[:, None]  # [B, Q]
    if q_count is None:  # real columns right-aligned: real columns up to and including each column
        q_count = (cols[None, :] - (q_len - lens)[:, None] + 1).clamp(min=0)
    # A column sees the keys stored before it: a real one itself and what precedes it, a padding one (as in
    # transformers' masks) the real tokens before its column.
    q_pos = (seq - lens)[:, None] + q_count.cpu() - 1
    k_pos = (
        torch.tensor(first_pos, dtype=torch.int64, device="cpu")[:, None]
        + torch.arange(kv_len, dtype=torch.int64, device="cpu")[None, :]
    )
    k_real = (k_pos < seq[:, None]) & (k_pos >= 0)
    if direct:
        k_real &= q_real
    allowed = k_real[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    # A query with nothing visible (padding before a row's first token) attends every slot: finite values,
    # ignored downstream.
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    return TorchMeta(
        direct, gather_table, contiguous_start, allowed[:, None].to(device), False, leading,
        0 if direct else num_gather, row_stride=row_stride,
    )


def row_runs(rows: list[list[int]]) -> tuple[int, int] | None:
    """`(first id, row stride)` when the rows' ids (at least 2 rows) can be read as one strided view of the pool:
    each row's ids consecutive, each row starting a constant positive number of ids after the previous one, and
    the last row among the longest (a shorter row then reads, masked, blocks after its own that exist); else None.
    """
    first = consecutive_start(rows[0]) if rows and rows[0] else None
    if first is None or len(rows) < 2 or not rows[1] or len(rows[-1]) < max(map(len, rows)):
        return None
    stride = rows[1][0] - first
    if stride <= 0:
        return None
    for r, ids in enumerate(rows):
        start = first + r * stride
        if ids != list(range(start, start + len(ids))):
            return None
    return first, stride


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id when `block_ids` (non-empty) are consecutive ids (read as one view of the pool), else None."""
    first = block_ids[0]
    return first if first >= 0 and block_ids == list(range(first, first + len(block_ids))) else None


@dataclass(slots=True)
class TorchInputs:
    """Everything the PyTorch path needs for a layer of a group, built once per forward, window and device.

    Attributes:
        write_index: int64 `[n]` indices into the flattened `batch * q_len` tokens to write, or None for all.
        write_slots: int64 `[n]` their slots, or None when `single_slot` is set.
        single_slot: the slot of a single row's single new token (its decode step), else None.
        meta: the gather index and mask (`build_torch_meta`).
    """

    write_index: torch.Tensor | None
    write_slots: torch.Tensor | None
    single_slot: int | None
    meta: TorchMeta


def write_index(
    plan: ForwardPlan, group_id: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, int | None]:
    """`(write_index, write_slots, single_slot)` for `torch_write` (see `TorchInputs`), once per forward."""
    inputs = plan.groups[group_id].inputs_on(device)
    if inputs.torch_write is None:
        group = plan.groups[group_id]
        rows, slots = group.write_rows, group.write_slots
        all_rows = len(rows) == len(plan.seq_lens) * plan.q_len and rows == list(range(len(rows)))
        if all_rows and len(slots) == 1:
            inputs.torch_write = (None, None, slots[0])
        else:
            inputs.torch_write = (None if all_rows else device_ints(rows, device), device_ints(slots, device), None)
    return inputs.torch_write


def torch_inputs(plan: ForwardPlan, group_id: int, sliding_window: int | None, device: torch.device) -> TorchInputs:
    """The PyTorch path's inputs of a plan's group for a window and a device (`build_torch_meta` and the write
    index), once per forward."""
    inputs = plan.groups[group_id].inputs_on(device)
    meta = inputs.torch_meta.get(sliding_window)
    if meta is None:
        meta = inputs.torch_meta[sliding_window] = build_torch_meta(
            plan.groups[group_id].tables, plan.seq_lens, plan.query_lens, plan.q_len, plan.block_size,
            sliding_window, device, plan.identity, plan.column_count,
        )
    return TorchInputs(*write_index(plan, group_id, device), meta)
