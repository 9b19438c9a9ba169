"""Capacity: how many concurrent sequences fit in a fixed KV budget.

Two parts:
- A *simulation* (arithmetic over a trace, no model): requests are admitted in trace order until the
  budget is full. Contiguous caches reserve `max_len` tokens per sequence (what a server must do when it
  cannot know the output length); paged caches take `ceil((input + output) / block_size)` blocks. An
  oracle contiguous cache that knows every output length is shown for reference.
- A *real run* at small scale: a `KVPool(max_memory=budget)` admits requests (one cache each, prompt and
  output written by the model) until it raises `OutOfBlocksError`; a `StaticCache` of `max_len` is grown
  row by row until its measured tensors pass the budget.
"""

from __future__ import annotations

import math

import torch
from transformers import StaticCache

import hf_paged

from .bench_memory import fill_one
from .common import Suite, sample_trace, tensor_cache_bytes

NAME = "capacity"


def simulate(trace: list[tuple[int, int]], budget_tokens: int, max_len: int, block_size: int) -> dict[str, int]:
    """Sequences admitted (in trace order) before the budget, in token slots, is exceeded."""
    out = {}
    cost = {
        "contiguous_max_len": lambda a, b: max_len,
        "contiguous_oracle": lambda a, b: a + b,
        "paged": lambda a, b: math.ceil((a + b) / block_size) * block_size,
    }
    for name, fn in cost.items():
        used = count = 0
        for a, b in trace:
            need = fn(a, b)
            if used + need > budget_tokens:
                break
            used, count = used + need, count + 1
        out[name] = count
    return out


@torch.no_grad()
def real_run(suite: Suite, trace: list[tuple[int, int]], max_len: int, budget_bytes: int) -> dict[str, int]:
    vocab = suite.config.vocab_size
    pool = hf_paged.KVPool(suite.config, max_memory=budget_bytes, prefix_caching=False)
    caches = []
    for i, (a, b) in enumerate(trace):
        cache = pool.new_cache()
        try:
            fill_one(suite.paged_model, cache, a + b, vocab, seed=i)
        except hf_paged.OutOfBlocksError:
            cache.release()
            break
        caches.append(cache)
    paged = len(caches)
    assert pool.stats().bytes_reserved <= budget_bytes
    for cache in caches:
        cache.release()

    contiguous = 0
    for rows in range(1, len(trace) + 1):
        cache = StaticCache(config=suite.config, max_cache_len=max_len)
        ids = torch.ones((rows, 1), dtype=torch.long)
        suite.sdpa_model(input_ids=ids, **hf_paged.cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        if tensor_cache_bytes(cache) > budget_bytes:
            break
        contiguous = rows
    return {"paged": paged, "contiguous_max_len": contiguous}


def run(suite: Suite, progress) -> None:
    cfg = suite.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # fp32 K and V
    steps = [("simulation", trace) for trace in ("sharegpt", "alpaca")] + [("real", "sharegpt"), ("real", "alpaca")]
    for kind, trace_name in progress(steps, desc="capacity"):
        if kind == "simulation":
            max_len, budget_seqs = 2048, 64
            trace = sample_trace(trace_name, 5000, seed=2, max_total=max_len)
            counts = simulate(trace, budget_seqs * max_len, max_len, block_size=16)
            param = f"{trace_name}, budget {budget_seqs}x{max_len} tokens"
            for variant, n in counts.items():
                suite.add(NAME, "sequences_sim", variant, "trace", param, n, "sequences")
        else:
            max_len = suite.pick(512, 128)
            budget_seqs = suite.pick(4, 2)
            trace = sample_trace(trace_name, 200, seed=3, max_total=max_len)
            counts = real_run(suite, trace, max_len, budget_seqs * max_len * bytes_per_token)
            param = f"{trace_name}, budget {budget_seqs}x{max_len} tokens"
            for variant, n in counts.items():
                suite.add(NAME, "sequences_real", variant, "trace", param, n, "sequences")
