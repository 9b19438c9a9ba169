"""The memory layer: where K/V live and who may use which block.

Block allocators (reference counts, free queue, LRU of cached blocks, prefix index), the chained digests that
name full blocks, the layer groups a model's config asks for, `BlockPool` (per-layer block tensors and their
slabs, one allocator per group, the lock), its byte budgets, quantized formats and their rotation, statistics,
and the weights fingerprint that keys cached prefixes. Nothing here knows caches or attention.
"""
