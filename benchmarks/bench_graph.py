"""The compiled decode step (`Engine(compile=True)`) against the eager engine and transformers' compiled
`generate()`.

Two figures, each from variants alternated in one run on the same model and requests (`common.alternate`):

- **Serving throughput**: `NUM_REQUESTS` ShareGPT-like requests (`bench_serving.make_requests`: random prompt
  tokens, each request generates exactly its own output length), all submitted at once, output tokens per wall
  second of `engine_eager` (`hf_paged.Engine`) and `engine_compiled` (`Engine(compile=True)`, warmed up before
  the timed rounds). Both engines' tokens are checked equal. `speedup` is the median per-round ratio.
- **Single-stream decode**: one prompt of `PROMPT_TOKENS` random tokens, `NEW_TOKENS` greedy tokens; decode
  tokens/s over the steps after the first token: `engine_compiled` and `engine_eager` (one request; the times of
  its streamed tokens), `static_compiled` (`generate(cache_implementation="static")` on the sdpa model,
  compiled by transformers' `compile_config`, `fullgraph=True`), and `paged_generate` (`generate()` with a
  `PagedCache`, eager). `vs_static_compiled` is the median per-round ratio of `engine_compiled` over
  `static_compiled`.

The compiled engine's warm-up time (every bucket compiled), its buckets, and the compiler's graph and graph-break
counts go into the summary's notes.

    .venv/bin/python -m benchmarks.bench_graph                 # = python -m benchmarks.run_all --only graph
    taskset -c 1 chrt -f 50 .venv/bin/python -m benchmarks.bench_graph --threads 1   # steadier on a shared machine
"""

from __future__ import annotations

import sys
import time

import torch
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig, GenerationConfig

import hf_paged

from .bench_serving import make_requests
from .common import StepClock, Suite, alternate, random_prompts

NAME = "graph"
NUM_REQUESTS = 32
PROMPT_TOKENS = 512
NEW_TOKENS = 128
REPEATS = 3


def _configs(lengths: list[int]) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0) for n in lengths]


def _stream_decode_tokens_per_s(engine: hf_paged.Engine, prompt: list[int], new_tokens: int) -> float:
    times = [time.perf_counter() for _ in engine.stream([prompt], _configs([new_tokens]))]
    return (len(times) - 1) / (times[-1] - times[0])


def _static_compiled(suite: Suite, ids: torch.Tensor, new_tokens: int) -> float:
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # (transformers compiles on CUDA only unless told)
    clock = StepClock()
    with torch.no_grad():
        suite.sdpa_model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache_implementation="static",
            compile_config=compile_config, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            logits_processor=[clock], pad_token_id=0,
        )
    return clock.decode_tokens_per_s(1)


def _paged_generate(suite: Suite, ids: torch.Tensor, new_tokens: int) -> float:
    clock = StepClock()
    with torch.no_grad():
        suite.paged_model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **hf_paged.cache_kwargs(hf_paged.PagedCache()),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock],
            pad_token_id=0,
        )
    return clock.decode_tokens_per_s(1)


