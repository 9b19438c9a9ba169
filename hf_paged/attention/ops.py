"""The paged cache write and the paged attention as PyTorch custom ops: `torch.ops.hf_paged.write_kv`,
`torch.ops.hf_paged.paged_attention`, and both in one call, `torch.ops.hf_paged.write_and_attend` (what a
compiled layer calls).

A compiled forward (`torch.compile`, CUDA graphs) sees each of them as one opaque op with a fake (meta)
implementation that gives its output's shape, instead of the Python that plans a `PagedCache` forward. The ops
are declared with `torch.library.Library` (schema with the mutated pool tensors marked) and implemented for every
device by one Python function each: `torch.library.custom_op`'s wrapper would cost several times the dispatch. Every
input that varies from step to step is a tensor (slots, block tables, lengths), so a graph captured once
replays for any rows of the same batch size. On a CUDA device the ops run the Triton kernels
(`hf_paged.kernels`); anywhere else, or when Triton cannot take the call, the PyTorch path
(`torch_backend.py`). Both read K/V through `block_table` and `seq_lens` only; a row with `seq_lens == 0`
(padding up to a batch bucket) reads nothing and gets zeros, a slot of -1 writes nothing. (A compiled decode step
on a CPU over an unquantized pool traces its layers' write and attention instead, `graph_attention.py`.)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from ..backend import backend_for, is_fallback_error, triton_failed, triton_supports
from .torch_backend import torch_paged_attention, torch_write
from .torch_meta import TorchMeta, consecutive_start

__all__ = ["paged_attention", "write_and_attend", "write_kv"]

_LIBRARY = torch.library.Library("hf_paged", "DEF")  # (kept: the ops live as long as the library object)
_LIBRARY.define(
    "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
    "Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()"
)
_LIBRARY.define(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
    "float scale, int? sliding_window=None, float? softcap=None, Tensor? sinks=None, Tensor? key_scale=None, "
    "Tensor? value_scale=None) -> Tensor"
)
_LIBRARY.define(
    "write_and_attend(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, float scale, int? sliding_window=None, "
    "float? softcap=None, Tensor? sinks=None, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> Tensor"
)


def _implements(name: str):
    def register(fn):
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


@_implements("write_kv")
def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Writes new K/V into their slots of a layer's pool tensors (in place).

    Args:
        key, value: `[batch, q_len, num_kv_heads, head_dim]` and `[..., head_dim_v]`.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and `[..., head_dim_v]`.
        slot_mapping: int64 `[batch, q_len]`, `block_id * block_size + offset` per token; -1 writes nothing.
        key_scale, value_scale: a quantized pool's float16 scales `[num_blocks, block_size, num_kv_heads]`,
            written with the K/V, or None.
    """
    scales = None if key_scale is None or value_scale is None else (key_scale, value_scale)
    if backend_for(key.device) == "triton":
        try:
            from hf_paged.kernels import write_kv_cache  # noqa: PLC0415

            write_kv_cache(
                key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                key_scale=key_scale, value_scale=value_scale,
            )
            return
        except Exception as error:  # noqa: BLE001 - never crash a user: write with PyTorch instead
            if not is_fallback_error(error):
                raise
            triton_failed(key, error, "cache write")
    slots = slot_mapping.reshape(-1)
    valid = slots >= 0
    index = None if bool(valid.all()) else valid.nonzero().squeeze(1)
    write_slots = slots if index is None else slots.index_select(0, index)
    torch_write(key_cache, value_cache, key.transpose(1, 2), value.transpose(1, 2), index, write_slots, scales)


@torch.library.register_fake("hf_paged::write_kv")
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping, key_scale=None, value_scale=None) -> None:
    return None


@_implements("paged_attention")
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each row's last `q_len` tokens over its blocks.

    Args:
        query: `[batch, q_len, num_heads, head_dim]`; row `b`'s queries are the tokens at positions
            `seq_lens[b] - q_len .. seq_lens[b] - 1`, all real (a row with `seq_lens[b] == 0` is padding).
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and `[..., head_dim_v]`.
        block_table: int32 `[batch, max_blocks]`; the key at position `k` of row `b` is in block
            `block_table[b, k // block_size]`. Entries past a row's blocks (and freed ones, -1) are never read.
        seq_lens: int32 `[batch]`, tokens stored per row including this step's.
        scale: multiplier of `q·k`.
        sliding_window: keys at positions `p - sliding_window < k <= p` are visible, or None for all.
        softcap: logit soft-capping, or None.
        sinks: `[num_heads]` attention-sink logits, or None.
        key_scale, value_scale: a quantized pool's float16 scales `[num_blocks, block_size, num_kv_heads]`.

    Returns:
        `[batch, q_len, num_heads, head_dim_v]` in the query's dtype; zeros for padding rows.
    """
    scales = None if key_scale is None or value_scale is None else (key_scale, value_scale)
    if backend_for(query.device) == "triton" and triton_supports(
        query.transpose(1, 2), key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks
    ) is None:
        try:
            from hf_paged.kernels import paged_attention as kernel  # noqa: PLC0415

            q_len = query.shape[1]
            query_lens = torch.where(seq_lens > 0, q_len, 0).to(torch.int32)
            return kernel(
                query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_table,
                seq_lens=seq_lens, query_lens=query_lens, scale=scale, sliding_window=sliding_window,
                softcap=softcap, sinks=sinks, key_scale=key_scale, value_scale=value_scale,
            )
        except Exception as error:  # noqa: BLE001 - never crash a user: attend with PyTorch instead
            if not is_fallback_error(error):
                raise
            triton_failed(query, error, "paged attention")
    return _torch_paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale,
                                  sliding_window, softcap, sinks, scales)


@torch.library.register_fake("hf_paged::paged_attention")
def _paged_attention_fake(
    query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window=None, softcap=None, sinks=None,
    key_scale=None, value_scale=None,
) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], value_cache.shape[3]))


@_implements("write_and_attend")
def write_and_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`write_kv` then `paged_attention` in one op (one per layer in a compiled forward); arguments as theirs.

    Returns:
        `[batch, q_len, num_heads, head_dim_v]`.
    """
    write_kv(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale)
    return paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window, softcap, sinks,
                           key_scale, value_scale)


