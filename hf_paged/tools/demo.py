"""`python -m hf_paged demo`: the default cache and `PagedCache` side by side on the shipped model.

Three rounds, each measured on the same model and prompts (whose size the first line gives); each variant runs
once to warm up, then `--repeats` times, the variants taking turns, and the tables give medians and ranges:
1. batched greedy generation: each prompt and its continuation, identical-output check, tokens/s with the
   speed ratio and a verdict, KV memory;
2. prefix reuse: a `KVPool` serves a shared system prompt to a second request;
3. parallel sampling: `num_return_sequences` stores the prompt once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..cache.paged_cache import PagedCache
from .cli_args import model_path_or_id, positive_int
from ..compat import cache_kwargs
from ..errors import OutOfBlocksError, UnsupportedModelError
from ..cache.kvpool import KVPool
from ..memory.stats import contiguous_cache_bytes

PROMPTS = [
    "def read_config(path):\n",
    "import os\n\n\ndef walk(top):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for key, value in sorted(",
    # a longer prompt: batches mix lengths, and a contiguous cache pads every row to the longest
    '"""Helpers for reading and writing INI style configuration files.\n\nThe parser keeps the order of '
    'sections and options, and reports errors with the line number."""\n\nimport os\nimport re\n\n\n'
    "class ConfigParser:\n    def read(self, path):\n",
]
SYSTEM_PROMPT = (
    '"""Utilities for parsing and validating configuration files.\n\n'
    "Every function in this module takes a path or a mapping and returns plain Python objects.\n"
    'Errors are reported with the offending key and line number."""\n\nimport os\nimport re\nimport sys\n\n'
)


@dataclass(slots=True)
class Row:
    """One line of a comparison table: a variant's timed runs and its cache's memory after the last one."""

    variant: str
    seconds: list[float]
    new_tokens: int
    kv_in_use: int
    kv_reserved: int
    blocks: str = "-"
    shared: str = "-"
    prefix_hits: str = "-"

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        """Median tokens/s over the runs."""
        return self.new_tokens / self.median_s if self.median_s else 0.0


def paged_row(variant: str, seconds: list[float], new_tokens: int, cache: PagedCache) -> Row:
    stats = cache.stats()
    return Row(
        variant, seconds, new_tokens, stats.bytes_in_use, stats.bytes_reserved,
        str(stats.blocks_in_use), str(stats.blocks_shared), str(stats.prefix_hit_tokens),
    )


def format_table(rows: list[Row], ttft: bool = False) -> str:
    """Fixed-width table: the median (and the range over the runs) of tokens/s, or of the call's time in ms
    with `ttft`."""
    head = ("variant", "TTFT median (range)" if ttft else "tokens/s median (range)", "KV in use", "KV reserved",
            "blocks", "shared", "prefix hits")
    body = [
        (
            r.variant, _ms(r) if ttft else _rate(r),
            _mb(r.kv_in_use), _mb(r.kv_reserved), r.blocks, r.shared, r.prefix_hits,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _rate(row: Row) -> str:
    rates = sorted(row.new_tokens / s for s in row.seconds)
    spread = f" ({rates[0]:.1f}-{rates[-1]:.1f})" if len(rates) > 1 else ""
    return f"{row.tokens_per_s:.1f}{spread}"


def _ms(row: Row) -> str:
    times = sorted(s * 1e3 for s in row.seconds)
    spread = f" ({times[0]:.1f}-{times[-1]:.1f})" if len(times) > 1 else ""
    return f"{row.median_s * 1e3:.1f} ms{spread}"


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def verdict(reference: Row, paged: Row) -> str:
    """One line: PagedCache's median speed as a multiple of the reference's, and whether every run agrees."""
    ratio = paged.tokens_per_s / reference.tokens_per_s
    runs = f"medians of {len(paged.seconds)} alternating runs each"
    if max(paged.seconds) < min(reference.seconds):
        call = "PagedCache faster here: every run"
    elif min(paged.seconds) > max(reference.seconds):
        call = "PagedCache slower here: every run"
    else:
        call = "no clear difference here: the runs overlap"
    return f"speed: PagedCache {ratio:.2f}x the default cache's tokens/s ({runs}); {call}"


def describe_model(model: torch.nn.Module, model_path: str | None) -> str:
    """The model's name, class, parameter count, layers and dtype, in one line."""
    num_parameters = sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    layers = getattr(model.config, "num_hidden_layers", "?")
    name = "the shipped demo model (hf_paged/demo_model/weights)" if model_path is None else model_path
    return f"model: {name}: {type(model).__name__}, {_count(num_parameters)} parameters, {layers} layers, {dtype}"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def load(model_path: str | None, dtype: torch.dtype):
    """The model (with `"paged"` attention) and tokenizer; the shipped demo model by default."""
    if model_path is None:
        from ..demo_model import DEMO_MODEL_PATH  # noqa: PLC0415

        path = str(DEMO_MODEL_PATH)
    else:
        path = model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="paged").eval()
    except UnsupportedModelError as err:  # loaded, but refused under "paged" (attention code of its own)
        raise SystemExit(f"This model cannot use a paged KV cache: {err}") from None
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"Could not load a causal LM from {path!r}: {err}\n"
            "Pass --model with a local directory (config.json + weights + tokenizer) or a hub id you have cached."
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


T = TypeVar("T")


def alternate(runs: Sequence[Callable[[], T]], repeats: int) -> list[tuple[list[float], T]]:
    """Runs every variant once untimed (warm-up), then `repeats` timed rounds, the order reversed every other
    round so that a machine getting faster or slower weighs on each variant alike. Returns, per variant, its
    seconds and what its last run returned."""
    results: list[T] = [run() for run in runs]
    seconds: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats):
        order = range(len(runs)) if repeat % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            start = time.perf_counter()
            results[i] = runs[i]()
            seconds[i].append(time.perf_counter() - start)
    return list(zip(seconds, results, strict=True))


