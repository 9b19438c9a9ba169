"""The hand-off of a layer's new K/V from `PagedCache.update()` to the `"paged"` attention function.

transformers calls `cache.update(key, value, layer_idx)` and then the attention function with whatever
`update()` returned, but never passes the cache to the attention function. Under `"paged"`, `update()`
stages `(cache, key, value)` for its layer in a thread-local slot and returns the tensors unchanged; the
attention function takes the slot of its module's layer and checks that it received those very K/V.
Nothing rides on an attribute of a tensor, so a model that copies or casts K/V between the two calls is
still recognised, and one that changes them is refused with a clear error instead of attending wrongly.
Each slot is consumed by the attention call it was staged for. A forward that raised between the two
calls leaves its slot behind; the `"paged"` mask function, which runs at the start of every forward of a
`"paged"` model before any layer, clears the thread's slots, so a later forward never reads a stale one.
Under a compiled model the mask function is traced and does not clear them (`outside_graph.py`): a slot left by
an interrupted compiled forward stays until the next uncompiled forward, or until its layer stages again.

Layers that reuse an earlier layer's K/V (Gemma 3n's and Gemma 4's `num_kv_shared_layers`) receive exactly what
that layer's `update()` returned, after its slot was consumed. The attention function keeps the slot of such a
source layer (`keep_for_readers`) until the next forward begins, and a reading layer finds it by the very key
tensor it received (`taken_for_reader`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedCache


class _Slots(threading.local):
    """Per thread: the staged K/V of each layer, by layer index; and the shared cross-attention K/V read for each
    layer (`stage_shared`)."""

    def __init__(self) -> None:
        self.by_layer: dict[int, Staged] = {}
        self.shared_by_layer: dict[int, SharedStaged] = {}
        self.attended_layer: int | None = None  # the layer of the last "paged" self-attention (note_self_attention)
        self.kept_for_readers: dict[int, Staged] = {}  # consumed slots that later layers read again, by layer


_local = _Slots()


class Staged(NamedTuple):
    """What `update()` handed to the attention of one layer.

    Attributes:
        cache: the cache that will write and attend.
        layer_idx: the layer.
        key, value: `[batch, num_kv_heads, q_len, head_dim]` (or history + new on a first forward whose
            attention was not known yet) — exactly what `update()` returned.
    """

    cache: PagedCache
    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor


class SharedReader(Protocol):
    """What attends shared K/V staged by `stage_shared` (a `cache.cross.CrossAttentionCache`)."""

    def attend(
        self, staged: SharedStaged, query: torch.Tensor, mask: torch.Tensor | None, scale: float,
        bias: torch.Tensor | None, want_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(out [batch, q_len, num_heads, head_dim_v], probabilities or None)` of the staged layer."""


class SharedStaged(NamedTuple):
    """K/V that several rows share, as a cross-attention cache handed them to the model for one layer.

    Attributes:
        store: the cache that holds them and attends them.
        layer_idx: the layer.
        key, value: `[num_entries, num_kv_heads, kv_len, head_dim]` (and `[..., head_dim_v]`): each entry's K/V,
            exactly what the model read.
        row_entries: int64 `[batch]`: the entry each row of the batch reads.
    """

    store: SharedReader
    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor
    row_entries: torch.Tensor


def stage_shared(staged: SharedStaged) -> None:
    """Records shared K/V handed to the model for `staged.layer_idx` on this thread."""
    _local.shared_by_layer[staged.layer_idx] = staged


def shared_staged(layer_idx: int) -> SharedStaged | None:
    """The shared K/V staged for `layer_idx` and not taken yet (the model read its keys and will read its values)."""
    return _local.shared_by_layer.get(layer_idx)


def note_self_attention(layer_idx: int | None) -> None:
    """The `"paged"` attention runs the self-attention of `layer_idx` (see `follows_attention_of`)."""
    _local.attended_layer = layer_idx


def follows_attention_of(layer_idx: int) -> bool:
    """Whether the last `"paged"` self-attention on this thread was of `layer_idx` and no shared K/V were taken
    since: the model is inside that decoder layer (its cross-attention comes right after its self-attention) and
    attends with `"paged"`, not a caller reading the cache from outside."""
    return _local.attended_layer == layer_idx


def take_shared(layer_idx: int | None, key: torch.Tensor) -> SharedStaged | None:
    """Removes and returns the shared K/V staged for `layer_idx` when the attention received that very key tensor;
    None otherwise (the slot, if any, stays for its own call)."""
    staged = _local.shared_by_layer.get(layer_idx) if layer_idx is not None else None
    if staged is None or staged.key is not key:
        return None
    _local.attended_layer = None
    return _local.shared_by_layer.pop(layer_idx)


def stage(cache: PagedCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Records what `update()` returns for `layer_idx` on this thread."""
    _local.by_layer[layer_idx] = Staged(cache, layer_idx, key, value)


def clear() -> None:
    """Drops every slot of this thread (a new forward begins)."""
    _local.by_layer.clear()
    _local.shared_by_layer.clear()
    _local.attended_layer = None
    _local.kept_for_readers.clear()


def has_staged() -> bool:
    """Whether some layer's K/V are staged on this thread (a `PagedCache` forward is between `update()` and the
    attention). Traced by torch.compile as a guard on the thread's slots, without a graph break."""
    return bool(_local.by_layer)


def take(layer_idx: int | None, key: torch.Tensor) -> Staged | None:
    """Removes and returns the slot of `layer_idx` (or, for a module without `layer_idx` or whose `layer_idx`
    staged nothing — a block shared by several layers, such as Zamba's shared transformer with `layer_idx=-1`,
    which passes each layer's index to `update()` — the slot whose key is `key`); None when no `PagedCache`
    staged anything for it."""
    slots = _local.by_layer
    if layer_idx is None or layer_idx not in slots:
        layer_idx = next((i for i, s in slots.items() if s.key is key), None)
    return slots.pop(layer_idx, None) if layer_idx is not None else None


def keep_for_readers(staged: Staged) -> None:
    """Keeps a consumed slot for the later layers of this forward that attend over the same K/V (layers reusing
    the K/V of `staged.layer_idx`), until the next forward begins (`clear`) or the layer stages again."""
    _local.kept_for_readers[staged.layer_idx] = staged


def has_kept_for_readers() -> bool:
    """Whether some consumed slot is kept for reusing layers (`keep_for_readers`). Traced by torch.compile as a
    guard on the thread's slots, like `has_staged`."""
    return bool(_local.kept_for_readers)


def taken_for_reader(key: torch.Tensor) -> Staged | None:
    """The slot kept by `keep_for_readers` whose key is `key` itself (the K/V a reusing layer received), or None."""
    return next((s for s in _local.kept_for_readers.values() if s.key is key), None)


def received_as_staged(received: torch.Tensor, staged: torch.Tensor) -> bool:
    """Whether the attention received the staged tensor: the same object, a view of the same memory
    with the same layout, or a copy with equal values (`.contiguous()`, a no-op `.to()`)."""
    if received is staged:
        return True
    if received.shape != staged.shape or received.dtype != staged.dtype:
        return False
    if received.data_ptr() == staged.data_ptr() and received.stride() == staged.stride():
        return True
    return bool(torch.equal(received, staged))
