"""`PagedLayer`: the per-layer view `transformers.Cache.layers` expects, over a `PagedCache`'s blocks.

transformers walks `cache.layers` (e.g. `generate()` of 5.24 decides from `cache.is_linear` whether a
continued prompt is sliced, and its test helpers read `layer.keys`). A `PagedCache` keeps one block table
per row for all layers of a group, so its layers are views: `keys`/`values` gather the layer's K/V
(right-aligned like a left-padded contiguous cache) when read, and whole-cache operations (crop, beam
reorder, reset, ...) go through the cache, which applies them to every layer at once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from .paged_cache import PagedCache
    from ..memory.layers import LayerLayout


class PagedLayer(CacheLayerMixin):
    """One layer of a `PagedCache`, as transformers' `Cache.layers[i]`.

    Attributes:
        layer_idx: the model layer.
        sliding_window: the layer's window, or None.
        is_sliding: whether the layer has a window.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int, sliding_window: int | None) -> None:
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    def __repr__(self) -> str:
        return f"PagedLayer(layer_idx={self.layer_idx}, sliding_window={self.sliding_window})"

    @property
    def cache(self) -> PagedCache:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("This PagedLayer's cache was garbage-collected.")
        return cache

    # CacheLayerMixin sets these in __init__; here they are read from the cache.
    @property
    def keys(self) -> torch.Tensor | None:
        """`[batch, num_kv_heads, seq_length, head_dim]` gathered keys (None before anything is stored)."""
        return self.cache.layer_kv(self.layer_idx, 0)

    @keys.setter
    def keys(self, value: object) -> None:
        self._refuse_write("keys")

    @property
    def values(self) -> torch.Tensor | None:
        """`[batch, num_kv_heads, seq_length, head_dim]` gathered values (None before anything is stored)."""
        return self.cache.layer_kv(self.layer_idx, 1)

    @values.setter
    def values(self, value: object) -> None:
        self._refuse_write("values")

    @property
    def is_initialized(self) -> bool:
        return self.cache.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: object) -> None:
        self._refuse_write("is_initialized")

    @property
    def device(self) -> torch.device | None:
        keys = self.cache.layer_kv(self.layer_idx, 0)
        return None if keys is None else keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool creates storage on the first write."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_mask_sizes(query_length, self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        raise NotImplementedError("A PagedCache keeps its blocks in its KVPool; offloading single layers is not supported.")

    def prefetch(self) -> None:
        """Nothing to do: blocks live on their layer's device."""

    # Whole-cache operations: every layer shares the rows' block tables.
    def reset(self) -> None:
        self._whole_cache("reset()")

    def crop(self, max_length: int) -> None:
        self._whole_cache("crop()")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole_cache("reorder_cache()")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache("batch_repeat_interleave()")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache("batch_select_indices()")

    @staticmethod
    def _whole_cache(what: str) -> None:
        raise NotImplementedError(
            f"A PagedCache's layers share one block table per row; call {what} on the cache, which applies it "
            "to every layer."
        )

    @staticmethod
    def _refuse_write(what: str) -> None:
        raise AttributeError(
            f"PagedLayer.{what} is a read-only view of the cache's blocks; write K/V through cache.update()."
        )


def paged_layers(
    cache: PagedCache, current: list[PagedLayer], layout: LayerLayout, learned_layers: int | None
) -> list[PagedLayer]:
    """One `PagedLayer` per model layer once their number is known (from the pool's layout, else from the
    layers a forward wrote); `current` when it already has that many."""
    count = max(layout.layer_to_group, default=-1) + 1 if layout.num_layers is not None else learned_layers or 0
    if len(current) == count:
        return current
    windows = [g.sliding_window for g in layout.groups]
    return [
        PagedLayer(cache, i, windows[layout.layer_to_group[i]] if i in layout.layer_to_group else None)
        for i in range(count)
    ]
