"""Prefill time of a model whose last layers reuse an earlier layer's K/V (Gemma 4's `num_kv_shared_layers`) vs
DynamicCache + sdpa, same logits.

The model is a Gemma 4 text model built from a config at the shipped demo model's size (hidden 256, 8 layers of
which the last 4 reuse K/V, sliding window 512 on 6 of them, random weights). In a prefill, Gemma 4 keeps only the
last query in those layers: `"paged"` attends that one query over the rows' blocks (`ForwardPlan.last_columns`), as
sdpa attends the sliced query. Variants, alternated on the same prompts: `paged` (`PagedCache` + `"paged"`) and
`dynamic` (`DynamicCache` + sdpa); the figure is the wall time of one forward over the prompt (`logits_to_keep=1`),
and the largest difference of their last logits is recorded.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_paged

from .common import Suite, alternate

NAME = "kv_sharing"


def sharing_models(smoke: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(`"paged"` model, sdpa model) of one Gemma 4 text config with the same weights."""
    config = AutoConfig.for_model(
        "gemma4_text", vocab_size=1024, hidden_size=64 if smoke else 256, intermediate_size=128 if smoke else 512,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=64, global_head_dim=64,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2, sliding_window=512, num_kv_shared_layers=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=1024, max_position_embeddings=8192,
        pad_token_id=0, eos_token_id=None,
    )
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="paged").eval()
    paged.load_state_dict(sdpa.state_dict())
    return paged, sdpa


def run(suite: Suite, progress) -> None:
    paged, sdpa = sharing_models(suite.smoke)
    vocab = paged.config.vocab_size
    repeats = suite.pick(5, 1)
    for length in progress(suite.pick([512, 2048], [32]), desc=NAME):
        ids = torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(length))
        logits: dict[str, torch.Tensor] = {}

        def prefill(name: str) -> float:
            model = paged if name == "paged" else sdpa
            cache = hf_paged.PagedCache(config=paged.config) if name == "paged" else DynamicCache(config=sdpa.config)
            with torch.no_grad():
                start = time.perf_counter()
                out = model(input_ids=ids, **hf_paged.cache_kwargs(cache), logits_to_keep=1)
                elapsed = time.perf_counter() - start
            logits[name] = out.logits[0, -1]
            return elapsed

        prefill("paged"), prefill("dynamic")  # warm-up
        results = alternate({name: (lambda name=name: prefill(name)) for name in ("paged", "dynamic")}, repeats=repeats)
        for variant, values in results.items():
            suite.add(NAME, "prefill_ms", variant, "prompt_len", length, [v * 1000 for v in values], "ms")
        diff = (logits["paged"] - logits["dynamic"]).abs().max().item()
        suite.add(NAME, "max_logit_diff", "paged", "prompt_len", length, diff, "logit")


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """The headline row for `run_all`'s table: prefill time at the longest prompt."""
    lengths = [r.x for r in suite.rows if r.benchmark == NAME and r.metric == "prefill_ms"]
    if not lengths:
        return []
    x = max(lengths)
    paged, dynamic = (suite.get(NAME, "prefill_ms", v, x) for v in ("paged", "dynamic"))
    diff = suite.get(NAME, "max_logit_diff", "paged", x)
    return [(
        f"Gemma 4-style model (4 of 8 layers reuse K/V): prefill ms, prompt {x}",
        f"{paged.p50:.3g}",
        f"dynamic {dynamic.p50:.3g}",
        f"paged/dynamic {paged.p50 / dynamic.p50:.2f}x time; max logit diff {diff.p50:.1e}",
    )]
