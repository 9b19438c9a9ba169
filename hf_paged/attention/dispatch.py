"""One layer of a `"paged"` forward: write its new K/V and attend, on the path `backend.py` chooses.

The first layer of each group decides, once per forward and call signature (`CallSignature`), whether the Triton
path takes the call or which inputs the PyTorch path uses, and keeps that in the group's `GroupInputs`; every later
layer of the group reads it. A single row's decode step on the PyTorch path does not come here: `PagedCache.attend`
asks the one fast path first (`fast_decode.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..backend import attention_backend
from ..memory.rotation import from_storage, kv_to_storage, rotates, to_storage
from .plan import CallSignature
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import TorchInputs, torch_inputs, write_index
from .triton_path import triton_attention, triton_write

if TYPE_CHECKING:
    from ..memory.pool import BlockPool
    from .plan import AttentionFeatures, ForwardPlan, GroupInputs


def write_and_attend(
    pool: BlockPool,
    plan: ForwardPlan,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    features: AttentionFeatures,
) -> torch.Tensor:
    """Writes one layer's new K/V into their slots and attends `query` over each row's blocks, through the
    Triton path where it takes the call, else the PyTorch path.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`.
        key, value: `[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]` this step's K/V.
        features: the layer's scale, window, soft-capping and sinks.

    Returns:
        `[batch, q_len, num_heads, head_dim_v]`.
    """
    return _attend(pool, plan, layer_idx, query, key, value, features, write=True)


def attend_stored(
    pool: BlockPool,
    plan: ForwardPlan,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    features: AttentionFeatures,
) -> torch.Tensor:
    """Attends `query` over the blocks of `layer_idx`, which already wrote this forward's K/V (`key`, `value`, as
    `write_and_attend` took them): a layer that reuses another layer's K/V. Same shapes as `write_and_attend`."""
    return _attend(pool, plan, layer_idx, query, key, value, features, write=False)


def _attend(
    pool: BlockPool,
    plan: ForwardPlan,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    features: AttentionFeatures,
    write: bool,
) -> torch.Tensor:
    group_id = pool.layout.group_of(layer_idx)
    inputs = plan.groups[group_id].inputs_on(query.device)
    rotate = rotates(pool.kv_format)
    if rotate:  # the pool stores K/V @ R: attend in that space, rotate the output back (rotation.py)
        query, (key, value) = to_storage(query), kv_to_storage(pool.kv_format, key, value)
    with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
        stored = pool.storage_for_write(layer_idx, key, value.shape[-1]) if write else pool.layer_storage(layer_idx)
        key_cache, value_cache = stored
        scales = pool.scales(layer_idx)
        route = _route(plan, group_id, inputs, query, key_cache, value_cache, features)
        if write and route is None:
            triton_write(plan, group_id, key, value, key_cache, value_cache, scales)
        elif write:
            torch_write(key_cache, value_cache, key, value, route.write_index, route.write_slots, scales,
                        single_slot=route.single_slot)
    if route is None:
        out = triton_attention(plan, group_id, query, key_cache, value_cache, features, scales=scales)
    else:
        out = torch_paged_attention(
            query, key, value, key_cache, value_cache, route.meta, features.scale, features.softcap, features.sinks,
            scales,
        )
    return from_storage(out) if rotate else out


def _signature(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, features: AttentionFeatures
) -> CallSignature:
    return CallSignature(
        query.shape, query.stride(-1) == 1, query.dtype, key_cache.dtype, key_cache.shape[-1], value_cache.shape[-1],
        features.sliding_window, features.softcap, None if features.sinks is None else features.sinks.numel(),
    )


def _route(
    plan: ForwardPlan,
    group_id: int,
    inputs: GroupInputs,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    features: AttentionFeatures,
) -> TorchInputs | None:
    """The PyTorch path's inputs for the call, or None where the Triton path takes it: chosen once per forward,
    group and call signature. Reordered columns, and padding queries after a real token (`gapped`: e.g. a chunk
    of right padding), take the PyTorch path: only it gives padding queries what transformers' masks show them
    (the kernels give them zeros, which is what a left-padded row's padding gets, and nobody reads)."""
    signature = _signature(query, key_cache, value_cache, features)
    if signature in inputs.routes:
        return inputs.routes[signature]
    padding_after_real = plan.gapped and min(plan.query_lens, default=plan.q_len) < plan.q_len
    triton = plan.column_order is None and not padding_after_real and _backend(query, key_cache, value_cache, features) == "triton"
    route = None if triton else torch_inputs(plan, group_id, features.sliding_window, query.device)
    inputs.routes[signature] = route
    return route


def _backend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, features: AttentionFeatures) -> str:
    return attention_backend(
        query, key_cache, value_cache, sliding_window=features.sliding_window, softcap=features.softcap,
        sinks=features.sinks,
    )


def write_gathered(pool: BlockPool, plan: ForwardPlan, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Writes one layer's new K/V (`[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]`) into their
    slots with the PyTorch path, for a cache that reads its K/V back gathered (rotated first if the pool rotates)."""
    with pool.lock:
        key_cache, value_cache = pool.storage_for_write(layer_idx, key, value.shape[-1])
        key, value = kv_to_storage(pool.kv_format, key, value)
        index, slots, single = write_index(plan, pool.layout.group_of(layer_idx), key.device)
        torch_write(key_cache, value_cache, key, value, index, slots, pool.scales(layer_idx), single_slot=single)
