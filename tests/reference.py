"""Readable float32 reference for paged attention, and random paged pools for tests.

Shared by the Triton kernel tests and the CPU torch path tests; keep the signature stable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def seeded(seed: int) -> torch.Generator:
    """A random generator seeded with `seed`, on torch's default device (the GPU in a session that runs the kernel
    tests there, `HF_PAGED_TEST_DEVICE`)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of left-padded queries over a paged KV cache, in float32, one row at a time.

    Args:
        query: `[batch, q_len, num_heads, head_dim]`; row b's `query_lens[b]` real tokens are the
            last ones on the q axis.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and `[..., head_dim_v]`
            (`head_dim_v` differs from `head_dim` in multi-latent attention).
        block_tables: int `[batch, max_blocks_per_seq]`.
        seq_lens: int `[batch]` tokens stored per row, including the new ones.
        query_lens: int `[batch]`.
        scale, sliding_window, softcap, sinks: as in `hf_paged.kernels.paged_attention`.

    Returns:
        float32 `[batch, q_len, num_heads, head_dim_v]` on the query's device (computed on the CPU); padding
        query positions are zeros.
    """
    with torch.device("cpu"):  # (a test session on a GPU sets a default device: `HF_PAGED_TEST_DEVICE`)
        out = _reference_on_cpu(query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale=scale,
                                sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return out.to(query.device)


def _reference_on_cpu(query, key_cache, value_cache, block_tables, seq_lens, query_lens, *, scale, sliding_window,
                      softcap, sinks) -> torch.Tensor:
    batch, q_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, q_len, num_heads, value_cache.shape[-1], dtype=torch.float32)
    for b in range(batch):
        seq_len, query_len = int(seq_lens[b]), int(query_lens[b])
        if query_len == 0:
            continue
        positions = torch.arange(seq_len)
        slots_block = block_tables[b].long().cpu()[positions // block_size]
        keys = key_cache.cpu()[slots_block, positions % block_size].float()  # [seq_len, kv_heads, D]
        values = value_cache.cpu()[slots_block, positions % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
        values = values.repeat_interleave(group, dim=1)
        q = query[b, q_len - query_len :].cpu().float()  # [query_len, num_heads, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = (seq_len - query_len + torch.arange(query_len))[:, None]
        visible = positions[None, :] <= q_pos
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.cpu().float()[:, None, None].expand(num_heads, query_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[b, q_len - query_len :] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


@dataclass(slots=True)
class PagedInputs:
    """Random inputs for paged attention; tensors live on `device`."""

    query: torch.Tensor  # [batch, q_len, num_heads, head_dim], a transposed view of [B, H, Q, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max_blocks_per_seq], unused entries -1
    seq_lens: torch.Tensor  # int32 [batch]
    query_lens: torch.Tensor  # int32 [batch]


def make_paged_inputs(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    q_len: int | None = None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    extra_blocks: int = 7,
    seed: int = 0,
) -> PagedInputs:
    """Random pools with shuffled, non-contiguous block tables; the last pool block is always used
    (so the largest block id appears), and table entries past a row's length are -1. Made on the CPU from `seed`,
    then moved to `device` (by default torch's default device)."""
    device = torch.get_default_device() if device is None else device
    with torch.device("cpu"):
        return _make_paged_inputs(seq_lens, query_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                  device, extra_blocks, seed)


def _make_paged_inputs(seq_lens, query_lens, q_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                       extra_blocks, seed) -> PagedInputs:
    gen = torch.Generator().manual_seed(seed)
    q_len = q_len if q_len is not None else max(query_lens)
    blocks_per_row = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    perm = torch.cat([perm[perm == num_blocks - 1], perm[perm != num_blocks - 1]])  # largest id first
    width = max(max(blocks_per_row), 1)
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_row):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, q_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    return PagedInputs(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
    )
