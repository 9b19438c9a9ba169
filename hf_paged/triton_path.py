"""The Triton path of the `"paged"` attention: the kernels of `hf_paged.kernels` fed from a `ForwardPlan`."""

from __future__ import annotations

import torch

from .plan import ForwardPlan


def triton_write(
    plan: ForwardPlan,
    group_id: int,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> None:
    """Writes this step's K/V (`[batch, num_kv_heads, q_len, head_dim]`) into their slots of the pool
    tensors (`[num_blocks, block_size, num_kv_heads, head_dim]`); padding columns are skipped."""
    from hf_paged.kernels import write_kv_cache  # noqa: PLC0415

    write_kv_cache(
        key=key.transpose(1, 2),
        value=value.transpose(1, 2),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=plan.slot_mapping(group_id, key.device),
    )


def triton_attention(
    plan: ForwardPlan,
    group_id: int,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of `query` (`[batch, num_heads, q_len, head_dim]`) over each row's blocks.

    Returns:
        `[batch, q_len, num_heads, head_dim]`.
    """
    from hf_paged.kernels import paged_attention  # noqa: PLC0415

    block_tables, seq_lens, query_lens = plan.kernel_inputs(group_id, query.device)
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