@torch.library.register_fake("hf_paged::write_and_attend")
def _write_and_attend_fake(
    query, key, value, key_cache, value_cache, slot_mapping, block_table, seq_lens, scale, sliding_window=None,
    softcap=None, sinks=None, key_scale=None, value_scale=None,
) -> torch.Tensor:
    return query.new_empty((*query.shape[:3], value_cache.shape[3]))


def _torch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`paged_attention` on the PyTorch path: each `RowClass` gathered and attended on its own."""
    batch, q_len, num_heads, _ = query.shape
    hf_query = query.transpose(1, 2)
    classes = row_classes(block_table, seq_lens, q_len, sliding_window, key_cache.shape[1])
    if len(classes) == 1 and classes[0].every_row:  # no padding row, one class: attend the batch as it is
        meta = classes[0].meta
        attended = torch_paged_attention(
            hf_query, hf_query, hf_query, key_cache, value_cache, meta, scale, softcap, sinks, scales
        )
        return attended.to(query.dtype)
    out = query.new_zeros((batch, q_len, num_heads, value_cache.shape[3]))
    for row_class in classes:
        part = hf_query.index_select(0, row_class.rows)
        meta = row_class.meta
        attended = torch_paged_attention(part, part, part, key_cache, value_cache, meta, scale, softcap, sinks, scales)
        out.index_copy_(0, row_class.rows, attended.to(out.dtype))
    return out


class RowClass(NamedTuple):
    """Rows attended together: `rows` (int64 `[n]`), their gather index and mask (`TorchMeta`), and whether they
    are every row of the batch, in order (`every_row`: the batch is attended without selecting rows)."""

    rows: torch.Tensor
    meta: TorchMeta
    every_row: bool = False


#: The row classes of the last few steps, by (tables, lengths): every layer of a step reads the same tables and
#: lengths, so only a step's first layer builds its classes. An entry is used only if the lengths are equal and the
#: table columns it read are equal too (compared, never assumed from an address or a version counter).
_classes_seen: OrderedDict[tuple, tuple[torch.Tensor, list[RowClass]]] = OrderedDict()
_CLASSES_KEPT = 8


def row_classes(
    block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int, sliding_window: int | None, block_size: int
) -> list[RowClass]:
    """The non-padding rows grouped by the power of two of blocks they fill (as the engine's length classes are),
    so that no row reads keys as far as a much longer row's, each with its gather index and mask.

    Args:
        block_table: int32 `[batch, max_blocks]`; seq_lens: int32 `[batch]` (0: padding row).
        q_len: new tokens per row; sliding_window: the layer's window or None; block_size: tokens per block.
    """
    device = block_table.device
    lens = seq_lens.tolist()
    width = min(block_table.shape[1], max(1, -(-max(lens, default=0) // block_size)))
    key = (tuple(lens), block_table.shape[0], device, q_len, sliding_window, block_size)
    found = _classes_seen.get(key)
    if found is not None and torch.equal(found[0], block_table[:, :width]):
        return found[1]
    by_size: dict[int, list[int]] = {}
    for row, seq_len in enumerate(lens):
        if seq_len > 0:
            by_size.setdefault(1 << (-(-seq_len // block_size) - 1).bit_length(), []).append(row)
    classes = []
    for rows in by_size.values():
        num_blocks = -(-max(lens[r] for r in rows) // block_size)
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        every_row = len(rows) == len(lens)
        start = consecutive_start(block_table[rows[0], :num_blocks].tolist()) if len(rows) == 1 else None
        table = None
        if start is None:  # gathered: the row's blocks are not one run of ids
            table = block_table.index_select(0, index)[:, :num_blocks].to(torch.int64).clamp(min=0)
        mask, kv_valid = None, None
        if q_len == 1 and sliding_window is None and all(lens[r] == lens[rows[0]] for r in rows):
            kv_valid = lens[rows[0]]  # every row sees exactly its first `kv_valid` keys: no mask
        else:
            row_lens = seq_lens.index_select(0, index).to(torch.int64)
            key_pos = torch.arange(num_blocks * block_size, device=device)[None, None, :]
            query_pos = (row_lens[:, None] - q_len + torch.arange(q_len, device=device)[None, :])[:, :, None]
            allowed = (key_pos <= query_pos) & (key_pos < row_lens[:, None, None])
            if sliding_window is not None:
                allowed &= key_pos > query_pos - sliding_window
            mask = allowed[:, None]
        meta = TorchMeta(False, table, start, mask, False, num_gather=num_blocks, kv_valid=kv_valid)
        classes.append(RowClass(index, meta, every_row))
    _classes_seen[key] = (block_table[:, :width].clone(), classes)
    while len(_classes_seen) > _CLASSES_KEPT:
        _classes_seen.popitem(last=False)
    return classes
