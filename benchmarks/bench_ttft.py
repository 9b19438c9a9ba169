"""Time to first token with and without a prefix hit, vs shared-prefix length.

Every prompt is `prefix + suffix` (a new 32-token suffix per call). Variants, alternated:
- `paged_prefix_hit`: a `KVPool` that already served the prefix; `pool.new_cache(ids)` takes its blocks,
  so `generate()` computes only the suffix.
- `paged_cold`: a fresh `KVPool` per call (the whole prompt is computed).
- `dynamic`: DynamicCache + sdpa (the whole prompt is computed).
Time to first token is the wall time of `generate(max_new_tokens=1)`, including `new_cache()`.
At the longest prefix, greedy outputs of the hit and the cold call are compared token by token.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

import hf_paged

from .common import Suite, alternate

NAME = "ttft"


def _prompt(prefix: torch.Tensor, vocab: int, seed: int, suffix_len: int) -> torch.Tensor:
    suffix = torch.randint(1, vocab, (1, suffix_len), generator=torch.Generator().manual_seed(seed))
    return torch.cat([prefix, suffix], dim=1)


def _first_token(model, cache, ids: torch.Tensor, new_tokens: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(cache),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        )


def run(suite: Suite, progress) -> None:
    vocab = suite.config.vocab_size
    suffix_len = suite.pick(32, 8)
    prefixes = suite.pick([256, 1024, 2000], [32, 64])
    repeats = suite.pick(3, 1)
    for prefix_len in progress(prefixes, desc="ttft"):
        prefix = torch.randint(1, vocab, (1, prefix_len), generator=torch.Generator().manual_seed(prefix_len))
        warm_pool = hf_paged.KVPool(suite.config)
        with warm_pool.new_cache(ids := _prompt(prefix, vocab, 0, suffix_len)) as cache:
            _first_token(suite.paged_model, cache, ids)  # the first call: fills the prefix index
        seeds = {"paged_prefix_hit": 0, "paged_cold": 0, "dynamic": 0}

        def timed(name: str) -> float:
            seeds[name] += 1
            ids = _prompt(prefix, vocab, seeds[name], suffix_len)  # the same prompts for every variant
            start = time.perf_counter()
            if name == "dynamic":
                _first_token(suite.sdpa_model, DynamicCache(config=suite.config), ids)
                return time.perf_counter() - start
            pool = warm_pool if name == "paged_prefix_hit" else hf_paged.KVPool(suite.config)
            with pool.new_cache(ids) as cache:
                _first_token(suite.paged_model, cache, ids)
                return time.perf_counter() - start

        results = alternate({name: (lambda name=name: timed(name)) for name in seeds}, repeats=repeats)
        for variant, values in results.items():
            suite.add(NAME, "ttft", variant, "prefix_len", prefix_len, [v * 1000 for v in values], "ms")
        stats = warm_pool.stats()
        suite.add(NAME, "prefix_hit_rate", "paged_prefix_hit", "prefix_len", prefix_len, 100 * stats.prefix_hit_rate, "%")

    # Issue 4 (v): the second call of the longest prefix gives the same tokens as a cold call.
    ids = _prompt(prefix, vocab, 10_000, suffix_len)
    new = suite.pick(16, 4)
    with hf_paged.KVPool(suite.config).new_cache(ids) as cache:
        cold = _first_token(suite.paged_model, cache, ids, new)
    with warm_pool.new_cache(ids) as cache:
        hit_tokens = cache.get_seq_length()
        warm = _first_token(suite.paged_model, cache, ids, new)
    ref = _first_token(suite.sdpa_model, DynamicCache(config=suite.config), ids, new)
    x = prefix_len
    suite.add(NAME, "outputs_identical_hit_vs_cold", "paged_prefix_hit", "prefix_len", x, float(torch.equal(cold, warm)), "bool")
    suite.add(NAME, "outputs_identical_vs_dynamic", "paged_prefix_hit", "prefix_len", x, float(torch.equal(ref, warm)), "bool")
    suite.add(NAME, "prefix_tokens_reused", "paged_prefix_hit", "prefix_len", x, hit_tokens, "tokens")
