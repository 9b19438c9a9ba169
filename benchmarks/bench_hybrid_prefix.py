"""Time to first token of a hybrid model with its prefix in a `KVPool` (recurrent states restored from a snapshot)
vs cold, same tokens.

The model is a hybrid built from a config at the shipped demo model's size (qwen3_next: gated DeltaNet + attention
layers alternating, hidden 256, 4 layers, random weights scaled for peaked logits). The prefix is a 2000-token
"system prompt" computed once in the warm pool (`new_cache(prefix, model=)` + `generate()`: forwards end at its block
ends, so the index holds the recurrent states there); every timed prompt is `prefix + suffix` (a new 32-token suffix
per call). Variants, alternated:
- `paged_prefix_hit`: the warm pool; `new_cache(ids, model=)` takes the prefix's blocks and states, so `generate()`
  computes only the suffix.
- `paged_cold`: a fresh `KVPool` per call (`new_cache(ids, model=)` runs the prompt up to its last block end, then
  `generate()` the rest).
- `dynamic`: DynamicCache + sdpa (the whole prompt in one forward).
Time to first token is the wall time of `generate(max_new_tokens=1)`, including `new_cache()`. Also recorded: the
prefix hit tokens, state snapshot bytes and K/V bytes per sequence, and whether greedy outputs of the hit, the cold
call and DynamicCache agree token by token.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_paged

from .common import Suite, alternate

NAME = "hybrid_prefix"
FAMILY = "qwen3_next"


def hybrid_models(smoke: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(`"paged"` model, sdpa model) of one hybrid config with the same weights."""
    config = AutoConfig.for_model(
        FAMILY, vocab_size=1024, hidden_size=64 if smoke else 256, intermediate_size=128 if smoke else 512,
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096, pad_token_id=0,
        eos_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for param in sdpa.parameters():
            param.mul_(2.0)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="paged").eval()
    paged.load_state_dict(sdpa.state_dict())
    return paged, sdpa


def _prompt(prefix: torch.Tensor, vocab: int, seed: int, suffix_len: int) -> torch.Tensor:
    suffix = torch.randint(1, vocab, (1, suffix_len), generator=torch.Generator().manual_seed(seed))
    return torch.cat([prefix, suffix], dim=1)


def _generate(model, cache, ids: torch.Tensor, new_tokens: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(cache),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )


def run(suite: Suite, progress) -> None:
    paged, sdpa = hybrid_models(suite.smoke)
    vocab = paged.config.vocab_size
    prefix_len, suffix_len = suite.pick(2000, 64), suite.pick(32, 8)
    repeats = suite.pick(5, 1)
    prefix = torch.randint(1, vocab, (1, prefix_len), generator=torch.Generator().manual_seed(prefix_len))
    warm_pool = hf_paged.KVPool(paged.config)
    with warm_pool.new_cache(prefix, model=paged) as cache:  # the system prompt, once: snapshots at its block ends
        _generate(paged, cache, prefix)
    seeds = {"paged_prefix_hit": 0, "paged_cold": 0, "dynamic": 0}
    hits: list[int] = []

    def timed(name: str) -> float:
        seeds[name] += 1
        ids = _prompt(prefix, vocab, seeds[name], suffix_len)  # the same prompts for every variant
        start = time.perf_counter()
        if name == "dynamic":
            _generate(sdpa, DynamicCache(config=sdpa.config), ids)
            return time.perf_counter() - start
        pool = warm_pool if name == "paged_prefix_hit" else hf_paged.KVPool(paged.config)
        with pool.new_cache(ids, model=paged) as cache:
            _generate(paged, cache, ids)
            elapsed = time.perf_counter() - start
            if name == "paged_prefix_hit":
                hits.append(cache.prefix_hit_tokens)
            return elapsed

    results = alternate({name: (lambda name=name: timed(name)) for name in progress(seeds, desc=NAME)}, repeats=repeats)
    for variant, values in results.items():
        suite.add(NAME, "ttft", variant, "prefix_len", prefix_len, [v * 1000 for v in values], "ms")
    suite.add(NAME, "prefix_hit_tokens", "paged_prefix_hit", "prefix_len", prefix_len, hits, "tokens")

    ids = _prompt(prefix, vocab, 10_000, suffix_len)
    new = suite.pick(16, 4)
    with hf_paged.KVPool(paged.config).new_cache(ids, model=paged) as cache:
        cold = _generate(paged, cache, ids, new)
    with warm_pool.new_cache(ids, model=paged) as cache:
        warm = _generate(paged, cache, ids, new)
        stats = cache.stats()
    ref = _generate(sdpa, DynamicCache(config=sdpa.config), ids, new)
    x = prefix_len
    kv_bytes = stats.bytes_in_use - stats.state_bytes_in_use
    suite.add(NAME, "kv_bytes_per_sequence", "paged_prefix_hit", "prefix_len", x, kv_bytes, "bytes")
    suite.add(NAME, "state_bytes_per_sequence", "paged_prefix_hit", "prefix_len", x,
              warm_pool.state_slots.bytes_per_slot, "bytes")
    suite.add(NAME, "snapshot_bytes_held", "paged_prefix_hit", "prefix_len", x, warm_pool.stats().state_snapshot_bytes, "bytes")
    suite.add(NAME, "outputs_identical_hit_vs_cold", "paged_prefix_hit", "prefix_len", x, float(torch.equal(cold, warm)), "bool")
    suite.add(NAME, "outputs_identical_vs_dynamic", "paged_prefix_hit", "prefix_len", x, float(torch.equal(ref, warm)), "bool")
    warm_pool.check()


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """The headline row for `run_all`'s table: hit vs cold TTFT, same tokens."""
    row = suite.get(NAME, "ttft", "paged_prefix_hit")
    if row is None:
        return []
    x = row.x
    cold, dyn = (suite.get(NAME, "ttft", v, x) for v in ("paged_cold", "dynamic"))
    same = suite.get(NAME, "outputs_identical_hit_vs_cold", "paged_prefix_hit", x)
    state, kv = (suite.get(NAME, m, "paged_prefix_hit", x) for m in ("state_bytes_per_sequence", "kv_bytes_per_sequence"))
    return [(
        f"hybrid ({FAMILY}) TTFT ms, prefix {x} in a KVPool + suffix",
        f"{row.p50:.3g}",
        f"cold {cold.p50:.3g}, dynamic {dyn.p50:.3g}",
        f"hit/cold {row.p50 / cold.p50:.2f}x; identical={bool(same.p50)}; state {state.p50:.0f} B vs K/V {kv.p50:.0f} B "
        "per sequence",
    )]
