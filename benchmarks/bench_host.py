"""Host work per layer and decode step: what the CPU does around a tiny attention, paged vs the default cache.

On a GPU at small batch, the time a step takes is the time the host needs to issue it. This benchmark makes
the model so small that the math is negligible (a 24-layer Llama of width 64, batch 1, one thread) and
measures the decode steps' thread CPU time (`time.thread_time`, so a shared machine's other processes do
not count) for `PagedCache` + `"paged"` and for `DynamicCache` + sdpa, alternated on the same prompt. A run's
figure is its mean decode step (every cost counts, garbage collection included); the difference between the
two variants of a pair, divided by the number of layers, is the host work the paged path adds per layer and
step, and the median over pairs is reported.

Both variants run one model object (its attention implementation switched between runs). The whole-step
figure still moves by several µs per layer between processes; a second, steadier figure times each layer's
own calls in the same runs: the attention function and the cache's `update()` (thread CPU time per call,
decode steps only). Their median per call, paged minus default, is what a layer adds in itself; their mean
also spreads over the layers what the paged path does once per step in its first layer (the plan and its
device tensors) and last layer (the commit). The whole step also holds what the calls leave outside them (the
mask function, the model's own ops running after a different host path).

Run alone: `python -m benchmarks.bench_host [--steps 64] [--repeats 7] [--batch 1]`; `make bench` runs it as
`host` (batch 1).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache, LlamaConfig, LogitsProcessor

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
        """Mean thread seconds per decode step (the prefill step excluded)."""
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)


class CallTimes:
    """Thread CPU time of each call of the layers' attention function and of the cache's `update()`."""

    def __init__(self) -> None:
        self.attention: list[int] = []
        self.update: list[int] = []

    def wrap(self, fn, into: list[int]):
        def timed(*args, **kwargs):
            start = time.thread_time_ns()
            out = fn(*args, **kwargs)
            into.append(time.thread_time_ns() - start)
            return out

        return timed

    def per_layer(self) -> tuple[float, float]:
        """(median, mean) seconds of attention + update per layer call, the prefill's calls excluded."""
        attention, update = self.attention[NUM_LAYERS:], self.update[NUM_LAYERS:]

        def median(values: list[int]) -> float:
            return sorted(values)[len(values) // 2]

        return (median(attention) + median(update)) / 1e9, (sum(attention) / len(attention) + sum(update) / len(update)) / 1e9


@contextlib.contextmanager
def timed_calls(implementation: str, cache) -> Iterator[CallTimes]:
    """Times the registered attention function `implementation` and `cache.update` while inside."""
    times = CallTimes()
    registry = AttentionInterface._global_mapping
    original = registry[implementation]
    registry[implementation] = times.wrap(original, times.attention)
    cache.update = times.wrap(cache.update, times.update)  # an attribute of this instance only
    try:
        yield times
    finally:
        registry[implementation] = original
        del cache.update


def tiny_model() -> torch.nn.Module:
    """A random 24-layer, width-64 Llama. Both variants run this one model (its attention implementation is
    switched between runs), so their weights sit at the same addresses: two copies of the model differ by
    several µs per layer in their matmuls alone, which is not host work of either cache."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()


def measure(steps: int, repeats: int, batch: int = 1) -> dict[str, list[dict[str, float]]]:
    """Per variant and repeat, thread seconds: `step`, the mean decode step; `layer_calls` and
    `layer_calls_mean`, a layer's attention call + `update()` call (median and mean, `CallTimes.per_layer`)."""
    model = tiny_model()
    ids = torch.randint(1, 256, (batch, 16), generator=torch.Generator().manual_seed(0))

    def run(implementation: str, cache) -> dict[str, float]:
        model.set_attn_implementation(implementation)
        if model.config._attn_implementation != implementation:
            raise RuntimeError(f"the model did not switch to attn_implementation={implementation!r}")
        clock = ThreadClock()
        with torch.no_grad(), timed_calls(implementation, cache) as calls:
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(cache),
                max_new_tokens=steps, min_new_tokens=steps, do_sample=False, logits_processor=[clock],
            )  # fmt: skip
        median, mean = calls.per_layer()
        return {"step": clock.per_step(), "layer_calls": median, "layer_calls_mean": mean}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return alternate(
            {
                "paged": lambda: run("paged", hf_paged.PagedCache(model.config)),
                "dynamic": lambda: run("sdpa", DynamicCache(config=model.config)),
            },
            repeats,
            warmup=1,
        )
    finally:
        torch.set_num_threads(threads)


def run(suite: Suite, progress) -> None:
    results = measure(steps=suite.pick(64, 8), repeats=suite.pick(7, 2))
    for variant, values in results.items():
        step = [v["step"] * 1e6 for v in values]
        suite.add(NAME, "thread_us_per_step", variant, "layers", NUM_LAYERS, step, "us")
        suite.add(NAME, "thread_us_per_layer_step", variant, "layers", NUM_LAYERS, [v / NUM_LAYERS for v in step], "us")
        suite.add(NAME, "layer_calls_us", variant, "layers", NUM_LAYERS, [v["layer_calls"] * 1e6 for v in values], "us")
    for metric, key, scale in (("added_us_per_layer_step", "step", 1 / NUM_LAYERS), ("layer_calls_added_us", "layer_calls", 1),
                               ("layer_calls_added_mean_us", "layer_calls_mean", 1)):  # fmt: skip
        added = [(p[key] - d[key]) * 1e6 * scale for p, d in zip(results["paged"], results["dynamic"], strict=True)]
        suite.add(NAME, metric, "paged", "layers", NUM_LAYERS, added, "us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (the `host` row: 1)")
    args = parser.parse_args()
    results = measure(args.steps, args.repeats, args.batch)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    for variant, values in results.items():
        step = median([v["step"] for v in values]) * 1e6
        calls = median([v["layer_calls"] for v in values]) * 1e6
        print(f"{variant:8s} {step:8.0f} us/step  {step / NUM_LAYERS:6.1f} us/layer/step  {calls:6.1f} us in a layer's "
              "attention + update (median call)")  # fmt: skip
    pairs = list(zip(results["paged"], results["dynamic"], strict=True))
    whole = median([(p["step"] - d["step"]) * 1e6 / NUM_LAYERS for p, d in pairs])
    calls = median([(p["layer_calls"] - d["layer_calls"]) * 1e6 for p, d in pairs])
    mean = median([(p["layer_calls_mean"] - d["layer_calls_mean"]) * 1e6 for p, d in pairs])
    print(f"paged adds {whole:.1f} us per layer and decode step (median of {len(pairs)} side-by-side pairs); "
          f"in the layers' calls: {calls:.1f} us (median call), {mean:.1f} us (mean call, with the per-step plan)")


if __name__ == "__main__":
    main()
