"""Stored K/V read back as contiguous tensors: what a plain attention, `cache.layers[i].keys`,
`output_attentions` and a cache's first forward over a prefix hit see.

Rows are right-aligned like a left-padded contiguous cache (columns left of a shorter row are zeros), and a
quantized pool's blocks are dequantized into the model's dtype. Nothing here writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..memory.quant import dequantize
from ..memory.slots import gather_slots
from ..memory.rotation import from_storage, rotates
from ..attention.torch_backend import attention_probs

if TYPE_CHECKING:
    from ..attention.plan import AttentionFeatures, ForwardPlan
    from ..memory.pool import BlockPool
    from .rows import Rows


def right_aligned_slots(
    tables: list[list[int]], seq_lens: list[int], width: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots of each row's last `width` positions, right-aligned like a left-padded contiguous cache.

    Returns:
        `(index int64 [batch * width], valid float32 [batch, width, 1, 1] or None)`; columns left of a
        shorter row, and columns whose block a sliding window freed (-1 in the table), read slot 0 and are
        zeroed by `valid` (slot 0 may hold another sequence's K/V).
    """
    longest = max((len(t) for t in tables), default=0)
    host = dict(dtype=torch.int64, device="cpu")  # (the index is built on the host, then moved)
    table = torch.tensor([t + [0] * (longest - len(t)) for t in tables], **host).view(len(tables), -1)
    seq = torch.tensor(seq_lens, **host)
    pos = seq[:, None] - width + torch.arange(width, **host)[None, :]
    valid = pos >= 0
    pos = pos.clamp(min=0)
    if table.shape[1] == 0:
        table = torch.zeros(len(tables), 1, **host)
    blocks = table.gather(1, (pos // block_size).clamp(max=table.shape[1] - 1))
    valid &= blocks >= 0
    slots = blocks.clamp(min=0) * block_size + pos % block_size
    mask = None if bool(valid.all()) else valid[:, :, None, None].to(device=device, dtype=torch.float32)
    return slots.view(-1).to(device), mask


def read_slots(pool: BlockPool, layer_idx: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V at slots `index` (int64 `[n]`), `[n, num_kv_heads, head_dim]` each in `dtype`
    (dequantized from a quantized pool, and rotated back from a rotating one)."""
    key_cache, value_cache = pool.layer_storage(layer_idx)
    scales = pool.scales(layer_idx) or (None, None)
    rotate = rotates(pool.kv_format)
    out = []
    for cache, scale in zip((key_cache, value_cache), scales, strict=True):
        rows = gather_slots(cache, index)
        if scale is not None:
            rows = dequantize(rows, scale.view(-1, scale.shape[2]).index_select(0, index), dtype)
            rows = from_storage(rows) if rotate else rows
        out.append(rows)
    return out[0], out[1]


def _right_aligned(
    pool: BlockPool, layer_idx: int, index: torch.Tensor, valid: torch.Tensor | None, batch: int, width: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for rows in read_slots(pool, layer_idx, index, dtype):
        rows = rows.view(batch, width, *rows.shape[1:])
        rows = rows * valid.to(rows.dtype) if valid is not None else rows
        # contiguous, as a DynamicCache's concatenation is: some models view() the K/V they get back
        out.append(rows.transpose(1, 2).contiguous())
    return out[0], out[1]


def planned_kv(
    pool: BlockPool, plan: ForwardPlan, layer_idx: int, width: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K/V after this forward's write, `[batch, num_kv_heads, width, head_dim]` each, right-aligned
    (the plain-attention path; slots computed once per forward)."""
    group = plan.groups[pool.layout.group_of(layer_idx)]
    gathered = group.inputs_on(device).gathered
    found = gathered.get(width)
    if found is None:
        found = gathered[width] = right_aligned_slots(group.tables, plan.seq_lens, width, plan.block_size, device)
    index, valid = found
    return _right_aligned(pool, layer_idx, index, valid, len(plan.seq_lens), width, dtype)


def stored_kv(pool: BlockPool, rows: Rows, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a layer stores now, `[rows, num_kv_heads, seq_length, head_dim]` each, right-aligned, in the
    model's dtype."""
    key_cache, _ = pool.layer_storage(layer_idx)
    width = rows.num_columns
    tables = rows.group_tables(pool.layout.group_of(layer_idx))
    index, valid = right_aligned_slots(tables, rows.seq_lens, width, pool.block_size, key_cache.device)
    return _right_aligned(pool, layer_idx, index, valid, rows.batch, width, pool.model_dtype(layer_idx))


def with_history(
    pool: BlockPool, rows: Rows, key: torch.Tensor, value: torch.Tensor, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored history (right-aligned, `[batch, num_kv_heads, seq_length, head_dim]`) followed by the new
    K/V `[batch, num_kv_heads, q_len, head_dim]`, without writing anything."""
    past = []
    for stored in stored_kv(pool, rows, layer_idx):
        if key.shape[0] != stored.shape[0]:  # generate repeated the prompt rows (num_return_sequences / num_beams)
            stored = stored.repeat_interleave(key.shape[0] // stored.shape[0], dim=0)
        past.append(stored.to(key.dtype))
    return torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)


def attention_weights(
    pool: BlockPool,
    rows: Rows,
    layer_idx: int,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    features: AttentionFeatures,
) -> torch.Tensor:
    """The attention probabilities of a layer's forward, laid out like `DynamicCache`'s (one column per
    column fed, padding included, zero there; sliding layers: the last `window - 1 + q_len` columns), for
    `output_attentions=True`. Read after the layer's write.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        attention_mask: bool `[batch, columns]` padding mask or None.
        features: the layer's scale, window, soft-capping and sinks.

    Returns:
        `[batch, num_heads, q_len, columns]` in the query's dtype.
    """
    sliding_window = features.sliding_window
    keys = stored_kv(pool, rows, layer_idx)[0]  # right-aligned: [batch, num_kv_heads, columns, head_dim]
    batch, _, width, _ = keys.shape
    q_len = query.shape[2]
    if attention_mask is None:
        real = torch.ones(batch, width, dtype=torch.bool, device="cpu")
    else:
        real = attention_mask[:, -width:].cpu()
    counts = real.sum(dim=1)
    if not bool((real == (torch.arange(width, device="cpu")[None, :] >= (width - counts)[:, None])).all()):
        placed = torch.zeros_like(keys)  # a row's i-th stored token sits at its i-th real column
        for b in range(batch):
            n = int(counts[b])
            placed[b, :, real[b].nonzero().squeeze(1).to(keys.device)] = keys[b, :, width - n :]
        keys = placed
    q_pos = torch.arange(width - q_len, width, device="cpu")[:, None]
    k_pos = torch.arange(width, device="cpu")[None, :]
    allowed = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window if sliding_window is not None else True)
    allowed = real[:, None, None, :] & allowed[None, None]
    allowed = (allowed | ~allowed.any(dim=-1, keepdim=True)).to(query.device)
    probs = attention_probs(query, keys.to(query.dtype), allowed, False, features.scale, features.softcap,
                            features.sinks)
    probs = probs.masked_fill(~real[:, None, None, :].to(query.device), 0.0).to(query.dtype)
    if sliding_window is not None:  # a sliding layer of DynamicCache keeps window - 1 past columns
        probs = probs[..., -min(width, sliding_window - 1 + q_len) :]
    return probs
