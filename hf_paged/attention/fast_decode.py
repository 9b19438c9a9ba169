"""The one fast path: a single row's decode step over consecutive blocks, on the PyTorch path.

Batch-1 generation spends almost all of its steps here: one new token per step, after a history stored in
blocks that follow each other in the pool (a growing pool hands out consecutive ids to a lone row). Such a step
needs no gather index, no mask and no write index: each layer copies its token's K/V into the slot after the
history and attends over one strided view of the row's slots. `FastDecode.decide` is the one entry condition,
asked once per forward and layer group by the group's first layer; `FastDecode.attend` runs a layer, or declines
(None) when the layer's call is not what the step was decided for, and the general path then takes it.

`HF_PAGED_FAST_DECODE=0` (read at import) turns the fast path off: every step takes the general path, which gives
bitwise-equal logits and stored blocks (`tests/test_fast_decode.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..memory.slots import slot_view, slots_view
from .torch_backend import decode_attention
from .torch_meta import consecutive_start

if TYPE_CHECKING:
    from ..memory.pool import BlockPool
    from .plan import ForwardPlan

#: Whether the fast path is taken at all (`HF_PAGED_FAST_DECODE=0` turns it off).
ENABLED = os.environ.get("HF_PAGED_FAST_DECODE", "1").strip() != "0"


@dataclass(frozen=True, slots=True)
class FastDecode:
    """One row's decode step of a layer group, its blocks consecutive: the same for every layer of the group.

    Attributes:
        device: the device the step was decided on (a layer elsewhere takes the general path).
        slot: the new token's slot.
        first: the first slot the row reads; it reads `count` slots, the new token's last.
    """

    device: torch.device
    slot: int
    first: int
    count: int

    @staticmethod
    def decide(pool: BlockPool, plan: ForwardPlan, group_id: int, query: torch.Tensor) -> FastDecode | None:
        """The group's step in this forward, or None when the forward is not one row's decode step over consecutive
        blocks of an unquantized pool: one row, one new token after some history, no reordered columns, one slot
        written right after the row's last stored slot. The caller has chosen the PyTorch path for the call.

        Args:
            query: `[1, num_heads, 1, head_dim]` of the group's first layer.
        """
        if not ENABLED:
            return None
        group = plan.groups[group_id]
        if (
            pool.kv_format is not None
            or plan.q_len != 1
            or len(plan.seq_lens) != 1
            or plan.query_lens[0] != 1
            or plan.seq_lens[0] < 2
            or plan.column_order is not None
            or len(group.write_slots) != 1
        ):
            return None
        seq_len, slot = plan.seq_lens[0], group.write_slots[0]
        first = consecutive_start(group.tables[0][: -(-seq_len // plan.block_size)])
        if first is None or slot != first * plan.block_size + seq_len - 1:
            return None
        return FastDecode(query.device, slot, first * plan.block_size, seq_len)

    def attend(
        self, pool: BlockPool, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """Writes a layer's token into its slot and attends over the row's slots: `[1, 1, num_heads, head_dim_v]`;
        None, with nothing written, when this layer's call is not what the step was decided for (gradients on,
        another device or dtype, or tensors the pool does not hold yet). The pool's tensors store their slots at one
        stride in either layout (`memory/slots.py`), so the slot views need no check.

        Args:
            query: `[1, num_heads, 1, head_dim]`; key, value: `[1, num_kv_heads, 1, head_dim]` and `[..., head_dim_v]`.
        """
        if torch.is_grad_enabled() or query.device != self.device:
            return None
        with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
            stored = pool.layer_storage(layer_idx)
            if stored is None:
                return None
            key_cache, value_cache = stored
            if not (
                key.dtype is key_cache.dtype is value_cache.dtype is value.dtype is query.dtype
                and key_cache.device == self.device
                and key.shape[1:] == (key_cache.shape[2], 1, key_cache.shape[3])
                and value.shape[1:] == (value_cache.shape[2], 1, value_cache.shape[3])
                and self.slot < key_cache.shape[0] * key_cache.shape[1]
            ):
                return None
            slot_view(key_cache, key, self.slot).copy_(key)
            slot_view(value_cache, value, self.slot).copy_(value)
            rows_k = slots_view(key_cache, self.first, self.count)
            rows_v = slots_view(value_cache, self.first, self.count)
        return decode_attention(query, rows_k, rows_v, scale).transpose(1, 2)
