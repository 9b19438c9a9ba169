"""Launcher for copy-on-write block copies across all layers in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, device_context

#: 32-bit words per program; blocks are copied as raw words, so one kernel serves every dtype.
_WORDS_PER_PROGRAM = 1024


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr,  # int64 [num_caches]: data pointers of every K and V pool (all the same block size)
    src_block_ids_ptr,  # int64 [num_pairs]
    dst_block_ids_ptr,  # int64 [num_pairs]
    words_per_block,  # int32 words in one block of one pool
    BLOCK: tl.constexpr,  # words per program
):
    cache = tl.program_id(0)
    pair = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(tl.int32))
    src = tl.load(src_block_ids_ptr + pair)
    dst = tl.load(dst_block_ids_ptr + pair)
    words = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = words < words_per_block
    block_words = words_per_block.to(tl.int64)
    data = tl.load(base + (src * block_words + words), mask=ok)
    tl.store(base + (dst * block_words + words), data, mask=ok)


def copy_launches(
    *,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> list[Launch]:
    """The launch of one `copy_blocks` call (inputs already checked; shared with `aot.py`)."""
    caches = [*key_caches, *value_caches]
    num_pairs = src_block_ids.numel()
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    if num_pairs == 0 or block_bytes == 0:
        return []
    words_per_block = block_bytes // 4
    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(caches[0].device)
    grid = (len(caches), num_pairs, triton.cdiv(words_per_block, _WORDS_PER_PROGRAM))
    kwargs = dict(
        cache_ptrs_ptr=cache_ptrs,
        src_block_ids_ptr=src_block_ids.contiguous(),
        dst_block_ids_ptr=dst_block_ids.contiguous(),
        words_per_block=words_per_block,
        BLOCK=_WORDS_PER_PROGRAM,
        num_warps=4,
    )
    return [Launch(_copy_blocks_kernel, grid, kwargs)]


def copy_blocks(
    *,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy whole blocks `src_block_ids[i] -> dst_block_ids[i]` in every layer's K and V pool.

    Args:
        key_caches, value_caches: per layer `[num_blocks, block_size, num_kv_heads, head_dim]`,
            contiguous, all on one device with the same bytes per block (a multiple of 4; dtypes
            may differ only if that still holds). Written in place.
        src_block_ids, dst_block_ids: int64 `[num_pairs]` on the pools' device. Destinations
            must be distinct and must not appear among the sources (copy-on-write never needs that).

    Raises:
        ValueError / TypeError naming the input that is not supported.
    """
    caches = [*key_caches, *value_caches]
    if len(key_caches) != len(value_caches) or not caches:
        raise ValueError(f"need one K and one V pool per layer, got {len(key_caches)} K and {len(value_caches)} V")
    for name, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
    if src_block_ids.shape != dst_block_ids.shape:
        raise ValueError(f"{src_block_ids.numel()} sources but {dst_block_ids.numel()} destinations")
    device = caches[0].device
    if src_block_ids.device != device or dst_block_ids.device != device:
        raise ValueError(f"block ids must be on the pools' device {device}")
    block_bytes = caches[0][0].numel() * caches[0].element_size() if caches[0].shape[0] else 0
    for cache in caches:
        if not cache.is_contiguous() or cache.device != device:
            raise ValueError("pools must be contiguous and on one device")
        if cache.dim() < 1 or (cache.shape[0] and cache[0].numel() * cache.element_size() != block_bytes):
            raise ValueError("pools differ in bytes per block")
    if block_bytes % 4:
        raise ValueError(f"bytes per block ({block_bytes}) must be a multiple of 4")
    launches = copy_launches(
        key_caches=key_caches, value_caches=value_caches, src_block_ids=src_block_ids, dst_block_ids=dst_block_ids
    )
    with device_context(caches[0]):
        for launch in launches:
            launch()
