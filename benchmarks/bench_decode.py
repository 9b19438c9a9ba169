"""Decode throughput (tokens/s) vs batch size and context length, and the cost of prefix caching.

Variants, alternated on the same prompts: `paged` (PagedCache + "paged"), `dynamic` (DynamicCache + sdpa),
`static` (StaticCache + sdpa). Decode tokens/s counts the steps after the first token (prefill excluded),
timed by a logits processor. `hf_generate_batch` is transformers' own continuous batching
(`generate_batch`, its paged cache with sdpa attention) on the same prompts, run once per point (its fixed
cost per call is tens of seconds on CPU) at the lead point and the largest batch; it has no step clock, so
it is reported end to end (prefill included) next to the others' end-to-end figure. The cost of prefix caching
(a `KVPool` with caching on, every prompt new, vs off) is measured forward by forward, the two caches side by side
(`_prefix_caching_cost`).
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, StaticCache

import hf_paged

from .common import StepClock, Suite, alternate, random_prompts

NAME = "decode"


def _generate(model, cache, ids, mask, new_tokens: int, **kwargs) -> dict[str, float]:
    clock = StepClock()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock], **kwargs,
        )
    batch = ids.shape[0]
    return {
        "decode_tokens_per_s": clock.decode_tokens_per_s(batch),
        "e2e_tokens_per_s": batch * new_tokens / (clock.times[-1] - clock.start),
    }


def generate_variants(suite: Suite, ids, mask, new_tokens: int, static: bool = True) -> dict:
    width = ids.shape[1] + new_tokens
    variants = {
        "paged": lambda: _generate(suite.paged_model, hf_paged.PagedCache(), ids, mask, new_tokens),
        "dynamic": lambda: _generate(suite.sdpa_model, DynamicCache(config=suite.config), ids, mask, new_tokens),
    }
    if static:
        variants["static"] = lambda: _generate(
            suite.sdpa_model, StaticCache(config=suite.config, max_cache_len=width), ids, mask, new_tokens
        )
    return variants


class _HFContinuousBatching:
    """transformers' `generate_batch` on its own copy of the model (it switches the attention)."""

    def __init__(self, suite: Suite) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(suite.model_path, dtype=torch.float32).eval()

    def __call__(self, ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        from time import perf_counter  # noqa: PLC0415

        start = perf_counter()
        with torch.no_grad():
            out = self.model.generate_batch([row.tolist() for row in ids], generation_config=config, warmup=False)
        elapsed = perf_counter() - start
        produced = sum(len(r.generated_tokens) for r in out.values())
        return {"e2e_tokens_per_s": produced / elapsed}


def _record(suite: Suite, results: dict, parameter: str, x) -> None:
    for variant, values in results.items():
        for metric in values[0]:
            suite.add(NAME, metric, variant, parameter, x, [v[metric] for v in values], "tokens/s")


def run(suite: Suite, progress) -> None:
    vocab = suite.config.vocab_size
    # transformers' generate_batch costs ~30 s of fixed overhead per call on this CPU: full runs only, once
    # per point where it is shown (not alternated), after the alternated variants of that point.
    hf_cb = None if suite.smoke else _HFContinuousBatching(suite)
    # Warm every path once (first calls allocate and dispatch slowly).
    ids, mask = random_prompts([16] * 2, vocab, seed=0)
    alternate(generate_variants(suite, ids, mask, 4), repeats=1)

    lead = (8, 512, 128) if not suite.smoke else (2, 32, 8)
    batches = suite.pick([1, 4, 8, 16], [1, 2])
    contexts = suite.pick([128, 1024, 2048], [16, 64])
    new_tokens = suite.pick(32, 4)
    repeats = suite.pick(3, 1)
    points = (
        [("lead", lead)]
        + [("batch", (b, suite.pick(512, 32), new_tokens)) for b in batches]
        + [("context", (suite.pick(4, 2), c, new_tokens)) for c in contexts]
        + [("prefix_caching", (suite.pick(8, 2), suite.pick(512, 32), suite.pick(64, 4)))]
    )
    for kind, (batch, context, new) in progress(points, desc="decode"):
        ids, mask = random_prompts([context] * batch, vocab, seed=batch * 7919 + context)
        if kind == "prefix_caching":
            _prefix_caching_cost(suite, batch, context, new, repeats)
            continue
        rounds = repeats if kind == "lead" else suite.pick(2, 1)
        results = alternate(generate_variants(suite, ids, mask, new), repeats=rounds)
        if hf_cb is not None and (kind == "lead" or (kind == "batch" and batch == max(batches))):
            results["hf_generate_batch"] = [hf_cb(ids, new)]
        if kind == "lead":
            _record(suite, results, "batch,context,new_tokens", f"{batch},{context},{new}")
        else:
            _record(suite, results, "batch_size" if kind == "batch" else "context", batch if kind == "batch" else context)


def _prefix_caching_cost(suite: Suite, batch: int, context: int, new: int, repeats: int) -> None:
    """Issue 4 (vi): a KVPool with prefix caching on, every prompt new (0% hits), vs caching off.

    Round after round (the first warms up: both pools start empty), each pool takes the round's prompts (the same
    for both; new each round) in a cache of its own, and the two caches decode side by side, forward by forward,
    alternating which goes first: the pools then differ only in where the blocks are and in the caching work, and
    the drift of a shared machine, which moves whole `generate()` runs by more than the difference, cancels.
    Decode tokens/s is `batch` over the round's median forward; end to end adds the prefill.
    Both caches must give the same greedy tokens.
    """
    vocab = suite.config.vocab_size
    model = suite.paged_model
    pools = {
        "prefix_caching_on": hf_paged.KVPool(suite.config, prefix_caching=True),
        "prefix_caching_off": hf_paged.KVPool(suite.config, prefix_caching=False),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in pools}
    with torch.no_grad():
        for round_ in range(repeats + 1):
            ids, mask = random_prompts([context] * batch, vocab, seed=100_000 + round_)
            caches, tokens, masks, seconds, prefill = {}, {}, {}, {name: [] for name in pools}, {}
            for name, pool in pools.items():
                caches[name] = pool.new_cache(ids, mask)
                start = time.perf_counter()
                logits = model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(caches[name])).logits
                prefill[name] = time.perf_counter() - start
                tokens[name], masks[name] = logits[:, -1:].argmax(-1), mask
            order = list(pools)
            for _ in range(new - 1):
                for name in order:
                    masks[name] = torch.cat([masks[name], masks[name].new_ones(batch, 1)], dim=1)
                    start = time.perf_counter()
                    logits = model(input_ids=tokens[name], attention_mask=masks[name],
                                   **hf_paged.cache_kwargs(caches[name])).logits
                    seconds[name].append(time.perf_counter() - start)
                    tokens[name] = logits[:, -1:].argmax(-1)
                order.reverse()
            if not torch.equal(*tokens.values()):
                raise AssertionError("prefix caching on and off decoded different tokens")
            for name, cache in caches.items():
                cache.release()
                if round_:
                    step = sorted(seconds[name])[len(seconds[name]) // 2]
                    results[name].append({"decode_tokens_per_s": batch / step,
                                          "e2e_tokens_per_s": batch * new / (prefill[name] + sum(seconds[name]))})
    _record(suite, results, "batch,context,new_tokens", f"{batch},{context},{new}")
    hit = pools["prefix_caching_on"].stats().prefix_hit_rate
    suite.add(NAME, "prefix_hit_rate", "prefix_caching_on", "batch,context,new_tokens", f"{batch},{context},{new}", 100 * hit, "%")
