"""Which `BlockPool` a new `PagedCache` stores its K/V in: a shared one it was given, or a private one."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..memory.pool import BlockPool


def pool_for_cache(
    pool: BlockPool | None,
    config: PretrainedConfig | None,
    block_size: int | None,
    num_blocks: int | None,
    max_memory: int | None,
    kv_dtype: str | None,
) -> BlockPool:
    """The pool of a new `PagedCache`: the shared `pool` it was given (checked against the other arguments,
    which the pool owns), or a private, unindexed one built from them."""
    if pool is None:
        return BlockPool(
            config, block_size=16 if block_size is None else block_size, num_blocks=num_blocks,
            max_memory=max_memory, prefix_caching=False, kv_dtype=kv_dtype,
        )
    if num_blocks is not None or max_memory is not None:
        raise ValueError("num_blocks/max_memory size a private pool; set them on the KVPool you pass.")
    if kv_dtype is not None and kv_dtype != pool.kv_dtype:
        raise ValueError(
            f"kv_dtype={kv_dtype!r} differs from the pool's kv_dtype={pool.kv_dtype!r}; the pool owns the "
            "storage format: create it with KVPool(config, kv_dtype=...)."
        )
    if block_size is not None and block_size != pool.block_size:
        raise ValueError(f"block_size={block_size} differs from the pool's block_size={pool.block_size}.")
    if config is not None:
        pool.bind_config(config)
    return pool
