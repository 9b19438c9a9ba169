"""Runs the CPU benchmark suite: `python -m benchmarks.run_all [--smoke] [--out benchmarks/results]`.

Writes `results.csv` (long format), one PNG per benchmark and `summary.md`, and prints the summary.
`--only NAME ...` runs some benchmarks: their rows replace theirs in an existing `results.csv` (the others stay,
with their own dates), every plot is drawn again from it, and the summary goes to `summary-NAME[-...].md`. The
summary holds the rows of the benchmarks that ran only.
`--smoke` runs every benchmark at toy sizes in seconds (used by the test suite).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from . import (  # noqa: E402
    bench_block_size,
    bench_capacity,
    bench_decode,
    bench_graph,
    bench_host,
    bench_hybrid_prefix,
    bench_kv_sharing,
    bench_memory,
    bench_quantized,
    bench_serving,
    bench_sharing,
    bench_spec,
    bench_ttft,
    bench_vlm_batch,
    bench_vlm_engine,
    bench_vlm_prefix,
    bench_window,
)
from .common import Suite, load_suite, machine_info, write_csv  # noqa: E402
from .plot import plot_all  # noqa: E402

BENCHMARKS = {
    "memory": bench_memory,
    "capacity": bench_capacity,
    "decode": bench_decode,
    "ttft": bench_ttft,
    "sharing": bench_sharing,
    "block_size": bench_block_size,
    "quantized": bench_quantized,
    "serving": bench_serving,
    "host": bench_host,
    "spec": bench_spec,
    "graph": bench_graph,
    "hybrid_prefix": bench_hybrid_prefix,
    "kv_sharing": bench_kv_sharing,
    "vlm_prefix": bench_vlm_prefix,
    "vlm_engine": bench_vlm_engine,
    "vlm_batch": bench_vlm_batch,
    "window": bench_window,
}


def _p50(suite: Suite, benchmark: str, metric: str, variant: str, x=None) -> float | None:
    row = suite.get(benchmark, metric, variant, x)
    return row.p50 if row else None


def _last_x(suite: Suite, benchmark: str, metric: str):
    xs = [r.x for r in suite.rows if r.benchmark == benchmark and r.metric == metric]
    return max(xs, key=float) if xs else None


def summary(suite: Suite) -> list[tuple[str, str, str, str]]:
    """(figure, hf-paged, baseline, comparison) rows for the headline table."""
    out: list[tuple[str, str, str, str]] = []

    def ratio(a, b, fmt="{:.2f}x"):
        return fmt.format(a / b) if a is not None and b else "n/a"

    def f(v, unit=""):
        return "n/a" if v is None else f"{v:.3g}{unit}"

    # Each row is shown only when its benchmark ran (`--only X` shows X's rows, not n/a rows of the others).
    lead = next((r.x for r in suite.rows if r.benchmark == "decode" and r.parameter == "batch,context,new_tokens"), None)
    if lead is not None:
        p, d, s = (_p50(suite, "decode", "decode_tokens_per_s", v, lead) for v in ("paged", "dynamic", "static"))
        out.append((f"(i) decode tokens/s, batch,ctx,new={lead}", f(p), f"dynamic {f(d)}, static {f(s)}", f"paged/dynamic {ratio(p, d)}"))
    pb = suite.get("padded_batch", "kv_bytes", "paged")
    db = suite.get("padded_batch", "kv_bytes", "dynamic")
    up, ub, ud = (_p50(suite, "padded_batch", m, v) for m, v in (("unused_slots", "paged"), ("unused_slots_bound", "paged"), ("unused_slots", "dynamic")))
    if pb and db:
        out.append((f"(ii) KV MiB, {pb.x}", f(pb.p50), f"dynamic {f(db.p50)}", f"{ratio(pb.p50, db.p50)}; unused slots {up:.0f} (bound {ub:.0f}) vs {ud:.0f}"))
    n = _last_x(suite, "sharing_samples", "kv_bytes")
    if n is not None:
        p, d = (_p50(suite, "sharing_samples", "kv_bytes", v, n) for v in ("paged", "dynamic"))
        tp, td = (_p50(suite, "sharing_samples", "time", v, n) for v in ("paged", "dynamic"))
        out.append((f"(iii) {n} samples: KV MiB", f(p), f"dynamic {f(d)}", f"{ratio(p, d)} memory, {ratio(tp, td)} time"))
    n = _last_x(suite, "sharing_beams", "time")
    if n is not None:
        tp, td = (_p50(suite, "sharing_beams", "time", v, n) for v in ("paged", "dynamic"))
        cp, cd = (_p50(suite, "sharing_beams", "copied_per_reorder", v, n) for v in ("paged", "dynamic"))
        out.append((f"(iv) {n} beams: generate s", f(tp), f"dynamic {f(td)}", f"{ratio(tp, td)} time; copied/reorder {f(cp, ' KiB')} vs {f(cd, ' KiB')}"))
    x = _last_x(suite, "ttft", "ttft")
    if x is not None:
        hit, cold, dyn = (_p50(suite, "ttft", "ttft", v, x) for v in ("paged_prefix_hit", "paged_cold", "dynamic"))
        same = _p50(suite, "ttft", "outputs_identical_hit_vs_cold", "paged_prefix_hit")
        out.append((f"(v) TTFT ms, prefix {x} + suffix", f(hit), f"cold {f(cold)}, dynamic {f(dyn)}", f"hit/cold {ratio(hit, cold)}; identical={bool(same)}"))
    on = next((r for r in suite.rows if r.metric == "decode_tokens_per_s" and r.variant == "prefix_caching_on"), None)
    off = next((r for r in suite.rows if r.metric == "decode_tokens_per_s" and r.variant == "prefix_caching_off"), None)
    if on and off:
        out.append((f"(vi) prefix caching on, 0% hits, {on.x}", f(on.p50), f"off {f(off.p50)}", f"cost {100 * (1 - on.p50 / off.p50):+.1f}% tokens/s"))
    tput = {r.variant: r.p50 for r in suite.rows if r.benchmark == "serving_throughput" and r.metric == "output_tokens_per_s"}
    if tput:
        n = _last_x(suite, "serving_throughput", "output_tokens_per_s")
        rates = {v: bench_serving.sustained_rate(suite, v) for v in tput}
        out.append((f"(vii) serving {n} ShareGPT-like requests: output tokens/s", f"engine {f(tput.get('engine'))}",
                    ", ".join(f"{v} {f(t)}" for v, t in tput.items() if v != "engine"),
                    f"engine/generate_b8 {ratio(tput.get('engine'), tput.get('generate_b8'))}, "
                    f"engine/generate_batch {ratio(tput.get('engine'), tput.get('generate_batch'))}; sustained rate (req/s): "
                    + ", ".join(f"{v} {rates[v] if rates[v] is not None else '<min'}" for v in tput)))
    for trace in ("sharegpt", "alpaca"):
        rows = {r.variant: r.p50 for r in suite.rows if r.benchmark == "memory" and r.metric == "waste" and str(r.x).startswith(trace)}
        if rows:
            out.append((f"KV waste, {trace}-like batch", f"batch {f(rows.get('paged_batch'), '%')}, pool {f(rows.get('paged_pool'), '%')}",
                        f"dynamic {f(rows.get('dynamic_batch'), '%')}, static {f(rows.get('static_batch'), '%')}", ""))
        cap = {r.variant: r.p50 for r in suite.rows if r.metric == "sequences_sim" and str(r.x).startswith(trace)}
        if cap:
            out.append((f"capacity (simulation), {trace}", f"{cap['paged']:.0f} seqs", f"max-len reservation {cap['contiguous_max_len']:.0f}",
                        f"{ratio(cap['paged'], cap['contiguous_max_len'])}"))
    base = _p50(suite, "quantized", "bytes_per_token", "model_dtype")
    if base:
        per = {kv: _p50(suite, "quantized", "bytes_per_token", kv) for kv in ("int8", "fp8_e4m3")}
        seqs = {kv: _p50(suite, "quantized", "sequences_admitted", kv) for kv in ("model_dtype", "int8", "fp8_e4m3")}
        out.append(("KV bytes/token, int8 / fp8_e4m3 (scales incl.)", f"{f(per['int8'])} / {f(per['fp8_e4m3'])}",
                    f"model dtype {f(base)}", f"{ratio(per['int8'], base)} / {ratio(per['fp8_e4m3'], base)}; sequences "
                    f"in a fixed budget {seqs['int8']:.0f} / {seqs['fp8_e4m3']:.0f} vs {seqs['model_dtype']:.0f}"))
    extra = _p50(suite, "host", "added_us_per_layer_step", "paged")
    if extra is not None:
        p, d = (_p50(suite, "host", "thread_us_per_layer_step", v) for v in ("paged", "dynamic"))
        calls = _p50(suite, "host", "layer_calls_added_us", "paged")
        mean = _p50(suite, "host", "layer_calls_added_mean_us", "paged")
        out.append(("host CPU us per layer and decode step (24-layer width-64 Llama, batch 1)", f(p),
                    f"dynamic {f(d)}", f"paged adds {extra:.0f} us per layer and step; in a layer's attention + update "
                    f"{f(calls)} (median call), {f(mean)} (mean, with the per-step plan)"))
    out.extend(bench_spec.summary_rows(suite))
    out.extend(bench_graph.summary_rows(suite))
    out.extend(bench_hybrid_prefix.summary_rows(suite))
    out.extend(bench_kv_sharing.summary_rows(suite))
    out.extend(bench_vlm_prefix.summary_rows(suite))
    out.extend(bench_vlm_engine.summary_rows(suite))
    out.extend(bench_vlm_batch.summary_rows(suite))
    out.extend(bench_window.summary_rows(suite))
    return out


def format_table(rows: list[tuple[str, ...]]) -> str:
    header = ("figure", "hf-paged", "baseline", "comparison")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, seconds (for tests)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="*", choices=list(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    args = parser.parse_args(argv)

    # A paged variant silently falling back to plain attention would make its figures meaningless.
    warnings.filterwarnings("error", message="attn_implementation='paged' got contiguous K/V")
    start = time.perf_counter()
    info_before = machine_info()
    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or 1)  # smoke: seconds-long even on a busy machine
    suite = load_suite(smoke=args.smoke)
    disable = args.smoke and not sys.stderr.isatty()

    def progress(items, desc: str):
        return tqdm(list(items), desc=desc, leave=False, disable=disable)

    for name in tqdm(args.only or list(BENCHMARKS), desc="suite", disable=disable):
        started = time.perf_counter()
        BENCHMARKS[name].run(suite, progress)
        suite.notes[name] = f"{time.perf_counter() - started:.0f} s"
    info = machine_info()
    info["load"] = f"before {info_before['load']}; after {info['load']}"
    # A subset updates its own rows of an existing CSV and writes its summary beside the full run's summary.md.
    write_csv(suite.rows, args.out / "results.csv", info, keep_others=bool(args.only))
    drawn = {row.benchmark for row in suite.rows} if args.only else None  # a subset redraws its own figures only
    plot_all(args.out / "results.csv", args.out, suite.model_name, drawn)
    elapsed = time.perf_counter() - start
    table = format_table(summary(suite))
    quantized_table = suite.notes.pop("quantized_table", "")
    if quantized_table:
        table += "\n\nQuantized K/V blocks vs the unquantized cache:" + quantized_table
    text = (
        f"{table}\n\nmodel: {suite.model_name}\nmachine: {info['device']}\nversions: {info['versions']}\n"
        f"load average (1, 5, 15 min): {info['load']}\ndate: {info['date']}\n"
        f"time per benchmark: {suite.notes}\nsuite wall time: {elapsed:.0f} s\n"
    )
    summary_name = "summary.md" if not args.only else f"summary-{'-'.join(args.only)}.md"
    (args.out / summary_name).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
