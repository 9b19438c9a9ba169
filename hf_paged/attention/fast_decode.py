"""The one fast path: a single row's decode step on the PyTorch path.

Batch-1 generation spends almost all of its steps here: one new token per step after a stored history. Such a
step needs no gather index, no mask and no write index: each layer copies its token's K/V into its slot and
attends over the row's slots it sees (all of them, or a sliding window's last ones), read in place as one strided
view when the row's blocks follow each other in the pool (a growing pool hands out consecutive ids to a lone row),
else gathered block by block (a row that took cached prefix blocks, or forked). `attend` is the one entry:
`PagedCache.attend` asks it first for every layer it writes and attends. The group's first layer decides the step
(`step`: the row's previous step one slot on, `FastDecode.next_token`, or `FastDecode.decide` from the forward's
plan) into the group's `GroupInputs`; `FastDecode.attend` runs a layer, or declines (None) when the layer's call is
not what the step was decided for, and the general path (`dispatch.py`) then takes it.
(A compiled step does not come here: its layers' attention is traced into its graph, `graph_attention.py`.)

`HF_PAGED_FAST_DECODE=0` (read at import) turns the fast path off: every step takes the general path, which gives
bitwise-equal logits and stored blocks (`tests/test_fast_decode.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..backend import attention_backend
from ..memory.slots import step_views
from .torch_backend import decode_attention, gathered_row
from .torch_meta import consecutive_start

if TYPE_CHECKING:
    from ..memory.pool import BlockPool
    from .plan import AttentionFeatures, ForwardPlan

#: Whether the fast path is taken at all (`HF_PAGED_FAST_DECODE=0` turns it off).
ENABLED = os.environ.get("HF_PAGED_FAST_DECODE", "1").strip() != "0"


def attend(
    pool: BlockPool,
    plan: ForwardPlan,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    features: AttentionFeatures,
) -> torch.Tensor | None:
    """The fast path's one entry: writes a layer's token and attends when the forward `plan` is one row's decode step
    on the PyTorch path (decided on the group's first layer, `step`), else None with nothing written.

    Args:
        query: `[batch, num_heads, q_len, head_dim]`; key, value: `[batch, num_kv_heads, q_len, head_dim]` and
            `[..., head_dim_v]`, this step's K/V.
        features: the layer's scale, window, soft-capping and sinks (a step with the last two is not fast).

    Returns:
        `[1, 1, num_heads, head_dim_v]`, or None.
    """
    if not ENABLED or features.softcap is not None or features.sinks is not None:
        return None
    group_id = pool.layout.group_of(layer_idx)
    inputs = plan.groups[group_id].inputs_on(query.device)
    if not inputs.fast_decided:
        inputs.fast, inputs.fast_decided = step(pool, plan, group_id, layer_idx, query, features.sliding_window), True
    if inputs.fast is None:
        return None
    return inputs.fast.attend(pool, layer_idx, query, key, value, features.scale, features.sliding_window)


def step(
    pool: BlockPool, plan: ForwardPlan, group_id: int, layer_idx: int, query: torch.Tensor, window: int | None
) -> FastDecode | None:
    """The group's `FastDecode` for this forward where the PyTorch path would take the call, else None: the previous
    forward's step one token on where this forward is the next step of its row (`FastDecode.next_token`; the path
    was chosen for that step), else decided afresh (`FastDecode.decide`)."""
    earlier = plan.previous_inputs(group_id, query.device)
    if earlier is not None and earlier.fast is not None:
        taken_over = earlier.fast.next_token(plan, group_id)
        if taken_over is not None:
            return taken_over
    stored = pool.layer_storage(layer_idx)
    if stored is None or attention_backend(query, *stored, sliding_window=window) == "triton":
        return None
    return FastDecode.decide(pool, plan, group_id, query)


@dataclass(frozen=True, slots=True)
class FastDecode:
    """One row's decode step of a layer group: the same for every layer of the group.

    Attributes:
        device: the device the step was decided on (a layer elsewhere takes the general path).
        slot: the new token's slot, in the row's last block.
        first: the first slot the row reads when the blocks it reads are consecutive (read in place), else None.
        count: slots the row reads, the new token's last.
        blocks: int64 `[num_blocks]` the blocks the row reads when they are not consecutive (gathered), else None.
        num_slots: slots a pool tensor must hold for the step (one past its highest block's).
        window: the layers' sliding window (the row reads its last `window` slots), or None.
        skip: with `blocks`, the slots of the first block before the first one the row reads.
    """

    device: torch.device
    slot: int
    first: int | None
    count: int
    blocks: torch.Tensor | None = None
    num_slots: int = 0
    window: int | None = None
    skip: int = 0

    @staticmethod
    def of_row(
        device: torch.device, block_ids: list[int], seq_len: int, slot: int, block_size: int, window: int | None = None
    ) -> FastDecode | None:
        """The step of a row holding `block_ids` (its first `ceil(seq_len / block_size)` blocks; -1 where a block out
        of its window was freed) that writes its token at `slot` and sees its last `window` tokens (None: all), or
        None when `slot` is not the row's position `seq_len - 1` or a block it reads is missing (-1)."""
        if seq_len < 2 or len(block_ids) != -(-seq_len // block_size):
            return None
        since = max(0, seq_len - window) if window is not None else 0  # the first position the new token sees
        read = block_ids[since // block_size :]
        if min(read) < 0 or slot != block_ids[-1] * block_size + (seq_len - 1) % block_size:
            return None
        num_slots, skip = (max(read) + 1) * block_size, since % block_size
        first = consecutive_start(read)
        if first is not None:
            return FastDecode(device, slot, first * block_size + skip, seq_len - since, None, num_slots, window)
        blocks = torch.tensor(read, dtype=torch.int64, device=device)
        return FastDecode(device, slot, None, seq_len - since, blocks, num_slots, window, skip)

    @staticmethod
    def decide(pool: BlockPool, plan: ForwardPlan, group_id: int, query: torch.Tensor) -> FastDecode | None:
        """The group's step in this forward (its layers' sliding window the group's), or None when the forward is
        not one row's decode step of an unquantized pool: one row, one new token after some history, no reordered
        columns, one slot written right after the row's last stored slot. The caller has chosen the PyTorch path for
        the call.

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
            or plan.column_order is not None
            or len(group.write_slots) != 1
        ):
            return None
        seq_len = plan.seq_lens[0]
        block_ids = group.tables[0][: -(-seq_len // plan.block_size)]
        return FastDecode.of_row(
            query.device, block_ids, seq_len, group.write_slots[0], plan.block_size, group.sliding_window
        )

    def next_token(self, plan: ForwardPlan, group_id: int) -> FastDecode | None:
        """This step one token later, when the forward `plan` is the row's next decode step and writes the slot right
        after this step's, in the same block: the same slots read (in place or gathered), and the new one. None
        otherwise (a new block, a sliding window, any other forward): `decide` then decides afresh. A step taken
        over keeps the path chosen for the first step of the run (`HF_PAGED_BACKEND` is read there)."""
        group = plan.groups[group_id]
        slot = self.slot + 1
        if (
            self.window is not None
            or slot % plan.block_size == 0  # the step before wrote its block's last slot
            or plan.q_len != 1
            or plan.seq_lens != [self.count + 1]
            or plan.column_order is not None
            or group.write_slots != [slot]
        ):
            return None
        return FastDecode(self.device, slot, self.first, self.count + 1, self.blocks, self.num_slots)

    def attend(
        self,
        pool: BlockPool,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor | None:
        """Writes a layer's token into its slot and attends over the row's slots it sees: `[1, 1, num_heads,
        head_dim_v]`; None, with nothing written, when this layer's call is not what the step was decided for
        (gradients on, another sliding window, tensors the pool does not hold yet, or of other dtypes or device,
        head counts or widths, or too few slots). (`query` is on `device`: a step is kept per device.) The pool's
        tensors store their slots at one stride in either layout (`memory/slots.py`), so the slot views need no
        check; a gathered row is read as the general path gathers it (`torch_backend.py`), so both give the same
        bits.

        Args:
            query: `[1, num_heads, 1, head_dim]`; key, value: `[1, num_kv_heads, 1, head_dim]` and `[..., head_dim_v]`.
            window: the layer's sliding window, or None.
        """
        if window != self.window or torch.is_grad_enabled():
            return None
        with pool.lock:  # a concurrent growth of this layer's tensors must not lose the write
            stored = pool.layer_storage(layer_idx)
            if stored is None:
                return None
            key_cache, value_cache = stored  # [num_blocks, block_size, num_kv_heads, head_dim], [..., head_dim_v]
            cached = key_cache.shape
            if not (
                key.dtype is key_cache.dtype is value_cache.dtype is value.dtype  # (SDPA checks the query's)
                and key_cache.device == self.device
                and key.shape[1::2] == cached[2:]  # (num_kv_heads, head_dim); key is [1, num_kv_heads, 1, head_dim]
                and value.shape[1::2] == value_cache.shape[2:]
                and self.num_slots <= cached[0] * cached[1]
            ):
                return None
            slot_k, rows_k = step_views(key_cache, self.slot, self.first, self.count)
            slot_v, rows_v = step_views(value_cache, self.slot, self.first, self.count)
            slot_k.copy_(key)
            slot_v.copy_(value)
        if rows_k is None:
            rows_k, rows_v = (
                gathered_row(cache, self.blocks, self.count, self.skip) for cache in (key_cache, value_cache)
            )
        return decode_attention(query, rows_k, rows_v, scale)
