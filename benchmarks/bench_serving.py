"""Serving a ShareGPT-like request set: `hf_paged.Engine` vs `generate()` in padded batches vs transformers'
continuous batching, on the same requests, in one run.

Requests: `sample_trace("sharegpt")` (the lognormal mix of `bench_memory`), random prompt tokens; each request
generates exactly its own output length (no EOS), so every system does the same useful work.

Throughput (all requests submitted at once, output tokens / wall seconds):
- `engine`: `hf_paged.Engine` (packed steps, chunked prefill, continuous batching), a growing `KVPool`.
- `generate_b8`, `generate_b16`: stock `generate()` (sdpa, DynamicCache) on left-padded batches of 8 / 16 in
  arrival order; a batch runs until its longest output ends (shorter rows' extra tokens are not counted).
- `generate_batch`: transformers' continuous-batching manager (what `model.generate_batch()` runs), each
  request added with its own `max_new_tokens`.

Latency (vLLM paper, Fig. 12): requests arrive as a Poisson process at increasing rates; per request, time
to first token (TTFT), time per output token after the first (TPOT) and normalized latency (end-to-end
latency / output tokens); a system sustains a rate while its mean normalized latency stays under
`SUSTAINED_S_PER_TOKEN`. `generate()` serves arrivals the way a simple server would: whenever idle, it
takes up to 8 (16) requests that have arrived and runs them as one padded batch.

Sizes: `NUM_REQUESTS` for throughput, the first `LATENCY_REQUESTS` of them per rate of `RATES`; the environment
variables `BENCH_SERVING_REQUESTS` / `BENCH_SERVING_LATENCY_REQUESTS` override the two counts (a full run on
a 2-core CPU takes tens of minutes; the padded `generate()` baselines dominate it).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig

import hf_paged

from .common import StepClock, Suite, sample_trace

NAME = "serving"
#: A rate is sustained while mean normalized latency stays below this (seconds per output token).
SUSTAINED_S_PER_TOKEN = 0.5
NUM_REQUESTS = int(os.environ.get("BENCH_SERVING_REQUESTS", 200))
LATENCY_REQUESTS = int(os.environ.get("BENCH_SERVING_LATENCY_REQUESTS", 40))
#: Poisson arrival rates (requests/s) of the latency sweep.
RATES = [0.25, 0.5, 1.0, 2.0]


def make_requests(suite: Suite, num: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """`(prompts, output_lengths)` of a ShareGPT-like trace, prompts of random tokens (a smoke run divides the
    lengths by 16)."""
    max_total = suite.config.max_position_embeddings
    trace = sample_trace("sharegpt", num, seed, max_total=min(2048, max_total))
    if suite.smoke:
        trace = [(max(1, a // 16), max(2, b // 16)) for a, b in trace]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, suite.config.vocab_size, (n_in,), generator=gen).tolist() for n_in, _ in trace]
    return prompts, [n_out for _, n_out in trace]


def _configs(lengths: list[int]) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0) for n in lengths]


# ---------------------------------------------------------------------------- the systems
def run_engine(suite: Suite, prompts, lengths, arrival_s=None, **engine_kwargs) -> dict[int, list[float]]:
    """Per request, the times (perf_counter) of its tokens."""
    engine = hf_paged.Engine(suite.paged_model, hf_paged.KVPool(suite.config), **engine_kwargs)
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    for index, _, _ in engine.stream(prompts, _configs(lengths), arrival_s=arrival_s):
        times[index].append(time.perf_counter())
    return times


def _generate_batch_of(suite: Suite, prompts, lengths) -> list[float]:
    """One padded `generate()` batch; returns the times of its steps."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    clock = StepClock()
    with torch.no_grad():
        suite.sdpa_model.generate(
            input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(DynamicCache(config=suite.config)),
            max_new_tokens=max(lengths), min_new_tokens=max(lengths), do_sample=False, logits_processor=[clock],
        )
    return clock.times


def run_padded(suite: Suite, prompts, lengths, batch_size: int, arrival_s=None) -> dict[int, list[float]]:
    """A simple server on `generate()`: whenever idle, the next (up to) `batch_size` arrived requests as one batch."""
    start = time.perf_counter()
    arrival_s = arrival_s or [0.0] * len(prompts)
    times: dict[int, list[float]] = {}
    next_index = 0
    while next_index < len(prompts):
        now = time.perf_counter() - start
        if arrival_s[next_index] > now:
            time.sleep(arrival_s[next_index] - now)
            continue
        batch = [i for i in range(next_index, min(next_index + batch_size, len(prompts))) if arrival_s[i] <= now]
        steps = _generate_batch_of(suite, [prompts[i] for i in batch], [lengths[i] for i in batch])
        for i in batch:
            times[i] = steps[: lengths[i]]  # a row's own tokens; the batch ends later, at its longest
        next_index = batch[-1] + 1
    return times


