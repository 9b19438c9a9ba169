"""hf-paged: PagedAttention for stock transformers `generate()`.

>>> import hf_paged                         # registers attn_implementation="paged"
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged")
>>> out = model.generate(**inputs, **hf_paged.cache_kwargs(hf_paged.PagedCache()), max_new_tokens=64)
"""

from .attention.paged import is_registered, paged_attention_forward, paged_mask, register
from .cache.paged_cache import PagedCache
from .cache.cross import CrossAttentionCache, CrossAttentionStats
from .cache.encoder_decoder import EncoderDecoderPagedCache
from .engine import Engine, EngineStats
from .compat import CACHE_KWARG, cache_kwargs, output_cache
from .errors import CacheMismatchError, OutOfBlocksError, UnsupportedModelError
from .cache.kvpool import KVPool
from .memory.stats import PoolStats, contiguous_cache_bytes

__version__ = "0.1.0"

register()

__all__ = [
    "CACHE_KWARG",
    "cache_kwargs",
    "output_cache",
    "CacheMismatchError",
    "CrossAttentionCache",
    "CrossAttentionStats",
    "EncoderDecoderPagedCache",
    "Engine",
    "EngineStats",
    "KVPool",
    "OutOfBlocksError",
    "PagedCache",
    "PoolStats",
    "UnsupportedModelError",
    "contiguous_cache_bytes",
    "is_registered",
    "paged_attention_forward",
    "paged_mask",
    "register",
]
