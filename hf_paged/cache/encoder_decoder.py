"""`EncoderDecoderPagedCache`: transformers' `EncoderDecoderCache` over a `PagedCache` (the decoder's
self-attention, in blocks) and a `CrossAttentionCache` (cross-attention K/V, once per request, `cross.py`).

Encoder-decoder models (BART, Whisper, T5, ...) read `cache.self_attention_cache` and `cache.cross_attention_cache`
of an `EncoderDecoderCache`; this subclass only adds what transformers' version reserves for `DynamicCache` pairs
(crop, batch selection) and the hf-paged API (`release`, `fork`, `check`, `stats`).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import EncoderDecoderCache

from ..attention import handoff
from ..attention.outside_graph import run_outside_graph
from ..memory.pool import BlockPool
from ..memory.stats import PoolStats
from .cross import CrossAttentionCache, CrossAttentionStats
from .paged_cache import PagedCache


class DecoderSelfAttentionCache(PagedCache):
    """The self-attention half of an `EncoderDecoderPagedCache`. Only a decoder's self-attention writes it, which is
    causal through its mask even where the module says `is_causal=False` (Pegasus-X, NLLB-MoE, BigBird-Pegasus).

    Rows are never stored once for several (`dedupe_rows` is off): equal decoder tokens give equal K/V in the first
    layer only, the later layers' depend on each row's encoder output through the cross-attention."""

    causal_writers_only = True

    def __init__(self, *args, **kwargs) -> None:
        kwargs["dedupe_rows"] = False
        super().__init__(*args, **kwargs)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`PagedCache.update`, after dropping any note of a `"paged"` self-attention left on this thread (by another
        model, or an earlier forward): only the attention that runs right after this update may tell the
        cross-attention that follows to read shared K/V (`handoff.follows_attention_of`); under another attention
        the cross-attention then reads per-row K/V."""
        if torch.compiler.is_compiling():
            return run_outside_graph(DecoderSelfAttentionCache.update, self, key_states, value_states, layer_idx)
        handoff.note_self_attention(None)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class EncoderDecoderPagedCache(EncoderDecoderCache):
    """The cache of an encoder-decoder model: decoder self-attention paged, cross-attention K/V stored once per
    request and shared by its beams and samples (reference counted; beam search remaps rows, copies nothing).

    Args:
        config: the encoder-decoder model's config (`model.config`).
        block_size, pool, num_blocks, max_memory, salt, kv_dtype: of the self-attention `PagedCache` (see there).

    Example:
        >>> import hf_paged
        >>> model = AutoModelForSeq2SeqLM.from_pretrained(path, attn_implementation="paged")
        >>> with hf_paged.EncoderDecoderPagedCache(model.config) as cache:
        ...     out = model.generate(**inputs, **hf_paged.cache_kwargs(cache), num_beams=5, max_new_tokens=32)
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        block_size: int | None = None,
        pool: BlockPool | None = None,
        num_blocks: int | None = None,
        max_memory: int | None = None,
        salt: str | bytes | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        if not getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"EncoderDecoderPagedCache serves encoder-decoder models; model type {config.model_type!r} is not one. "
                "Use hf_paged.PagedCache for it."
            )
        self_attention = DecoderSelfAttentionCache(
            config,
            block_size=block_size,
            pool=pool,
            num_blocks=num_blocks,
            max_memory=max_memory,
            salt=salt,
            kv_dtype=kv_dtype,
        )
        super().__init__(self_attention, CrossAttentionCache(config))

    @property
    def pool(self) -> BlockPool:
        """The self-attention cache's pool."""
        return self.self_attention_cache.pool

    def crop(self, max_length: int) -> None:
        """Crops the decoder's self-attention (cross-attention K/V do not grow with decoded tokens)."""
        self.self_attention_cache.crop(max_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def release(self) -> None:
        """Returns the self-attention blocks to the pool and drops the cross-attention K/V."""
        self.reset()

    def __enter__(self) -> EncoderDecoderPagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def fork(self) -> EncoderDecoderPagedCache:
        """A new cache with the same rows: self-attention blocks shared copy-on-write, cross-attention entries
        shared."""
        other = EncoderDecoderCache.__new__(EncoderDecoderPagedCache)
        EncoderDecoderCache.__init__(other, self.self_attention_cache.fork(), self.cross_attention_cache.fork())
        other.is_updated = dict(self.is_updated)
        return other

    def __copy__(self) -> EncoderDecoderPagedCache:
        return self.fork()

    def __deepcopy__(self, memo: dict) -> EncoderDecoderPagedCache:
        return self.fork()

    def stats(self) -> PoolStats:
        """Statistics of the self-attention blocks (`PagedCache.stats`)."""
        return self.self_attention_cache.stats()

    def cross_stats(self) -> CrossAttentionStats:
        """What the cross-attention cache holds (`CrossAttentionCache.stats`)."""
        return self.cross_attention_cache.stats()

    def check(self) -> None:
        """Verifies the self-attention pool's invariants (`BlockPool.check`) and the cross-attention entries'
        reference counts (`CrossAttentionCache.check`); raises AssertionError if one fails."""
        self.self_attention_cache.pool.check()
        self.cross_attention_cache.check()


__all__ = ["DecoderSelfAttentionCache", "EncoderDecoderPagedCache"]
