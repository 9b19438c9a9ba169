"""Snapshots of a hybrid model's recurrent states at block ends, for prefix hits (`prefix_hits.py` takes them).

transformers' recurrent layers give their state only at the end of a forward, so a snapshot exists only where a
forward ended on a block boundary:

    prompt   |  block 0  |  block 1  |  block 2  | b3 ...|
    forward  [ new_cache(model=): up to the last block end  ][ generate(): the rest ]
                                                 ^ the row's slot becomes block 2's snapshot

`snapshot_block_ends` runs after every committed forward of a hybrid cache: a row whose stored tokens end on the
boundary of an indexed block lends its committed slot to that block (`BlockPool.hold_snapshot`; the row's next
commit copies it). `prefill_block_ends` is the forward that ends there: `KVPool.new_cache(..., model=)` runs the
prompt up to its last block end, after whatever the index already served, so that the next prompt with that prefix
hits; `generate()` then computes only the rest.

A batch's forwards end at the same column for every row, and left-padded rows of different lengths reach their
block ends at different columns, while a hit needs every row to keep a snapshot's tokens (or none) at one column.
So `KVPool.new_cache` prepares such a batch row by row (`PagedCache.adopt_rows`): each row in a cache of its own takes
its hit, runs to its last block end and then to its last-but-one token, and the rows are joined in one cache, from
which `generate()` computes the last column.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from ..compat import cache_kwargs

if TYPE_CHECKING:
    from ..memory.pool import BlockPool
    from .paged_cache import PagedCache
    from .row_states import RowStates
    from .rows import Rows


def snapshot_block_ends(pool: BlockPool, rows: Rows, states: RowStates) -> int:
    """After a forward's states entered the rows' slots: each row whose stored tokens end at the end of an indexed
    block of the snapshot group keeps its slot as that block's snapshot (none where one is already kept).

    Returns:
        Snapshots taken.
    """
    bs, group = pool.block_size, pool.snapshot_group
    if not pool.keeps_state_snapshots or pool.allocators is None:
        return 0
    tables, taken = rows.group_tables(group), 0
    with pool.lock:
        allocator = pool.allocators[group]
        for b, (seq_len, slot) in enumerate(zip(rows.seq_lens, states.slots, strict=False)):
            if seq_len == 0 or seq_len % bs or b >= len(tables):
                continue
            block_id = tables[b][seq_len // bs - 1]
            if block_id >= 0 and allocator.is_indexed(block_id):
                taken += pool.hold_snapshot(block_id, slot)
    return taken


def block_end_columns(attention_mask: torch.Tensor, block_size: int, done: int) -> list[int]:
    """The columns after which some row's stored tokens end at its last block end that leaves a token to compute.

    Args:
        attention_mask: `[batch, seq_len]` left-padding mask of the prompts.
        done: columns the cache already holds; only later ends are returned.

    Returns:
        Increasing columns in `(done, seq_len)`.
    """
    width = attention_mask.shape[1]
    ends = set()
    for length in attention_mask.sum(dim=1).tolist():
        kept = (int(length) - 1) // block_size * block_size
        if kept:
            ends.add(width - int(length) + kept)
    return sorted(c for c in ends if c > done)


@torch.no_grad()
def prefill_block_ends(
    cache: PagedCache, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
    through: int | None = None,
) -> None:
    """Runs `model` on the prompt columns the cache does not hold yet, up to each row's last block end, one forward
    per such column (`block_end_columns`), so that the rows' states there become snapshots; `generate()` then
    computes the columns after the last one. Positions follow the mask as in `generate()`.

    Args:
        cache: a cache just prepared by `load_prompt(input_ids, attention_mask)`.
        input_ids: `[batch, seq_len]` left-padded prompts.
        attention_mask: `[batch, seq_len]`, 0 on padding, or None.
        through: also compute up to this column (a last forward after the block ends), if it is later.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    accepted = inspect.signature(model.forward).parameters
    start = cache.get_seq_length()
    ends = block_end_columns(mask, cache.pool.block_size, start)
    if through is not None and through > max([start, *ends]):
        ends.append(through)
    for end in ends:
        kwargs = {"input_ids": ids[:, start:end], "attention_mask": mask[:, :end], "use_cache": True}
        if "position_ids" in accepted:
            kwargs["position_ids"] = positions[:, start:end]
        if "logits_to_keep" in accepted:
            kwargs["logits_to_keep"] = 1
        model(**kwargs, **cache_kwargs(cache))
        cache.finish_forward()
        start = end
