"""`KVPool`: the public pool — `BlockPool` storage plus `new_cache()`, which hands out caches that start
from the longest cached prefix of their prompts."""

from __future__ import annotations

import torch

from .cache import PagedCache
from .pool import BlockPool


class KVPool(BlockPool):
    __doc__ = BlockPool.__doc__ + """
    Example:
        >>> pool = hf_paged.KVPool(model.config, block_size=16)
        >>> with pool.new_cache(inputs.input_ids, inputs.attention_mask) as cache:
        ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    """

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
        cache = PagedCache(pool=self, salt=salt)
        if input_ids is not None:
            cache.load_prompt(input_ids, attention_mask)
        return cache
