"""The PyTorch path: writes and attention over paged blocks on any device, used on CPU.

PyTorch has no CPU attention that addresses K/V through a block table, so a layer whose rows have
history gathers the blocks it needs (only the window's blocks for sliding layers) into one scratch
tensor and runs SDPA over it. Rows that are each one run of consecutive blocks, at one stride from row to row
(how the allocator places a batch's rows, `BlockAllocator.allocate_runs`), are read as one view of the pool,
without a copy; so are the rows' leading blocks when every row shares them or each row's lie at one stride from
the previous row's (`LeadingBlocks`), attended apart and merged by log-sum-exp.
A forward with no history (a prefill) attends the new K/V directly. The gather index and the mask are
built once per forward and group (`TorchMeta`, `torch_meta.py`) and reused by every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..memory.quant import byte_view, dequantize, fake_quantize, quantize
from ..memory.slots import gather_blocks, slot_view, slots_flat, slots_view
from .torch_meta import LeadingBlocks, TorchMeta


#: PyTorch's CPU flash attention returns the log-sum-exp that cascade attention merges with.
_HAS_CPU_FLASH_LSE = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")

#: Rows whose gathered K/V together exceed this many bytes are gathered and attended a group of rows at a time,
#: each group within it, so that a group's K/V are still in the CPU's caches when SDPA reads them right after
#: the gather (a contiguous cache cannot do this: its K/V are one tensor). Figures: docs/performance.md.
GATHER_CHUNK_BYTES = 3 * 2**20


def torch_write(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    write_index: torch.Tensor | None,
    write_slots: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    single_slot: int | None = None,
) -> None:
    """Writes new K/V into their slots, quantizing them when the pool is quantized.

    Args:
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and `[..., head_dim_v]`.
        key, value: `[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]` new K/V (HF layout).
        write_index: int64 `[n]` indices into the flattened `batch * q_len` tokens to write, or None for all.
        write_slots: int64 `[n]` destination slots (`block_id * block_size + offset`); None with `single_slot`.
        scales: a quantized pool's K and V scales `[num_blocks, block_size, num_kv_heads]`, or None.
        single_slot: the slot when one row writes one token (its decode step), or None.
    """
    batch, num_kv_heads, q_len, _ = key.shape
    if write_slots is None:
        if single_slot is None:
            raise ValueError("torch_write() needs write_slots or single_slot.")
        as_is = scales is None and key.dtype == key_cache.dtype
        if not (as_is and slots_flat(key_cache) and slots_flat(value_cache)):
            write_slots = torch.tensor([single_slot], dtype=torch.int64, device=key_cache.device)
    if q_len == 1 and write_index is None and scales is None and key.dtype == key_cache.dtype:
        # Plain decode: each row's `[num_kv_heads, 1, head_dim]` token goes to its slot as it is (no view of it).
        if torch.is_grad_enabled():  # the pool is inference storage: it never joins an autograd graph
            key, value = key.detach(), value.detach()
        if write_slots is None:  # one token: copied into a strided view of its slot (no index tensor, no index op)
            slot_view(key_cache, single_slot).copy_(key)
            slot_view(value_cache, single_slot).copy_(value)
            return
        key_cache.view(-1, num_kv_heads, 1, key_cache.shape[3]).index_copy_(0, write_slots, key)
        value_cache.view(-1, num_kv_heads, 1, value_cache.shape[3]).index_copy_(0, write_slots, value)
        return
    if q_len == 1:  # decode: a view, no transpose
        flat_key, flat_value = key.select(2, 0), value.select(2, 0)
    else:
        flat_key = key.transpose(1, 2).reshape(batch * q_len, num_kv_heads, key.shape[3])
        flat_value = value.transpose(1, 2).reshape(batch * q_len, num_kv_heads, value.shape[3])
    if write_index is not None:
        flat_key, flat_value = flat_key.index_select(0, write_index), flat_value.index_select(0, write_index)
    if torch.is_grad_enabled():  # the pool is inference storage: it never joins an autograd graph
        flat_key, flat_value = flat_key.detach(), flat_value.detach()
    if scales is None:
        if flat_key.dtype != key_cache.dtype:
            flat_key, flat_value = flat_key.to(key_cache.dtype), flat_value.to(value_cache.dtype)
        key_cache.view(-1, num_kv_heads, key_cache.shape[3]).index_copy_(0, write_slots, flat_key)
        value_cache.view(-1, num_kv_heads, value_cache.shape[3]).index_copy_(0, write_slots, flat_value)
        return
    for cache, flat, scale in zip((key_cache, value_cache), (flat_key, flat_value), scales, strict=True):
        q, s = quantize(flat, cache.dtype)
        byte_view(cache).view(-1, num_kv_heads, cache.shape[3]).index_copy_(0, write_slots, byte_view(q))
        scale.view(-1, num_kv_heads).index_copy_(0, write_slots, s)


def _blocks(cache: torch.Tensor, meta: TorchMeta, batch: int) -> torch.Tensor:
    """`[batch, count, block_size, ...]` view or gather of the blocks the meta names."""
    if meta.contiguous_start is not None:
        return _strided_blocks(cache, meta.contiguous_start, meta.num_gather, batch, meta.row_stride)
    # whole blocks (memcpy-like); advanced indexing is several times slower on CPU
    count = meta.gather_table.shape[1]
    return gather_blocks(cache, meta.gather_table.view(-1)).view(batch, count, *cache.shape[1:])


def _strided_blocks(t: torch.Tensor, start: int, count: int, rows: int, row_stride: int) -> torch.Tensor:
    """`[rows, count, ...]` view of the blocks `start + r * row_stride .. + count - 1` of row `r`."""
    first = t.storage_offset() + start * t.stride(0)
    return t.as_strided((rows, count, *t.shape[1:]), (row_stride * t.stride(0), *t.stride()), first)


def _gathered(
    cache: torch.Tensor, meta: TorchMeta, batch: int, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`[batch, num_kv_heads, kv_len, head_dim]` (the cache's own width: `head_dim_v` for values) view or gather
    of the blocks the meta names (their `meta.kv_valid` keys from `meta.kv_from` when set), dequantized into `dtype`
    with `scale` (`[num_blocks, block_size, num_kv_heads]`) when the pool is quantized."""
    block_size = cache.shape[1]
    if meta.contiguous_start is not None and scale is None and slots_flat(cache):  # rows of consecutive blocks
        kv_len = meta.kv_valid if meta.kv_valid is not None else meta.num_gather * block_size
        first = meta.contiguous_start * block_size + (meta.kv_from if meta.kv_valid is not None else 0)
        return slots_view(cache, first, kv_len, batch, meta.row_stride * block_size)
    blocks = _blocks(cache, meta, batch)
    if scale is not None:
        blocks = dequantize(blocks, _blocks(scale, meta, batch), dtype)
    return _rows_of_blocks(blocks, meta.kv_valid, meta.kv_from)


