"""Memory and sharing statistics of a pool or a cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class PoolStats:
    """A snapshot of KV memory use. Blocks are counted over all layer groups.

    Attributes:
        blocks_total: block ids that exist (the pool tensors' first dimension, summed over groups).
        blocks_in_use: blocks referenced by live caches (for `cache.stats()`: by this cache).
        blocks_cached: unreferenced blocks kept for prefix hits; evictable.
        blocks_shared: blocks in use referenced more than once (forks, beams, samples, prefix hits).
        blocks_free: blocks neither in use nor cached.
        tokens_stored: token slots holding K/V in blocks in use, each block counted once.
        bytes_reserved: bytes of the pool tensors (all layers, K and V; a quantized pool's scales and a hybrid
            model's state slots included).
        bytes_in_use: bytes of the blocks in use (all layers, K and V; a quantized pool's scales and the state
            slots in use included).
        scale_bytes_reserved: of `bytes_reserved`, the quantization scales (0 unquantized).
        scale_bytes_in_use: of `bytes_in_use`, the quantization scales (0 unquantized).
        prefix_hit_tokens: prompt tokens served from the prefix index instead of being computed.
        prefix_query_tokens: prompt tokens looked up in the prefix index.
        evictions: cached blocks evicted to make room.
        state_slots_total: recurrent-state slots that exist (hybrid models; one slot holds one sequence's
            states in every recurrent layer).
        state_slots_in_use: state slots referenced by live caches (for `cache.stats()`: by this cache).
        state_bytes_reserved: of `bytes_reserved`, the state slots' tensors.
        state_bytes_in_use: of `bytes_in_use`, the state slots in use by live caches.
        state_snapshots: recurrent-state snapshots the prefix index holds at the ends of indexed blocks (hybrids; a
            prefix hit restores one), kept like cached blocks: outside `bytes_in_use`, evicted with their blocks.
        state_snapshot_bytes: of `state_bytes_reserved`, the slots only snapshots hold.
        block_size: tokens per block.
        kv_dtype: the pool's `kv_dtype` (None: K/V stored in the model's dtype).
    """

    blocks_total: int = 0
    blocks_in_use: int = 0
    blocks_cached: int = 0
    blocks_shared: int = 0
    blocks_free: int = 0
    tokens_stored: int = 0
    bytes_reserved: int = 0
    bytes_in_use: int = 0
    scale_bytes_reserved: int = 0
    scale_bytes_in_use: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    evictions: int = 0
    state_slots_total: int = 0
    state_slots_in_use: int = 0
    state_bytes_reserved: int = 0
    state_bytes_in_use: int = 0
    state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    block_size: int = 16
    kv_dtype: str | None = None

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens that were served from the prefix index."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def waste(self) -> float:
        """Fraction of the slots of blocks in use that hold no token (internal fragmentation)."""
        slots = self.blocks_in_use * self.block_size
        return 1.0 - self.tokens_stored / slots if slots else 0.0

    def as_dict(self) -> dict[str, float | str | None]:
        """All fields plus `prefix_hit_rate` and `waste`."""
        out = asdict(self)
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["waste"] = self.waste
        return out


def contiguous_cache_bytes(cache: object) -> int:
    """Bytes of K and V a contiguous transformers cache (`DynamicCache`, `StaticCache`) holds over all
    layers, padding included — what `PoolStats.bytes_in_use` compares against."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total
