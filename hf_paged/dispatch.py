"""One layer of a `"paged"` forward: write its new K/V and attend, on the path `backend.py` chooses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backend import attention_backend
from .rotation import from_storage, kv_to_storage, rotates, to_storage
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import torch_inputs, write_index
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
    rotate = rotates(pool.kv_format)
    if rotate:  # the pool stores K/V @ R: attend in that space, rotate the output back (rotation.py)
        query, (key, value) = to_storage(query), kv_to_storage(pool.kv_format, key, value)
    group_id = pool.layout.group_of(layer_idx)
    with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
        key_cache, value_cache = pool.storage(layer_idx, key, value.shape[-1])
        scales = pool.scales(layer_idx)
        # The path depends on the call's shapes, dtypes, device and features only: chosen once per forward, with
        # the PyTorch path's inputs for the group (None on the Triton path).
        route_key = (group_id, query.shape, query.stride(-1), query.dtype, query.device, key_cache.dtype,
                     value_cache.shape[-1], sliding_window, softcap, None if sinks is None else sinks.numel())  # fmt: skip
        torch_route = plan.memo_get(route_key)
        if torch_route is None:
            torch_route = plan.memo(route_key, lambda: _torch_route(plan, group_id, query, key_cache, value_cache,
                                                                    sliding_window, softcap, sinks))  # fmt: skip
        if torch_route is TRITON:
            triton_write(plan, group_id, key, value, key_cache, value_cache, scales)
        else:
            torch_write(key_cache, value_cache, key, value, *torch_route[:2], scales, single_slot=torch_route[2])
    if torch_route is TRITON:
        out = triton_attention(
            plan, group_id, query, key_cache, value_cache, scale, sliding_window, softcap, sinks, scales=scales
        )
    else:
        out = torch_paged_attention(
            query, key, value, key_cache, value_cache, torch_route[3], scale, softcap, sinks, scales
        )
    return from_storage(out) if rotate else out


#: `_torch_route`'s answer when the Triton path takes the call.
TRITON = ("triton",)


def _torch_route(
    plan: ForwardPlan,
    group_id: int,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple:
    """`TRITON`, or the PyTorch path's `(write_index, write_slots, single_slot, meta)` for the group (`torch_inputs`).
    Reordered columns take the PyTorch path: only it gives padding queries what transformers' masks show them."""
    if plan.column_order is None and attention_backend(
        query, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks
    ) == "triton":  # fmt: skip
        return TRITON
    return torch_inputs(plan, group_id, sliding_window, query.device)


def write_gathered(pool: BlockPool, plan: ForwardPlan, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Writes one layer's new K/V (`[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]`) into their
    slots with the PyTorch path, for a cache that reads its K/V back gathered (rotated first if the pool rotates)."""
    with pool.lock:
        key_cache, value_cache = pool.storage(layer_idx, key, value.shape[-1])
        key, value = kv_to_storage(pool.kv_format, key, value)
        index, slots, single = write_index(plan, pool.layout.group_of(layer_idx), key.device)
        torch_write(key_cache, value_cache, key, value, index, slots, pool.scales(layer_idx), single_slot=single)
