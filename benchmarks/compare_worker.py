"""One process of `benchmarks.compare`: measures the chosen benchmarks of one source tree and prints one JSON line.

The driver runs this file by its path (`python <driver>/benchmarks/compare_worker.py --tree TREE ...`) with the
working directory and `PYTHONPATH` set to TREE. Before importing anything of the project it puts TREE first on
`sys.path` and maps `hf_paged.kernels` to `TREE/kernels/triton` (setuptools ships that folder, `kernels/` in older
trees, as `hf_paged.kernels`, and the editable install maps that name to the driver's checkout), so `hf_paged`,
`hf_paged.kernels` and `benchmarks` are all TREE's own; the JSON line reports their files for the driver to
check. This file imports nothing from the driver's tree, so it runs unchanged against an older tree.

Each benchmark is measured with TREE's own functions (`benchmarks.bench_decode`, `benchmarks.common`, ...):
where TREE lacks them, the benchmark is reported as missing, with the reason, instead of failing.

Printed: `{"hf_paged": FILE, "kernels": FILE, "benchmarks": {NAME: {"figures": [FIGURE, ...]} or {"missing":
REASON}}}`, a FIGURE being `{"name", "value", "unit", "higher_is_better", "is_control", "control"}`: a control
is measured without hf-paged (`DynamicCache`: it shows how the machine's speed moved between processes), and
`control` names the control of a figure measured beside it.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


class TreeKernels(importlib.abc.MetaPathFinder):
    """Finds `hf_paged.kernels` in TREE (ahead of the editable install's mapping to another checkout):
    `TREE/kernels/triton`, or `TREE/kernels` in trees before the kernels moved there. And finds a top-level
    `kernels` (the hub package transformers 5.25 on imports) anywhere on `sys.path` but in TREE, whose
    `kernels/` would shadow it in those older trees."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree
        folders = (tree / "kernels" / "triton", tree / "kernels")
        self.kernels = next((d for d in folders if (d / "__init__.py").is_file()), None)

    def find_spec(self, fullname, path, target=None):
        if fullname == "kernels":
            outside = [p for p in sys.path if Path(p or ".").resolve() != self.tree]
            return importlib.machinery.PathFinder.find_spec(fullname, outside)
        if fullname != "hf_paged.kernels" or self.kernels is None:
            return None  # a tree with its kernels inside hf_paged/ is found the ordinary way
        init = self.kernels / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(self.kernels)])


def use_tree(tree: Path) -> None:
    """Makes `tree`'s packages the ones imported: first on `sys.path` (instead of this file's folder, which
    belongs to the driver's tree) and its kernels folder as `hf_paged.kernels`."""
    sys.path[0] = str(tree)
    sys.meta_path.insert(0, TreeKernels(tree))


def figure(name: str, value: float, unit: str, higher_is_better: bool, *, is_control: bool = False,
           control: str | None = None) -> dict:
    return {"name": name, "value": value, "unit": unit, "higher_is_better": higher_is_better,
            "is_control": is_control, "control": control}


def decode(args: argparse.Namespace) -> Callable[[], list[dict]]:
    """generate() decode tokens/s (steps after the first), `PagedCache` + "paged" vs `DynamicCache` + sdpa,
    alternated in this process on the same prompts, at each batch size; and their ratio."""
    from benchmarks import bench_decode, common  # TREE's own

    generate_variants, alternate, random_prompts = bench_decode.generate_variants, common.alternate, common.random_prompts

    def measure() -> list[dict]:
        suite = common.load_suite(smoke=args.smoke)
        vocab = suite.config.vocab_size
        ids, mask = random_prompts([16] * 2, vocab, seed=0)
        alternate(generate_variants(suite, ids, mask, 4, static=False), repeats=1)  # first calls are slow
        out = []
        for batch in args.batch_sizes:
            ids, mask = random_prompts([args.prompt] * batch, vocab, seed=batch * 7919 + args.prompt)
            results = alternate(generate_variants(suite, ids, mask, args.new_tokens, static=False), repeats=args.rounds)
            rate = {v: statistics.median(r["decode_tokens_per_s"] for r in runs) for v, runs in results.items()}
            point = f"batch {batch}, prompt {args.prompt}, {args.new_tokens} new"
            control = f"decode tokens/s dynamic, {point}"
            out += [
                figure(f"decode tokens/s paged, {point}", rate["paged"], "tokens/s", True, control=control),
                figure(control, rate["dynamic"], "tokens/s", True, is_control=True),
                figure(f"decode paged/dynamic, {point}", rate["paged"] / rate["dynamic"], "x", True),
            ]
        return out

    return measure


