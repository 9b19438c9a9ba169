"""Time to first token of a vision-language model (llava) asked a second question about the same image, with the
first request's blocks in a `KVPool`, vs cold; and a different image, which must not hit the image's blocks.

The model is a llava built from a config (Llama language model: hidden 512, 4 layers; CLIP tower: hidden 256,
4 layers, 336-pixel images in 14-pixel patches, so 576 placeholder tokens per image, as llava-1.5's; random weights
scaled for peaked logits). The warm pool has a fixed size that holds every request's blocks (a growing pool reuses cached
blocks before it grows). Every prompt is `16 text tokens + the image's placeholders + a 16-token question`. The warm pool
served one question about image A (`new_cache(**inputs, model=)`; its whole sequence indexed by `commit_tokens`).
Variants, alternated, each with a new question:
- `paged_prefix_hit`: image A again, on the warm pool: the text and the image's blocks are hit, `generate()` gets
  `cache.uncached_inputs(inputs)` (no `pixel_values`: the vision tower does not run) and computes the question.
- `paged_other_image`: a new image each call, on the same pool: only the text before the image hits.
- `paged_cold`: a fresh `KVPool` per call.
- `dynamic`: DynamicCache + sdpa (the whole prompt, vision tower included).
Time to first token is the wall time of `generate(max_new_tokens=1)`, including `new_cache()`. Also recorded: the
hit tokens of both paged variants, and whether greedy outputs of the hit, a cold call and DynamicCache agree.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, DynamicCache

import hf_paged

from .common import Suite, alternate, paired_vlms

NAME = "vlm_prefix"
IMAGE_TOKEN = 1000
TEXT_LEN = 16
#: Blocks of the warm pool: every timed request's blocks stay cached (about 20 blocks of 16 tokens each).
WARM_BLOCKS = 512


def vlm_models(smoke: bool) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """(`"paged"` llava, sdpa llava with the same weights, placeholders per image)."""
    image_size, patch = (56, 14) if smoke else (336, 14)
    text = dict(model_type="llama", vocab_size=1024, hidden_size=64 if smoke else 512,
                intermediate_size=128 if smoke else 1024, num_hidden_layers=2 if smoke else 4,
                num_attention_heads=4 if smoke else 8, num_key_value_heads=2, head_dim=16 if smoke else 64,
                max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, tie_word_embeddings=False)
    vision = dict(model_type="clip_vision_model", hidden_size=32 if smoke else 256, intermediate_size=64 if smoke else 1024,
                  num_hidden_layers=1 if smoke else 4, num_attention_heads=2 if smoke else 4, image_size=image_size,
                  patch_size=patch, projection_dim=64)
    config = AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                  vision_feature_layer=-1, vision_feature_select_strategy="default")
    paged, sdpa = paired_vlms(config, 2.0)
    return paged, sdpa, (image_size // patch) ** 2


def _inputs(prefix: torch.Tensor, placeholders: int, image_seed: int, question_seed: int, size: int) -> dict:
    question = torch.randint(1, 1000, (1, TEXT_LEN), generator=torch.Generator().manual_seed(question_seed))
    ids = torch.cat([prefix, torch.full((1, placeholders), IMAGE_TOKEN), question], dim=1)
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(image_seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _generate(model, cache, inputs: dict, new_tokens: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            **inputs, **hf_paged.cache_kwargs(cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )


def run(suite: Suite, progress) -> None:
    paged, sdpa, placeholders = vlm_models(suite.smoke)
    size = paged.config.vision_config.image_size
    repeats = suite.pick(5, 1)
    prefix = torch.randint(1, 1000, (1, TEXT_LEN), generator=torch.Generator().manual_seed(0))
    warm_pool = hf_paged.KVPool(paged.config, num_blocks=WARM_BLOCKS)
    first = _inputs(prefix, placeholders, image_seed=1, question_seed=0, size=size)
    with warm_pool.new_cache(**first, model=paged) as cache:  # the first question about image A
        cache.commit_tokens(_generate(paged, cache, first))
    seeds = {"paged_prefix_hit": 0, "paged_other_image": 0, "paged_cold": 0, "dynamic": 0}
    hits: dict[str, list[int]] = {"paged_prefix_hit": [], "paged_other_image": []}

    def timed(name: str) -> float:
        seeds[name] += 1
        image = 1000 + seeds[name] if name == "paged_other_image" else 1
        inputs = _inputs(prefix, placeholders, image, seeds[name], size)  # the same questions for every variant
        start = time.perf_counter()
        if name == "dynamic":
            _generate(sdpa, DynamicCache(config=sdpa.config), inputs)
            return time.perf_counter() - start
        pool = hf_paged.KVPool(paged.config) if name == "paged_cold" else warm_pool
        with pool.new_cache(**inputs, model=paged) as cache:
            _generate(paged, cache, cache.uncached_inputs(inputs))
            elapsed = time.perf_counter() - start
            if name in hits:
                hits[name].append(cache.prefix_hit_tokens)
            return elapsed

    results = alternate({name: (lambda name=name: timed(name)) for name in progress(seeds, desc=NAME)}, repeats=repeats)
    x = TEXT_LEN + placeholders + TEXT_LEN
    for variant, values in results.items():
        suite.add(NAME, "ttft", variant, "prompt_len", x, [v * 1000 for v in values], "ms")
    for variant, values in hits.items():
        suite.add(NAME, "prefix_hit_tokens", variant, "prompt_len", x, values, "tokens")

    inputs = _inputs(prefix, placeholders, 1, 10_000, size)
    new = suite.pick(16, 4)
    with hf_paged.KVPool(paged.config).new_cache(**inputs, model=paged) as cache:
        cold = _generate(paged, cache, cache.uncached_inputs(inputs), new)
    with warm_pool.new_cache(**inputs, model=paged) as cache:
        warm = _generate(paged, cache, cache.uncached_inputs(inputs), new)
    ref = _generate(sdpa, DynamicCache(config=sdpa.config), inputs, new)
    suite.add(NAME, "outputs_identical_hit_vs_cold", "paged_prefix_hit", "prompt_len", x, float(torch.equal(cold, warm)), "bool")
    suite.add(NAME, "outputs_identical_vs_dynamic", "paged_prefix_hit", "prompt_len", x, float(torch.equal(ref, warm)), "bool")
    warm_pool.check()


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """The headline row for `run_all`'s table: same-image hit vs cold TTFT, other-image hit tokens, same tokens."""
    row = suite.get(NAME, "ttft", "paged_prefix_hit")
    if row is None:
        return []
    x = row.x
    cold, dyn, other = (suite.get(NAME, "ttft", v, x) for v in ("paged_cold", "dynamic", "paged_other_image"))
    same = suite.get(NAME, "outputs_identical_hit_vs_cold", "paged_prefix_hit", x)
    hit, other_hit = (suite.get(NAME, "prefix_hit_tokens", v, x) for v in ("paged_prefix_hit", "paged_other_image"))
    return [(
        f"VLM (llava) TTFT ms, second question about one image, prompt {x}",
        f"{row.p50:.3g}",
        f"cold {cold.p50:.3g}, dynamic {dyn.p50:.3g}, other image {other.p50:.3g}",
        f"hit/cold {row.p50 / cold.p50:.2f}x; hit tokens {hit.p50:.0f} (other image {other_hit.p50:.0f}); "
        f"identical={bool(same.p50)}",
    )]
