"""Launcher for copy-on-write block copies across all layers in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
            contiguous, all on one device with the same bytes per block (dtypes may differ only if
            that still holds). Written in place.
        src_block_ids, dst_block_ids: int64 `[num_pairs]` on the pools' device. Destinations
            must be distinct and must not appear among the sources (copy-on-write never needs that).
    """
    caches = [*key_caches, *value_caches]
    assert len(key_caches) == len(value_caches) and caches, "need one K and one V pool per layer"
    assert src_block_ids.dtype == torch.int64 and dst_block_ids.dtype == torch.int64
    assert src_block_ids.shape == dst_block_ids.shape and src_block_ids.dim() == 1
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    device = caches[0].device
    for cache in caches:
        assert cache.is_contiguous() and cache.device == device, "pools must be contiguous, on one device"
        assert cache[0].numel() * cache.element_size() == block_bytes, "pools differ in bytes per block"
    assert block_bytes % 4 == 0
    num_pairs = src_block_ids.numel()
    if num_pairs == 0:
        return
    words_per_block = block_bytes // 4
    cache_ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=device)
    grid = (len(caches), num_pairs, triton.cdiv(words_per_block, _WORDS_PER_PROGRAM))
    _copy_blocks_kernel[grid](
        cache_ptrs_ptr=cache_ptrs,
        src_block_ids_ptr=src_block_ids.contiguous(),
        dst_block_ids_ptr=dst_block_ids.contiguous(),
        words_per_block=words_per_block,
        BLOCK=_WORDS_PER_PROGRAM,
        num_warps=4,
    )
