"""The paged write and decode attention that a compiled step on a CPU traces into its graph, in place of the
opaque op (`ops.write_and_attend`).

On a CPU the op runs the PyTorch path eagerly inside the graph: per layer it plans its rows (classes by length,
gather indices, masks), gathers each row's blocks into a contiguous copy and hands that copy to SDPA. Written as
plain tensor operations over a list of the step's `(row, block)` pairs instead, the compiler (Inductor) fuses
each block's gather into the dot products that read it, so K/V are read once from the pool and never copied, and
no Python runs per layer::

    pairs p = 0 .. P-1:   (row r_p, block b_p, first position s_p)      one entry per block a row reads
    scores[p, t]        = q[r_p] · K[b_p, t] * scale                    masked where s_p + t is not visible
    m[r]                = max over the row's pairs and slots (and the sink)
    out[r]              = sum_p sum_t exp(scores[p, t] - m[r]) V[b_p, t] / sum_p sum_t exp(scores[p, t] - m[r])

The pairs are listed by the host before the step (`StepBlocks.from_tables`), so their number `P` is the graph's
one dynamic size besides the batch. Decode only: every row has one new token, at position `seq_lens[r] - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepBlocks:
    """The blocks one layer group's rows read in a decode step, one entry per `(row, block)` pair, and where
    each row writes its new token.

    Attributes:
        rows: int64 `[P]`, the row of each pair.
        blocks: int64 `[P]`, the pair's block id.
        starts: int64 `[P]`, the position of the block's first slot in its row.
        write_rows: int64 `[batch]`, the row whose new K/V each row writes to its slot (`slot_mapping`): itself,
            or for a row that writes nothing (padding, a row sharing an identical row's blocks) the step's first
            writing row, whose slot it then names too, so that every write is real and duplicates are identical.
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    starts: torch.Tensor
    write_rows: torch.Tensor

    @classmethod
    def from_tables(
        cls, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int | None,
        write_rows: torch.Tensor,
    ) -> StepBlocks:
        """The pairs of a step's rows.

        Args:
            tables: int64 `[batch, width]` block ids (-1 past a row's blocks, and for blocks a window dropped).
            seq_lens: int64 `[batch]` tokens per row including the new one (0: a padding row, which reads nothing).
            block_size: tokens per block; window: the group's sliding window, or None.
            write_rows: as the attribute.
        """
        cols = torch.arange(tables.shape[1], device=tables.device)
        keep = (tables >= 0) & (cols[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None])
        if window is not None:  # blocks wholly before the window are not read
            keep &= cols[None, :] >= ((seq_lens - window).clamp(min=0) // block_size)[:, None]
        rows, index = keep.nonzero(as_tuple=True)
        return cls(rows, tables[rows, index], index * block_size, write_rows)

    def mark_dynamic(self) -> None:
        """Tells the compiler that the number of pairs changes from step to step: one graph for every number,
        1 included (an unbacked size, which the compiler does not specialize at 0 or 1)."""
        for tensor in (self.rows, self.blocks, self.starts):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)


def write_and_attend_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    blocks: StepBlocks,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    write: bool = True,
) -> torch.Tensor:
    """Writes each row's new K/V into its slot (unless `write` is False: a layer reusing K/V that another layer of
    the step wrote), then attends each row's new query over its blocks.

    Args:
        query: `[batch, num_heads, 1, head_dim]`; key, value: `[batch, num_kv_heads, 1, head_dim]` and
            `[..., head_dim_v]` (the model's layout).
        key_cache, value_cache: the layer's unquantized pool tensors `[num_blocks, block_size, num_kv_heads,
            head_dim]` and `[..., head_dim_v]`, written in place.
        slot_mapping: int64 `[batch, 1]`, every entry a real slot (`StepBlocks.write_rows`).
        seq_lens: int32 `[batch]` tokens per row including the new one (0: padding).
        blocks: the step's pairs for the layer's group.
        scale: multiplier of `q·k`; sliding_window: keys at positions `p - sliding_window < k <= p` are visible,
            or None; softcap: logit soft-capping, or None; sinks: `[num_heads]` sink logits, or None.

    Returns:
        `[batch, 1, num_heads, head_dim_v]` in the query's dtype; zeros for rows that read nothing.
    """
    batch, num_heads, _, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if write:
        slots = slot_mapping[:, 0]
        block_of, offset = slots // block_size, slots % block_size
        key_cache[block_of, offset] = key[blocks.write_rows, :, 0].to(key_cache.dtype)
        value_cache[block_of, offset] = value[blocks.write_rows, :, 0].to(value_cache.dtype)

    rows = blocks.rows
    # [num_kv_heads, P, group, head_dim] queries against [num_kv_heads, P, block_size, head_dim] keys: a dot
    # product over head_dim, which the compiler fuses with the gather of the pair's block
    q = query[:, :, 0].float().reshape(batch, num_kv_heads, group, head_dim)[rows].transpose(0, 1)
    k = key_cache.permute(2, 0, 1, 3)[:, blocks.blocks].float()
    scores = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale  # [num_kv_heads, P, group, block_size]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = blocks.starts[:, None] + torch.arange(block_size, device=rows.device)  # [P, block_size]
    lens = seq_lens.to(torch.int64)[rows][:, None]
    visible = positions < lens
    if sliding_window is not None:
        visible &= positions >= lens - sliding_window
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))

    pair_max = scores.amax(-1)  # [num_kv_heads, P, group]
    row_max = torch.full((num_kv_heads, batch, group), float("-inf"), device=q.device)
    row_max = row_max.scatter_reduce(1, rows[None, :, None].expand_as(pair_max), pair_max, "amax")
    if sinks is not None:
        sink = sinks.float().reshape(num_kv_heads, 1, group)
        row_max = torch.maximum(row_max, sink)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # (a row that reads nothing)
    weights = torch.exp(scores - row_max[:, rows, :, None])  # [num_kv_heads, P, group, block_size]
    v = value_cache.permute(2, 0, 1, 3)[:, blocks.blocks].float()  # [num_kv_heads, P, block_size, head_dim_v]
    pair_out = (weights[..., None] * v[:, :, None, :, :]).sum(-2)  # [num_kv_heads, P, group, head_dim_v]
    denom = torch.zeros((num_kv_heads, batch, group), device=q.device).index_add(1, rows, weights.sum(-1))
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.zeros((num_kv_heads, batch, group, v.shape[-1]), device=q.device).index_add(1, rows, pair_out)
    out = torch.where(denom[..., None] > 0, out / denom[..., None], 0.0)
    return out.permute(1, 0, 2, 3).reshape(batch, 1, num_heads, v.shape[-1]).to(query.dtype)
