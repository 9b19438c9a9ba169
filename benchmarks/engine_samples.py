"""KV bytes of `n` samples of one prompt through the Engine (`num_return_sequences=n`, the prompt's blocks
shared) against `n` separate requests of the same prompt, read from `pool.stats().bytes_in_use` after every
engine step (the peak is reported). The separate requests run with prefix caching off (each stores its own
prompt, as `n` clients with different prompts would) and on (the later ones may hit blocks the first already
indexed, when their prefills do not overlap).

    .venv/bin/python -m benchmarks.engine_samples                      # 1024-token prompt, 8 samples, 32 new
    .venv/bin/python -m benchmarks.engine_samples --out benchmarks/results/engine_samples.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

import hf_paged
from hf_paged.demo_model import load_demo_model

from .common import machine_info


def peak_bytes(engine: hf_paged.Engine) -> tuple[int, int]:
    """Steps the engine until idle; `(peak bytes_in_use, peak blocks_in_use)` over the steps."""
    peak = peak_blocks = 0
    while engine.has_work():
        engine.step()
        stats = engine.pool.stats()
        peak, peak_blocks = max(peak, stats.bytes_in_use), max(peak_blocks, stats.blocks_in_use)
    engine.pool.check()
    return peak, peak_blocks


def measure(prompt_len: int, n: int, new_tokens: int) -> list[dict[str, object]]:
    model, tok = load_demo_model(attn_implementation="paged")
    ids = (tok.encode(open(hf_paged.__file__).read()) * 8)[:prompt_len]
    gen = dict(max_new_tokens=new_tokens, do_sample=True, temperature=1.0)
    rows = []
    for variant, prefix_caching in (("n_samples", False), ("separate", False), ("separate_prefix_cache", True)):
        pool = hf_paged.KVPool(model.config, prefix_caching=prefix_caching)
        engine = hf_paged.Engine(model, pool, max_batch_tokens=max(512, prompt_len), max_seqs=64)
        if variant == "n_samples":
            engine.submit(ids, seed=0, num_return_sequences=n, **gen)
        else:
            for seed in range(n):
                engine.submit(ids, seed=seed, **gen)
        peak, blocks = peak_bytes(engine)
        rows.append({"variant": variant, "prompt_len": prompt_len, "n": n, "new_tokens": new_tokens,
                     "peak_bytes_in_use": peak, "peak_blocks_in_use": blocks})
    base = rows[1]["peak_bytes_in_use"]
    for row in rows:
        row["ratio_vs_separate"] = round(row["peak_bytes_in_use"] / base, 4)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.prompt_len, args.n, args.new_tokens)
    info = machine_info()
    for row in rows:
        row.update(device=info["device"], versions=info["versions"], date=info["date"], load=info["load"])
    writer = csv.DictWriter(sys.stdout if args.out is None else args.out.open("w", newline=""), fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
