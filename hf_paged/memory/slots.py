"""The layouts of a pool tensor, and views of its consecutive slots: rows' K or V read in place, without a copy.

A pool tensor is `[num_blocks, block_size, num_kv_heads, head_dim]`. Slot `s` is `block_id * block_size + offset`.
When block `b + 1`'s first slot follows block `b`'s last one at the same stride as two slots of one block
(`slots_flat`), consecutive slots are one stride apart, and the slots of consecutive blocks are one strided view in
the `[batch, num_kv_heads, kv_len, head_dim]` layout attention reads; so are several rows' when each row's blocks
are consecutive and the rows lie at one stride.

Both pool layouts of `BlockPool` are flat in that sense: the token-major one (contiguous, what the Triton kernels
take), where one slot's heads are adjacent, and the head-major one (`[num_kv_heads, num_blocks, block_size,
head_dim]` storage seen through a permuted view), where one KV head's slots are adjacent, so a row's run of blocks is
one contiguous span per KV head.

Why two layouts: the PyTorch path hands those views to a CPU attention kernel that walks one KV head at a time.
Over a token-major pool each step to the next key skips the other heads' values, a stride that the hardware
prefetcher follows poorly once the K/V are no longer in cache; over a head-major pool it reads one span per head,
as it does over a contiguous cache (docs/performance.md, "Head-major pools"). The Triton kernels address a
token-major pool. Writes, block copies and the gathers below index either layout the same way, as `[num_blocks,
block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch


@torch.inference_mode(False)
def storage_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for state that outlives a forward (pool blocks, scales, state slots): a normal tensor even
    when made under `torch.inference_mode()`, so that writes from outside it (a later `generate()` runs under
    `no_grad`) may change it."""
    return torch.zeros(shape, dtype=dtype, device=device)


@torch.inference_mode(False)
def new_pool_tensor(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, head_major: bool
) -> torch.Tensor:
    """A zeroed pool tensor `shape = [num_blocks, block_size, num_kv_heads, head_dim]` (`storage_zeros`): contiguous
    (token-major) or, when `head_major`, a view of `[num_kv_heads, num_blocks, block_size, head_dim]` storage."""
    if not head_major:
        return storage_zeros(shape, dtype, device)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    return storage_zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype, device).permute(1, 2, 0, 3)


def _head_major(cache: torch.Tensor) -> bool:
    return cache.dim() == 4 and cache.shape[2] > 1 and cache.permute(2, 0, 1, 3).is_contiguous()


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[len(block_ids), block_size, num_kv_heads, head_dim]` copy of the given blocks (int64 ids) of a pool tensor,
    or `[len(block_ids), block_size, num_kv_heads]` of a quantized pool's scales. It copies whole stretches of the
    storage: a block of a token-major tensor, a block's slots of one KV head of a head-major one (whose copy is then
    head-major too, each head's slots adjacent)."""
    if _head_major(cache):
        return cache.permute(2, 0, 1, 3).index_select(1, block_ids).permute(1, 2, 0, 3)
    return cache.index_select(0, block_ids)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`[len(slots), num_kv_heads, head_dim]` copy of the given slots (int64) of a flat pool tensor (`slots_flat`),
    gathered per KV head from a head-major one."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    if _head_major(cache):
        return cache.permute(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim).index_select(1, slots).transpose(0, 1)
    return cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots)


def slots_flat(cache: torch.Tensor) -> bool:
    """Whether a pool tensor (`[num_blocks, block_size, num_kv_heads, head_dim]`) stores its slots at one stride
    with each head's `head_dim` values contiguous: what `slot_view` and `slots_view` need."""
    per_block, per_slot, _, per_value = cache.stride()
    return per_block == cache.shape[1] * per_slot and per_value == 1


def slot_view(cache: torch.Tensor, slot: int) -> torch.Tensor:
    """`[1, num_kv_heads, 1, head_dim]` view of slot `slot` of a flat pool tensor (`slots_flat`)."""
    return step_views(cache, slot, None, 0)[0]


def slots_view(cache: torch.Tensor, first: int, count: int, rows: int = 1, row_stride: int = 0) -> torch.Tensor:
    """`[rows, num_kv_heads, count, head_dim]` view of a flat pool tensor (`slots_flat`; `[num_blocks, block_size,
    num_kv_heads, head_dim]`) in which row `r` is the `count` consecutive slots from `first + r * row_stride`:
    rows' K or V read in place, no copy."""
    _, per_slot, per_head, _ = cache.stride()
    _, _, num_kv_heads, head_dim = cache.shape
    row_step = row_stride * per_slot if rows > 1 else count * per_slot
    return cache.as_strided(
        (rows, num_kv_heads, count, head_dim), (row_step, per_head, per_slot, 1), cache.storage_offset() + first * per_slot
    )


def step_views(
    cache: torch.Tensor, slot: int, first: int | None, count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row's decode step over a flat pool tensor (`slots_flat`; `[num_blocks, block_size, num_kv_heads,
    head_dim]`): the `[1, num_kv_heads, 1, head_dim]` view of slot `slot` (the new token's) and the
    `[1, num_kv_heads, count, head_dim]` view of the `count` consecutive slots from `first` (`slots_view`; None when
    `first` is None), the tensor's layout read once for both."""
    _, per_slot, per_head, _ = cache.stride()
    _, _, num_kv_heads, head_dim = cache.shape
    offset = cache.storage_offset()
    written = cache.as_strided(
        (1, num_kv_heads, 1, head_dim), (per_slot, per_head, per_slot, 1), offset + slot * per_slot
    )
    if first is None:
        return written, None
    read = cache.as_strided(
        (1, num_kv_heads, count, head_dim), (count * per_slot, per_head, per_slot, 1), offset + first * per_slot
    )
    return written, read
