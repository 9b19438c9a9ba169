"""One layer of a `"paged"` forward: write its new K/V and attend, on the path `backend.py` chooses.

The first layer of each group decides the path and its inputs once per forward (`_torch_route`). Before
that, it asks whether the forward is one row's decode step over consecutive blocks on the PyTorch path
(batch-1 generation's steady state, `_one_row_step`, carried over from the step before while the row's
tokens follow each other in consecutive slots): then that layer and every later one of the group take the
short way (`OneRowDecode`): write the token into its slot view, attend over one strided view of the row's
slots, with only the checks that keep that exact. A decided step has the pool stack the group's layers into one
slab first (`BlockPool.consolidate`) where it can; a slab's views for all of its layers are made at once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..backend import attention_backend
from ..memory.rotation import from_storage, kv_to_storage, rotates, to_storage
from ..memory.slots import Strided, slots_strided
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import consecutive_start, torch_inputs, write_index
from .triton_path import triton_attention, triton_write

if TYPE_CHECKING:
    from .plan import ForwardPlan
    from ..memory.pool import BlockPool
    from ..memory.slab import Slab


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
    if sliding_window is None and softcap is None and sinks is None:
        one_row = plan.memo_get((ONE_ROW, group_id))
        if one_row is None:
            one_row = plan.memo((ONE_ROW, group_id), lambda: _one_row_step(pool, plan, group_id, layer_idx, query))
        out = None if one_row is NOT_ONE_ROW else _one_row_decode(pool, one_row, layer_idx, query, key, value, scale)
        if out is not None:
            return out
    rotate = rotates(pool.kv_format)
    if rotate:  # the pool stores K/V @ R: attend in that space, rotate the output back (rotation.py)
        query, (key, value) = to_storage(query), kv_to_storage(pool.kv_format, key, value)
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


#: Memo key of a forward's `OneRowDecode` for a group.
ONE_ROW = "one_row_decode"


@dataclass(slots=True)
class ShortLayer:
    """What the short way checked once of one layer's pool tensors (`[num_blocks, block_size, num_kv_heads,
    head_dim]` and `[..., head_dim_v]`: contiguous, on the step's device, one dtype). It holds while the pool's
    `storage_version` is `version` (the pool made or grew no layer's tensors since); the tensors are held weakly,
    so a grown pool's old tensors are freed at once.

    Attributes:
        expected: what a layer call must bring: (K shape `[1, num_kv_heads, 1, head_dim]`, V shape `[...,
            head_dim_v]`, K dtype, V dtype, query dtype, query device).
        capacity: slots of the tensors.
        views_key: (num_kv_heads, head_dim, head_dim_v, K storage offset, V storage offset): the step's views
            (`OneRowDecode.views`) are made once per key.
        position: the layer's place in the slab its tensors are views of (`BlockPool.consolidate`), or None.
    """

    key_cache: weakref.ref
    value_cache: weakref.ref
    version: int
    expected: tuple
    capacity: int
    views_key: tuple[int, int, int, int, int]
    position: int | None


@dataclass(slots=True)
class OneRowDecode:
    """One row's decode step on the PyTorch path, its blocks consecutive: the same for every layer of a group.

    Attributes:
        device: where the path was chosen (a layer elsewhere takes the general way).
        slot: the new token's slot.
        first: the first slot the row reads; it reads `count` slots, the new token's last.
        layers: per layer, its `ShortLayer` (`accept_layer`): shared by the steps carried over from this one, so
            a layer's pool tensors are checked once, not every step.
    """

    device: torch.device
    slot: int
    first: int
    count: int
    layers: dict[int, ShortLayer] = field(default_factory=dict)
    _views: dict[tuple[int, ...], tuple[Strided, Strided, Strided, Strided]] = field(default_factory=dict)
    _slab: Slab | None = None
    _slab_views: tuple[tuple[torch.Tensor, ...], ...] = ()
    _slab_left: int = 0

    def layer_views(self, pool: BlockPool, layer_idx: int, layer: ShortLayer) -> tuple[torch.Tensor, ...]:
        """Views of a layer's K and V for this step: the new token's slot in K (`[1, num_kv_heads, 1, head_dim]`),
        the row's slots in K (`[1, num_kv_heads, count, head_dim]`), and the same two of V. A layer of a slab takes
        them from views made for all of its slab's layers at once, which the step lets go after the slab's last
        layer (it never keeps a slab's storage alive for later); any other layer makes its own. The caller holds
        `pool.lock` and has checked that `layer` holds (`ShortLayer.version`)."""
        position = layer.position
        if position is None:
            k_slot, k_rows, v_slot, v_rows = self.views(layer.views_key)
            key_cache, value_cache = layer.key_cache(), layer.value_cache()
            return (key_cache.as_strided(*k_slot), key_cache.as_strided(*k_rows), value_cache.as_strided(*v_slot),
                    value_cache.as_strided(*v_rows))  # fmt: skip
        slab = pool.slab_of(layer_idx)
        if self._slab is not slab:
            self._slab, self._slab_left = slab, len(slab.layers)
            self._slab_views = (*slab.slot_views(self.slot, 1), *slab.slot_views(self.first, self.count))
        k_slots, v_slots, k_rows, v_rows = self._slab_views
        self._slab_left -= 1
        if not self._slab_left:
            self._slab, self._slab_views = None, ()
        return k_slots[position], k_rows[position], v_slots[position], v_rows[position]

    def views(self, views_key: tuple[int, int, int, int, int]) -> tuple[Strided, Strided, Strided, Strided]:
        """`as_strided` arguments (`memory.slots.slots_strided`, storage offsets included) of the new token's slot
        and of the row's slots, in a layer's K and in its V (`ShortLayer.views_key`): made once per step and key."""
        found = self._views.get(views_key)
        if found is None:
            num_kv_heads, head_dim, head_dim_v, k_offset, v_offset = views_key
            found = self._views[views_key] = (
                slots_strided(num_kv_heads, head_dim, self.slot, 1, k_offset),
                slots_strided(num_kv_heads, head_dim, self.first, self.count, k_offset),
                slots_strided(num_kv_heads, head_dim_v, self.slot, 1, v_offset),
                slots_strided(num_kv_heads, head_dim_v, self.first, self.count, v_offset),
            )
        return found

    def accept_layer(self, layer_idx: int, pool: BlockPool) -> ShortLayer | None:
        """Accepts a layer's pool tensors for the short way: their `ShortLayer`, checked and kept in `layers`; None
        when the short way cannot read them (not stored yet, another device, not contiguous, K and V of two
        dtypes). The caller holds `pool.lock`."""
        stored = pool.layer_storage(layer_idx)
        if stored is None:
            return None
        key_cache, value_cache = stored
        layer = self.layers.get(layer_idx)
        if layer is not None and layer.key_cache() is key_cache and layer.value_cache() is value_cache:
            layer.version = pool.storage_version  # another layer's tensors changed, not these
            return layer
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        if not (
            key_cache.device == self.device and value_cache.device == self.device and key_cache.dtype is value_cache.dtype
            and key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.shape[:3] == key_cache.shape[:3]
        ):  # fmt: skip
            return None
        head_dim_v, dtype, slab = value_cache.shape[3], key_cache.dtype, pool.slab_of(layer_idx)
        layer = self.layers[layer_idx] = ShortLayer(
            weakref.ref(key_cache), weakref.ref(value_cache), pool.storage_version,
            ((1, num_kv_heads, 1, head_dim), (1, num_kv_heads, 1, head_dim_v), dtype, dtype, dtype, self.device),
            num_blocks * block_size,
            (num_kv_heads, head_dim, head_dim_v, key_cache.storage_offset(), value_cache.storage_offset()),
            None if slab is None else slab.position(layer_idx),
        )  # fmt: skip
        return layer


#: `_one_row_step`'s answer when a forward's group does not qualify.
NOT_ONE_ROW = ("not one row",)


def _one_row_step(
    pool: BlockPool, plan: ForwardPlan, group_id: int, layer_idx: int, query: torch.Tensor
) -> OneRowDecode | tuple:
    """The group's `OneRowDecode` in this forward (decided on its first layer), or `NOT_ONE_ROW`: one row, one new
    token after some history, blocks consecutive, an unquantized pool that already holds the layer, and the
    PyTorch path chosen for this device (the Triton path takes its calls otherwise).

    When the previous forward was the same row's `OneRowDecode` and this token goes into the slot right after its
    token, the step is carried over one token on: the row's earlier blocks are unchanged (a table changes only
    by growing, by copying its partial last block, which takes a new block id, or by losing tokens), so its slots
    are still consecutive and the path is the one chosen for them; this costs the same at any context length."""
    group = plan.groups[group_id]
    if (
        pool.kv_format is not None or plan.q_len != 1 or len(plan.seq_lens) != 1 or plan.query_lens[0] != 1
        or plan.seq_lens[0] < 2 or plan.column_order is not None or len(group.write_slots) != 1
    ):  # fmt: skip
        return NOT_ONE_ROW
    seq_len, slot = plan.seq_lens[0], group.write_slots[0]
    carried = None if plan.previous is None else plan.previous.memo_get((ONE_ROW, group_id))
    if type(carried) is OneRowDecode and slot == carried.slot + 1 and seq_len == carried.count + 1:
        return OneRowDecode(carried.device, slot, carried.first, seq_len, carried.layers)
    stored = pool.layer_storage(layer_idx)
    if stored is None or _backend(plan, query, *stored, None, None, None) == "triton":
        return NOT_ONE_ROW
    first = consecutive_start(group.tables[0][: -(-seq_len // plan.block_size)])
    if first is None or slot != first * plan.block_size + seq_len - 1:
        return NOT_ONE_ROW
    pool.consolidate(group_id)  # (once per run of steps: a no-op once the group is one slab, or cannot be)
    return OneRowDecode(query.device, slot, first * plan.block_size, seq_len)


def _one_row_decode(
    pool: BlockPool,
    step: OneRowDecode,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """`write_and_attend` of a layer in a `OneRowDecode` step (`[1, q_len, num_heads, head_dim_v]`), or None when
    this layer's call differs from what the step was decided for (the general way then takes it)."""
    if torch.is_grad_enabled():
        return None
    with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
        layer = step.layers.get(layer_idx)
        if layer is None or layer.version != pool.storage_version:
            layer = step.accept_layer(layer_idx, pool)
            if layer is None:
                return None
        if (
            (key.shape, value.shape, key.dtype, value.dtype, query.dtype, query.device) != layer.expected
            or step.slot >= layer.capacity
        ):
            return None
        k_slot, k_rows, v_slot, v_rows = step.layer_views(pool, layer_idx, layer)
        torch._foreach_copy_((k_slot, v_slot), (key, value))
    return F.scaled_dot_product_attention(query, k_rows, v_rows, scale=scale, enable_gqa=True).transpose(1, 2)


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
    Reordered columns, and padding queries after a real token (`gapped`: e.g. a chunk of right padding), take the
    PyTorch path: only it gives padding queries what transformers' masks show them (the kernels give them zeros,
    which is what a left-padded row's padding gets, and nobody reads)."""
    padding_after_real = plan.gapped and min(plan.query_lens, default=plan.q_len) < plan.q_len
    if plan.column_order is None and not padding_after_real:  # (the backend is asked only then)
        if _backend(plan, query, key_cache, value_cache, sliding_window, softcap, sinks) == "triton":
            return TRITON
    return torch_inputs(plan, group_id, sliding_window, query.device)


def _backend(
    plan: ForwardPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> str:
    """`attention_backend` of a call, once per forward and everything it reads of the call (the one-row check
    and the route of a group's first layer ask the same question)."""
    key = ("backend", query.shape, query.stride(-1), query.dtype, query.device, key_cache.shape[-1], key_cache.dtype,
           key_cache.device, value_cache.shape[-1], value_cache.dtype, value_cache.device, sliding_window, softcap,
           None if sinks is None else sinks.numel())  # fmt: skip
    found = plan.memo_get(key)
    if found is None:
        found = plan.memo(key, lambda: attention_backend(
            query, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks))  # fmt: skip
    return found


def write_gathered(pool: BlockPool, plan: ForwardPlan, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Writes one layer's new K/V (`[batch, num_kv_heads, q_len, head_dim]` and `[..., head_dim_v]`) into their
    slots with the PyTorch path, for a cache that reads its K/V back gathered (rotated first if the pool rotates)."""
    with pool.lock:
        key_cache, value_cache = pool.storage(layer_idx, key, value.shape[-1])
        key, value = kv_to_storage(pool.kv_format, key, value)
        index, slots, single = write_index(plan, pool.layout.group_of(layer_idx), key.device)
        torch_write(key_cache, value_cache, key, value, index, slots, pool.scales(layer_idx), single_slot=single)
