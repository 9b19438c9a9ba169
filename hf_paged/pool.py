"""`KVPool`: block storage shared by many caches, with automatic prefix caching."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from .allocator import BlockAllocator
from .errors import CacheMismatchError
from .layers import DEFAULT_LAYOUT, LayerLayout, layout_from_config
from .quant import SCALE_DTYPE, KVFormat, byte_view, kv_format
from .stats import PoolStats

if TYPE_CHECKING:
    from .cache import PagedCache


def _validate_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size!r}; 16 is typical.")
    return block_size


class KVPool:
    """Paged K/V storage for one model, shared by any number of `PagedCache` objects.

    Per layer it holds one key and one value tensor of shape `[num_blocks, block_size, num_kv_heads,
    head_dim]`, created on the first write with the dtype, device and heads of that layer's keys (so
    `device_map` placements keep each layer's blocks on its device). Layers of the same attention type
    share block ids (see `layers.py`). With `prefix_caching`, full blocks whose tokens are known are
    indexed by a chained digest; `new_cache(input_ids)` returns a cache that already holds the longest
    cached prefix of each prompt, so stock `generate()` computes only the rest.

    Args:
        config: the model config (positional). Optional: without it the layout is learned from the
            first forward (the `"paged"` attention function reads it from the model).
        block_size: tokens per block.
        max_memory: fixed budget in bytes for K and V of all layers; the pool never grows past it.
        num_blocks: fixed number of blocks per layer group (alternative to `max_memory`).
        prefix_caching: index full blocks for reuse by later caches.
        kv_dtype: None stores K/V in the model's dtype; `"int8"`, `"fp8_e4m3"` or `"fp8_e5m2"` store one
            byte per element plus a float16 scale per token and KV head (`quant.py`, `docs/quantized-kv.md`):
            about a quarter of float32's bytes, half of bfloat16's. Attention reads them dequantized.

    Raises `OutOfBlocksError` when a fixed pool cannot hold a step; without a fixed size it grows.

    Thread safety: the public methods take the pool's lock, and callers of `ensure_allocators()`, `storage()` and
    `copy_blocks()` hold it, so several threads may run `generate()` with
    caches of one pool concurrently; each cache itself belongs to one thread at a time.

    Example:
        >>> pool = hf_paged.KVPool(model.config, block_size=16)
        >>> with pool.new_cache(inputs.input_ids, inputs.attention_mask) as cache:
        ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    """

    def __init__(
        self,
        config: PretrainedConfig | None = None,
        *,
        block_size: int = 16,
        max_memory: int | None = None,
        num_blocks: int | None = None,
        prefix_caching: bool = True,
        kv_dtype: str | None = None,
    ) -> None:
        self.kv_format: KVFormat | None = kv_format(kv_dtype)
        self.kv_dtype = kv_dtype
        self.block_size = _validate_block_size(block_size)
        if max_memory is not None and num_blocks is not None:
            raise ValueError("Pass either max_memory (bytes) or num_blocks, not both.")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}.")
        if max_memory is not None and (not isinstance(max_memory, int) or max_memory < 1):
            raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}.")
        self.max_memory = max_memory
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.config: PretrainedConfig | None = None
        self.layout: LayerLayout = DEFAULT_LAYOUT
        self.allocators: list[BlockAllocator] | None = None
        self.key_caches: dict[int, torch.Tensor] = {}
        self.value_caches: dict[int, torch.Tensor] = {}
        # Quantized pools only: per layer, float16 scales `[num_blocks, block_size, num_kv_heads]` of K and V,
        # and the dtype the model computes K/V in (what attention reads them back as).
        self.key_scales: dict[int, torch.Tensor] = {}
        self.value_scales: dict[int, torch.Tensor] = {}
        self.model_dtypes: dict[int, torch.dtype] = {}
        self.lock = threading.RLock()
        self.caches: weakref.WeakSet[PagedCache] = weakref.WeakSet()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        if config is not None:
            self.bind_config(config)

    # ------------------------------------------------------------------ binding
    def bind_config(self, config: PretrainedConfig) -> None:
        """Adopts the model's layer layout. Only possible before the first block is allocated."""
        with self.lock:
            if self.config is config:
                return
            layout = layout_from_config(config)
            if self.allocators is not None:
                mine, theirs = (self.layout.groups, self.layout.layer_to_group), (layout.groups, layout.layer_to_group)
                if mine != theirs and self.layout.num_layers is not None:
                    raise CacheMismatchError(
                        f"This KVPool already stores K/V for a model with {self.layout.num_layers} cached layers "
                        f"({self.layout.groups}), but this model has {layout.num_layers} ({layout.groups}); a cache "
                        "or KVPool serves one model: use a new PagedCache/KVPool for this one."
                    )
                if self.layout.num_layers is None:  # learned lazily; keep the layout blocks were made for
                    self.config = config
                    return
            self.config, self.layout = config, layout

    def ensure_allocators(self, key_states: torch.Tensor) -> list[BlockAllocator]:
        """Creates the per-group allocators on first use, sizing fixed pools from the first keys.

        Args:
            key_states: `[batch, num_kv_heads, q_len, head_dim]` keys of the first layer.
        """
        if self.allocators is None:
            max_blocks = self.num_blocks
            if self.max_memory is not None:
                if self.layout.num_layers is None:
                    raise ValueError(
                        "KVPool(max_memory=...) needs the number of layers: pass the model config, "
                        "KVPool(model.config, max_memory=...), or use num_blocks=..."
                    )
                _, num_kv_heads, _, head_dim = key_states.shape
                per_block = 2 * self.block_size * num_kv_heads * self.bytes_per_token_head(head_dim, key_states.dtype)
                max_blocks = self.max_memory // (per_block * self.layout.num_layers)
                if max_blocks < 1:
                    raise ValueError(
                        f"max_memory={self.max_memory} bytes cannot hold one block of every layer "
                        f"({per_block * self.layout.num_layers} bytes); raise it or lower block_size."
                    )
            self.allocators = [
                BlockAllocator(self.block_size, 0, max_blocks, self.prefix_caching) for _ in self.layout.groups
            ]
        return self.allocators

    def bytes_per_token_head(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes one token of one KV head takes in K (or in V): its elements plus, if quantized, its scale."""
        if self.kv_format is None:
            return head_dim * torch.empty((), dtype=model_dtype).element_size()
        return head_dim * self.kv_format.bytes_per_element + self.kv_format.scale_bytes

    # ------------------------------------------------------------------ storage
    def storage(self, layer_idx: int, key_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value pool tensors of a layer, `[num_blocks, block_size, num_kv_heads, head_dim]`,
        created or grown to the group's capacity, checked against the incoming keys.

        Args:
            layer_idx: the layer.
            key_states: `[batch, num_kv_heads, q_len, head_dim]` keys about to be written.
        """
        capacity = self.allocators[self.layout.group_of(layer_idx)].capacity
        _, num_kv_heads, _, head_dim = key_states.shape
        key_cache = self.key_caches.get(layer_idx)
        if key_cache is not None:
            expected = (num_kv_heads, head_dim, key_states.dtype, key_states.device)
            found = (key_cache.shape[2], key_cache.shape[3], self.model_dtypes[layer_idx], key_cache.device)
            if expected != found:
                raise CacheMismatchError(
                    f"Layer {layer_idx} of this cache's pool stores K/V as (num_kv_heads, head_dim, dtype, "
                    f"device) = {found}, but the model now gives {expected}. A cache or KVPool serves one "
                    "model; create a new PagedCache/KVPool for this one (or call cache.reset())."
                )
            if key_cache.shape[0] >= capacity:
                return key_cache, self.value_caches[layer_idx]
        shape = (capacity, self.block_size, num_kv_heads, head_dim)
        dtype = key_states.dtype if self.kv_format is None else self.kv_format.storage_dtype
        new_key = torch.zeros(shape, dtype=dtype, device=key_states.device)
        new_value = torch.zeros_like(new_key)
        if key_cache is not None:  # grow: keep the blocks written so far
            byte_view(new_key)[: key_cache.shape[0]].copy_(byte_view(key_cache))
            byte_view(new_value)[: key_cache.shape[0]].copy_(byte_view(self.value_caches[layer_idx]))
        self.key_caches[layer_idx], self.value_caches[layer_idx] = new_key, new_value
        self.model_dtypes[layer_idx] = key_states.dtype
        if self.kv_format is not None:
            for scales in (self.key_scales, self.value_scales):
                grown = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=key_states.device)
                if layer_idx in scales:
                    grown[: scales[layer_idx].shape[0]].copy_(scales[layer_idx])
                scales[layer_idx] = grown
        return new_key, new_value

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized layer's K and V scales, `[num_blocks, block_size, num_kv_heads]` float16 each (as large
        as its storage); None for unquantized storage."""
        if self.kv_format is None:
            return None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def _grow_layers(self, layers: list[int]) -> None:
        """Grows existing layer tensors to their group's capacity (before copying into new block ids)."""
        for layer_idx in layers:
            key_cache = self.key_caches[layer_idx]
            shape = (1, key_cache.shape[2], 1, key_cache.shape[3])
            self.storage(layer_idx, torch.empty(shape, dtype=self.model_dtypes[layer_idx], device=key_cache.device))

    def layers_of_group(self, group_id: int) -> list[int]:
        """Layer indices with storage in a group."""
        return [i for i in self.key_caches if self.layout.group_of(i) == group_id]

    def copy_blocks(self, group_id: int, src: list[int], dst: list[int]) -> None:
        """Copies whole blocks `src[i] -> dst[i]` in every layer of a group (copy-on-write)."""
        if not src:
            return
        layers = self.layers_of_group(group_id)
        if not layers:
            return
        self._grow_layers(layers)
        from .backend import copy_blocks  # noqa: PLC0415 - avoids an import cycle

        copy_blocks(
            [byte_view(self.key_caches[i]) for i in layers], [byte_view(self.value_caches[i]) for i in layers],
            src, dst, self.block_size,
        )
        if self.kv_format is not None:  # a slot's scale travels with it
            copy_blocks([self.key_scales[i] for i in layers], [self.value_scales[i] for i in layers], src, dst, self.block_size)

    # ------------------------------------------------------------------ caches
    def new_cache(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        salt: str | bytes | None = None,
    ) -> PagedCache:
        """A `PagedCache` on this pool, holding the longest cached prefix of each prompt row.

        Args:
            input_ids: `[batch, seq_len]` (left-padded) prompts, or None for an empty cache.
            attention_mask: `[batch, seq_len]`, 0 on padding; None when there is none.
            salt: tenant key. Prefixes cached under one salt are never hit (nor timed) under another.

        Returns:
            A cache whose `get_seq_length()` tells `generate()` how many prompt columns it already holds.
            It records the prompt tokens, so its own full blocks are indexed for later caches.
        """
        from .cache import PagedCache  # noqa: PLC0415 - import cycle

        cache = PagedCache(pool=self, salt=salt)
        if input_ids is not None:
            cache.load_prompt(input_ids, attention_mask)
        return cache

    def register_cache(self, cache: PagedCache) -> None:
        with self.lock:
            self.caches.add(cache)

    # ------------------------------------------------------------------ stats and invariants
    def _live_refs(self) -> list[Counter[int]]:
        refs: list[Counter[int]] = [Counter() for _ in self.layout.groups]
        for cache in list(self.caches):
            for group_id, counter in enumerate(cache.block_refs()):
                refs[group_id].update(counter)
        return refs

    def _bytes_per_block(self) -> list[int]:
        sizes = [0] * len(self.layout.groups)
        for layer_idx, key_cache in self.key_caches.items():
            per_block = key_cache[0].numel() * key_cache.element_size() * 2
            sizes[self.layout.group_of(layer_idx)] += per_block + self._scale_bytes_per_block(layer_idx)
        return sizes

    def _scale_bytes_per_block(self, layer_idx: int) -> int:
        """Bytes of one block's K and V scales in a layer (0 unquantized)."""
        if layer_idx not in self.key_scales:
            return 0
        return self.key_scales[layer_idx][0].numel() * self.key_scales[layer_idx].element_size() * 2

    def stats(self) -> PoolStats:
        """Memory and sharing statistics over all caches of this pool."""
        with self.lock:
            return self._stats(None)

    def _stats(self, only: PagedCache | None) -> PoolStats:
        stats = PoolStats(block_size=self.block_size, kv_dtype=self.kv_dtype)
        stats.scale_bytes_reserved = sum(t.nbytes for t in self.key_scales.values()) * 2
        stats.bytes_reserved = sum(t.nbytes for t in self.key_caches.values()) * 2 + stats.scale_bytes_reserved
        stats.prefix_hit_tokens = (only or self).prefix_hit_tokens
        stats.prefix_query_tokens = (only or self).prefix_query_tokens
        if self.allocators is None:
            return stats
        caches = [only] if only is not None else list(self.caches)
        bytes_per_block = self._bytes_per_block()
        scale_bytes_per_block = [0] * len(self.layout.groups)
        for layer_idx in self.key_scales:
            scale_bytes_per_block[self.layout.group_of(layer_idx)] += self._scale_bytes_per_block(layer_idx)
        for group_id, allocator in enumerate(self.allocators):
            filled: dict[int, int] = {}
            for cache in caches:
                for block_id, count in cache.filled_slots(group_id).items():
                    filled[block_id] = max(filled.get(block_id, 0), count)
            stats.blocks_total += allocator.capacity
            stats.blocks_in_use += len(filled)
            stats.blocks_shared += sum(allocator.blocks[b].ref_count > 1 for b in filled)
            stats.tokens_stored += sum(filled.values())
            stats.bytes_in_use += len(filled) * bytes_per_block[group_id]
            stats.scale_bytes_in_use += len(filled) * scale_bytes_per_block[group_id]
            stats.evictions += allocator.num_evictions
            if only is None:
                stats.blocks_cached += len(allocator.evictable)
                stats.blocks_free += len(allocator.free_ids)
        return stats

    def check(self) -> None:
        """Verifies every invariant of the pool and its live caches; raises AssertionError if one fails.

        Each block is free, cached or in use, never two; reference counts equal the references from live
        block tables; the free queue holds no referenced block; every block-table entry points into the
        pool; every row's table holds exactly the blocks its token count needs; indexed blocks are full;
        in a quantized pool, every scale of a slot a live row holds is finite and positive.
        """
        with self.lock:
            for cache in list(self.caches):
                cache.check_rows()
            if self.allocators is None:
                return
            for allocator, refs in zip(self.allocators, self._live_refs(), strict=True):
                allocator.check(dict(refs))
            self._check_scales()

    def _check_scales(self) -> None:
        """Every filled slot of a live row has finite, positive K and V scales in every layer."""
        caches = list(self.caches)
        for layer_idx, key_scale in self.key_scales.items():
            group_id = self.layout.group_of(layer_idx)
            filled: dict[int, int] = {}
            for cache in caches:
                for block_id, count in cache.filled_slots(group_id).items():
                    filled[block_id] = max(filled.get(block_id, 0), count)
            slots = [b * self.block_size + i for b, count in filled.items() for i in range(count)]
            if not slots:
                continue
            index = torch.tensor(slots, dtype=torch.int64, device=key_scale.device)
            for name, scale in (("K", key_scale), ("V", self.value_scales[layer_idx])):
                values = scale.view(-1, scale.shape[2]).index_select(0, index).float()
                bad = ~(torch.isfinite(values) & (values > 0)).all(dim=1)
                assert not bool(bad.any()), (
                    f"layer {layer_idx}: {name} scales of filled slots {index[bad].tolist()[:8]} are not finite and "
                    "positive"
                )

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix; their blocks become free."""
        with self.lock:
            for allocator in self.allocators or []:
                allocator.clear_index()
