"""The Triton path of the `"paged"` attention: cache-write and paged-attention kernels of `hf_paged.kernels`."""

from __future__ import annotations

import torch

from .plan import ForwardPlan


def triton_attend(
    plan: ForwardPlan,
    group_id: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Writes this step's K/V into their slots and attends over the blocks, in two kernel launches.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        key, value: `[batch, num_kv_heads, q_len, head_dim]`.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.

    Returns:
        `[batch, q_len, num_heads, head_dim]`.
    """
    from hf_paged.kernels import paged_attention, write_kv_cache  # noqa: PLC0415

    device = query.device
    write_kv_cache(
        key=key.transpose(1, 2),
        value=value.transpose(1, 2),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=plan.slot_mapping(group_id, device),
    )
    block_tables, seq_lens, query_lens = plan.kernel_inputs(group_id, device)
    return paged_attention(
        query=query.transpose(1, 2),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_lens=query_lens,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )
