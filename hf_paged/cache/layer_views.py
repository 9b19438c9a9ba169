"""`PagedLayer`: the per-layer view `transformers.Cache.layers` expects, over a `PagedCache`'s blocks.

transformers walks `cache.layers` (e.g. `generate()` of 5.24 decides from `cache.is_linear` whether a
continued prompt is sliced, and its test helpers read `layer.keys`). A `PagedCache` keeps one block table
per row for all layers of a group, so its layers are views: `keys`/`values` gather the layer's K/V
(right-aligned like a left-padded contiguous cache) when read, and whole-cache operations (crop, beam
reorder, reset, ...) go through the cache, which applies them to every layer at once. A hybrid model's
recurrent layers are `PagedStateLayer`s (transformers' `LinearAttentionLayer` API: `is_linear` is True for
them) and its layers with both a state and attention `PagedHybridLayer`s.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

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


class PagedStateLayer(LinearAttentionCacheLayerMixin):
    """A recurrent layer of a `PagedCache` (hybrid models), as transformers' `LinearAttentionLayer` in
    `Cache.layers[i]`: `conv_states` / `recurrent_states` / `has_previous_state` read every row's latest states
    (`{state_idx: [batch, ...]}`: the forward in flight's, else copies of the committed slots); the states are
    written through the cache's `update_*_state`."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx

    @property
    def is_croppable(self) -> bool:
        return self.cache.is_croppable

    @property
    def record_past(self) -> bool:
        """Whether the cache records its recurrent states' past (`activate_past_recording`); transformers sets it
        False when it gives a cache back (5.25's deferred stop check), which stops the recording."""
        return self.cache.is_recording_past(self.layer_idx)

    @record_past.setter
    def record_past(self, value: bool) -> None:
        if value:
            self.cache.activate_past_recording()
        else:
            self.cache.stop_recording_past()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer_idx={self.layer_idx})"

    @property
    def cache(self) -> PagedCache:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("This layer's PagedCache was garbage-collected.")
        return cache

    @property
    def conv_states(self) -> dict[int, torch.Tensor | None]:
        return self._committed("conv")

    @property
    def recurrent_states(self) -> dict[int, torch.Tensor | None]:
        return self._committed("recurrent")

    @property
    def has_previous_state(self) -> dict[int, bool]:
        states = self.cache.states
        return {i: states.has_previous(self.layer_idx, i) for i in self._state_indices()}

    def _state_indices(self) -> list[int]:
        states = self.cache.states
        return sorted({i for layer, i in states.previous | states.written if layer == self.layer_idx}) or [0]

    def _committed(self, kind: str) -> dict[int, torch.Tensor | None]:
        states = self.cache.states
        return {i: states.current((self.layer_idx, kind, i)) for i in self._state_indices()}

    def lazy_initialization(self, *args: object, **kwargs: object) -> None:
        """Nothing to do: the pool's state slots are made on the first write."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: object) -> torch.Tensor:
        return self.cache.update_conv_state(conv_states, self.layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: object) -> torch.Tensor:
        return self.cache.update_recurrent_state(recurrent_states, self.layer_idx, state_idx, **kwargs)

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        raise NotImplementedError("A PagedCache keeps its states in its KVPool; offloading single layers is not supported.")

    def prefetch(self) -> None:
        """Nothing to do: states live on their layer's device."""

    def reset(self) -> None:
        PagedLayer._whole_cache("reset()")

    def crop(self, tokens_to_remove: int) -> None:
        PagedLayer._whole_cache("crop()")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        PagedLayer._whole_cache("reorder_cache()")

    def batch_repeat_interleave(self, repeats: int) -> None:
        PagedLayer._whole_cache("batch_repeat_interleave()")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        PagedLayer._whole_cache("batch_select_indices()")

    def activate_past_recording(self, **kwargs: object) -> None:
        self.cache.activate_past_recording(**kwargs)

    def increase_count(self, state_idx: int = 0) -> None:
        self.cache.increase_count(self.layer_idx, state_idx)

    def get_seq_length(self) -> int:
        """The cache's length (transformers 5.25 on asks each layer): the tokens the rows went through."""
        return self.cache.get_seq_length(self.layer_idx)


class PagedHybridLayer(PagedStateLayer, PagedLayer):
    """A layer with a recurrent state and attention K/V (transformers' `LinearAttentionAndFullAttentionLayer`)."""

    def __init__(self, cache: PagedCache, layer_idx: int, sliding_window: int | None) -> None:
        PagedLayer.__init__(self, cache, layer_idx, sliding_window)

    def lazy_initialization(self, *args: object, **kwargs: object) -> None:
        """Nothing to do: blocks and state slots are made on the first write."""


def paged_layers(
    cache: PagedCache, current: list[PagedLayer], layout: LayerLayout, learned_layers: int | None
) -> list[PagedLayer]:
    """One `PagedLayer` per model layer once their number is known (from the pool's layout, else from the
    layers a forward wrote); `current` when it already has that many."""
    count = max(layout.layer_to_group, default=-1) + 1 if layout.num_layers is not None else learned_layers or 0
    if layout.state_layers:
        count = max(count, layout.state_layers[-1] + 1)
    if len(current) == count:
        return current
    windows = [g.sliding_window for g in layout.groups]
    states = set(layout.state_layers)
    layers: list[PagedLayer] = []
    for i in range(count):
        window = windows[layout.layer_to_group[i]] if i in layout.layer_to_group else None
        if i not in states:
            layers.append(PagedLayer(cache, i, window))
        elif i in layout.layer_to_group:
            layers.append(PagedHybridLayer(cache, i, window))
        else:
            layers.append(PagedStateLayer(cache, i))
    return layers
