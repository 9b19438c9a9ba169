"""Plots from the long-format CSV: `python -m benchmarks.plot benchmarks/results/results.csv [--out DIR]`."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator, ScalarFormatter  # noqa: E402

COLORS = {
    "paged": "tab:blue", "paged_batch": "tab:blue", "paged_pool": "tab:cyan", "paged_prefix_hit": "tab:blue",
    "paged_cold": "tab:cyan", "dynamic": "tab:orange", "dynamic_batch": "tab:orange",
    "dynamic_per_request": "tab:brown", "static": "tab:green", "static_batch": "tab:green",
    "hf_generate_batch": "tab:purple", "contiguous_max_len": "tab:red", "contiguous_oracle": "tab:gray",
    "engine": "tab:blue", "generate_b8": "tab:orange", "generate_b16": "tab:red", "generate_batch": "tab:purple",
}

#: Units of the x parameters (axis labels carry units; counts say what they count).
X_UNITS = {
    "batch_size": "sequences", "context": "tokens", "num_beams": "beams", "num_return_sequences": "samples",
    "block_size": "tokens per block", "prefix_len": "tokens", "prefix_length": "tokens", "request_rate": "requests/s",
    "requests": "requests",
}


def _x_label(parameter: str) -> str:
    unit = X_UNITS.get(parameter)
    return f"{parameter} ({unit})" if unit else parameter


def _measured_ticks(ax, xs: list[float]) -> None:
    """Ticks at the measured x values only, printed as integers when they are (no 1.5 beams)."""
    ax.set_xticks(xs)
    ax.xaxis.set_minor_locator(NullLocator())
    if all(float(x).is_integer() for x in xs):
        ax.set_xticklabels([str(int(x)) for x in xs])
    else:
        ax.xaxis.set_major_formatter(ScalarFormatter())


def _legend_below(ax) -> None:
    """The legend under the axes, where it cannot cover data."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("p20", "p50", "p80"):
            row[key] = float(row[key])
    return rows


def _select(rows, benchmark: str, metric: str) -> dict[str, list[dict]]:
    by_variant: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["benchmark"] == benchmark and row["metric"] == metric:
            by_variant[row["variant"]].append(row)
    return by_variant


def _lines(ax, rows, benchmark: str, metric: str, title: str, log_x: bool = False) -> None:
    all_xs: set[float] = set()
    for variant, items in _select(rows, benchmark, metric).items():
        items = sorted(items, key=lambda r: float(r["x"]))
        xs = [float(r["x"]) for r in items]
        all_xs.update(xs)
        ys = [r["p50"] for r in items]
        err = [[r["p50"] - r["p20"] for r in items], [r["p80"] - r["p50"] for r in items]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=variant, color=COLORS.get(variant))
        if items:
            ax.set_xlabel(_x_label(items[0]["parameter"]))
            ax.set_ylabel(f"{metric} ({items[0]['unit']})")
    if log_x:
        ax.set_xscale("log", base=2)
    if all_xs:
        _measured_ticks(ax, sorted(all_xs))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _legend_below(ax)


def _bars(ax, rows, benchmark: str, metric: str, title: str) -> None:
    selected = _select(rows, benchmark, metric)
    groups = sorted({r["x"] for items in selected.values() for r in items})
    width = 0.8 / max(len(selected), 1)
    for i, (variant, items) in enumerate(selected.items()):
        values = {r["x"]: r["p50"] for r in items}
        xs = [g + i * width for g in range(len(groups))]
        bars = ax.bar(xs, [values.get(g, 0) for g in groups], width, label=variant, color=COLORS.get(variant))
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        if items:
            ax.set_ylabel(f"{metric} ({items[0]['unit']})")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, fontsize=8)
    parameter = next((r.get("parameter", "") for items in selected.values() for r in items), "")
    ax.set_xlabel("request mix" if benchmark in ("memory", "capacity") else parameter)
    ax.margins(y=0.12)  # room for the value labels above the bars
    ax.set_title(title, fontsize=10)
    _legend_below(ax)


