"""Host work per layer and decode step: what the CPU does around a tiny attention, paged vs the default cache.

On a GPU at small batch, the time a step takes is the time the host needs to issue it. This benchmark makes
the model so small that the math is negligible (a 24-layer Llama of width 64, batch 1, one thread) and
measures each decode step's thread CPU time (`time.thread_time`, so a shared machine's other processes do
not count) for `PagedCache` + `"paged"` and for `DynamicCache` + sdpa, alternated on the same prompt. The
difference divided by the number of layers is the host work the paged path adds per layer and step.

Run alone: `python -m benchmarks.bench_host [--steps 64] [--repeats 7]`; `make bench` runs it as `host`.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LogitsProcessor

import hf_paged

from .common import Suite, alternate

NAME = "host"
NUM_LAYERS = 24


class ThreadClock(LogitsProcessor):
    """Thread CPU time at every decoding step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.thread_time())
        return scores

    def per_step(self) -> float:
        """Median thread seconds per decode step (the prefill step excluded)."""
        steps = sorted(b - a for a, b in zip(self.times[:-1], self.times[1:], strict=False))
        return steps[len(steps) // 2]


def tiny_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random 24-layer, width-64 Llama loaded with `"paged"` and with sdpa."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="paged").eval()
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    assert paged.config._attn_implementation == "paged" and sdpa.config._attn_implementation == "sdpa"
    sdpa.load_state_dict(paged.state_dict())
    return paged, sdpa


def measure(steps: int, repeats: int) -> dict[str, list[float]]:
    """Thread seconds per decode step, per variant and repeat."""
    paged, sdpa = tiny_models()
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(model, cache) -> float:
        clock = ThreadClock()
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(cache),
                max_new_tokens=steps, min_new_tokens=steps, do_sample=False, logits_processor=[clock],
            )  # fmt: skip
        return clock.per_step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return alternate(
            {
                "paged": lambda: run(paged, hf_paged.PagedCache(paged.config)),
                "dynamic": lambda: run(sdpa, DynamicCache(config=sdpa.config)),
            },
            repeats,
            warmup=1,
        )
    finally:
        torch.set_num_threads(threads)


def run(suite: Suite, progress) -> None:
    results = measure(steps=suite.pick(64, 8), repeats=suite.pick(7, 2))
    for variant, values in results.items():
        suite.add(NAME, "thread_us_per_step", variant, "layers", NUM_LAYERS, [v * 1e6 for v in values], "us")
        suite.add(NAME, "thread_us_per_layer_step", variant, "layers", NUM_LAYERS, [v * 1e6 / NUM_LAYERS for v in values], "us")
    extra = [(p - d) * 1e6 / NUM_LAYERS for p, d in zip(results["paged"], results["dynamic"], strict=True)]
    suite.add(NAME, "added_us_per_layer_step", "paged", "layers", NUM_LAYERS, extra, "us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = measure(args.steps, args.repeats)
    for variant, values in results.items():
        values = sorted(values)
        print(f"{variant:8s} {values[len(values) // 2] * 1e6:8.0f} us/step  {values[len(values) // 2] * 1e6 / NUM_LAYERS:6.1f} us/layer/step")
    extra = sorted((p - d) * 1e6 / NUM_LAYERS for p, d in zip(results["paged"], results["dynamic"], strict=True))
    print(f"paged adds {extra[len(extra) // 2]:.1f} us per layer and decode step (median of {len(extra)} side-by-side pairs)")


if __name__ == "__main__":
    main()
