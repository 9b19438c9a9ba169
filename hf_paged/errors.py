"""Errors raised by hf-paged. Each message says what to change."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """A fixed-size pool cannot hold a request.

    Raised before anything is written: the pool and every cache are left exactly as they were.

    Attributes:
        blocks_needed: blocks the request asked for.
        blocks_free: blocks that were free or evictable at that moment.
        blocks_total: the pool's fixed capacity.
        outputs: set by `Engine.generate()`: every request's generated tokens (the failed ones' partial, the
            others' complete); None otherwise.
    """

    def __init__(self, blocks_needed: int, blocks_free: int, blocks_total: int, block_size: int) -> None:
        self.outputs: list[list[int]] | None = None
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free
        self.blocks_total = blocks_total
        super().__init__(
            f"The KV pool is out of blocks: this step needs {blocks_needed} new block(s) of {block_size} tokens "
            f"but only {blocks_free} of {blocks_total} are free or evictable. Raise `num_blocks`/`max_memory` "
            f"of the KVPool, shorten `max_new_tokens` or the batch, or release caches you no longer need "
            f"(`cache.release()` or `with cache:`). Nothing was written; the pool is unchanged."
        )


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served from a paged KV cache."""


class CacheMismatchError(ValueError):
    """A cache or pool was reused with a model of a different shape, dtype or device."""