def gathered_row(cache: torch.Tensor, block_ids: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """`[1, num_kv_heads, count, head_dim]` copy of one row's `count` slots from its `start`-th, gathered from its
    blocks (int64 `[num_blocks]`): the row `_gathered` gives for the same blocks, by the same calls."""
    return _rows_of_blocks(gather_blocks(cache, block_ids).unsqueeze(0), count, start)


def _rows_of_blocks(blocks: torch.Tensor, kv_len: int | None, start: int = 0) -> torch.Tensor:
    """`[batch, num_kv_heads, kv_len, head_dim]` view of each row's blocks `[batch, count, block_size,
    num_kv_heads, head_dim]` as one sequence of keys, cut to its `kv_len` keys from `start` (None: all)."""
    batch, count, block_size, num_kv_heads, head_dim = blocks.shape
    rows = blocks.reshape(batch, count * block_size, num_kv_heads, head_dim).transpose(1, 2)
    return rows if kv_len is None else rows[:, :, start : start + kv_len]


def _leading_kv(
    cache: torch.Tensor,
    leading: LeadingBlocks,
    batch: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`[1, num_kv_heads, leading_len, head_dim]` (blocks shared by all rows) or `[batch, ...]` (each row's own,
    at `leading.row_stride` blocks from the previous row's) view of the leading blocks, read where they are
    stored (gathered once when shared and not consecutive), dequantized into `dtype` with `scale` when the pool
    is quantized."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    count = len(leading.block_ids)
    rows = 1 if leading.row_stride == 0 else batch

    def take(t: torch.Tensor) -> torch.Tensor:
        if leading.row_stride:  # [batch, count, ...]: row r's blocks start row_stride blocks after row r - 1's
            return _strided_blocks(t, leading.contiguous_start, count, batch, leading.row_stride)
        if leading.contiguous_start is not None:
            return t[leading.contiguous_start : leading.contiguous_start + count]
        return gather_blocks(t, leading.table)

    blocks = take(cache) if scale is None else dequantize(take(cache), take(scale), dtype)
    return blocks.reshape(rows, count * block_size, num_kv_heads, head_dim).transpose(1, 2)


def _flash_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp. GQA query heads are folded into the query length.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`; key, value: `[batch or 1, num_kv_heads, kv_len, head_dim]`
        and `[..., head_dim_v]`; mask: bool `[batch, 1, q_len, kv_len]` or None.

    Returns:
        `([batch, num_heads, q_len, head_dim_v], [batch, num_heads, q_len] float32)`.
    """
    batch, num_heads, q_len, head_dim = query.shape
    head_dim_v = value.shape[3]
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    if key.shape[0] == 1 and batch > 1:  # one K/V for every row: fold the rows into the query length too
        q = query.reshape(batch, num_kv_heads, groups * q_len, head_dim).transpose(0, 1)
        q = q.reshape(1, num_kv_heads, batch * groups * q_len, head_dim)
    else:
        q = query.reshape(batch, num_kv_heads, groups * q_len, head_dim)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, -math.inf)
        bias = bias.expand(batch, 1, q_len, -1).repeat(1, 1, groups, 1)  # [B, 1, G*Q, kv_len]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, key, value, 0.0, False, attn_mask=bias, scale=scale)
    if key.shape[0] == 1 and batch > 1:
        out = out.reshape(num_kv_heads, batch, groups * q_len, head_dim_v).transpose(0, 1)
        lse = lse.reshape(num_kv_heads, batch, groups * q_len).transpose(0, 1)
    return out.reshape(batch, num_heads, q_len, head_dim_v), lse.reshape(batch, num_heads, q_len)


def _cascade_attention(
    query: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Merges attention over the rows' leading blocks (`[1 or batch, num_kv_heads, leading_len, head_dim]`) with
    attention over the rest of each row, by their log-sum-exp."""
    out_p, lse_p = _flash_with_lse(query, prefix_k, prefix_v, None, scale)
    out_s, lse_s = _flash_with_lse(query, suffix_k, suffix_v, mask, scale)
    top = torch.maximum(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - top).unsqueeze(-1), torch.exp(lse_s - top).unsqueeze(-1)
    return ((out_p.float() * w_p + out_s.float() * w_s) / (w_p + w_s)).to(query.dtype)


def torch_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: TorchMeta,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of the new queries over each row's blocks.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        key, value: `[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]` this forward's K/V (used
            when `meta.direct`); `head_dim_v` differs from `head_dim` only in multi-latent attention.
        key_cache, value_cache: the layer's pool tensors, `[num_blocks, block_size, num_kv_heads, head_dim]`
            and `[..., head_dim_v]`.
        meta: gather index and mask of this forward and group.
        scale: multiplier of `q·k`.
        softcap: logit soft-capping `softcap * tanh(s / softcap)`, or None.
        sinks: `[num_heads]` per-head sink logits that join the softmax denominator, or None.
        scales: a quantized pool's K and V scales `[num_blocks, block_size, num_kv_heads]`, or None. Everything
            is then attended as stored, this forward's K/V included (quantized and dequantized), so the
            result does not depend on whether they were read from the blocks.

    Returns:
        `[batch, q_len, num_heads, head_dim_v]` in the query's dtype.
    """
    if meta.unique_rows is not None:  # identical rows: attend once per distinct row, then copy the result
        rows = meta.unique_rows
        unique_meta = TorchMeta(
            meta.direct, meta.gather_table, meta.contiguous_start, meta.mask, meta.is_causal, meta.leading,
            meta.num_gather, kv_valid=meta.kv_valid, row_stride=meta.row_stride, kv_from=meta.kv_from,
        )
        out = torch_paged_attention(
            query.index_select(0, rows), key.index_select(0, rows), value.index_select(0, rows),
            key_cache, value_cache, unique_meta, scale, softcap, sinks, scales,
        )
        return out.index_select(0, meta.row_source)
    rows = _rows_per_chunk(query, key_cache, value_cache, meta)
    if rows < query.shape[0]:  # a group of rows at a time (GATHER_CHUNK_BYTES); each row's output stays its own
        outs = []
        for start in range(0, query.shape[0], rows):
            part = slice(start, start + rows)
            outs.append(torch_paged_attention(
                query[part], key[part], value[part], key_cache, value_cache, meta.rows(start, start + rows),
                scale, softcap, sinks, scales,
            ))
        return torch.cat(outs)
    key_scale, value_scale = scales if scales is not None else (None, None)
    if meta.direct:
        k, v = key, value
        if scales is not None:
            k, v = fake_quantize(key, key_cache.dtype), fake_quantize(value, value_cache.dtype)
    else:
        k = _gathered(key_cache, meta, query.shape[0], key_scale, query.dtype)
        v = _gathered(value_cache, meta, query.shape[0], value_scale, query.dtype)
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    mask = meta.mask
    if meta.leading is not None:
        batch = query.shape[0]
        prefix_k = _leading_kv(key_cache, meta.leading, batch, key_scale, query.dtype).to(query.dtype)
        prefix_v = _leading_kv(value_cache, meta.leading, batch, value_scale, query.dtype).to(query.dtype)
        # (CPU flash attention takes one head size: K and V of different widths take the path below)
        same_width = prefix_k.shape[-1] == prefix_v.shape[-1]
        if softcap is None and sinks is None and query.device.type == "cpu" and _HAS_CPU_FLASH_LSE and same_width:
            return _cascade_attention(query, prefix_k, prefix_v, k, v, mask, scale).transpose(1, 2)
        k = torch.cat([prefix_k.expand(batch, -1, -1, -1), k], dim=2)  # other devices and features: one K/V per row
        v = torch.cat([prefix_v.expand(batch, -1, -1, -1), v], dim=2)
        if mask is not None:
            visible = torch.ones(*mask.shape[:3], prefix_k.shape[2], dtype=torch.bool, device=mask.device)
            mask = torch.cat([visible, mask], dim=-1)
        meta = TorchMeta(True, None, None, mask, False)
    if softcap is None and sinks is None:
        if not meta.is_causal and (mask is None or query.shape[2] == 1):
            return decode_attention(query, k, v, scale, mask)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, is_causal=meta.is_causal, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    return _eager_attention(query, k, v, meta, scale, softcap, sinks).transpose(1, 2)


#: Query heads per KV head from which a CPU decode always folds them into the query length (`folds_gqa`).
FOLD_GQA_ALWAYS_FROM = 4
#: A CPU decode of fewer query heads per KV head folds them when its keys take at least this many bytes; below it,
#: SDPA's one-query path costs less than the fold's copy of its output. Figures: docs/performance.md ("GQA decode
#: folded through SDPA").
FOLD_GQA_MIN_BYTES = 64 * 2**10


def folds_gqa(query: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `decode_attention` folds the query heads of a call into the query length: a CPU decode step (`q_len`
    1) of a GQA model, with `FOLD_GQA_ALWAYS_FROM` or more query heads per KV head or keys of `FOLD_GQA_MIN_BYTES`.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`; k: `[batch, num_kv_heads, kv_len, head_dim]`.
    """
    return _folds(query.shape, k.shape, k.element_size(), query.is_cpu)


def _folds(query_shape: torch.Size, key_shape: torch.Size, key_element_size: int, on_cpu: bool) -> bool:
    """`folds_gqa` of a call's shapes, read once by `decode_attention`."""
    batch, num_heads, q_len, _ = query_shape
    key_batch, num_kv_heads, kv_len, head_dim = key_shape
    return (
        q_len == 1
        and num_heads != num_kv_heads
        and key_batch == batch
        and on_cpu
        and (
            num_heads >= FOLD_GQA_ALWAYS_FROM * num_kv_heads
            or batch * num_kv_heads * kv_len * head_dim * key_element_size >= FOLD_GQA_MIN_BYTES
        )
    )


def decode_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of queries that see every key, or the keys `mask` allows: `[batch, q_len, num_heads, head_dim_v]`
    (the layout an attention function returns).

    On a CPU, a decode step (`q_len == 1`) of a GQA model folds each KV head's query heads into the query length
    (SDPA over `[batch, num_kv_heads, groups, head_dim]` queries, the mask broadcast over them), so each KV head
    is read once; SDPA with `enable_gqa` reads it once per query head. The two differ by float rounding only.
    When it folds: `folds_gqa`.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`; k, v: `[batch, num_kv_heads, kv_len, head_dim]` and
            `[..., head_dim_v]`; mask: bool `[batch, 1, q_len, kv_len]` (True = allowed) or None (all keys; with
            `q_len > 1` a mask is needed for causality).
    """
    query_shape, key_shape = query.shape, k.shape
    if _folds(query_shape, key_shape, k.element_size(), query.is_cpu):
        batch, num_heads, _, head_dim = query_shape
        num_kv_heads = key_shape[1]
        folded = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
        return out.reshape(batch, 1, num_heads, -1)  # (`[batch, num_kv_heads, groups, ...]` is in head order)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


def _rows_per_chunk(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: TorchMeta) -> int:
    """How many rows to gather and attend at a time: all of them, unless their gathered K/V exceed
    `GATHER_CHUNK_BYTES`; then as few equal groups as keep each within it (a row at least)."""
    batch = query.shape[0]
    if meta.gather_table is None or meta.leading is not None or batch == 1:
        return batch
    per_row = meta.num_gather * key_cache.shape[1] * key_cache.shape[2] * (key_cache.shape[3] + value_cache.shape[3])
    total = batch * per_row * query.element_size()
    if total <= GATHER_CHUNK_BYTES:
        return batch
    groups = -(-total // GATHER_CHUNK_BYTES)
    return max(1, -(-batch // groups))


def _eager_attention(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: TorchMeta,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Float32 attention with soft-capping and sinks, `[batch, num_heads, q_len, head_dim_v]`."""
    batch, num_heads, q_len, _ = query.shape
    probs = attention_probs(query, k, meta.mask, meta.is_causal, scale, softcap, sinks)
    probs = probs.view(batch, k.shape[1], (num_heads // k.shape[1]) * q_len, -1)
    out = torch.matmul(probs, v.float()).view(batch, num_heads, q_len, v.shape[3])
    return out.to(query.dtype)


def attention_probs(
    query: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 attention probabilities (what `output_attentions=True` returns).

    Args:
        query: `[batch, num_heads, q_len, head_dim]`; k: `[batch, num_kv_heads, kv_len, head_dim]`.
        mask: bool `[batch, 1, q_len, kv_len]` (True = allowed) or None; is_causal: bottom-right causal
            when `mask` is None.

    Returns:
        `[batch, num_heads, q_len, kv_len]` float32.
    """
    batch, num_heads, q_len, head_dim = query.shape
    groups = num_heads // k.shape[1]
    q = query.float().reshape(batch, k.shape[1], groups * q_len, head_dim)
    scores = torch.matmul(q, k.float().transpose(-1, -2)).view(batch, num_heads, q_len, -1) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    elif is_causal:
        causal = torch.ones(q_len, k.shape[2], dtype=torch.bool, device=query.device).tril(k.shape[2] - q_len)
        scores = scores.masked_fill(~causal, -math.inf)
    if sinks is not None:
        sink = sinks.float().view(1, num_heads, 1, 1).expand(batch, num_heads, q_len, 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)
