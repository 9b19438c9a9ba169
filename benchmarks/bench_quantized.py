"""Quantized K/V blocks (`kv_dtype`): bytes per token, sequences a fixed budget admits, and accuracy.

- `bytes_per_token`: K and V of all layers for one token, scales included, read from `cache.stats()` after
  a generate (`bytes_in_use / (blocks_in_use * block_size)`).
- `sequences_admitted`: a `KVPool(max_memory=budget)` per kv_dtype admits requests of one fixed length
  (one cache each, written by the model) until it raises `OutOfBlocksError`.
- accuracy against the unquantized cache (`quant_accuracy.py`): prompts whose 32 greedy tokens are
  identical, per-step max logit error (teacher-forced decode), perplexity on held-out stdlib files.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

import hf_paged

from . import quant_accuracy
from .bench_memory import fill_one
from .common import Suite

NAME = "quantized"
KV_DTYPES: list[str | None] = [None, "int8", "fp8_e4m3", "fp8_e5m2"]


def _label(kv_dtype: str | None) -> str:
    return kv_dtype or "model_dtype"


@torch.no_grad()
def bytes_per_token(suite: Suite, kv_dtype: str | None, tokens: int) -> float:
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    fill_one(suite.paged_model, cache, tokens, suite.config.vocab_size)
    stats = cache.stats()
    return stats.bytes_in_use / (stats.blocks_in_use * stats.block_size)


@torch.no_grad()
def sequences_admitted(suite: Suite, kv_dtype: str | None, budget_bytes: int, tokens: int, limit: int) -> int:
    pool = hf_paged.KVPool(suite.config, max_memory=budget_bytes, prefix_caching=False, kv_dtype=kv_dtype)
    caches = []
    for i in range(limit):
        cache = pool.new_cache()
        try:
            fill_one(suite.paged_model, cache, tokens, suite.config.vocab_size, seed=i)
        except hf_paged.OutOfBlocksError:
            cache.release()
            break
        caches.append(cache)
    assert pool.stats().bytes_reserved <= budget_bytes
    admitted = len(caches)
    for cache in caches:
        cache.release()
    return admitted


def run(suite: Suite, progress) -> None:
    tokens = suite.pick(256, 32)
    budget = suite.pick(16, 2) * 2**20  # bytes
    seq_tokens = suite.pick(512, 64)
    for kv in progress(KV_DTYPES, desc="quantized memory"):
        suite.add(NAME, "bytes_per_token", _label(kv), "kv_dtype", "all layers, K+V", bytes_per_token(suite, kv, tokens), "bytes")
        n = sequences_admitted(suite, kv, budget, seq_tokens, limit=suite.pick(400, 200))
        suite.add(NAME, "sequences_admitted", _label(kv), "budget", f"{budget >> 20} MiB, {seq_tokens} tokens each", n, "sequences")
    tokenizer_path = suite.model_path if (suite.model_path / "tokenizer.json").is_file() else None
    if tokenizer_path is None:  # a random stand-in model: accuracy against it says nothing
        suite.notes[NAME] = "accuracy skipped: no trained model"
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    new_tokens = suite.pick(32, 8)
    prompts = quant_accuracy.PROMPTS if not suite.smoke else quant_accuracy.PROMPTS[:2]
    results = quant_accuracy.measure(
        suite.paged_model, tokenizer, KV_DTYPES, prompts, new_tokens,
        ppl_window=suite.pick(256, 96), ppl_windows_per_file=suite.pick(4, 1), ppl_chunk=64,
        ppl_files=None if not suite.smoke else quant_accuracy.HELD_OUT[:1],
    )
    x = f"{len(prompts)} prompts x {new_tokens} tokens"
    for kv, acc in results.items():
        suite.add(NAME, "greedy_identical", _label(kv), "prompts", x, acc.identical, "prompts")
        suite.add(NAME, "max_logit_error", _label(kv), "prompts", x, acc.max_logit_error, "logit")
        suite.add(NAME, "mean_step_max_logit_error", _label(kv), "prompts", x, acc.mean_step_max_logit_error, "logit")
        suite.add(NAME, "perplexity", _label(kv), "held-out", "stdlib held-out files", acc.ppl, "ppl")
    suite.notes[f"{NAME}_table"] = "\n" + quant_accuracy.table(results, new_tokens)
