"""Views of consecutive slots of a pool tensor: one row's K or V read in place, without a copy.

A contiguous pool tensor `[num_blocks, block_size, num_kv_heads, head_dim]` stores slot `s` (`block_id *
block_size + offset`) at row `s` of its `[num_blocks * block_size, num_kv_heads, head_dim]` flattening, so the
slots of consecutive blocks are one strided view in the `[batch, num_kv_heads, kv_len, head_dim]` layout
attention reads.
"""

from __future__ import annotations

import torch


#: `as_strided` arguments `(size, stride, offset from the tensor's first element)`.
Strided = tuple[tuple[int, ...], tuple[int, ...], int]


def slots_strided(num_kv_heads: int, head_dim: int, first: int, count: int, storage_offset: int = 0) -> Strided:
    """`as_strided` arguments of the `[1, num_kv_heads, count, head_dim]` view of the consecutive slots `first ..
    first + count - 1` of a contiguous pool tensor `[num_blocks, block_size, num_kv_heads, head_dim]` whose storage
    offset is `storage_offset`."""
    per_slot = num_kv_heads * head_dim
    offset = storage_offset + first * per_slot
    return (1, num_kv_heads, count, head_dim), (count * per_slot, head_dim, per_slot, 1), offset


def slot_view(cache: torch.Tensor, token: torch.Tensor, slot: int) -> torch.Tensor:
    """`[1, num_kv_heads, 1, head_dim]` view of slot `slot` of a contiguous pool tensor (`[num_blocks, block_size,
    num_kv_heads, head_dim]`), shaped like `token`."""
    _, stride, offset = slots_strided(cache.shape[2], cache.shape[3], slot, 1, cache.storage_offset())
    return cache.as_strided(token.shape, stride, offset)


def slots_view(cache: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """`[1, num_kv_heads, count, head_dim]` view of the consecutive slots `first .. first + count - 1` of a
    contiguous pool tensor (`[num_blocks, block_size, num_kv_heads, head_dim]`): one row's K or V, no copy."""
    return cache.as_strided(*slots_strided(cache.shape[2], cache.shape[3], first, count, cache.storage_offset()))