def run(suite: Suite, progress) -> None:
    model = suite.paged_model
    repeats = suite.pick(REPEATS, 1)
    compiled = hf_paged.Engine(model, compile=True)
    eager = hf_paged.Engine(model)
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    breaks_before = sum(dynamo_utils.counters["graph_break"].values())
    start = time.perf_counter()
    compiled.generate([[1, 2, 3]], max_new_tokens=2, progress=False)  # warm-up: every bucket compiles here
    warm_up = time.perf_counter() - start
    graphs_warm = dynamo_utils.counters["stats"]["unique_graphs"]

    # Serving throughput.
    num = suite.pick(NUM_REQUESTS, 6)
    prompts, lengths = make_requests(suite, num)
    configs = _configs(lengths)
    outputs: dict[str, list] = {}

    def engine_run(name: str, engine: hf_paged.Engine):
        def once() -> dict[str, float]:
            begin = time.perf_counter()
            out = engine.generate(prompts, generation_config=configs, progress=False)
            wall = time.perf_counter() - begin
            outputs.setdefault(name, out)
            return {"output_tokens_per_s": sum(lengths) / wall}

        return once

    for _ in progress(range(1), desc="compiled engine: throughput"):
        results = alternate({"engine_eager": engine_run("engine_eager", eager),
                             "engine_compiled": engine_run("engine_compiled", compiled)}, repeats, warmup=1)
    assert outputs["engine_compiled"] == outputs["engine_eager"], "the compiled engine's tokens differ from the eager"
    for name, rounds in results.items():
        suite.add(NAME, "output_tokens_per_s", name, "requests", num, [r["output_tokens_per_s"] for r in rounds], "tokens/s")
    ratios = [c["output_tokens_per_s"] / e["output_tokens_per_s"]
              for c, e in zip(results["engine_compiled"], results["engine_eager"], strict=True)]
    suite.add(NAME, "speedup", "engine_compiled", "requests", num, ratios, "x")

    # Single-stream decode.
    prompt_tokens, new_tokens = suite.pick(PROMPT_TOKENS, 32), suite.pick(NEW_TOKENS, 16)
    ids, _ = random_prompts([prompt_tokens], suite.config.vocab_size, seed=1)
    prompt = ids[0].tolist()
    variants = {
        "engine_compiled": lambda: _stream_decode_tokens_per_s(compiled, prompt, new_tokens),
        "engine_eager": lambda: _stream_decode_tokens_per_s(eager, prompt, new_tokens),
        "static_compiled": lambda: _static_compiled(suite, ids, new_tokens),
        "paged_generate": lambda: _paged_generate(suite, ids, new_tokens),
    }
    for _ in progress(range(1), desc="compiled engine: single stream"):
        single = alternate(variants, repeats, warmup=1)
    for name, values in single.items():
        suite.add(NAME, "decode_tokens_per_s", name, "batch", 1, values, "tokens/s")
    ratios = [c / s for c, s in zip(single["engine_compiled"], single["static_compiled"], strict=True)]
    suite.add(NAME, "vs_static_compiled", "engine_compiled", "batch", 1, ratios, "x")

    recompiles = dynamo_utils.counters["stats"]["unique_graphs"] - graphs_warm
    suite.notes["graph_run"] = (
        f"compiled engine: buckets {compiled.graphs.buckets}, warm-up {warm_up:.0f} s "
        f"({graphs_warm - graphs_before} graphs), graphs compiled after warm-up by the engine and the static "
        f"baseline together: {recompiles}, graph breaks: {sum(dynamo_utils.counters['graph_break'].values()) - breaks_before}; "
        f"{num} ShareGPT-like requests; single stream: {prompt_tokens}-token prompt, {new_tokens} new tokens"
    )


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """Headline rows for `run_all`'s table."""
    out = []
    speedup = suite.get(NAME, "speedup", "engine_compiled")
    if speedup is not None:
        c, e = (suite.get(NAME, "output_tokens_per_s", v) for v in ("engine_compiled", "engine_eager"))
        out.append((f"Engine, {speedup.x} ShareGPT-like requests: output tokens/s", f"compiled {c.p50:.3g}",
                    f"eager {e.p50:.3g}", f"{speedup.p50:.2f}x"))
    ratio = suite.get(NAME, "vs_static_compiled", "engine_compiled")
    if ratio is not None:
        c, s = (suite.get(NAME, "decode_tokens_per_s", v) for v in ("engine_compiled", "static_compiled"))
        out.append(("single-stream decode tokens/s, compiled", f"Engine(compile=True) {c.p50:.3g}",
                    f"StaticCache + torch.compile {s.p50:.3g}", f"{ratio.p50:.2f}x"))
    return out


if __name__ == "__main__":
    from .run_all import main

    raise SystemExit(main(["--only", NAME, *sys.argv[1:]]))