def host(args: argparse.Namespace) -> Callable[[], list[dict]]:
    """Thread CPU time of a decode forward of the 24-layer width-64 Llama, paged vs default, side by side
    (`bench_host.measure`); and the paged path's extra host time per layer and step."""
    from benchmarks import bench_host  # TREE's own

    measure_host, num_layers = bench_host.measure, bench_host.NUM_LAYERS

    def measure() -> list[dict]:
        results = measure_host(steps=8 if args.smoke else 64, repeats=args.rounds)
        step = {v: statistics.median(r["step"] for r in runs) * 1e6 for v, runs in results.items()}
        added = statistics.median(r["step_added"] for r in results["paged"]) * 1e6 / num_layers
        control = "host us per decode step dynamic"
        return [
            figure("host us per decode step paged", step["paged"], "us", False, control=control),
            figure(control, step["dynamic"], "us", False, is_control=True),
            figure("host us added per layer and step", added, "us", False),
        ]

    return measure


def engine(args: argparse.Namespace) -> Callable[[], list[dict]]:
    """Output tokens/s of the eager `Engine` serving ShareGPT-like requests submitted at once
    (`bench_serving.make_requests`, 32; smoke 6), each generating its trace's length greedily, through
    `bench_serving.run_engine` (a fresh engine and pool per round, so no round reuses another's prefixes): the
    median of the process's rounds, after one warm-up round of two requests."""
    from benchmarks import bench_serving, common  # TREE's own

    make_requests, run_engine, load_suite = bench_serving.make_requests, bench_serving.run_engine, common.load_suite

    def measure() -> list[dict]:
        suite = load_suite(smoke=args.smoke)
        prompts, lengths = make_requests(suite, 6 if args.smoke else 32)
        run_engine(suite, prompts[:2], lengths[:2])
        rates = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            times = run_engine(suite, prompts, lengths)
            rates.append(sum(lengths) / (max(t[-1] for t in times.values()) - start))
        return [figure(f"engine output tokens/s, {len(prompts)} ShareGPT-like requests", statistics.median(rates),
                       "tokens/s", True)]

    return measure


def graph(args: argparse.Namespace) -> Callable[[], list[dict]]:
    """TREE's `bench_graph` whole (its own rounds, alternated inside the process): the compiled `Engine`'s output
    tokens/s on ShareGPT-like requests and its ratio to the eager engine's, and single-stream decode tokens/s of
    `Engine(compile=True)` beside `generate(cache_implementation="static")` + `torch.compile` (the control, no
    hf-paged in it) and their ratio; medians of the rounds. `--rounds` does not apply: the benchmark sets its own."""
    from benchmarks import bench_graph, common  # TREE's own

    run, load_suite, name = bench_graph.run, common.load_suite, bench_graph.NAME

    def measure() -> list[dict]:
        suite = load_suite(smoke=args.smoke)
        run(suite, lambda iterable, **_: iterable)

        def p50(metric: str, variant: str) -> float:
            return suite.get(name, metric, variant).p50

        requests = suite.get(name, "speedup", "engine_compiled").x
        static = "single-stream decode tokens/s, StaticCache + torch.compile"
        return [
            figure(f"compiled engine output tokens/s, {requests} ShareGPT-like requests",
                   p50("output_tokens_per_s", "engine_compiled"), "tokens/s", True),
            figure("compiled engine / eager engine, output tokens/s", p50("speedup", "engine_compiled"), "x", True),
            figure(static, p50("decode_tokens_per_s", "static_compiled"), "tokens/s", True, is_control=True),
            figure("single-stream decode tokens/s, Engine(compile=True)", p50("decode_tokens_per_s", "engine_compiled"),
                   "tokens/s", True, control=static),
            figure("single stream, Engine(compile=True) / StaticCache + torch.compile",
                   p50("vs_static_compiled", "engine_compiled"), "x", True),
        ]

    return measure


