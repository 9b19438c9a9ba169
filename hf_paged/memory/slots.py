"""Views of consecutive slots of a pool tensor: one row's K or V read in place, without a copy.

A contiguous pool tensor `[num_blocks, block_size, num_kv_heads, head_dim]` stores slot `s` (`block_id *
block_size + offset`) at row `s` of its `[num_blocks * block_size, num_kv_heads, head_dim]` flattening, so the
slots of consecutive blocks are one strided view in the `[batch, num_kv_heads, kv_len, head_dim]` layout
attention reads, and so are several rows' when each row's blocks are consecutive and the rows lie at one stride.
"""

from __future__ import annotations

import torch


#: `as_strided` arguments `(size, stride, offset from the tensor's first element)`.
Strided = tuple[tuple[int, ...], tuple[int, ...], int]


def slots_strided(
    num_kv_heads: int, head_dim: int, first: int, count: int, storage_offset: int = 0, rows: int = 1, row_stride: int = 0
) -> Strided:
    """`as_strided` arguments of the `[rows, num_kv_heads, count, head_dim]` view of a contiguous pool tensor
    `[num_blocks, block_size, num_kv_heads, head_dim]` whose storage offset is `storage_offset`: row `r` reads the
    consecutive slots `first + r * row_stride .. first + r * row_stride + count - 1`."""
    per_slot = num_kv_heads * head_dim
    offset = storage_offset + first * per_slot
    row_step = row_stride * per_slot if rows > 1 else count * per_slot
    return (rows, num_kv_heads, count, head_dim), (row_step, head_dim, per_slot, 1), offset


def slot_view(cache: torch.Tensor, token: torch.Tensor, slot: int) -> torch.Tensor:
    """`[1, num_kv_heads, 1, head_dim]` view of slot `slot` of a contiguous pool tensor (`[num_blocks, block_size,
    num_kv_heads, head_dim]`), shaped like `token`."""
    _, stride, offset = slots_strided(cache.shape[2], cache.shape[3], slot, 1, cache.storage_offset())
    return cache.as_strided(token.shape, stride, offset)


def slots_view(cache: torch.Tensor, first: int, count: int, rows: int = 1, row_stride: int = 0) -> torch.Tensor:
    """`[rows, num_kv_heads, count, head_dim]` view of a contiguous pool tensor (`[num_blocks, block_size,
    num_kv_heads, head_dim]`) in which row `r` is the `count` consecutive slots from `first + r * row_stride`:
    rows' K or V read in place, no copy."""
    shape = cache.shape
    return cache.as_strided(*slots_strided(shape[2], shape[3], first, count, cache.storage_offset(), rows, row_stride))
