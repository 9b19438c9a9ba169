"""`python -m hf_paged demo`: the default cache and `PagedCache` side by side on the shipped model.

Three rounds, each measured on the same model and prompts:
1. batched greedy generation: texts, identical-output check, tokens/s and KV memory;
2. prefix reuse: a `KVPool` serves a shared system prompt to a second request;
3. parallel sampling: `num_return_sequences` stores the prompt once.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

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
    """One line of the comparison table."""

    variant: str
    seconds: float
    new_tokens: int
    kv_in_use: int
    kv_reserved: int
    blocks: str = "-"
    shared: str = "-"
    prefix_hits: str = "-"

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def paged_row(variant: str, seconds: float, new_tokens: int, cache: PagedCache) -> Row:
    stats = cache.stats()
    return Row(
        variant, seconds, new_tokens, stats.bytes_in_use, stats.bytes_reserved,
        str(stats.blocks_in_use), str(stats.blocks_shared), str(stats.prefix_hit_tokens),
    )


def format_table(rows: list[Row], ttft: bool = False) -> str:
    """Fixed-width table; `ttft` shows the time of the call in ms instead of tokens/s."""
    head = ("variant", "TTFT" if ttft else "tokens/s", "KV in use", "KV reserved", "blocks", "shared", "prefix hits")
    body = [
        (
            r.variant,
            f"{r.seconds * 1e3:.1f} ms" if ttft else f"{r.tokens_per_s:.1f}",
            _mb(r.kv_in_use), _mb(r.kv_reserved), r.blocks, r.shared, r.prefix_hits,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def load(model_path: str | None, dtype: torch.dtype):
    """The model (with `"paged"` attention) and tokenizer; the shipped demo model by default."""
    if model_path is None:
        from ..demo_model import DEMO_MODEL_PATH  # noqa: PLC0415

        model_path = str(DEMO_MODEL_PATH)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="paged").eval()
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"Could not load a causal LM from {model_path!r}: {err}\n"
            "Pass --model with a local directory (config.json + weights + tokenizer) or a hub id you have cached."
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def timed_generate(model, inputs, cache, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **cache_kwargs(cache), pad_token_id=kwargs.pop("pad_token_id"), **kwargs)
    return out, time.perf_counter() - start


def run(model_path: str | None, max_new_tokens: int, dtype: torch.dtype, out=sys.stdout) -> bool:
    """Runs the three rounds, prints texts and tables. Returns whether greedy texts were identical."""
    model, tokenizer = load(model_path, dtype)
    pad = tokenizer.pad_token_id
    PagedCache(config=model.config)  # fails early, with a clear message, for unsupported models
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    prompt_width = inputs.input_ids.shape[1]
    rounds = tqdm(total=3, desc="demo rounds", file=sys.stderr)

    # 1. batched greedy generation, side by side
    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    ref, ref_s = timed_generate(model, inputs, dynamic, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    model.set_attn_implementation("paged")
    cache = PagedCache(config=model.config)
    got, got_s = timed_generate(model, inputs, cache, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    identical = torch.equal(ref, got)
    new_tokens = int((got[:, prompt_width:] != pad).sum()) or got[:, prompt_width:].numel()
    print("== Greedy generation, batch of", len(PROMPTS), "left-padded prompts ==", file=out)
    for text in tokenizer.batch_decode(got, skip_special_tokens=True):
        print("---\n" + text, file=out)
    print("---", file=out)
    rows = [
        Row("DynamicCache + sdpa", ref_s, new_tokens, contiguous_cache_bytes(dynamic), contiguous_cache_bytes(dynamic)),
        paged_row("PagedCache + paged", got_s, new_tokens, cache),
    ]
    print(format_table(rows), file=out)
    print(f"identical greedy text: {'yes' if identical else 'NO'}\n", file=out)
    cache.release()
    rounds.update()

    # 2. prefix reuse across calls through a KVPool
    pool = KVPool(model.config)
    request = tokenizer([SYSTEM_PROMPT + "def parse(path):\n"], return_tensors="pt")
    rows = []
    outputs = []
    for label in ("cold (nothing cached)", "warm (prefix hit)"):
        with pool.new_cache(request.input_ids, request.attention_mask) as pooled:
            text, seconds = timed_generate(model, request, pooled, max_new_tokens=1, do_sample=False, pad_token_id=pad)
            outputs.append(text)
            rows.append(paged_row(f"KVPool {label}", seconds, 1, pooled))
    print("== Prefix reuse: time to first token for a", request.input_ids.shape[1], "token prompt ==", file=out)
    print(format_table(rows, ttft=True), file=out)
    print(f"warm/cold TTFT: {rows[1].seconds / rows[0].seconds:.2f}; "
          f"same first token: {'yes' if torch.equal(outputs[0], outputs[1]) else 'NO'}\n", file=out)
    rounds.update()

    # 3. parallel sampling: the prompt is stored once
    sample = tokenizer([SYSTEM_PROMPT], return_tensors="pt")
    kwargs = dict(max_new_tokens=max_new_tokens // 2, do_sample=True, num_return_sequences=4, pad_token_id=pad)
    model.set_attn_implementation("sdpa")
    dynamic = DynamicCache(config=model.config)
    torch.manual_seed(0)
    _, ref_s = timed_generate(model, sample, dynamic, **dict(kwargs))
    model.set_attn_implementation("paged")
    cache = PagedCache(config=model.config)
    torch.manual_seed(0)
    _, got_s = timed_generate(model, sample, cache, **dict(kwargs))
    total = 4 * kwargs["max_new_tokens"]
    rows = [
        Row("DynamicCache + sdpa", ref_s, total, contiguous_cache_bytes(dynamic), contiguous_cache_bytes(dynamic)),
        paged_row("PagedCache + paged", got_s, total, cache),
    ]
    print("== Parallel sampling: 4 samples of one", sample.input_ids.shape[1], "token prompt ==", file=out)
    print(format_table(rows), file=out)
    cache.release()
    rounds.update()
    rounds.close()
    return identical


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_path_or_id, default=None,
                        help="local path or cached hub id (default: the shipped model)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args(argv)
    try:
        identical = run(args.model, args.max_new_tokens, getattr(torch, args.dtype))
    except UnsupportedModelError as err:
        raise SystemExit(f"This model cannot use a paged KV cache: {err}") from None
    except (OutOfBlocksError, torch.OutOfMemoryError, MemoryError) as err:
        raise SystemExit(f"Out of memory: {err}\nTry --max-new-tokens smaller, --dtype bfloat16 or a smaller model.") from None
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
