"""Cross-attention bytes of a Whisper-tiny-shaped model in beam search: transformers' `EncoderDecoderCache` (every
beam's row holds its own copy of the encoder's K/V) against `hf_paged.EncoderDecoderPagedCache` (one entry per
request, its beams naming it), with the self-attention bytes, the totals, and whether both give the same tokens.

The model is built from a config with Whisper-tiny's attention shapes (d_model 384, 4 encoder and 4 decoder layers,
6 heads, 80 mel bins, 1500 encoder positions = 30 s of audio features; random weights); one 30 s input, `num_beams`
beams. Bytes are read after `generate()` from the cache objects passed to it: transformers' from each layer's
tensors (distinct storages), ours from `cross_stats().bytes_in_use` and `stats().bytes_in_use` (blocks held).

    .venv/bin/python -m benchmarks.bench_encdec                                   # prints the CSV
    .venv/bin/python -m benchmarks.bench_encdec --out benchmarks/results/encdec.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache, EncoderDecoderCache, WhisperForConditionalGeneration

import hf_paged

from .common import machine_info

WHISPER_TINY = dict(
    d_model=384,
    encoder_layers=4,
    decoder_layers=4,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    encoder_ffn_dim=1536,
    decoder_ffn_dim=1536,
    num_mel_bins=80,
    max_source_positions=1500,
    max_target_positions=448,
)


def tensor_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def layer_bytes(cache: DynamicCache) -> int:
    return tensor_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])


def run(num_beams: int, new_tokens: int, seed: int = 0) -> list[dict]:
    config = AutoConfig.for_model("whisper", **WHISPER_TINY)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    features = torch.randn(
        1, config.num_mel_bins, 2 * config.max_source_positions, generator=torch.Generator().manual_seed(seed)
    )
    kwargs = dict(num_beams=num_beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    rows = []
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        theirs = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        start = time.perf_counter()
        reference = model.generate(input_features=features, **hf_paged.cache_kwargs(theirs), **kwargs)
        seconds_theirs = time.perf_counter() - start
        model.set_attn_implementation("paged")
        ours = hf_paged.EncoderDecoderPagedCache(model.config)
        start = time.perf_counter()
        paged = model.generate(input_features=features, **hf_paged.cache_kwargs(ours), **kwargs)
        seconds_ours = time.perf_counter() - start
        ours.check()
    same = reference.shape == paged.shape and bool(torch.equal(reference, paged))
    cross_theirs = layer_bytes(theirs.cross_attention_cache)
    self_theirs = layer_bytes(theirs.self_attention_cache)
    cross_ours = ours.cross_stats().bytes_in_use
    self_ours = ours.stats().bytes_in_use
    common = dict(
        num_beams=num_beams, encoder_len=config.max_source_positions, new_tokens=new_tokens, tokens_equal=same
    )
    for variant, cross, self_bytes, seconds in (
        ("transformers", cross_theirs, self_theirs, seconds_theirs),
        ("hf_paged", cross_ours, self_ours, seconds_ours),
    ):
        rows.append(
            dict(
                variant=variant,
                **common,
                cross_bytes=cross,
                self_bytes=self_bytes,
                total_bytes=cross + self_bytes,
                cross_ratio=round(cross / cross_theirs, 4),
                total_ratio=round((cross + self_bytes) / (cross_theirs + self_theirs), 4),
                seconds=round(seconds, 2),
            )
        )
    ours.release()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-beams", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.num_beams, args.new_tokens)
    info = machine_info()
    for row in rows:
        row.update(info)
    out = sys.stdout if args.out is None else args.out.open("w", newline="")
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    if args.out is not None:
        out.close()
        print(f"wrote {args.out}")
    ours = rows[1]
    print(
        f"cross-attention bytes: {ours['cross_ratio']}x of transformers' cache; total {ours['total_ratio']}x; "
        f"tokens equal: {ours['tokens_equal']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