def generate_with(model, attn: str, make_cache: Callable[[], object], inputs, seed: int | None = None, **kwargs):
    """One `generate()` under attention `attn` with a fresh cache from `make_cache`; returns `(output, cache)`."""
    model.set_attn_implementation(attn)
    cache = make_cache()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(**inputs, **cache_kwargs(cache), **kwargs)
    return out, cache


def run(model_path: str | None, max_new_tokens: int, dtype: torch.dtype, repeats: int = 5, out=sys.stdout) -> bool:
    """Runs the three rounds, prints texts and tables. Returns whether greedy texts were identical."""
    model, tokenizer = load(model_path, dtype)
    pad = tokenizer.pad_token_id
    PagedCache(config=model.config)  # fails early, with a clear message, for unsupported models
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    prompt_width = inputs.input_ids.shape[1]
    print(describe_model(model, model_path), file=out)
    print(f"each timing: a warm-up run, then {repeats} runs per variant, taking turns "
          f"({torch.get_num_threads()} torch threads; other work on the machine shows as spread)\n", file=out)
    rounds = tqdm(total=3, desc="demo rounds", file=sys.stderr)

    # 1. batched greedy generation, side by side
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    (ref_s, (ref, dynamic)), (got_s, (got, cache)) = alternate(
        [lambda: generate_with(model, "sdpa", lambda: DynamicCache(config=model.config), inputs, **greedy),
         lambda: generate_with(model, "paged", lambda: PagedCache(config=model.config), inputs, **greedy)],
        repeats,
    )
    identical = torch.equal(ref, got)
    new_tokens = int((got[:, prompt_width:] != pad).sum()) or got[:, prompt_width:].numel()
    print(f"== Greedy generation, batch of {len(PROMPTS)} left-padded prompts, up to {max_new_tokens} new tokens ==",
          file=out)
    continuations = tokenizer.batch_decode(got[:, prompt_width:], skip_special_tokens=True)
    for i, (prompt, continuation) in enumerate(zip(PROMPTS, continuations, strict=True), start=1):
        print(f"--- prompt {i} ---\n{prompt.rstrip(chr(10))}", file=out)
        print(f"--- continuation {i} (PagedCache) ---\n{continuation.rstrip(chr(10))}", file=out)
    print("---", file=out)
    rows = [
        Row("DynamicCache + sdpa", ref_s, new_tokens, contiguous_cache_bytes(dynamic), contiguous_cache_bytes(dynamic)),
        paged_row("PagedCache + paged", got_s, new_tokens, cache),
    ]
    print(format_table(rows), file=out)
    print(f"identical greedy text: {'yes' if identical else 'NO'}", file=out)
    print(verdict(rows[0], rows[1]), file=out)
    ratio = rows[1].kv_in_use / rows[0].kv_in_use
    why = "no padding slots" if ratio <= 1 else "blocks are allocated whole, and sliding-window layers keep a margin"
    print(f"KV memory: PagedCache holds {ratio:.2f}x the default cache's bytes ({why})\n", file=out)
    cache.release()
    rounds.update()

    # 2. prefix reuse across calls through a KVPool: a cold call fills a fresh pool, a warm one hits it
    request = tokenizer([SYSTEM_PROMPT + "def parse(path):\n"], return_tensors="pt")
    model.set_attn_implementation("paged")
    first = dict(max_new_tokens=1, do_sample=False, pad_token_id=pad)
    cold_s, warm_s, outputs, rows = [], [], [], []
    for _ in range(repeats + 1):  # the first pair warms up
        pool = KVPool(model.config)
        for seconds in (cold_s, warm_s):
            with pool.new_cache(request.input_ids, request.attention_mask) as pooled:
                start = time.perf_counter()
                output, _ = generate_with(model, "paged", lambda pooled=pooled: pooled, request, **first)
                seconds.append(time.perf_counter() - start)
                outputs.append(output)
                rows.append(pooled.stats())
    cold_s, warm_s = cold_s[1:], warm_s[1:]
    table = [
        Row("KVPool cold (nothing cached)", cold_s, 1, rows[-2].bytes_in_use, rows[-2].bytes_reserved,
            str(rows[-2].blocks_in_use), str(rows[-2].blocks_shared), str(rows[-2].prefix_hit_tokens)),
        Row("KVPool warm (prefix hit)", warm_s, 1, rows[-1].bytes_in_use, rows[-1].bytes_reserved,
            str(rows[-1].blocks_in_use), str(rows[-1].blocks_shared), str(rows[-1].prefix_hit_tokens)),
    ]
    print("== Prefix reuse: time to first token for a", request.input_ids.shape[1], "token prompt ==", file=out)
    print(format_table(table, ttft=True), file=out)
    same = all(torch.equal(outputs[0], o) for o in outputs)
    print(f"warm/cold TTFT: {table[1].median_s / table[0].median_s:.2f} (medians); "
          f"same first token: {'yes' if same else 'NO'}\n", file=out)
    rounds.update()

    # 3. parallel sampling: the prompt is stored once
    sample = tokenizer([SYSTEM_PROMPT], return_tensors="pt")
    new = max(1, max_new_tokens // 2)
    sampling = dict(max_new_tokens=new, do_sample=True, num_return_sequences=4, pad_token_id=pad, seed=0)
    (ref_s, (_, dynamic)), (got_s, (_, cache)) = alternate(
        [lambda: generate_with(model, "sdpa", lambda: DynamicCache(config=model.config), sample, **sampling),
         lambda: generate_with(model, "paged", lambda: PagedCache(config=model.config), sample, **sampling)],
        repeats,
    )
    rows = [
        Row("DynamicCache + sdpa", ref_s, 4 * new, contiguous_cache_bytes(dynamic), contiguous_cache_bytes(dynamic)),
        paged_row("PagedCache + paged", got_s, 4 * new, cache),
    ]
    print("== Parallel sampling: 4 samples of one", sample.input_ids.shape[1], "token prompt ==", file=out)
    print(format_table(rows), file=out)
    print(verdict(rows[0], rows[1]), file=out)
    cache.release()
    rounds.update()
    rounds.close()
    return identical


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_path_or_id, default=None,
                        help="local path or cached hub id (default: the shipped model)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48)
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per variant, taking turns after a warm-up run (default 5)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args(argv)
    try:
        identical = run(args.model, args.max_new_tokens, getattr(torch, args.dtype), args.repeats)
    except UnsupportedModelError as err:
        raise SystemExit(f"This model cannot use a paged KV cache: {err}") from None
    except (OutOfBlocksError, torch.OutOfMemoryError, MemoryError) as err:
        raise SystemExit(f"Out of memory: {err}\nTry --max-new-tokens smaller, --dtype bfloat16 or a smaller model.") from None
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
