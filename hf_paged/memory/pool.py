"""`BlockPool`: the K/V storage of one model — per-layer block tensors, one allocator per layer group, a lock.

The pool owns the tensors and the allocators and knows nothing of caches: block tables live above it
(`rows.py`), register themselves for `check()` through `register_tables()`, and change reference counts
through the allocators while holding `lock`. `KVPool` (`kvpool.py`) is this pool plus `new_cache()`.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import Counter
from typing import Protocol

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from .allocator import BlockAllocator
from ..distributed import agree_min
from ..backend import backend_for, copy_blocks
from .budget import blocks_in_budget, parse_max_memory, validate_block_size
from ..errors import CacheMismatchError
from ..support import hits_over_placeholders, placeholder_token_ids, resumes_recurrent_states
from .layers import DEFAULT_LAYOUT, LayerLayout, layout_from_config
from .quant import SCALE_DTYPE, KVFormat, byte_view, check_scales, kv_format
from .slots import new_pool_tensor, storage_zeros
from .state_slots import StateSlots
from .stats import PoolStats

#: Of a hybrid model's `max_memory`, the share kept for state slots (live rows' states and the prefix index's
#: snapshots); K/V blocks get the rest. Snapshots are dropped (least recently used first) to stay within it.
STATE_SHARE = 0.25


class TableOwner(Protocol):
    """What `check()` asks of a holder of block tables (a cache's `Rows`)."""

    def block_refs(self, group_id: int) -> Counter[int]:
        """Block id -> references this holder has in a group (tables and held copy-on-write sources)."""

    def usage(self, group_id: int) -> dict[int, int]:
        """Block id -> the most token slots any of its rows fills in that block of a group."""

    def check(self) -> None:
        """Raises AssertionError if a row's table does not hold exactly the blocks its length needs."""


class StateOwner(Protocol):
    """What `check()` asks of a holder of state slots (a cache's `RowStates`)."""

    def slot_refs(self) -> Counter[int]:
        """Slot id -> references this holder has."""


class BlockPool:
    """Paged K/V storage for one model, shared by any number of `PagedCache` objects.

    Per layer: K `[num_blocks, block_size, num_kv_heads, head_dim]` and V `[..., head_dim_v]` (widths differ only
    in multi-latent attention), made on the first write with that layer's dtype, device and heads (so
    `device_map` keeps each layer's blocks on its device). Layers of one attention type share block ids (`layers.py`). With `prefix_caching`, full blocks of known tokens are indexed
    by a chained digest, and `KVPool.new_cache(input_ids)` starts a cache from the longest cached prefix of each
    prompt.

    Args:
        config: the model config (positional). Optional: without it the layout is learned from the
            first forward (the `"paged"` attention function reads it from the model).
        block_size: tokens per block.
        max_memory: fixed budget for K and V of all layers, sized up front; the pool never grows past it. Bytes,
            or a share of the memory free on the devices holding the layers when the first block is made, such as
            `"90%"` (`budget.py`; `KVPool.for_model` tells the pool where each layer lives).
        num_blocks: fixed number of blocks per layer group (alternative to `max_memory`).
        prefix_caching: index full blocks for reuse by later caches.
        layer_devices: layer index -> the device its K/V will live on (default: the first layer's keys' device).
        kv_dtype: None stores K/V in the model's dtype; `"int8"`, `"fp8_e4m3"` or `"fp8_e5m2"` store one
            byte per element plus a float16 scale per token and KV head (`quant.py`, `docs/quantized-kv.md`):
            about a quarter of float32's bytes, half of bfloat16's. Attention reads them dequantized.

    Raises `OutOfBlocksError` when a fixed pool cannot hold a step; without a fixed size it grows.

    Thread safety: `lock` guards the allocators, the tensors' growth, and the counters. `bind_config`,
    `register_tables`, `note_prefix_lookup`, `stats`, `usage_stats`, `check` and
    `clear_prefix_cache` take it; callers of `ensure_allocators()`, `storage_for_write()`, `scales()` and `copy_blocks()` hold
    it. Several threads may run `generate()` with caches of one pool; each cache belongs to one thread at a time.
    """

    def __init__(
        self,
        config: PretrainedConfig | None = None,
        *,
        block_size: int = 16,
        max_memory: int | str | None = None,
        num_blocks: int | None = None,
        prefix_caching: bool = True,
        kv_dtype: str | None = None,
        layer_devices: dict[int, torch.device] | None = None,
    ) -> None:
        self.kv_format: KVFormat | None = kv_format(kv_dtype)
        self.kv_dtype = kv_dtype
        self.block_size = validate_block_size(block_size)
        if max_memory is not None and num_blocks is not None:
            raise ValueError("Pass either max_memory (bytes) or num_blocks, not both.")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}.")
        self.max_memory = parse_max_memory(max_memory)  # bytes, or a fraction of free memory (budget.py)
        self.layer_devices = dict(layer_devices or {})
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.config: PretrainedConfig | None = None
        self.layout: LayerLayout = DEFAULT_LAYOUT
        # The token ids standing for non-text input (`support.placeholder_token_ids`) and whether prefix hits may
        # cover them, from the configs the pool learns (`learn_placeholders`). Kept when the pool adopts a
        # vision-language model's own language model config at a forward, which names no placeholder.
        self.placeholder_ids: frozenset[int] = frozenset()
        self.hits_over_placeholders = False
        self.allocators: list[BlockAllocator] | None = None
        self.key_caches: dict[int, torch.Tensor] = {}
        self.value_caches: dict[int, torch.Tensor] = {}
        # Quantized pools only: per layer, float16 scales `[num_blocks, block_size, num_kv_heads]` of K and V.
        self.key_scales: dict[int, torch.Tensor] = {}
        self.value_scales: dict[int, torch.Tensor] = {}
        # Per layer, what the model writes: (num_kv_heads, head_dim, head_dim_v, dtype, device); the dtype is
        # what attention reads K/V back as.
        self._written: dict[int, tuple[int, int, int, torch.dtype, torch.device]] = {}
        # Per layer, whether its tensors are head-major (`new_pool_tensor`): fixed by its first tensors, kept when grown.
        self._head_major: dict[int, bool] = {}
        self.lock = threading.RLock()
        self._owners: weakref.WeakSet[TableOwner] = weakref.WeakSet()
        # Hybrid models: each sequence's recurrent-layer states, one slot per sequence (`state_slots.py`).
        self.state_slots = StateSlots()
        self._state_owners: weakref.WeakSet[StateOwner] = weakref.WeakSet()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        if config is not None:
            self.bind_config(config)

    def bind_config(self, config: PretrainedConfig) -> None:
        """Adopts the model's layer layout. Only possible before the first block is allocated."""
        with self.lock:
            if self.config is config:
                return
            self.learn_placeholders(config)
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

    def learn_placeholders(self, config: PretrainedConfig) -> None:
        """Keeps what a model's config says of its placeholder tokens (`placeholder_ids`), unless it names none
        (a language model's own config inside a vision-language model)."""
        ids = placeholder_token_ids(config)
        if ids:
            with self.lock:
                self.placeholder_ids, self.hits_over_placeholders = ids, hits_over_placeholders(config)

    def ensure_allocators(
        self, key_states: torch.Tensor, head_dim_v: int | None = None, group: dist.ProcessGroup | None = None
    ) -> list[BlockAllocator]:
        """Creates the per-group allocators on first use, sizing fixed pools from the first keys.

        Args:
            key_states: `[batch, num_kv_heads, q_len, head_dim]` keys of the first layer.
            head_dim_v: the values' width (None: `head_dim`).
            group: the tensor-parallel group of the model's ranks, or None: a `max_memory` pool takes the fewest
                blocks any rank's budget holds (a share of each rank's free memory differs), so that every rank
                allocates, preempts and evicts alike.
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
                per_token = num_kv_heads * (self.bytes_per_token_head(head_dim, key_states.dtype)
                                            + self.bytes_per_token_head(head_dim_v or head_dim, key_states.dtype))
                budget = self.max_memory
                if self.layout.is_hybrid:  # the rest is the state slots' (`hold_snapshot`)
                    budget = budget * (1 - STATE_SHARE) if isinstance(budget, float) else int(budget * (1 - STATE_SHARE))
                max_blocks = blocks_in_budget(budget, self.block_size * per_token, self.layout.layer_to_group,
                                              self.layer_devices, key_states.device)
                if group is not None:
                    max_blocks = agree_min(max_blocks, group, key_states.device)
            # The PyTorch path reads a lone row's blocks in place when they are one run of ids, so there the
            # allocator may move cached blocks out of a growing row's way; the Triton kernels and a quantized pool
            # read through the block tables either way.
            movable = backend_for(key_states.device) == "torch" and self.kv_format is None
            self.allocators = [
                BlockAllocator(
                    self.block_size, 0, max_blocks, self.prefix_caching, self._release_snapshot,
                    on_move=functools.partial(self.copy_blocks, group_id) if movable else None,
                )
                for group_id in range(len(self.layout.groups))
            ]
        return self.allocators

    def bytes_per_token_head(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes one token of one KV head takes in K (or in V): its elements plus, if quantized, its scale."""
        if (fmt := self.kv_format) is None:
            return head_dim * torch.empty((), dtype=model_dtype, device="cpu").element_size()
        return head_dim * fmt.bytes_per_element + fmt.scale_bytes

    # ------------------------------------------------------------------ storage
    def storage_for_write(
        self, layer_idx: int, key_states: torch.Tensor, head_dim_v: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value pool tensors of a layer, `[num_blocks, block_size, num_kv_heads, head_dim]` and
        `[num_blocks, block_size, num_kv_heads, head_dim_v]`, created or grown to the group's capacity,
        checked against the incoming K/V. A layer's first tensors take the layout of the path that will read them
        (`new_pool_tensor`): head-major for the PyTorch path, token-major (contiguous) for the Triton kernels.

        Args:
            layer_idx: the layer.
            key_states: `[batch, num_kv_heads, q_len, head_dim]` keys about to be written.
            head_dim_v: the width of the values about to be written (None: `head_dim`).
        """
        capacity = self.allocators[self.layout.group_of(layer_idx)].capacity
        _, num_kv_heads, _, head_dim = key_states.shape
        written = (num_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v, key_states.dtype, key_states.device)
        head_dim_v = written[2]
        key_cache = self.key_caches.get(layer_idx)
        if key_cache is not None:
            if written != self._written[layer_idx]:
                raise CacheMismatchError(
                    f"Layer {layer_idx} of this cache's pool stores K/V as (num_kv_heads, head_dim, head_dim_v, "
                    f"dtype, device) = {self._written[layer_idx]}, but the model now gives {written}. A cache or "
                    "KVPool serves one model: create a new PagedCache (or KVPool) for this one."
                )
            if key_cache.shape[0] >= capacity:
                return key_cache, self.value_caches[layer_idx]
        shape = (capacity, self.block_size, num_kv_heads, head_dim)
        dtype = key_states.dtype if self.kv_format is None else self.kv_format.storage_dtype
        head_major = self._head_major.setdefault(layer_idx, backend_for(key_states.device) == "torch")
        new_key = new_pool_tensor(shape, dtype, key_states.device, head_major)
        new_value = new_pool_tensor((*shape[:3], head_dim_v), dtype, key_states.device, head_major)
        if key_cache is not None:  # grow: keep the blocks written so far
            byte_view(new_key)[: key_cache.shape[0]].copy_(byte_view(key_cache))
            byte_view(new_value)[: key_cache.shape[0]].copy_(byte_view(self.value_caches[layer_idx]))
        self.key_caches[layer_idx], self.value_caches[layer_idx] = new_key, new_value
        self._written[layer_idx] = written
        if self.kv_format is not None:
            for scales in (self.key_scales, self.value_scales):
                grown = storage_zeros(shape[:3], SCALE_DTYPE, key_states.device)
                if layer_idx in scales:
                    grown[: scales[layer_idx].shape[0]].copy_(scales[layer_idx])
                scales[layer_idx] = grown
        return new_key, new_value

    def has_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.key_caches  # whether a layer has stored anything yet

    def layer_storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's key and value tensors as they are, `[num_blocks, block_size, num_kv_heads, head_dim]` and
        `[..., head_dim_v]`; None before the layer stored anything."""
        key_cache = self.key_caches.get(layer_idx)
        return None if key_cache is None else (key_cache, self.value_caches[layer_idx])

    def model_dtype(self, layer_idx: int) -> torch.dtype:
        """The dtype the model computes a layer's K/V in (what reads give back)."""
        return self._written[layer_idx][3]

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A quantized layer's K and V scales, `[num_blocks, block_size, num_kv_heads]` float16 each (as large
        as its storage); None for unquantized storage."""
        if self.kv_format is None:
            return None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def grow_storage(self) -> None:
        """Grows every stored layer's tensors to its group's capacity now (a write does it lazily; a compiled step
        that writes through the custom ops needs them at capacity before it runs)."""
        with self.lock:
            self._grow_layers(list(self.key_caches))

    def _grow_layers(self, layers: list[int]) -> None:
        """Grows existing layer tensors to their group's capacity (before copying into new block ids)."""
        for layer_idx in layers:
            key_cache = self.key_caches[layer_idx]
            shape = (1, key_cache.shape[2], 1, key_cache.shape[3])
            keys = torch.empty(shape, dtype=self.model_dtype(layer_idx), device=key_cache.device)
            self.storage_for_write(layer_idx, keys, self.value_caches[layer_idx].shape[3])

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
        copy_blocks(
            [byte_view(self.key_caches[i]) for i in layers], [byte_view(self.value_caches[i]) for i in layers],
            src, dst, self.block_size,
        )
        if self.kv_format is not None:  # a slot's scale travels with it
            copy_blocks([self.key_scales[i] for i in layers], [self.value_scales[i] for i in layers], src, dst, self.block_size)

    def register_tables(self, owner: TableOwner) -> None:
        """Lets `check()` see a holder of block tables (a cache's `Rows`); held weakly."""
        with self.lock:
            self._owners.add(owner)

    def register_states(self, owner: StateOwner) -> None:
        """Lets `check()` see a holder of state slots (a cache's `RowStates`); held weakly."""
        with self.lock:
            self._state_owners.add(owner)

    # ------------------------------------------------------------------ state snapshots (hybrids)
    @property
    def keeps_state_snapshots(self) -> bool:
        """Whether this pool keeps recurrent-state snapshots for prefix hits: a hybrid model whose forwards continue
        from a restored state (`support.resumes_recurrent_states`), with prefix caching."""
        return self.prefix_caching and self.layout.is_hybrid and resumes_recurrent_states(self.config)

    @property
    def snapshot_group(self) -> int:
        """The layer group whose indexed blocks hold the state snapshots: the first full-attention group."""
        return next((g.group_id for g in self.layout.groups if g.sliding_window is None), 0)

    def hold_snapshot(self, block_id: int, slot: int) -> bool:
        """Keeps the states of state slot `slot` (a row's committed slot, which holds the states after the last
        token of `block_id` of the snapshot group) as that indexed block's snapshot: the index takes a reference
        to the slot, so the row's next commit writes a fresh slot (copy-on-write). Under `max_memory`, least
        recently used snapshots are then dropped until the state slots in use fit `STATE_SHARE` of it.
        Callers hold the lock.

        Returns:
            Whether the block holds a snapshot now (False: not indexed, already holding one, or no room).
        """
        allocator = self.allocators[self.snapshot_group]
        if not allocator.attach_snapshot(block_id, slot):
            return False
        self.state_slots.incref([slot])
        budget = self._state_budget()
        while budget is not None and self.state_slots.num_in_use * self.state_slots.bytes_per_slot > budget:
            if not allocator.drop_oldest_snapshot():
                break
        return block_id in allocator.snapshots

    def take_snapshot(self, digest: bytes, token_ids: tuple[int, ...]) -> int | None:
        """A reference to the snapshot slot at the end of the indexed block `digest` names in the snapshot group,
        or None. The caller owns the reference (a row's slot, copied on its first write). Callers hold the lock."""
        slot = self.allocators[self.snapshot_group].snapshot(digest, token_ids)
        if slot is not None:
            self.state_slots.incref([slot])
        return slot

    def has_snapshot(self, digest: bytes, token_ids: tuple[int, ...]) -> bool:
        """Whether the indexed block `digest` names in the snapshot group holds a snapshot. Callers hold the lock."""
        return self.allocators is not None and self.allocators[self.snapshot_group].snapshot(digest, token_ids) is not None

    def _release_snapshot(self, slot: int) -> None:
        """The allocator let go of a snapshot (its block was evicted, or the snapshot dropped): drops its slot."""
        self.state_slots.decref([slot])

    def _state_budget(self) -> int | None:
        """Bytes the state slots may take under `max_memory` (`STATE_SHARE` of it), or None without a byte budget."""
        if self.max_memory is None:
            return None
        kv_bytes = sum(t.nbytes for t in self.key_caches.values()) + sum(t.nbytes for t in self.value_caches.values())
        kv_bytes += sum(t.nbytes for t in self.key_scales.values()) * 2
        return int(kv_bytes * STATE_SHARE / (1 - STATE_SHARE))

    def _snapshot_counts(self) -> tuple[int, int]:
        """(snapshots held by the prefix index, state slots held by nothing else)."""
        if not self.allocators:
            return 0, 0
        refs = self.allocators[self.snapshot_group].snapshot_refs()
        only = sum(1 for slot, count in refs.items() if self.state_slots.ref_count(slot) == count)
        return sum(refs.values()), only

    def note_prefix_lookup(self, looked_up: int, served: int) -> None:
        """Adds a prompt's prefix-index lookup to the pool's counters (`served` may be negative: a hit given
        back because the prompt was fed again from its first column)."""
        with self.lock:
            self.prefix_query_tokens += looked_up
            self.prefix_hit_tokens += served

    # ------------------------------------------------------------------ stats and invariants
    def _bytes_per_block(self) -> tuple[list[int], list[int]]:
        """Per group, bytes of one block over its layers (K and V, scales included), and of its scales alone."""
        total, scales = [0] * len(self.layout.groups), [0] * len(self.layout.groups)
        for layer_idx, key_cache in self.key_caches.items():
            group = self.layout.group_of(layer_idx)
            scale = self._scale_bytes_per_block(layer_idx)
            value_cache = self.value_caches[layer_idx]
            total[group] += (key_cache[0].numel() + value_cache[0].numel()) * key_cache.element_size() + scale
            scales[group] += scale
        return total, scales

    def _scale_bytes_per_block(self, layer_idx: int) -> int:
        """Bytes of one block's K and V scales in a layer (0 unquantized)."""
        if layer_idx not in self.key_scales:
            return 0
        return self.key_scales[layer_idx][0].numel() * self.key_scales[layer_idx].element_size() * 2

    def _reserved(self) -> PoolStats:
        stats = PoolStats(block_size=self.block_size, kv_dtype=self.kv_dtype)
        stats.scale_bytes_reserved = sum(t.nbytes for t in self.key_scales.values()) * 2
        data = sum(t.nbytes for t in self.key_caches.values()) + sum(t.nbytes for t in self.value_caches.values())
        stats.bytes_reserved = data + stats.scale_bytes_reserved
        for allocator in self.allocators or []:
            stats.blocks_total += allocator.capacity
            stats.evictions += allocator.num_evictions
        stats.state_slots_total = self.state_slots.capacity
        stats.state_bytes_reserved = self.state_slots.bytes_reserved
        stats.bytes_reserved += stats.state_bytes_reserved
        stats.state_snapshots, snapshot_only = self._snapshot_counts()
        stats.state_snapshot_bytes = snapshot_only * self.state_slots.bytes_per_slot
        return stats

    def _add_state_use(self, stats: PoolStats, slots_in_use: int) -> None:
        stats.state_slots_in_use = slots_in_use
        stats.state_bytes_in_use = slots_in_use * self.state_slots.bytes_per_slot
        stats.bytes_in_use += stats.state_bytes_in_use

    def stats(self) -> PoolStats:
        """Memory and sharing statistics of the whole pool, from the allocators' counters (no scan)."""
        with self.lock:
            stats = self._reserved()
            stats.prefix_hit_tokens, stats.prefix_query_tokens = self.prefix_hit_tokens, self.prefix_query_tokens
            bytes_per_block, scale_bytes = self._bytes_per_block()
            for group_id, allocator in enumerate(self.allocators or []):
                stats.blocks_in_use += allocator.num_in_use
                stats.blocks_shared += allocator.num_shared
                stats.tokens_stored += allocator.tokens_in_use
                stats.bytes_in_use += allocator.num_in_use * bytes_per_block[group_id]
                stats.scale_bytes_in_use += allocator.num_in_use * scale_bytes[group_id]
                stats.blocks_cached += len(allocator.evictable)
                stats.blocks_free += len(allocator.free_ids)
            self._add_state_use(stats, self.state_slots.num_in_use - self._snapshot_counts()[1])
            return stats

    def usage_stats(
        self, usage: list[dict[int, int]], prefix_hit_tokens: int, prefix_query_tokens: int, state_slots: int = 0
    ) -> PoolStats:
        """Statistics of some blocks of this pool (a cache's own), with the pool's reserved totals.

        Args:
            usage: per group, block id -> token slots the holder fills in it.
            state_slots: distinct state slots the holder references.
        """
        with self.lock:
            stats = self._reserved()
            stats.prefix_hit_tokens, stats.prefix_query_tokens = prefix_hit_tokens, prefix_query_tokens
            bytes_per_block, scale_bytes = self._bytes_per_block()
            for group_id, (allocator, filled) in enumerate(zip(self.allocators or [], usage, strict=False)):
                stats.blocks_in_use += len(filled)
                stats.blocks_shared += sum(allocator.ref_count(b) > 1 for b in filled)
                stats.tokens_stored += sum(filled.values())
                stats.bytes_in_use += len(filled) * bytes_per_block[group_id]
                stats.scale_bytes_in_use += len(filled) * scale_bytes[group_id]
            self._add_state_use(stats, state_slots)
            return stats

    def check(self) -> None:
        """Verifies every invariant of the pool and the block tables above it; raises AssertionError if one fails.

        Each block is free, cached or in use, never two; reference counts equal the references from live
        block tables, and the allocators' counters equal a recount; the free queue holds no referenced block;
        every block-table entry points into the pool; every row's table holds exactly the blocks its token
        count needs; indexed blocks are full; in a quantized pool, every scale of a slot a live row holds is
        finite and positive; each state slot's reference count equals its references from live caches and from the
        prefix index's snapshots, which only indexed blocks hold.
        """
        with self.lock:
            owners = list(self._owners)
            for owner in owners:
                owner.check()
            slot_refs: Counter[int] = Counter()
            for state_owner in list(self._state_owners):
                slot_refs.update(state_owner.slot_refs())
            if self.allocators:  # the prefix index's snapshots (hybrids)
                slot_refs.update(self.allocators[self.snapshot_group].snapshot_refs())
            self.state_slots.check(slot_refs)
            if self.allocators is None:
                return
            for group_id, allocator in enumerate(self.allocators):
                refs: Counter[int] = Counter()
                filled: dict[int, int] = {}
                for owner in owners:
                    refs.update(owner.block_refs(group_id))
                    for block_id, count in owner.usage(group_id).items():
                        filled[block_id] = max(filled.get(block_id, 0), count)
                allocator.check(dict(refs), filled)
                self._check_scales(group_id, filled)

    def _check_scales(self, group_id: int, filled: dict[int, int]) -> None:
        """Every filled slot of a live row has finite, positive K and V scales in every layer of a group."""
        slots = [b * self.block_size + i for b, count in filled.items() for i in range(count)]
        for layer_idx, key_scale in self.key_scales.items():
            if self.layout.group_of(layer_idx) == group_id and slots:
                check_scales(f"layer {layer_idx}", key_scale, self.value_scales[layer_idx], slots)

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix; their blocks become free and their state snapshots are released (e.g. after
        changing the model's weights)."""
        with self.lock:
            for allocator in self.allocators or []:
                allocator.clear_index()
