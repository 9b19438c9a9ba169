"""KV memory of a request mix: bytes reserved, bytes holding tokens, waste, peak process memory.

A batch of requests drawn from a ShareGPT-like or Alpaca-like length distribution is pushed through the
model the way `generate()` fills a cache: one forward of the left-padded prompts, then the output columns
(teacher-forced in one forward instead of token by token: same cache contents, minutes less). In a
`generate()` batch every row runs until the longest output ends, so those columns are stored by every
variant; "useful" tokens are each request's own prompt and output.

Variants (all on the same requests):
- `dynamic_batch`: DynamicCache + sdpa, one left-padded batch (stores padding).
- `static_batch`: StaticCache + sdpa, max_cache_len = longest prompt + longest output.
- `paged_batch`: PagedCache + "paged", the same batch (padding is never stored).
- `paged_pool`: one KVPool, one cache per request holding its own tokens only (a server that ends
  each request at its EOS); `dynamic_per_request` is the same with DynamicCache, batch 1 each.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

import hf_paged

from .common import PeakRSS, Suite, random_prompts, sample_trace, tensor_cache_bytes, tensor_cache_slots

NAME = "memory"


@torch.no_grad()
def fill_batch(model, cache, trace: list[tuple[int, int]], vocab: int, seed: int = 0) -> None:
    """Prompts (left-padded) then `max(output)` more columns for every row, in two forwards."""
    ids, mask = random_prompts([n for n, _ in trace], vocab, seed)
    model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    max_out = max(n for _, n in trace)
    more = torch.randint(1, vocab, (len(trace), max_out), generator=torch.Generator().manual_seed(seed + 1))
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    model(input_ids=more, attention_mask=full_mask, **hf_paged.cache_kwargs(cache), use_cache=True, logits_to_keep=1)


@torch.no_grad()
def fill_one(model, cache, n_tokens: int, vocab: int, seed: int = 0) -> None:
    """One request's prompt and output, `n_tokens` columns, in one forward."""
    ids = torch.randint(1, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, **hf_paged.cache_kwargs(cache), use_cache=True, logits_to_keep=1)


def measure(suite: Suite, trace: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Per variant: bytes_reserved, bytes_in_use, bytes_useful, waste (1 - useful/in use), waste_of_reserved,
    peak_rss (growth of the process's peak RSS while filling)."""
    vocab = suite.config.vocab_size
    useful_tokens = sum(a + b for a, b in trace)
    width = max(a for a, _ in trace) + max(b for _, b in trace)
    out: dict[str, dict[str, float]] = {}

    def record(name: str, reserved: int, bytes_per_slot: float, peak: int | None, in_use: int | None = None):
        useful = useful_tokens * bytes_per_slot
        out[name] = dict(
            bytes_reserved=reserved,
            bytes_in_use=in_use if in_use is not None else reserved,
            bytes_useful=useful,
            waste=1.0 - useful / (in_use if in_use is not None else reserved),
            waste_of_reserved=1.0 - useful / reserved,
            peak_rss=peak if peak is not None else float("nan"),
        )

    with PeakRSS() as peak:
        cache = DynamicCache(config=suite.config)
        fill_batch(suite.sdpa_model, cache, trace, vocab)
    record("dynamic_batch", tensor_cache_bytes(cache), tensor_cache_bytes(cache) / tensor_cache_slots(cache), peak.bytes)
    del cache

    with PeakRSS() as peak:
        cache = StaticCache(config=suite.config, max_cache_len=width)
        fill_batch(suite.sdpa_model, cache, trace, vocab)
    record("static_batch", tensor_cache_bytes(cache), tensor_cache_bytes(cache) / tensor_cache_slots(cache), peak.bytes)
    del cache

    with PeakRSS() as peak:
        cache = hf_paged.PagedCache()
        fill_batch(suite.paged_model, cache, trace, vocab)
    s = cache.stats()
    slot = s.bytes_in_use / (s.blocks_in_use * s.block_size)
    record("paged_batch", s.bytes_reserved, slot, peak.bytes, s.bytes_in_use)
    out["paged_batch"]["block_waste"] = s.waste
    cache.release()

    with PeakRSS() as peak:
        pool = hf_paged.KVPool(suite.config, prefix_caching=False)
        caches = []
        for i, (a, b) in enumerate(trace):
            caches.append(pool.new_cache())
            fill_one(suite.paged_model, caches[-1], a + b, vocab, seed=i)
    s = pool.stats()
    slot = s.bytes_in_use / (s.blocks_in_use * s.block_size)
    record("paged_pool", s.bytes_reserved, slot, peak.bytes, s.bytes_in_use)
    out["paged_pool"]["block_waste"] = s.waste
    for c in caches:
        c.release()

    with PeakRSS() as peak:
        dyn = []
        for i, (a, b) in enumerate(trace):
            dyn.append(DynamicCache(config=suite.config))
            fill_one(suite.sdpa_model, dyn[-1], a + b, vocab, seed=i)
    total = sum(tensor_cache_bytes(c) for c in dyn)
    record("dynamic_per_request", total, total / sum(tensor_cache_slots(c) for c in dyn), peak.bytes)
    return out


def run(suite: Suite, progress) -> None:
    num = suite.pick(16, 4)
    for trace_name in progress(["sharegpt", "alpaca"], desc="memory"):
        trace = sample_trace(trace_name, num, seed=1, max_total=suite.pick(2048, 96))
        for variant, m in measure(suite, trace).items():
            for metric, unit, scale in (
                ("bytes_reserved", "MiB", 2**-20),
                ("bytes_in_use", "MiB", 2**-20),
                ("bytes_useful", "MiB", 2**-20),
                ("waste", "%", 100.0),
                ("waste_of_reserved", "%", 100.0),
                ("peak_rss", "MiB", 2**-20),
                ("block_waste", "%", 100.0),
            ):
                if metric in m:
                    suite.add(NAME, metric, variant, "trace", f"{trace_name}x{num}", m[metric] * scale, unit)
    lead_batch(suite)


def lead_batch(suite: Suite) -> None:
    """Issue 2 (ii): prompts of 50, 200, 400, 1000 tokens, left-padded, plus 32 new tokens."""
    trace = [(50, 32), (200, 32), (400, 32), (1000, 32)] if not suite.smoke else [(5, 4), (20, 4), (40, 4), (100, 4)]
    vocab = suite.config.vocab_size
    dyn = DynamicCache(config=suite.config)
    fill_batch(suite.sdpa_model, dyn, trace, vocab)
    paged = hf_paged.PagedCache()
    fill_batch(suite.paged_model, paged, trace, vocab)
    s = paged.stats()
    param = "prompts 50/200/400/1000 + 32" if not suite.smoke else "smoke"
    suite.add("padded_batch", "kv_bytes", "dynamic", "batch", param, tensor_cache_bytes(dyn) / 2**20, "MiB")
    suite.add("padded_batch", "kv_bytes", "paged", "batch", param, s.bytes_in_use / 2**20, "MiB")
    suite.add("padded_batch", "unused_slots", "paged", "batch", param, s.blocks_in_use * s.block_size - s.tokens_stored, "slots")
    suite.add("padded_batch", "unused_slots_bound", "paged", "batch", param, len(trace) * (s.block_size - 1) * len(paged.rows.tables), "slots")
    suite.add("padded_batch", "unused_slots", "dynamic", "batch", param, tensor_cache_slots(dyn) - sum(a + b for a, b in trace), "slots")
    paged.release()
