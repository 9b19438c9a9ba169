"""Host work per layer and decode step: what the CPU does around a tiny attention, paged vs the default cache.

On a GPU at small batch, the time a step takes is the time the host needs to issue it. This benchmark makes
the model so small that the math is negligible (a 24-layer Llama of width 64, one thread) and measures the
thread CPU time (`time.thread_time`, so a shared machine's other processes do not count) of each decode
forward for `PagedCache` + `"paged"` and for `DynamicCache` + sdpa. The two variants run one model object
(its attention implementation switched before each forward) and decode side by side, forward by forward,
alternating which goes first: each pair of forwards is a few milliseconds apart, so the drift of a shared
machine, which moves a whole step by several µs per layer from one second to the next, cancels in their
difference. The median difference over a run's pairs, divided by the number of layers, is the host work the
paged path adds per layer and decode step.

A second figure times each layer's own calls in the same forwards: the attention function and the cache's
`update()`. Their median per call, paged minus default, is what a layer adds in itself; their mean also
spreads over the layers what the paged path does once per step in its first layer (the plan and its device
tensors) and last layer (the commit). The whole step also holds what the calls leave outside them (the mask
function, the model's own ops running after a different host path).

It measures in fresh Python processes, one after another (`measure_in_processes`): where a process's
objects and buffers lie (address randomization, what it imported and allocated before) moves its whole-step
figure by several µs per layer, more than the spread of its own runs, and a process that has run other
benchmarks first reads higher. The median over fresh processes is the typical process's figure; the range is
printed beside it.

Side by side in one process, each paged step runs after a default step, as no user's process does. With
`--one-cache-per-process` each process runs one cache only (`--processes` of each, alternating): the figure is
then the difference of the two variants' medians over processes, which needs more processes for the same
spread.

Run alone: `python -m benchmarks.bench_host [--processes 5] [--steps 64] [--repeats 3] [--batch 1]
[--one-cache-per-process]`; `make bench` runs it as `host` (batch 1, 7 processes, side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache, LlamaConfig

import hf_paged

from .common import Suite, run_json_process

NAME = "host"
NUM_LAYERS = 24
ROOT = Path(__file__).resolve().parent.parent


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
        """(median, mean) seconds of attention + update per layer call."""
        attention, update = self.attention, self.update

        def median(values: list[int]) -> float:
            return sorted(values)[len(values) // 2]

        return (median(attention) + median(update)) / 1e9, (sum(attention) / len(attention) + sum(update) / len(update)) / 1e9


@contextlib.contextmanager
def timed_calls(implementation: str, cache, times: CallTimes | None = None) -> Iterator[CallTimes]:
    """Times the registered attention function `implementation` and `cache.update` while inside, into `times`
    (a new `CallTimes` by default)."""
    times = CallTimes() if times is None else times
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
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()


#: The two variants: attention implementation and cache.
VARIANTS = {"paged": ("paged", lambda config: hf_paged.PagedCache(config)),
            "dynamic": ("sdpa", lambda config: DynamicCache(config=config))}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(
    steps: int, repeats: int, batch: int = 1, variants: tuple[str, ...] = tuple(VARIANTS)
) -> dict[str, list[dict[str, float]]]:
    """Per variant of `variants` and repeat (a run of `steps` decode forwards after a 16-token prompt, after one
    warm-up run), thread seconds: `step`, the median decode forward; `layer_calls` and `layer_calls_mean`, a layer's
    attention call + `update()` call (median and mean, `CallTimes.per_layer`); with both variants, for `"paged"`
    also `step_added`, the median over the run's side-by-side pairs of forwards of paged minus default."""
    model = tiny_model()
    ids = torch.randint(1, 256, (batch, 16), generator=torch.Generator().manual_seed(0))

    def forward(variant: str, cache, input_ids: torch.Tensor, mask: torch.Tensor, calls: CallTimes | None):
        """Next tokens `[batch, 1]` of one forward and its thread seconds (the calls timed into `calls`)."""
        implementation = VARIANTS[variant][0]
        model.set_attn_implementation(implementation)
        if model.config._attn_implementation != implementation:
            raise RuntimeError(f"the model did not switch to attn_implementation={implementation!r}")
        timing = timed_calls(implementation, cache, calls) if calls is not None else contextlib.nullcontext()
        with timing:
            start = time.thread_time()
            logits = model(input_ids=input_ids, attention_mask=mask, **hf_paged.cache_kwargs(cache)).logits
            seconds = time.thread_time() - start
        return logits[:, -1:].argmax(-1), seconds

    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for repeat in range(repeats + 1):  # the first run warms up
                caches = {variant: VARIANTS[variant][1](model.config) for variant in variants}
                calls = {variant: CallTimes() for variant in variants}
                seconds: dict[str, list[float]] = {variant: [] for variant in variants}
                mask = torch.ones_like(ids)
                tokens = {variant: forward(variant, caches[variant], ids, mask, None)[0] for variant in variants}
                order = list(variants)
                for _ in range(steps):
                    mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                    for variant in order:
                        tokens[variant], took = forward(variant, caches[variant], tokens[variant], mask, calls[variant])
                        seconds[variant].append(took)
                    order.reverse()
                if not repeat:
                    continue
                for variant in variants:
                    median, mean = calls[variant].per_layer()
                    results[variant].append({"step": _median(seconds[variant]), "layer_calls": median,
                                             "layer_calls_mean": mean})
                if len(variants) == 2:
                    pairs = zip(seconds["paged"], seconds["dynamic"], strict=True)
                    results["paged"][-1]["step_added"] = _median([p - d for p, d in pairs])
    finally:
        torch.set_num_threads(threads)
    return results


