"""The Triton path of the `"paged"` attention: the kernels of `hf_paged.kernels` fed from a `ForwardPlan`.

Never crashes a user: a kernel that fails to compile or launch (or rejects its inputs) is recorded in
`hf_paged.backend` (later calls go straight to the PyTorch path), warned about once, and this call is
computed by the PyTorch path instead.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import torch

from ..backend import is_fallback_error, triton_failed
from .host_ints import device_ints, host_ints, to_device
from ..memory.quant import dequantize
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import torch_inputs, write_index

if TYPE_CHECKING:
    from .plan import AttentionFeatures, ForwardPlan


def slot_mapping(plan: ForwardPlan, group_id: int, device: torch.device) -> torch.Tensor:
    """int64 `[batch, q_len]` slots for the cache-write kernel, -1 where nothing is written (once per forward)."""
    inputs = plan.groups[group_id].inputs_on(device)
    if inputs.slot_mapping is None:
        group, batch = plan.groups[group_id], len(plan.seq_lens)
        if len(group.write_slots) == batch * plan.q_len:  # every column is written (no padding, no shared rows)
            inputs.slot_mapping = device_ints(group.write_slots, device).view(batch, plan.q_len)
        else:
            flat = torch.full((batch * plan.q_len,), -1, dtype=torch.int64, device="cpu")
            if group.write_rows:  # (padding columns and rows that share an identical row's blocks stay -1)
                flat[host_ints(group.write_rows)] = host_ints(group.write_slots)
            inputs.slot_mapping = to_device(flat, device).view(batch, plan.q_len)
    return inputs.slot_mapping


def kernel_inputs(plan: ForwardPlan, group_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(block_tables int32 [batch, max_blocks], seq_lens int32 [batch], query_lens int32 [batch])` of a group,
    -1 past each row's blocks (once per forward, in one copy to the device)."""
    inputs = plan.groups[group_id].inputs_on(device)
    if inputs.kernel is None:
        tables, batch = plan.groups[group_id].tables, len(plan.seq_lens)
        width = max(1, max(len(t) for t in tables))
        padded = (t if len(t) == width else t + [-1] * (width - len(t)) for t in tables)
        flat = to_device(host_ints(chain(*padded, plan.seq_lens, plan.query_lens), torch.int32), device)
        size = batch * width
        inputs.kernel = flat[:size].view(batch, width), flat[size : size + batch], flat[size + batch :]
    return inputs.kernel


def launches(plan: ForwardPlan, group_id: int, device: torch.device) -> dict:
    """The kernels' `step` dict of a group: checked, laid-out launches that every later call with tensors of the
    same layouts repeats with its own (`kernels.launch.Repeatable`); taken over from the cache's previous forward,
    so a decode step lays its launches out again only when its tables change shape."""
    inputs = plan.groups[group_id].inputs_on(device)
    if inputs.launches is None:
        earlier = plan.previous_inputs(group_id, device)
        before = None if earlier is None else earlier.launches
        inputs.launches = {} if before is None else before
    return inputs.launches


def triton_write(
    plan: ForwardPlan,
    group_id: int,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Writes this step's K/V (`[batch, num_kv_heads, q_len, head_dim]`) into their slots of the pool
    tensors (`[num_blocks, block_size, num_kv_heads, head_dim]`); padding columns are skipped. A quantized
    pool's `scales` (`[num_blocks, block_size, num_kv_heads]` each) are written with them."""
    try:
        from hf_paged.kernels import write_kv_cache  # noqa: PLC0415

        write_kv_cache(
            key=key.transpose(1, 2),
            value=value.transpose(1, 2),
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slot_mapping(plan, group_id, key.device),
            key_scale=scales[0] if scales is not None else None,
            value_scale=scales[1] if scales is not None else None,
            step=launches(plan, group_id, key.device),
        )
    except Exception as error:  # noqa: BLE001 - never crash a user: write with PyTorch instead
        if not is_fallback_error(error):
            raise
        triton_failed(key, error, "cache write")
        index, slots, single = write_index(plan, group_id, key.device)
        torch_write(key_cache, value_cache, key, value, index, slots, scales, single_slot=single)


def _new_kv_from_pool(
    plan: ForwardPlan, group_id: int, cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """This step's K or V read back from the pool (`[batch, num_kv_heads, q_len, head_dim]` in `dtype`,
    dequantized with `scale` from a quantized pool; padding columns hold arbitrary values, which the PyTorch
    path masks)."""
    slots = slot_mapping(plan, group_id, cache.device).clamp(min=0)
    flat = cache.view(-1, cache.shape[2], cache.shape[3]).index_select(0, slots.view(-1))
    if scale is not None:
        flat = dequantize(flat, scale.view(-1, scale.shape[2]).index_select(0, slots.view(-1)), dtype)
    return flat.view(*slots.shape, *cache.shape[2:]).transpose(1, 2)


def triton_attention(
    plan: ForwardPlan,
    group_id: int,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    features: AttentionFeatures,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of `query` (`[batch, num_heads, q_len, head_dim]`) over each row's blocks.

    Args:
        features: the layer's scale, window, soft-capping and sinks.
        key, value: this step's K/V (`[batch, num_kv_heads, q_len, head_dim]`), used only if the call
            falls back to the PyTorch path (read back from the pool when not given).
        scales: a quantized pool's K and V scales (`[num_blocks, block_size, num_kv_heads]` each), or None.

    Returns:
        `[batch, q_len, num_heads, head_dim]`.
    """
    try:
        from hf_paged.kernels import paged_attention  # noqa: PLC0415

        block_tables, seq_lens, query_lens = kernel_inputs(plan, group_id, query.device)
        return paged_attention(
            query=query.transpose(1, 2),
            key_cache=key_cache,
            value_cache=value_cache,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_lens=query_lens,
            scale=features.scale,
            sliding_window=features.sliding_window,
            softcap=features.softcap,
            sinks=features.sinks,
            key_scale=scales[0] if scales is not None else None,
            value_scale=scales[1] if scales is not None else None,
            step=launches(plan, group_id, query.device),
        )
    except Exception as error:  # noqa: BLE001 - never crash a user: attend with PyTorch instead
        if not is_fallback_error(error):
            raise
        triton_failed(query, error, "paged attention")
    meta = torch_inputs(plan, group_id, features.sliding_window, query.device).meta
    if key is None or value is None:
        key_scale, value_scale = scales if scales is not None else (None, None)
        key = _new_kv_from_pool(plan, group_id, key_cache, key_scale, query.dtype)
        value = _new_kv_from_pool(plan, group_id, value_cache, value_scale, query.dtype)
    return torch_paged_attention(
        query, key, value, key_cache, value_cache, meta, features.scale, features.softcap, features.sinks, scales
    )
