"""Requests with images whose tokens attend each other both ways (Gemma 3) through `hf_paged.Engine`, against
`generate()` one request at a time: output tokens/s, and whether every request gets the tokens `generate()` gives it.

The model is a random Gemma 3 (text: hidden 256, 4 layers, sliding window 512; SigLIP tower: hidden 128, 2 layers,
224-pixel images pooled to 64 placeholders), its weights scaled so that greedy tokens are not near-ties. Each request
is `16 text tokens + <start of image> + 64 placeholders + <end of image> + 16 text tokens`, with its own image and
text, and the processor's `token_type_ids` (1 on the placeholders): the model's mask lets an image's tokens see each
other. Variants, alternated:
- `engine`: all requests in one `Engine.generate()` call (the chunks hold each image whole, under that mask);
- `generate_paged`: `generate()` with a `PagedCache`, one request after another;
- `generate_dynamic`: `generate()` with `DynamicCache` + sdpa, one request after another.
Tokens/s counts every request's new tokens over the variant's wall time (prefills and vision tower included).
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, DynamicCache

import hf_paged

from .common import Suite, alternate, paired_vlms

NAME = "vlm_batch"
VARIANTS = ("engine", "generate_paged", "generate_dynamic")
TEXT_LEN = 16
IMAGE_TOKEN, BOI, EOI = 1000, 1001, 1002


def gemma3_models(smoke: bool) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """(`"paged"` Gemma 3, sdpa Gemma 3 with the same weights, placeholders per image)."""
    image_size, patch, tokens = (28, 7, 4) if smoke else (224, 14, 64)
    text = dict(model_type="gemma3_text", vocab_size=1024 + 8, hidden_size=64 if smoke else 256,
                intermediate_size=128 if smoke else 512, num_hidden_layers=2 if smoke else 4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16 if smoke else 64, sliding_window=512, max_position_embeddings=4096,
                pad_token_id=0, eos_token_id=None, bos_token_id=1)
    vision = dict(model_type="siglip_vision_model", hidden_size=32 if smoke else 128,
                  intermediate_size=64 if smoke else 256, num_hidden_layers=1 if smoke else 2, num_attention_heads=2,
                  image_size=image_size, patch_size=patch)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                  boi_token_id=BOI, eoi_token_id=EOI, mm_tokens_per_image=tokens)
    paged, sdpa = paired_vlms(config, 3.0)
    return paged, sdpa, tokens


def request(seed: int, placeholders: int, size: int) -> dict:
    """One prompt with its own image, as a processor returns it."""
    gen = torch.Generator().manual_seed(seed)
    before, after = (torch.randint(2, 1000, (1, TEXT_LEN), generator=gen) for _ in range(2))
    image = torch.tensor([[BOI] + [IMAGE_TOKEN] * placeholders + [EOI]])
    ids = torch.cat([before, image, after], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": (ids == IMAGE_TOKEN).long(),
            "pixel_values": torch.randn(1, 3, size, size, generator=gen)}


def run(suite: Suite, progress) -> None:
    paged, sdpa, placeholders = gemma3_models(suite.smoke)
    size = paged.config.vision_config.image_size
    num_requests, new = suite.pick(8, 2), suite.pick(32, 4)
    requests = [request(seed, placeholders, size) for seed in range(num_requests)]
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    engine = hf_paged.Engine(paged, hf_paged.KVPool(paged.config))
    outputs: dict[str, list[list[int]]] = {}

    def one_by_one(model, make_cache) -> list[list[int]]:
        out = []
        for inputs in requests:
            with torch.no_grad():
                ids = model.generate(**inputs, **hf_paged.cache_kwargs(make_cache()), **options)
            out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
        return out

    runs = {
        "engine": lambda: engine.generate(requests, **options, progress=False),
        "generate_paged": lambda: one_by_one(paged, lambda: hf_paged.PagedCache(config=paged.config)),
        "generate_dynamic": lambda: one_by_one(sdpa, lambda: DynamicCache(config=sdpa.config)),
    }

    def timed(name: str) -> float:
        start = time.perf_counter()
        outputs[name] = runs[name]()
        return num_requests * new / (time.perf_counter() - start)

    results = alternate({name: (lambda name=name: timed(name)) for name in progress(VARIANTS, desc=NAME)},
                        suite.pick(3, 1), warmup=1)
    x = 2 * TEXT_LEN + placeholders + 2
    for variant, values in results.items():
        suite.add(NAME, "tokens_per_s", variant, "prompt_len", x, values, "tokens/s")
    for variant in ("engine", "generate_paged"):
        same = float(outputs[variant] == outputs["generate_dynamic"])
        suite.add(NAME, "outputs_identical_vs_dynamic", variant, "prompt_len", x, [same], "bool")
    engine.pool.check()


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """The headline row: the Engine's output tokens/s against generate() one request at a time, same tokens."""
    row = suite.get(NAME, "tokens_per_s", "engine")
    if row is None:
        return []
    x = row.x
    one, dynamic = (suite.get(NAME, "tokens_per_s", v, x) for v in ("generate_paged", "generate_dynamic"))
    same = [suite.get(NAME, "outputs_identical_vs_dynamic", v, x) for v in ("engine", "generate_paged")]
    return [(
        f"Gemma 3 requests with images (attended both ways), Engine output tokens/s, prompt {x}",
        f"{row.p50:.3g}",
        f"generate() one by one: PagedCache {one.p50:.3g}, DynamicCache {dynamic.p50:.3g}",
        f"engine/generate(DynamicCache) {row.p50 / dynamic.p50:.2f}x; every request's tokens as DynamicCache's: "
        f"engine {bool(same[0].p50)}, PagedCache {bool(same[1].p50)}",
    )]
