"""Host time per call of the Triton path's entry points on a GPU, beside Triton's own launcher and a PyTorch op.

    python -m benchmarks.bench_launch [--out DIR] [--calls 2000]      # needs CUDA

At small batch an eager decode step waits on the host: each layer's cache write and attention cost what their
Python and their kernel launches cost. The kernels here are tiny (one row, 512 tokens of context), so the wall time
of a loop of calls without a synchronization is the host's time per call. Rows: `paged_attention()` and
`write_kv_cache()` called as a fresh call (inputs checked, launches laid out), the same attention's launches issued
through Triton's launcher alone (`kernel[grid](...)`), and `torch.add` as a one-launch baseline.
Writes `launch.csv` (call, microseconds per call, device, versions, date) to --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Wall microseconds per call of `fn` over `calls` calls issued back to back (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"))
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch needs a CUDA GPU (it times kernel launches).", file=sys.stderr)
        return 2
    import triton  # noqa: PLC0415

    from hf_paged.kernels import paged_attention, write_kv_cache  # noqa: PLC0415
    from hf_paged.kernels.paged_attention import attention_launches  # noqa: PLC0415

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 40, 16, 32, 8, 128
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(1, 1, num_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    attention = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                     block_tables=torch.arange(32, dtype=torch.int32, device=device)[None],
                     seq_lens=torch.tensor([512], dtype=torch.int32, device=device),
                     query_lens=torch.tensor([1], dtype=torch.int32, device=device), scale=head_dim**-0.5)
    out = torch.empty_like(query)
    launches = attention_launches(**attention, sliding_window=None, softcap=None, sinks=None, out=out, num_splits=1)
    key = torch.randn(1, 1, num_kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    slots = torch.tensor([[5]], device=device)
    a, b = torch.randn(1024, device=device), torch.randn(1024, device=device)
    c = torch.empty_like(a)
    timings = {
        "paged_attention()": per_call_us(lambda: paged_attention(**attention, num_splits=1), args.calls),
        f"the same attention's {len(launches)} launch(es), Triton's launcher alone": per_call_us(
            lambda: [launch() for launch in launches], args.calls),
        "write_kv_cache()": per_call_us(lambda: write_kv_cache(key=key, value=key, key_cache=key_cache,
                                                               value_cache=value_cache, slot_mapping=slots), args.calls),
        "torch.add (one launch)": per_call_us(lambda: torch.add(a, b, out=c), args.calls),
    }
    stamp = dict(device=torch.cuda.get_device_name(), versions=f"torch {torch.__version__}, triton {triton.__version__}",
                 date=datetime.datetime.now(datetime.UTC).date().isoformat())
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "launch.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["call", "us_per_call", "device", "versions", "date"])
        writer.writeheader()
        for call, us in timings.items():
            writer.writerow(dict(call=call, us_per_call=f"{us:.1f}", **stamp))
            print(f"{call:60s} {us:7.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
