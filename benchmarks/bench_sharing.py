"""Beam search and parallel sampling: KV memory and time vs number of beams / samples.

Variants, alternated on the same prompt: `paged` (PagedCache + "paged": rows of one prompt share its
blocks, beams share blocks and copy at most their partial last block) and `dynamic` (DynamicCache + sdpa:
every row stores the prompt; each beam reorder copies the whole cache). Memory is read after `generate()`
from `cache.stats().bytes_in_use` and from the DynamicCache tensors' `nbytes`.

Bytes copied by reorders are counted by wrapping the caches' own calls: `BlockPool.copy_blocks` (block
count times the measured bytes of a block in every layer of its group) for the paged cache, and
`DynamicCache.reorder_cache` (the bytes of the tensors it rebuilds) for the dynamic one.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

import hf_paged

from .common import Suite, alternate, random_prompts, tensor_cache_bytes

NAME = "sharing"


def _count_paged_copies(cache: hf_paged.PagedCache, counter: dict[str, float]) -> None:
    pool = cache.pool
    original = pool.copy_blocks

    def copy_blocks(group_id: int, src: list[int], dst: list[int]) -> None:
        original(group_id, src, dst)
        per_block = sum(pool.key_caches[i][0].nbytes * 2 for i in pool.layers_of_group(group_id))
        counter["bytes"] += len(src) * per_block

    pool.copy_blocks = copy_blocks  # this pool only (instance attribute)
    reorder = cache.reorder_cache

    def reorder_cache(beam_idx):
        counter["reorders"] += 1
        return reorder(beam_idx)

    cache.reorder_cache = reorder_cache


def _count_dynamic_copies(cache: DynamicCache, counter: dict[str, float]) -> None:
    reorder = cache.reorder_cache

    def reorder_cache(beam_idx):
        counter["reorders"] += 1
        counter["bytes"] += tensor_cache_bytes(cache)  # index_select rebuilds every K and V tensor
        return reorder(beam_idx)

    cache.reorder_cache = reorder_cache


def _run(suite: Suite, variant: str, ids, mask, new: int, **kwargs) -> dict[str, float]:
    counter = {"bytes": 0.0, "reorders": 0}
    if variant == "paged":
        model, cache = suite.paged_model, hf_paged.PagedCache()
        _count_paged_copies(cache, counter)
    else:
        model, cache = suite.sdpa_model, DynamicCache(config=suite.config)
        _count_dynamic_copies(cache, counter)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=new,
            min_new_tokens=new, **kwargs,
        )
    elapsed = time.perf_counter() - start
    kv = cache.stats().bytes_in_use if variant == "paged" else tensor_cache_bytes(cache)
    if variant == "paged":
        cache.release()
    out = {"time": elapsed, "kv_bytes": kv}
    if counter["reorders"]:
        out["copied_per_reorder"] = counter["bytes"] / counter["reorders"]
    return out


def run(suite: Suite, progress) -> None:
    vocab = suite.config.vocab_size
    repeats = suite.pick(2, 1)
    new = suite.pick(64, 4)
    samples = [(n, suite.pick(1000, 48)) for n in suite.pick([1, 2, 4, 8], [1, 4])]
    beams = [(n, suite.pick(2000, 48)) for n in suite.pick([1, 2, 4], [1, 2])]
    points = [("samples", n, p) for n, p in samples] + [("beams", n, p) for n, p in beams]
    for kind, n, prompt_len in progress(points, desc="sharing"):
        ids, mask = random_prompts([prompt_len], vocab, seed=prompt_len)
        if kind == "samples":
            kwargs = dict(do_sample=True, num_return_sequences=n, top_k=50)
        else:
            kwargs = dict(do_sample=False, num_beams=n, num_return_sequences=1, early_stopping=False, length_penalty=0.0)
        variants = {v: (lambda v=v: _run(suite, v, ids, mask, new, **kwargs)) for v in ("paged", "dynamic")}
        results = alternate(variants, repeats=repeats)
        parameter = "num_return_sequences" if kind == "samples" else "num_beams"
        bench = f"{NAME}_{kind}"
        for variant, values in results.items():
            suite.add(bench, "time", variant, parameter, n, [v["time"] for v in values], "s")
            suite.add(bench, "kv_bytes", variant, parameter, n, [v["kv_bytes"] / 2**20 for v in values], "MiB")
            if "copied_per_reorder" in values[0]:
                copied = [v["copied_per_reorder"] / 2**10 for v in values]
                suite.add(bench, "copied_per_reorder", variant, parameter, n, copied, "KiB")
