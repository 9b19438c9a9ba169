"""One layer of a `"paged"` forward: write its new K/V and attend, on the path `backend.py` chooses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backend import attention_backend
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import torch_inputs
from .triton_path import triton_attention, triton_write

if TYPE_CHECKING:
    from .plan import ForwardPlan
    from .pool import BlockPool


def write_and_attend(
    pool: BlockPool,
    plan: ForwardPlan,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Writes one layer's new K/V into their slots and attends `query` over each row's blocks, through the
    Triton path where it takes the call, else the PyTorch path.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        key, value: `[batch, num_kv_heads, q_len, head_dim]` this step's K/V.

    Returns:
        `[batch, q_len, num_heads, head_dim]`.
    """
    group_id = pool.layout.group_of(layer_idx)
    device = query.device
    with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
        key_cache, value_cache = pool.storage(layer_idx, key, value.shape[-1])
        scales = pool.scales(layer_idx)
        # Reordered columns: only the PyTorch path gives padding queries what transformers' masks show them.
        # The choice depends on the call's shapes, dtypes, device and features only: made once per forward.
        use_triton = plan.column_order is None and plan.memo(
            ("backend", query.shape, query.stride(-1), query.dtype, device, key_cache.dtype, value_cache.shape[-1],
             sliding_window, softcap, None if sinks is None else sinks.numel()),
            lambda: attention_backend(
                query, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks
            ) == "triton",
        )  # fmt: skip
        if use_triton:
            triton_write(plan, group_id, key, value, key_cache, value_cache, scales)
        else:
            index, slots, meta = torch_inputs(plan, group_id, sliding_window, device)
            torch_write(key_cache, value_cache, key, value, index, slots, scales)
    if use_triton:
        return triton_attention(
            plan, group_id, query, key_cache, value_cache, scale, sliding_window, softcap, sinks, scales=scales
        )
    return torch_paged_attention(query, key, value, key_cache, value_cache, meta, scale, softcap, sinks, scales)
