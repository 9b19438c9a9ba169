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
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedCache


class _Slots(threading.local):
    """Per thread: the staged K/V of each layer, by layer index."""

    def __init__(self) -> None:
        self.by_layer: dict[int, Staged] = {}


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


def stage(cache: PagedCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Records what `update()` returns for `layer_idx` on this thread."""
    _local.by_layer[layer_idx] = Staged(cache, layer_idx, key, value)


def clear() -> None:
    """Drops every slot of this thread (a new forward begins)."""
    _local.by_layer.clear()


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