def measure_in_processes(
    processes: int, steps: int, repeats: int, batch: int = 1, one_cache_per_process: bool = False
) -> dict[str, list[dict[str, float]]]:
    """`measure(steps, repeats, batch)` in `processes` fresh Python processes, one after another: per variant, one
    entry per process holding the median of each figure over that process's repeats. With `one_cache_per_process`,
    each process runs one variant, as a user's process runs one cache (`processes` of each, alternating which
    goes first): no paged step follows a default one, and no figure pairs them (`step_added` is absent)."""
    command = [sys.executable, "-m", "benchmarks.bench_host", "--worker", "--steps", str(steps),
               "--repeats", str(repeats), "--batch", str(batch)]
    commands = [command] * processes
    if one_cache_per_process:
        names = list(VARIANTS)
        orders = [names if i % 2 == 0 else names[::-1] for i in range(processes)]
        commands = [command + ["--variant", variant] for order in orders for variant in order]
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for each in commands:
        for variant, runs in run_json_process(each, cwd=ROOT).items():
            results[variant].append({key: _median([run[key] for run in runs]) for key in runs[0]})
    return results


def run(suite: Suite, progress) -> None:
    results = measure_in_processes(processes=suite.pick(7, 1), steps=suite.pick(64, 8), repeats=suite.pick(3, 1))
    for variant, values in results.items():
        step = [v["step"] * 1e6 for v in values]
        suite.add(NAME, "thread_us_per_step", variant, "layers", NUM_LAYERS, step, "us")
        suite.add(NAME, "thread_us_per_layer_step", variant, "layers", NUM_LAYERS, [v / NUM_LAYERS for v in step], "us")
        suite.add(NAME, "layer_calls_us", variant, "layers", NUM_LAYERS, [v["layer_calls"] * 1e6 for v in values], "us")
    added = [p["step_added"] * 1e6 / NUM_LAYERS for p in results["paged"]]
    suite.add(NAME, "added_us_per_layer_step", "paged", "layers", NUM_LAYERS, added, "us")
    for metric, key in (("layer_calls_added_us", "layer_calls"), ("layer_calls_added_mean_us", "layer_calls_mean")):
        added = [(p[key] - d[key]) * 1e6 for p, d in zip(results["paged"], results["dynamic"], strict=True)]
        suite.add(NAME, metric, "paged", "layers", NUM_LAYERS, added, "us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=5, help="fresh processes measured one after another")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of `--steps` forwards per process (side-by-side pairs unless one cache per process)")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (the `host` row: 1)")
    parser.add_argument("--one-cache-per-process", action="store_true",
                        help="each process runs one cache (`--processes` of each), as a user's process does")
    parser.add_argument("--worker", action="store_true", help="measure in this process and print JSON (internal)")
    parser.add_argument("--variant", choices=list(VARIANTS), help="the worker measures this variant only (internal)")
    args = parser.parse_args()
    if args.worker:
        variants = (args.variant,) if args.variant else tuple(VARIANTS)
        print(json.dumps(measure(args.steps, args.repeats, args.batch, variants)))
        return
    results = measure_in_processes(args.processes, args.steps, args.repeats, args.batch, args.one_cache_per_process)

    steps = {}
    for variant, values in results.items():
        step = steps[variant] = _median([v["step"] for v in values]) * 1e6
        calls = _median([v["layer_calls"] for v in values]) * 1e6
        print(f"{variant:8s} {step:8.0f} us/step  {step / NUM_LAYERS:6.1f} us/layer/step  {calls:6.1f} us in a layer's "
              "attention + update (median call)")
    if args.one_cache_per_process:
        print(f"paged adds {(steps['paged'] - steps['dynamic']) / NUM_LAYERS:.1f} us per layer and decode step (median "
              f"of {args.processes} paged processes minus median of {args.processes} default ones, one cache each)")
        return
    pairs = list(zip(results["paged"], results["dynamic"], strict=True))
    added = sorted(p["step_added"] * 1e6 / NUM_LAYERS for p in results["paged"])
    calls = _median([(p["layer_calls"] - d["layer_calls"]) * 1e6 for p, d in pairs])
    mean = _median([(p["layer_calls_mean"] - d["layer_calls_mean"]) * 1e6 for p, d in pairs])
    print(f"paged adds {_median(added):.1f} us per layer and decode step (median of {len(added)} processes, each the "
          f"median of {args.repeats} runs of {args.steps} side-by-side forward pairs; processes {added[0]:.1f} to "
          f"{added[-1]:.1f}: {' '.join(f'{a:.1f}' for a in added)}); in the layers' calls: {calls:.1f} us (median "
          f"call), {mean:.1f} us (mean call, with the per-step plan)")


if __name__ == "__main__":
    main()
