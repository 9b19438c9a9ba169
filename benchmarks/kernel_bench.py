"""GPU micro-benchmark of the hf-paged Triton kernels.

    python -m benchmarks.kernel_bench [--out DIR] [--quick]     # needs CUDA
    python -m benchmarks.kernel_bench --smoke --out DIR         # CPU: tiny interpreter run

Measures, side by side in one run:
  * decode attention time and achieved K/V bandwidth (bytes of K/V read / time) vs context length
    (1k..32k) and batch (1..64): paged Triton kernel, SDPA on contiguous K/V, and
    flash_attn.flash_attn_with_kvcache(block_table=...) when importable;
  * prefill TFLOP/s (causal) for the paged kernel and SDPA;
  * device copy bandwidth (a large `copy_`), so decode bandwidth is also given as a fraction of it.
Writes a long-format CSV (benchmark, variant, parameters, p20/p50/p80, unit, device, versions, date),
PNG plots, and prints a summary table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FIELDS = ["benchmark", "variant", "batch", "context", "q_len", "num_heads", "num_kv_heads", "head_dim",
          "block_size", "dtype", "p20", "p50", "p80", "unit", "device", "versions", "date"]


@dataclass(slots=True)
class Row:
    benchmark: str
    variant: str
    batch: int
    context: int
    q_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    p20: float
    p50: float
    p80: float
    unit: str
    device: str
    versions: str
    date: str


@dataclass(frozen=True, slots=True)
class Shape:
    batch: int
    context: int
    q_len: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


def decode_shapes(quick: bool) -> list[Shape]:
    contexts = [1024, 4096, 32768] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    batches = [1, 16, 64] if quick else [1, 4, 16, 64]
    return [Shape(b, c, 1) for b in batches for c in contexts if b * c <= 64 * 16384 or b == 1]


def prefill_shapes(quick: bool) -> list[Shape]:
    return [Shape(1, n, n) for n in ([1024, 4096] if quick else [512, 1024, 2048, 4096, 8192])]


def make_paged(shape: Shape, dtype: torch.dtype, device: str):
    """Pools with a shuffled block table, plus the same K/V contiguous as [B, KVH, S, D]."""
    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    pool_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(pool_shape, dtype=dtype, device=device)
    value_cache = torch.randn(pool_shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device).view(shape.batch, blocks_per_seq).int()
    query = torch.randn(shape.batch, shape.num_heads, shape.q_len, shape.head_dim, dtype=dtype, device=device)

    def contiguous(cache):
        flat = cache[block_tables.long()].flatten(1, 2)[:, : shape.context]  # [B, S, KVH, D]
        return flat.transpose(1, 2).contiguous()

    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    query_lens = torch.full((shape.batch,), shape.q_len, dtype=torch.int32, device=device)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=seq_lens, query_lens=query_lens, k=contiguous(key_cache), v=contiguous(value_cache))


def variants(data: dict, shape: Shape) -> dict:
    """Callables to time, by variant name; each runs one attention over the same K/V."""
    from hf_paged.kernels import paged_attention

    scale = shape.head_dim**-0.5
    query_t = data["query"].transpose(1, 2)
    out = {
        "hf_paged": lambda: paged_attention(
            query=query_t, key_cache=data["key_cache"], value_cache=data["value_cache"],
            block_tables=data["block_tables"], seq_lens=data["seq_lens"], query_lens=data["query_lens"], scale=scale,
        ),
        "sdpa_contiguous": lambda: torch.nn.functional.scaled_dot_product_attention(
            data["query"], data["k"], data["v"], is_causal=shape.q_len > 1, scale=scale, enable_gqa=True
        ),
    }
    try:
        from flash_attn import flash_attn_with_kvcache

        out["flash_attn_paged"] = lambda: flash_attn_with_kvcache(
            query_t, data["key_cache"], data["value_cache"], cache_seqlens=data["seq_lens"],
            block_table=data["block_tables"], causal=True, softmax_scale=scale,
        )
    except ImportError:
        pass
    return out


def time_ms(fn, *, reps: int, sync) -> tuple[float, float, float]:
    """p20/p50/p80 of `reps` timed calls in milliseconds, after warm-up."""
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return pick(0.2), pick(0.5), pick(0.8)


def kv_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8


def prefill_flops(shape: Shape) -> float:
    return 4 * shape.batch * shape.num_heads * shape.head_dim * shape.q_len * shape.context / 2  # causal half


def run(shapes_decode, shapes_prefill, *, dtype, device, reps, sync) -> list[Row]:
    import triton
    import transformers

    versions = f"torch={torch.__version__};triton={triton.__version__};transformers={transformers.__version__}"
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"cpu-interpreter ({platform.processor()})"
    date = datetime.date.today().isoformat()
    rows: list[Row] = []

    def add(bench, variant, shape, p, unit):
        rows.append(Row(bench, variant, shape.batch, shape.context, shape.q_len, shape.num_heads, shape.num_kv_heads,
                        shape.head_dim, shape.block_size, str(dtype)[6:], *p, unit, dev_name, versions, date))

    big = torch.empty(256 * 2**20 if device == "cuda" else 2**20, dtype=torch.uint8, device=device)
    p = time_ms(lambda: big.clone(), reps=reps, sync=sync)
    copy_shape = Shape(1, 0, 0)
    add("copy_bandwidth", "tensor.clone", copy_shape, [2 * big.numel() / (t * 1e6) for t in reversed(p)], "GB/s")
    copy_gbs = rows[-1].p50
    for shape in shapes_decode:
        data = make_paged(shape, dtype, device)
        for name, fn in variants(data, shape).items():
            try:
                p = time_ms(fn, reps=reps, sync=sync)
            except RuntimeError as err:  # e.g. flash-attn 2 wants paged block_size % 256 == 0
                print(f"skipping {name} at {shape}: {err}")
                continue
            add("decode_time", name, shape, p, "ms")
            gbs = [kv_bytes(shape, dtype) / (t * 1e6) for t in reversed(p)]
            add("decode_bandwidth", name, shape, gbs, "GB/s")
            add("decode_copy_fraction", name, shape, [g / copy_gbs for g in gbs], "fraction")
        del data
    for shape in shapes_prefill:
        data = make_paged(shape, dtype, device)
        for name, fn in variants(data, shape).items():
            try:
                p = time_ms(fn, reps=reps, sync=sync)
            except RuntimeError as err:
                print(f"skipping {name} at {shape}: {err}")
                continue
            add("prefill_tflops", name, shape, [prefill_flops(shape) / (t * 1e9) for t in reversed(p)], "TFLOP/s")
        del data
    return rows


def write_csv(rows: list[Row], path: Path) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def plot(rows: list[Row], out_dir: Path) -> list[Path]:
    """One PNG per (benchmark, batch): p50 vs context length, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for bench in ("decode_bandwidth", "decode_time", "prefill_tflops"):
        sel = [r for r in rows if r.benchmark == bench]
        for batch in sorted({r.batch for r in sel}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for variant in sorted({r.variant for r in sel}):
                pts = sorted((r.context, r.p20, r.p50, r.p80) for r in sel if r.batch == batch and r.variant == variant)
                if pts:
                    xs, lo, mid, hi = zip(*pts)
                    ax.plot(xs, mid, marker="o", label=variant)
                    ax.fill_between(xs, lo, hi, alpha=0.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(f"{bench} [{sel[0].unit}]")
            ax.set_title(f"{bench}, batch {batch} ({sel[0].device})")
            ax.legend()
            path = out_dir / f"{bench}_batch{batch}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def summary(rows: list[Row]) -> str:
    lines = [f"{'benchmark':22s} {'variant':18s} {'batch':>5s} {'context':>7s} {'p50':>10s} unit"]
    for r in rows:
        if r.benchmark != "decode_time":
            lines.append(f"{r.benchmark:22s} {r.variant:18s} {r.batch:5d} {r.context:7d} {r.p50:10.3f} {r.unit}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hf-paged Triton kernel benchmark (CUDA)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_bench"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--smoke", "--dry-run", action="store_true",
                        help="CPU check of shapes, CSV and plots with a tiny Triton-interpreter run")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        assert decode_shapes(False) and prefill_shapes(False)
        tiny = dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
        shapes_decode = [Shape(1, 32, 1, **tiny), Shape(2, 64, 1, **tiny)]
        shapes_prefill = [Shape(1, 16, 16, **tiny)]
        rows = run(shapes_decode, shapes_prefill, dtype=torch.float32, device="cpu", reps=2, sync=lambda: None)
    else:
        if not torch.cuda.is_available():
            print("kernel_bench needs a CUDA GPU (none found). Use --smoke for a CPU check of the script.")
            return 2
        shapes = (decode_shapes(args.quick), prefill_shapes(args.quick))
        rows = run(*shapes, dtype=dtype, device="cuda", reps=args.reps, sync=torch.cuda.synchronize)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "kernel_bench.csv")
    paths = plot(rows, args.out)
    print(summary(rows))
    print(f"wrote {args.out / 'kernel_bench.csv'} and {len(paths)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