#: The model of `bench_host.py`, for its figure's caption.
HOST_MODEL = "random Llama, 24 layers of width 64, 4 heads / 2 KV heads, fp32, one thread"


def caption(rows: list[dict], model: str | None = None) -> str:
    """`model; machine; versions` of a run, for the bottom of every figure."""
    first = rows[0] if rows else {}
    parts = [model or first.get("model", ""), first.get("device", ""), first.get("versions", "").split(";")[0]]
    return " | ".join(p for p in parts if p)


def plot_all(csv_path: Path, out: Path, model: str | None = None, only: set[str] | None = None) -> list[Path]:
    """Draws every figure of the CSV into `out` (only those showing a benchmark of `only` when given: a run of some
    benchmarks leaves the others' figures as they are); `model` names the model in the captions."""
    rows = read_rows(csv_path)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "memory.png": [("bars", "memory", "bytes_in_use", "KV bytes in use"), ("bars", "memory", "waste", "waste: 1 - useful / in use")],
        "capacity.png": [
            ("bars", "capacity", "sequences_sim", "concurrent sequences (simulation)"),
            ("bars", "capacity", "sequences_real", "concurrent sequences (real run, small scale)"),
        ],
        "decode.png": [
            ("lines", "decode", "decode_tokens_per_s", "decode tokens/s vs batch size", "batch_size"),
            ("lines", "decode", "decode_tokens_per_s", "decode tokens/s vs context length", "context"),
            ("lines", "decode", "e2e_tokens_per_s", "end-to-end tokens/s (prefill included)", "batch_size"),
        ],
        "ttft.png": [("lines", "ttft", "ttft", "time to first token")],
        "hybrid_prefix.png": [("bars", "hybrid_prefix", "ttft", "hybrid model: time to first token, prefix in a KVPool vs cold")],
        "kv_sharing.png": [("bars", "kv_sharing", "prefill_ms", "Gemma 4-style model: prefill time, paged vs DynamicCache")],
        "sharing.png": [
            ("lines", "sharing_samples", "kv_bytes", "parallel sampling: KV bytes"),
            ("lines", "sharing_samples", "time", "parallel sampling: generate time"),
            ("lines", "sharing_beams", "kv_bytes", "beam search: KV bytes"),
            ("lines", "sharing_beams", "copied_per_reorder", "beam search: bytes copied per reorder"),
        ],
        "host.png": [
            ("bars", "host", "thread_us_per_layer_step", "host CPU time per layer and decode step"),
            ("bars", "host", "added_us_per_layer_step", "added by the paged path"),
            ("bars", "host", "layer_calls_added_us", "added in a layer's attention + update (median call)"),
        ],
        "graph.png": [
            ("bars", "graph", "output_tokens_per_s", "Engine output tokens/s: compiled decode step vs eager"),
            ("bars", "graph", "decode_tokens_per_s", "single-stream decode tokens/s"),
        ],
        "spec.png": [
            ("lines", "spec", "output_tokens_per_s", "Engine output tokens/s, speculation vs none"),
            ("lines", "spec", "speedup", "speedup over no speculation"),
            ("lines", "spec", "acceptance_rate", "acceptance rate (accepted / drafted)"),
        ],
        "block_size.png": [
            ("lines", "block_size", "waste", "waste vs block size"),
            ("lines", "block_size", "table_entries", "block-table entries"),
            ("lines", "block_size", "decode_tokens_per_s", "decode tokens/s"),
        ],
    }
    written = []
    for name, panels in figures.items():
        if only is not None and not any(panel[1] in only for panel in panels):
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (kind, benchmark, metric, title, *parameter) in zip(axes[0], panels, strict=True):
            if kind == "bars":
                _bars(ax, rows, benchmark, metric, title)
                continue
            chosen = [r for r in rows if not parameter or r["parameter"] == parameter[0]]
            _lines(ax, chosen, benchmark, metric, title, log_x=benchmark in ("block_size", "decode"))
        own_model = HOST_MODEL if name == "host.png" else model  # (the host benchmark runs a model of its own)
        fig.text(0.01, -0.02, caption(rows, own_model), fontsize=7, color="dimgray", ha="left", va="top")
        fig.tight_layout()
        fig.savefig(out / name, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(out / name)
    if any(r["benchmark"] == "quantized" for r in rows):
        written.append(_quantized_figure(rows, out / "quantized.png"))
    if any(r["benchmark"] == "serving_throughput" for r in rows):
        written.append(plot_serving(rows, out / "serving.png", model))
    return written


def _quantized_figure(rows: list[dict], path: Path) -> Path:
    """One bar per kv_dtype: bytes per token, sequences a fixed budget admits, prompts with identical greedy
    tokens; model and machine in the caption."""
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    panels = [
        ("bytes_per_token", "K+V bytes per token, scales included", "bytes per token"),
        ("sequences_admitted", "sequences admitted by KVPool(max_memory)", "sequences"),
        ("greedy_identical", "prompts with identical greedy tokens", "prompts"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (metric, title, unit) in zip(axes[0], panels, strict=True):
        chosen = [r for r in rows if r["benchmark"] == "quantized" and r["metric"] == metric]
        names = [r["variant"] for r in chosen]
        bars = ax.bar(range(len(chosen)), [r["p50"] for r in chosen], color="tab:blue")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(chosen)), names, fontsize=8)
        ax.set_xlabel("kv_dtype")
        ax.set_ylabel(unit)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{title}\n({chosen[0]['x']})" if chosen else title, fontsize=9)
        ax.margins(y=0.15)
    first = next(r for r in rows if r["benchmark"] == "quantized")
    fig.text(0.5, 0.01, f"demo model (4 layers, 2 KV heads x 64, fp32); {first['device']}; {first['versions']}",
             ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_serving(rows: list[dict], path: Path, model: str | None = None) -> Path:
    """Throughput of the systems side by side, and normalized latency vs request rate (as vLLM's Fig. 12)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    throughput = {v: items[0] for v, items in _select(rows, "serving_throughput", "output_tokens_per_s").items()}
    names = list(throughput)
    bars = left.bar(names, [throughput[n]["p50"] for n in names], color=[COLORS.get(n) for n in names])
    left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.margins(y=0.12)
    requests = int(float(next(iter(throughput.values()))["x"])) if throughput else 0
    left.set_ylabel("output tokens/s")
    left.set_xlabel("system")
    left.set_title(f"throughput, {requests} requests submitted at once", fontsize=10)
    left.tick_params(axis="x", labelsize=8)
    latency = _select(rows, "serving_latency", "normalized_latency")
    rates: set[float] = set()
    for variant, items in latency.items():
        items = sorted(items, key=lambda r: float(r["x"]))
        xs = [float(r["x"]) for r in items]
        rates.update(xs)
        right.plot(xs, [r["p50"] for r in items], marker="o", label=variant, color=COLORS.get(variant))
    right.set_xlabel(_x_label("request_rate"))
    right.set_ylabel("normalized latency (s/token)")
    right.set_yscale("log")
    if rates:
        _measured_ticks(right, sorted(rates))
    right.set_title("mean latency per output token, Poisson arrivals", fontsize=10)
    right.grid(alpha=0.3)
    _legend_below(right)
    fig.text(0.01, -0.02, caption(rows, model), fontsize=7, color="dimgray", ha="left", va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default=None, help="the model, for the figures' captions")
    args = parser.parse_args()
    for path in plot_all(args.csv, args.out or args.csv.parent, args.model):
        print(path)


if __name__ == "__main__":
    main()
