"""Attention of many query rows over K/V that several rows share: an encoder-decoder's cross-attention, whose
K/V are stored once per request (`cache/cross.py`) while the request's beams and samples are rows of the batch.

The rows of one entry are attended together: their queries are laid one after another as the queries of a
single sequence over the entry's K/V (`[1, num_heads, rows * q_len, head_dim]`), so the shared K/V are read in
place, never expanded or copied per row. When every entry has the same number of rows, all entries go through
one SDPA call (`[num_entries, num_heads, rows * q_len, head_dim]`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_shared(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_entries: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
    want_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Non-causal attention of each row's queries over its entry's K/V.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        keys: `[num_entries, num_kv_heads, kv_len, head_dim]`; `num_heads` a multiple of `num_kv_heads`.
        values: `[num_entries, num_kv_heads, kv_len, head_dim_v]`.
        row_entries: int64 `[batch]`: the entry each row reads.
        mask: None (every key visible), `[batch, kv_len]` bool or 0/1 (True / 1 = real key), or a 4D mask
            `[batch, 1, q_len, kv_len]`, bool (True = visible) or additive float.
        scale: multiplier of `q·k`.
        bias: additive float `[1 or batch, num_heads, q_len, kv_len]` (T5's position bias), or None.
        want_weights: also return the attention probabilities.

    Returns:
        `(out [batch, q_len, num_heads, head_dim_v], probabilities [batch, num_heads, q_len, kv_len] or None)`.
    """
    batch, num_heads, q_len, _ = query.shape
    num_entries, _, kv_len, _ = keys.shape
    additive = _additive_mask(mask, bias, batch, num_heads, q_len, kv_len, query.dtype, query.device)
    counts = torch.bincount(row_entries, minlength=num_entries).tolist()
    order = torch.argsort(row_entries, stable=True)
    in_order = bool(torch.equal(order, torch.arange(batch, device=order.device)))
    if not in_order:  # rows of one entry next to each other
        query = query.index_select(0, order)
        additive = additive.index_select(0, order) if additive is not None and additive.shape[0] > 1 else additive
    if len(set(counts)) == 1:  # every entry has as many rows: one call
        out, probs = _attend_entries(query, keys, values, additive, scale, counts[0], want_weights)
    else:
        outs, all_probs, start = [], [], 0
        for entry, count in enumerate(counts):
            if not count:
                continue
            rows = slice(start, start + count)
            part = additive[rows] if additive is not None and additive.shape[0] > 1 else additive
            o, p = _attend_entries(
                query[rows], keys[entry : entry + 1], values[entry : entry + 1], part, scale, count, want_weights
            )
            outs.append(o)
            all_probs.append(p)
            start += count
        out = torch.cat(outs)
        probs = torch.cat(all_probs) if want_weights else None
    if not in_order:
        restore = torch.argsort(order)
        out = out.index_select(0, restore)
        probs = probs.index_select(0, restore) if probs is not None else None
    return out, probs


def _attend_entries(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    additive: torch.Tensor | None,
    scale: float,
    rows_per_entry: int,
    want_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows `[e * rows_per_entry, (e + 1) * rows_per_entry)` of `query` read entry e of `keys` / `values`.

    Args:
        query: `[num_entries * rows_per_entry, num_heads, q_len, head_dim]`.
        keys, values: `[num_entries, num_kv_heads, kv_len, head_dim]` and `[..., head_dim_v]`.
        additive: float `[1 or rows, 1 or num_heads, q_len, kv_len]`, or None.

    Returns:
        `(out [rows, q_len, num_heads, head_dim_v], probabilities [rows, num_heads, q_len, kv_len] or None)`.
    """
    rows, num_heads, q_len, head_dim = query.shape
    num_entries, num_kv_heads, kv_len, _ = keys.shape
    n = rows_per_entry
    # [entries, n, H, q, D] -> [entries, H, n * q, D]: an entry's rows as one sequence of queries
    q = (
        query.view(num_entries, n, num_heads, q_len, head_dim)
        .transpose(1, 2)
        .reshape(num_entries, num_heads, n * q_len, head_dim)
    )
    mask = None
    if additive is not None:
        full = additive.expand(rows, -1, q_len, kv_len) if additive.shape[0] == 1 else additive
        mask = full.reshape(num_entries, n, full.shape[1], q_len, kv_len).transpose(1, 2)
        mask = mask.reshape(num_entries, full.shape[1], n * q_len, kv_len)
    probs = None
    if want_weights:
        k = keys.repeat_interleave(num_heads // num_kv_heads, dim=1) if num_kv_heads != num_heads else keys
        v = values.repeat_interleave(num_heads // num_kv_heads, dim=1) if num_kv_heads != num_heads else values
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores + mask.float()
        weights = scores.softmax(dim=-1)
        out = torch.matmul(weights, v.float()).to(query.dtype)
        probs = (
            weights.view(num_entries, num_heads, n, q_len, kv_len)
            .transpose(1, 2)
            .reshape(rows, num_heads, q_len, kv_len)
        )
        probs = probs.to(query.dtype)
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=num_kv_heads != num_heads
        )
    head_dim_v = out.shape[-1]
    # [entries, H, n * q, Dv] -> [rows, q, H, Dv]
    out = out.view(num_entries, num_heads, n, q_len, head_dim_v).permute(0, 2, 3, 1, 4)
    return out.reshape(rows, q_len, num_heads, head_dim_v), probs


def _additive_mask(
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    batch: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """`mask` and `bias` as one additive float mask `[1 or batch, 1 or num_heads, q_len, kv_len]`, or None."""
    additive = None
    if mask is not None:
        mask = mask.to(device)
        if mask.dim() == 2:  # a padding mask, bool or 0/1 ints (T5Gemma hands its encoder's attention_mask on as is)
            mask = mask[:, None, None, -kv_len:].bool()
        mask = mask[..., -kv_len:]
        if mask.dtype == torch.bool:
            visible = mask | ~mask.any(dim=-1, keepdim=True)  # rows with nothing visible stay finite
            additive = torch.zeros(visible.shape, dtype=dtype, device=device)
            additive = additive.masked_fill(~visible, torch.finfo(dtype).min)
        else:
            additive = mask.to(dtype)
        additive = additive.expand(-1, -1, q_len, -1) if additive.shape[2] == 1 else additive
    if bias is not None:
        bias = bias.to(device=device, dtype=dtype)[..., -kv_len:]
        additive = bias if additive is None else additive + bias
    if additive is not None and additive.shape[0] not in (1, batch):
        raise ValueError(f"a cross-attention mask of batch {additive.shape[0]} for {batch} rows.")
    return additive
