"""Decode tokens/s of models whose layers attend a sliding window, `PagedCache` + "paged" against `DynamicCache` +
sdpa, at batch 1 and 8.

Random models of the demo model's shapes (4 layers, hidden 256, 4 heads, 2 KV heads of 64, fp32, weights scaled for
peaked logits): Mistral with a window of 1024 (512-token prompts stay within it) and of 256 (rows pass it: the
default cache keeps its last 256 tokens, the paged one frees the blocks out of it), and Gemma 3's text model (every
layer windowed, 1024). One model object per family runs both variants, its attention implementation switched
before each `generate()`: two copies of a model differ in their matmuls alone by more than what is measured here.
Variants alternate on the same prompts (512 tokens per row, 64 new tokens); decode tokens/s counts the steps after
the first (`StepClock`). Both must give the same greedy tokens.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_paged

from .common import DEMO_SHAPE, StepClock, Suite, alternate, random_prompts

NAME = "window"
#: (name, model type, sliding window, extra config)
MODELS = (
    ("mistral_w1024", "mistral", 1024, {}),
    ("mistral_w256", "mistral", 256, {}),
    ("gemma3_w1024", "gemma3_text", 1024, {"layer_types": ["sliding_attention"] * DEMO_SHAPE["num_hidden_layers"]}),
)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")


def windowed_model(model_type: str, window: int, extra: dict, smoke: bool) -> torch.nn.Module:
    """A random model of the demo model's shapes (smoke: 2 layers of width 64) with every layer windowed."""
    shape = {k: DEMO_SHAPE[k] for k in SHAPE_KEYS if k in DEMO_SHAPE}
    if smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
        extra = {k: v[:2] if k == "layer_types" else v for k, v in extra.items()}
    config = AutoConfig.for_model(model_type, **shape, sliding_window=window, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def run(suite: Suite, progress) -> None:
    prompt, new = suite.pick(512, 16), suite.pick(64, 4)
    for name, model_type, window, extra in progress(MODELS, desc=NAME):
        model = windowed_model(model_type, suite.pick(window, window // 32), extra, suite.smoke)
        tokens: dict[str, torch.Tensor] = {}

        def generate(variant: str, ids: torch.Tensor, mask: torch.Tensor) -> float:
            model.set_attn_implementation("paged" if variant == "paged" else "sdpa")
            cache = hf_paged.PagedCache() if variant == "paged" else DynamicCache(config=model.config)
            clock = StepClock()
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, logits_processor=[clock],
                )
            tokens[variant] = out
            return clock.decode_tokens_per_s(ids.shape[0])

        for batch in suite.pick([1, 8], [1, 2]):
            ids, mask = random_prompts([prompt] * batch, model.config.vocab_size, seed=batch)
            results = alternate(
                {v: (lambda v=v: generate(v, ids, mask)) for v in ("paged", "dynamic")}, suite.pick(5, 1), warmup=1
            )
            x = f"{name},{batch}"
            for variant, values in results.items():
                suite.add(NAME, "decode_tokens_per_s", variant, "model,batch", x, values, "tokens/s")
            same = float(torch.equal(tokens["paged"], tokens["dynamic"]))
            suite.add(NAME, "outputs_identical_vs_dynamic", "paged", "model,batch", x, [same], "bool")


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """One row per model and batch: paged and dynamic decode tokens/s and their ratio."""
    out = []
    rows = [r for r in suite.rows if r.benchmark == NAME and r.metric == "decode_tokens_per_s" and r.variant == "paged"]
    for row in rows:
        dynamic = suite.get(NAME, "decode_tokens_per_s", "dynamic", row.x)
        same = suite.get(NAME, "outputs_identical_vs_dynamic", "paged", row.x)
        name, batch = str(row.x).split(",")
        out.append((
            f"sliding-window decode tokens/s, {name}, batch {batch}",
            f"{row.p50:.3g}",
            f"dynamic {dynamic.p50:.3g}",
            f"paged/dynamic {row.p50 / dynamic.p50:.2f}x; same tokens={bool(same.p50)}",
        ))
    return out