def growth(args: argparse.Namespace) -> Callable[[], list[dict]]:
    """Peak resident memory while one row's decode grows its pool, and that peak over the K/V bytes the pool holds
    at the end. An 8-layer Llama of tiny weights storing 64 KiB of K/V per token (8 KV heads of 128, float32)
    decodes from a 16-token prompt to 1100 tokens (smoke: 300) into a `PagedCache(config)`, whose pool doubles its
    blocks on the way; the decode runs inside TREE's `common.PeakRSS` (Linux `/proc`). How the pool grows shows:
    growing layer by layer holds one layer's old tensors beside the new ones at a time, a tensor stacking all
    layers holds all of them. The driver runs it in a process of its own (`compare.OWN_PROCESS`), where every
    tensor the pool makes is larger than any freed before it: glibc maps each one when made and unmaps it when
    freed, so resident memory follows what is alive."""
    from benchmarks import common  # TREE's own

    import hf_paged  # noqa: PLC0415

    peak_rss, paged_cache, cache_kwargs = common.PeakRSS, hf_paged.PagedCache, hf_paged.cache_kwargs
    with peak_rss() as probe:
        pass
    if probe.bytes is None:
        raise OSError("the growth benchmark reads peak memory from Linux's /proc/self (clear_refs, status)")

    def measure() -> list[dict]:
        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

        config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
        prompt = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(0))

        def run_decode(cache, steps: int) -> None:
            mask, token = torch.ones_like(prompt), prompt
            for _ in range(steps + 1):
                token = model(input_ids=token, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)

        tokens = 300 if args.smoke else 1100
        with torch.no_grad():
            run_decode(paged_cache(config), 8)  # first calls
            cache = paged_cache(config)
            with peak_rss() as peak:
                run_decode(cache, tokens - prompt.shape[1])
        reserved = cache.stats().bytes_reserved
        return [
            figure(f"growth: peak MiB while one row decodes to {tokens} tokens", peak.bytes / 2**20, "MiB", False),
            figure("growth: that peak over the K/V bytes the pool ends with", peak.bytes / reserved, "x", False),
        ]

    return measure


#: The benchmarks `benchmarks.compare` can run: each resolves TREE's functions (raising ImportError or
#: AttributeError where TREE lacks them, OSError where this machine cannot measure it), then measures.
BENCHMARKS: dict[str, Callable[[argparse.Namespace], Callable[[], list[dict]]]] = {
    "growth": growth, "decode": decode, "host": host, "engine": engine, "graph": graph,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="the source tree whose packages are measured")
    parser.add_argument("--bench", required=True, help="comma-separated names of BENCHMARKS")
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], required=True)
    parser.add_argument("--prompt", type=int, required=True, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True, help="alternated runs per point in this process")
    parser.add_argument("--threads", type=int, required=True, help="torch threads")
    parser.add_argument("--smoke", action="store_true", help="the tree's smoke-size model setting")
    args = parser.parse_args()
    tree = args.tree.resolve()
    use_tree(tree)

    import warnings  # noqa: PLC0415

    import torch  # noqa: PLC0415

    import hf_paged  # noqa: PLC0415
    import hf_paged.kernels  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    # A paged variant silently falling back to plain attention would make its figures meaningless.
    warnings.filterwarnings("error", message="attn_implementation='paged' got contiguous K/V")
    report: dict = {"hf_paged": hf_paged.__file__, "kernels": hf_paged.kernels.__file__, "benchmarks": {}}
    for name in args.bench.split(","):
        try:
            measure = BENCHMARKS[name](args)
        except (ImportError, AttributeError, OSError) as error:
            report["benchmarks"][name] = {"missing": f"{type(error).__name__}: {error}"}
            continue
        report["benchmarks"][name] = {"figures": measure()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
