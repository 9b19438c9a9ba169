"""Plots from the long-format CSV: `python -m benchmarks.plot benchmarks/results/results.csv [--out DIR]`."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "paged": "tab:blue", "paged_batch": "tab:blue", "paged_pool": "tab:cyan", "paged_prefix_hit": "tab:blue",
    "paged_cold": "tab:cyan", "dynamic": "tab:orange", "dynamic_batch": "tab:orange",
    "dynamic_per_request": "tab:brown", "static": "tab:green", "static_batch": "tab:green",
    "hf_generate_batch": "tab:purple", "contiguous_max_len": "tab:red", "contiguous_oracle": "tab:gray",
}  # fmt: skip


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
    for variant, items in _select(rows, benchmark, metric).items():
        items = sorted(items, key=lambda r: float(r["x"]))
        xs = [float(r["x"]) for r in items]
        ys = [r["p50"] for r in items]
        err = [[r["p50"] - r["p20"] for r in items], [r["p80"] - r["p50"] for r in items]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=variant, color=COLORS.get(variant))
        if items:
            ax.set_xlabel(items[0]["parameter"])
            ax.set_ylabel(f"{metric} ({items[0]['unit']})")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


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
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot_all(csv_path: Path, out: Path) -> list[Path]:
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
        "sharing.png": [
            ("lines", "sharing_samples", "kv_bytes", "parallel sampling: KV bytes"),
            ("lines", "sharing_samples", "time", "parallel sampling: generate time"),
            ("lines", "sharing_beams", "kv_bytes", "beam search: KV bytes"),
            ("lines", "sharing_beams", "copied_per_reorder", "beam search: bytes copied per reorder"),
        ],
        "block_size.png": [
            ("lines", "block_size", "waste", "waste vs block size"),
            ("lines", "block_size", "table_entries", "block-table entries"),
            ("lines", "block_size", "decode_tokens_per_s", "decode tokens/s"),
        ],
    }
    written = []
    for name, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (kind, benchmark, metric, title, *parameter) in zip(axes[0], panels, strict=True):
            if kind == "bars":
                _bars(ax, rows, benchmark, metric, title)
                continue
            chosen = [r for r in rows if not parameter or r["parameter"] == parameter[0]]
            _lines(ax, chosen, benchmark, metric, title, log_x=benchmark in ("block_size", "decode"))
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written.append(out / name)
    if any(r["benchmark"] == "quantized" for r in rows):
        written.append(_quantized_figure(rows, out / "quantized.png"))
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
             ha="center", fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for path in plot_all(args.csv, args.out or args.csv.parent):
        print(path)


if __name__ == "__main__":
    main()
