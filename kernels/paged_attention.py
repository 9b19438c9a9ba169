"""Launcher for paged attention over ragged, left-padded rows (mixed prefill + decode)."""

from __future__ import annotations

import functools
import os

import torch
import triton

from ._attention_kernels import _paged_attention_kernel, _split_kv_reduce_kernel
from .specializations import DECODE_BLOCK_M, attention_tile, check_supported, head_dim_pad

#: No sliding window: every causal key is visible (p - k < 2**31 - 1 always holds).
_NO_WINDOW = 2**31 - 1
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 512
_SPLIT_MIN_CONTEXT = 2048


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreter_bf16(dtype: torch.dtype) -> bool:
    """Triton 3.9's interpreter multiplies bf16 tiles in tl.dot as raw integers; upcast there only."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_num_splits(*, num_programs: int, max_context: int, q_len: int, num_sms: int) -> int:
    """Split-KV (flash-decoding) heuristic; 1 means the single-pass kernel.

    Split only when the single pass leaves the GPU mostly idle and the context is long:
      * the decode tile is in use (each row's query tokens fit one tile, i.e. decode or short
        speculative steps; `q_len <= 16`),
      * the context upper bound `max_context` (block table width x block_size, known on the host
        without a sync) is at least 2048 tokens,
      * fewer programs than SMs.
    Then split so that about two programs run per SM, with at least 512 keys per split and at
    most 32 splits. Splits past a row's real length exit immediately.
    """
    if q_len > DECODE_BLOCK_M or max_context < _SPLIT_MIN_CONTEXT or num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = max_context // _MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def paged_attention(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of ragged, left-padded queries over a paged KV cache.

    Args:
        query: `[batch, q_len, num_heads, head_dim]`, fp16/bf16/fp32, any strides with the last
            dim contiguous (HF's `[B, H, Q, D]` transposed). Row `b` has `query_lens[b]` real
            tokens right-aligned on the q axis; the rest is padding and gets zeros.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD),
            contiguous, same dtype as `query`.
        block_tables: int32 `[batch, max_blocks_per_seq]`; key at logical position `k` of row `b`
            lives in block `block_tables[b, k // block_size]`. Entries never read may be -1.
        seq_lens: int32 `[batch]`, tokens stored per row including this step's.
        query_lens: int32 `[batch]`, `0 <= query_lens[b] <= min(q_len, seq_lens[b])`.
        scale: multiplier of `q.k`.
        sliding_window: key `k` visible to query position `p` iff `p - sliding_window < k <= p`.
        softcap: logits become `softcap * tanh(logits / softcap)`.
        sinks: `[num_heads]` extra per-head logit in the softmax denominator (no value).
        out: optional contiguous `[batch, q_len, num_heads, head_dim]` output, query dtype.
        num_splits: force the split-KV count (1 = single pass); `None` uses `choose_num_splits`.

    Returns:
        Contiguous `[batch, q_len, num_heads, head_dim]` tensor in the query dtype.
    """
    batch, q_len, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = key_cache.shape
    check_supported(query.dtype, head_dim)
    assert kv_head_dim == head_dim and value_cache.shape == key_cache.shape, "K/V pool shapes differ from query"
    assert key_cache.dtype == value_cache.dtype == query.dtype, "query and KV pools must share a dtype"
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV pools must be contiguous"
    assert query.stride(3) == 1, "query head_dim must be contiguous"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == batch
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous()
    assert query_lens.dtype == torch.int32 and query_lens.shape == (batch,) and query_lens.is_contiguous()
    if sliding_window is not None:
        assert sliding_window >= 1, "sliding_window must be >= 1"
    if softcap is not None:
        assert softcap > 0, "softcap must be > 0"
    if out is None:
        out = torch.empty((batch, q_len, num_heads, head_dim), dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()
    if batch == 0 or q_len == 0:
        return out
    dummy = torch.empty(1, dtype=torch.float32, device=query.device)
    if sinks is not None:
        assert sinks.shape == (num_heads,), f"sinks must be [num_heads={num_heads}]"
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()

    group_size = num_heads // num_kv_heads
    decode = q_len * min(group_size, DECODE_BLOCK_M) <= DECODE_BLOCK_M
    tile = attention_tile(query.dtype, head_dim, decode=decode)
    heads_per_tile = min(group_size, tile.BLOCK_M)
    num_head_chunks = triton.cdiv(group_size, heads_per_tile)
    num_q_tiles = triton.cdiv(q_len, tile.BLOCK_M // heads_per_tile)
    num_programs = num_q_tiles * batch * num_kv_heads * num_head_chunks
    if num_splits is None:
        num_splits = 1
        if decode and query.is_cuda:
            num_splits = choose_num_splits(
                num_programs=num_programs,
                max_context=block_tables.shape[1] * block_size,
                q_len=q_len,
                num_sms=_num_sms(query.device.index or 0),
            )
    assert num_splits >= 1
    split_kv = num_splits > 1
    if split_kv and not decode:  # split-KV ships with the decode tile only
        tile = attention_tile(query.dtype, head_dim, decode=True)
        heads_per_tile = min(group_size, tile.BLOCK_M)
        num_head_chunks = triton.cdiv(group_size, heads_per_tile)
        num_q_tiles = triton.cdiv(q_len, tile.BLOCK_M // heads_per_tile)

    if split_kv:
        partial = torch.empty((batch, q_len, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        row_max = torch.empty((batch, q_len, num_heads, num_splits), dtype=torch.float32, device=query.device)
        row_sum = torch.empty_like(row_max)
        target, max_arg, sum_arg = partial, row_max, row_sum
    else:
        target, max_arg, sum_arg = out, dummy, dummy

    grid = (num_q_tiles, batch, num_kv_heads * num_head_chunks * num_splits)
    _paged_attention_kernel[grid](
        out_ptr=target,
        max_ptr=max_arg,
        sum_ptr=sum_arg,
        query_ptr=query,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_lens_ptr=query_lens,
        sinks_ptr=sinks if sinks is not None else dummy,
        scale=float(scale),
        softcap=float(softcap) if softcap is not None else 1.0,
        sliding_window=int(sliding_window) if sliding_window is not None else _NO_WINDOW,
        has_sinks=int(sinks is not None),
        use_softcap=int(softcap is not None),
        q_len=q_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        group_size=group_size,
        heads_per_tile=heads_per_tile,
        num_head_chunks=num_head_chunks,
        num_splits=num_splits,
        block_size=block_size,
        stride_q_batch=query.stride(0),
        stride_q_token=query.stride(1),
        stride_q_head=query.stride(2),
        stride_bt_batch=block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        BLOCK_M=tile.BLOCK_M,
        BLOCK_N=tile.BLOCK_N,
        SPLIT_KV=split_kv,
        DOT_IN_FP32=_interpreter_bf16(query.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if split_kv:
        _split_kv_reduce_kernel[(batch * q_len * num_heads,)](
            out_ptr=out,
            partial_ptr=partial,
            max_ptr=row_max,
            sum_ptr=row_sum,
            num_splits=num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad(head_dim),
            num_warps=4,
        )
    return out
