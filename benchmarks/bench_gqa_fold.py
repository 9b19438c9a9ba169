"""A CPU decode's attention with GQA: SDPA with `enable_gqa` against each KV head's query heads folded into the
query length, one call at a time, and which of the two `decode_attention` picks (`folds_gqa`).

    python -m benchmarks.bench_gqa_fold [--cold] [--smoke] [--out DIR]

For each shape (batch, query heads / KV heads, head_dim, keys, with or without a padding mask) both variants run
alternately on the same tensors (K/V strided as a head-major pool holds them), one torch thread; `--cold` sweeps
24 MiB between calls so that K/V come from the last-level cache, as inside a model. Prints a table of the median
times, their ratio fold/`enable_gqa` and the route `decode_attention` takes, and writes it as a CSV
(`gqa_fold.csv`, `gqa_fold_cold.csv` with `--cold`) to `--out` (`benchmarks/results/`).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_paged.attention.torch_backend import folds_gqa

SHAPES = [  # (batch, num_heads, num_kv_heads, head_dim)
    (1, 4, 2, 16), (1, 4, 2, 64), (1, 4, 2, 128), (8, 4, 2, 16), (8, 4, 2, 64), (1, 32, 8, 16), (1, 32, 8, 128),
    (8, 32, 8, 64),
]
KEYS = [32, 64, 128, 256, 512, 2048]


def _kv(batch: int, num_kv_heads: int, keys: int, head_dim: int) -> torch.Tensor:
    """`[batch, num_kv_heads, keys, head_dim]` view of head-major storage (each head's keys contiguous)."""
    return torch.randn(num_kv_heads, batch, keys, head_dim).permute(1, 0, 2, 3)


def _time(variants: dict, calls: int, sweep: torch.Tensor | None) -> dict[str, float]:
    times: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(calls):
        for name, fn in variants.items():
            if sweep is not None:
                sweep.add_(1.0)
            else:
                fn()
            start = time.perf_counter_ns()
            fn()
            times[name].append(time.perf_counter_ns() - start)
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def measure(cold: bool, smoke: bool) -> list[dict[str, object]]:
    """One row per shape, mask and key count: median µs of both variants and the route `decode_attention` takes."""
    torch.set_num_threads(1)
    sweep = torch.randn(6 * 2**20) if cold else None
    shapes, keys = (SHAPES[:2], KEYS[:2]) if smoke else (SHAPES, KEYS)
    rows = []
    for batch, num_heads, num_kv_heads, head_dim in shapes:
        groups = num_heads // num_kv_heads
        for kv_len in keys:
            k, v = _kv(batch, num_kv_heads, kv_len, head_dim), _kv(batch, num_kv_heads, kv_len, head_dim)
            query = torch.randn(batch, 1, num_heads, head_dim).transpose(1, 2)
            folded = query.reshape(batch, num_kv_heads, groups, head_dim)
            for masked in (False, True):
                mask = None
                if masked:  # every other row's first third is padding
                    mask = torch.ones(batch, 1, 1, kv_len, dtype=torch.bool)
                    mask[::2, ..., : kv_len // 3] = False

                def gqa(mask=mask, k=k, v=v, query=query):
                    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)

                def fold(mask=mask, k=k, v=v, folded=folded):
                    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=0.125)
                    return out.reshape(batch, num_heads, 1, head_dim)

                torch.testing.assert_close(fold(), gqa())
                budget = batch * num_heads * kv_len * head_dim
                calls = 3 if smoke else max(20, min(400, 2**26 // budget))
                us = _time({"enable_gqa": gqa, "fold": fold}, calls, sweep)
                key_bytes = k.numel() * k.element_size()
                rows.append({
                    "batch": batch, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                    "keys": kv_len, "mask": masked, "key_bytes": key_bytes, "enable_gqa_us": round(us["enable_gqa"], 2),
                    "fold_us": round(us["fold"], 2), "fold_over_gqa": round(us["fold"] / us["enable_gqa"], 3),
                    "decode_attention_folds": folds_gqa(query, k),
                })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="sweep 24 MiB between calls (K/V from L3)")
    parser.add_argument("--smoke", action="store_true", help="two shapes, two key counts, three calls each")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    rows = measure(args.cold, args.smoke)
    print("| batch | heads/KV heads | head_dim | keys | mask | key KiB | enable_gqa µs | fold µs | fold/gqa "
          "| folds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['num_heads']}/{r['num_kv_heads']} | {r['head_dim']} | {r['keys']} | "
              f"{'padding' if r['mask'] else '-'} | {r['key_bytes'] // 1024} | {r['enable_gqa_us']} | {r['fold_us']} | "
              f"{r['fold_over_gqa']} | {'yes' if r['decode_attention_folds'] else 'no'} |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gqa_fold_cold.csv" if args.cold else "gqa_fold.csv")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
