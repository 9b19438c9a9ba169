"""Time to first token of a vision-language model's request through `hf_paged.Engine`: a second question about an image
the engine already served (its blocks in the engine's pool) vs a cold engine, and a different image, which must not hit
the image's blocks. The Engine variant of `bench_vlm_prefix.py`, with its model (llava: Llama hidden 512, 4 layers; CLIP
hidden 256, 4 layers; 576 placeholders per image) and its prompts (`16 text tokens + the image's placeholders +
a 16-token question`, the processor's output as the request).

The warm engine served one question about image A. Variants, alternated, each with a new question:
- `engine_prefix_hit`: image A again on the warm engine: the text and the image's blocks are hit, so the vision tower
  does not run and only the question is prefilled.
- `engine_other_image`: a new image each call on the warm engine: only the text before the image hits.
- `engine_cold`: a fresh engine and pool per call.
Time to first token is the wall time of `engine.generate([request], max_new_tokens=1)`. Also recorded per variant:
its prefix hit tokens and how many times the vision tower ran; and whether the warm engine's greedy output equals
`generate()` with DynamicCache + sdpa.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

import hf_paged

from .bench_vlm_prefix import TEXT_LEN, WARM_BLOCKS, _inputs, vlm_models
from .common import Suite, alternate

NAME = "vlm_engine"
VARIANTS = ("engine_prefix_hit", "engine_other_image", "engine_cold")


def run(suite: Suite, progress) -> None:
    paged, sdpa, placeholders = vlm_models(suite.smoke)
    size = paged.config.vision_config.image_size
    repeats = suite.pick(5, 1)
    vision_runs = [0]
    paged.model.vision_tower.register_forward_hook(lambda *_: vision_runs.__setitem__(0, vision_runs[0] + 1))
    prefix = torch.randint(1, 1000, (1, TEXT_LEN), generator=torch.Generator().manual_seed(0))
    warm = hf_paged.Engine(paged, hf_paged.KVPool(paged.config, num_blocks=WARM_BLOCKS))
    warm.generate([_inputs(prefix, placeholders, 1, 0, size)], max_new_tokens=1, progress=False)  # image A, once
    seeds = dict.fromkeys(VARIANTS, 0)
    hits: dict[str, list[int]] = {name: [] for name in VARIANTS}
    runs: dict[str, list[int]] = {name: [] for name in VARIANTS}

    def timed(name: str) -> float:
        seeds[name] += 1
        image = 1000 + seeds[name] if name == "engine_other_image" else 1
        request = _inputs(prefix, placeholders, image, seeds[name], size)  # the same questions for every variant
        engine = warm if name != "engine_cold" else hf_paged.Engine(paged, hf_paged.KVPool(paged.config))
        hit_before, runs_before = engine.stats().prefix_hit_tokens, vision_runs[0]
        start = time.perf_counter()
        engine.generate([request], max_new_tokens=1, progress=False)
        elapsed = time.perf_counter() - start
        hits[name].append(engine.stats().prefix_hit_tokens - hit_before)
        runs[name].append(vision_runs[0] - runs_before)
        return elapsed

    results = alternate({name: (lambda name=name: timed(name)) for name in progress(VARIANTS, desc=NAME)}, repeats)
    x = TEXT_LEN + placeholders + TEXT_LEN
    for variant, values in results.items():
        suite.add(NAME, "ttft", variant, "prompt_len", x, [v * 1000 for v in values], "ms")
        suite.add(NAME, "prefix_hit_tokens", variant, "prompt_len", x, hits[variant], "tokens")
        suite.add(NAME, "vision_tower_runs", variant, "prompt_len", x, runs[variant], "runs")

    request = _inputs(prefix, placeholders, 1, 10_000, size)
    new = suite.pick(16, 4)
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    (tokens,) = warm.generate([request], **options, progress=False)
    with torch.no_grad():
        ref = sdpa.generate(**request, cache=DynamicCache(config=sdpa.config), pad_token_id=0, **options)
    same = tokens == ref[0, request["input_ids"].shape[1] :].tolist()
    suite.add(NAME, "outputs_identical_vs_dynamic", "engine_prefix_hit", "prompt_len", x, float(same), "bool")
    warm.pool.check()


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """The headline row: same-image TTFT vs a cold engine, hit tokens and vision tower runs, same tokens."""
    row = suite.get(NAME, "ttft", "engine_prefix_hit")
    if row is None:
        return []
    x = row.x
    cold, other = (suite.get(NAME, "ttft", v, x) for v in ("engine_cold", "engine_other_image"))
    hit, other_hit = (suite.get(NAME, "prefix_hit_tokens", v, x) for v in ("engine_prefix_hit", "engine_other_image"))
    runs, other_runs = (suite.get(NAME, "vision_tower_runs", v, x) for v in ("engine_prefix_hit", "engine_other_image"))
    same = suite.get(NAME, "outputs_identical_vs_dynamic", "engine_prefix_hit", x)
    return [(
        f"VLM (llava) Engine TTFT ms, second question about one image, prompt {x}",
        f"{row.p50:.3g}",
        f"cold engine {cold.p50:.3g}, other image {other.p50:.3g}",
        f"hit/cold {row.p50 / cold.p50:.2f}x; hit tokens {hit.p50:.0f} (other image {other_hit.p50:.0f}); vision tower "
        f"runs {runs.p50:.0f} (other image {other_runs.p50:.0f}); identical to DynamicCache={bool(same.p50)}",
    )]