def _smoke_cb_config(suite: Suite) -> dict:
    """In a smoke run, a small cache for transformers' continuous batching (by default it sizes its cache to most of
    the free memory, and zeroing that is most of a toy run's time); its own sizing in a full run, and with releases
    without `ContinuousBatchingConfig`."""
    if not suite.smoke:
        return {}
    try:
        from transformers import ContinuousBatchingConfig  # noqa: PLC0415
    except ImportError:
        return {}
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=256)}


def run_transformers_cb(suite: Suite, prompts, lengths, arrival_s=None) -> dict[int, list[float]]:
    """transformers' continuous-batching manager (`generate_batch`'s engine), per-request `max_new_tokens`."""
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(lengths))
    arrival_s = arrival_s or [0.0] * len(prompts)
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    ids: dict[str, int] = {}
    cb = suite.sdpa_model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30,
                                                              warmup=False, **_smoke_cb_config(suite))
    with cb as manager:  # no warm-up pass (it pre-captures CUDA graphs; nothing to capture on CPU)
        start = time.perf_counter()

        def feed() -> None:
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
                delay = start + arrival_s[i] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                ids[manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, streaming=True)] = i

        feeder = threading.Thread(target=feed)
        feeder.start()
        done = 0
        while done < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching manager stopped")
                continue
            index = int(result.request_id[1:])
            now = time.perf_counter()
            new = len(result.generated_tokens) - len(times[index])
            times[index].extend([now] * max(new, 0))
            if result.is_finished():
                done += 1
        feeder.join()
    return times


SYSTEMS = {
    "engine": lambda suite, p, n, a=None: run_engine(suite, p, n, a, max_batch_tokens=suite.pick(512, 64), max_seqs=64),
    "generate_b8": lambda suite, p, n, a=None: run_padded(suite, p, n, 8, a),
    "generate_b16": lambda suite, p, n, a=None: run_padded(suite, p, n, 16, a),
    "generate_batch": run_transformers_cb,
}


# ---------------------------------------------------------------------------- the benchmark
def latency_figures(times: dict[int, list[float]], arrivals: list[float], start: float, lengths: list[int]) -> dict[str, float]:
    ttft = np.array([times[i][0] - (start + arrivals[i]) for i in times])
    tpot = np.array([(times[i][-1] - times[i][0]) / (lengths[i] - 1) for i in times if lengths[i] > 1])
    normalized = np.array([(times[i][-1] - (start + arrivals[i])) / lengths[i] for i in times])
    return {
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99)),
        "normalized_latency": float(normalized.mean()),
    }


def run(suite: Suite, progress) -> None:
    num = suite.pick(NUM_REQUESTS, 12)
    prompts, lengths = make_requests(suite, num)
    useful = sum(lengths)
    suite.notes["serving_requests"] = (
        f"{num} ShareGPT-like requests (prompt mean {np.mean([len(p) for p in prompts]):.0f}, output mean "
        f"{np.mean(lengths):.0f} tokens) on the {suite.model_name}"
    )
    for name, system in progress(list(SYSTEMS.items()), desc="serving throughput"):
        start = time.perf_counter()
        times = system(suite, prompts, lengths)
        wall = time.perf_counter() - start
        assert sorted(times) == list(range(num)) and all(len(times[i]) == lengths[i] for i in times), name
        suite.add("serving_throughput", "output_tokens_per_s", name, "requests", num, useful / wall, "tokens/s")
        suite.add("serving_throughput", "wall_s", name, "requests", num, wall, "s")

    num_lat = suite.pick(LATENCY_REQUESTS, 6)
    prompts, lengths = prompts[:num_lat], lengths[:num_lat]
    rates = suite.pick(RATES, [2.0, 8.0])
    for rate in progress(rates, desc="serving latency"):
        gaps = np.random.default_rng(int(rate * 1000)).exponential(1.0 / rate, num_lat)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist()
        for name, system in SYSTEMS.items():
            start = time.perf_counter()
            times = system(suite, prompts, lengths, arrivals)
            for metric, value in latency_figures(times, arrivals, start, lengths).items():
                suite.add("serving_latency", metric, name, "request_rate", rate, value, "s" if metric != "normalized_latency" else "s/token")


def sustained_rate(suite: Suite, variant: str) -> float | None:
    """The highest measured rate at which `variant`'s mean normalized latency stays under the bound."""
    rows = [r for r in suite.rows if r.benchmark == "serving_latency" and r.metric == "normalized_latency" and r.variant == variant]
    ok = [float(r.x) for r in rows if r.p50 <= SUSTAINED_S_PER_TOKEN]
    return max(ok) if ok else None
