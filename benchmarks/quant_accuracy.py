"""Accuracy of quantized K/V blocks against the unquantized cache (used by `bench_quantized` and the tests).

Three measures per `kv_dtype`, each against a `PagedCache` storing K/V in the model's dtype:
- greedy agreement: per prompt (batch 1, no padding), are the `new_tokens` greedy tokens identical, and
  where does the first difference fall;
- per-step logit error: teacher-forced along the unquantized greedy continuation (prefill, then one decode
  forward per token, so every step reads its history from the quantized blocks), the max |logit difference|
  per step, and the top-1 agreement of those steps;
- perplexity on held-out text: windows of 256 tokens (the demo model's training length) of stdlib files
  it was not trained on, each fed in chunks of 64 through one cache (each chunk attends the earlier chunks
  from the blocks), cross-entropy of every next token.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hf_paged

#: Prompts for greedy agreement: the demo's and more stdlib-like openings.
PROMPTS = [
    "def read_config(path):\n",
    "import os\n\n\ndef walk(top):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for key, value in sorted(",
    '"""Helpers for reading and writing INI style configuration files."""\n\nimport os\nimport re\n\n\n'
    "class ConfigParser:\n    def read(self, path):\n",
    "def _parse_header(line):\n    \"\"\"Split a header line into name and value.\"\"\"\n",
    "import sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
    "class Error(Exception):\n    \"\"\"Base class for errors in this module.\"\"\"\n\n",
    "    def __repr__(self):\n        return ",
    "try:\n    import threading\nexcept ImportError:\n",
    "def copyfile(src, dst, *, follow_symlinks=True):\n",
    "        if not isinstance(name, str):\n            raise TypeError(",
    "__all__ = [\n",
    "    @property\n    def name(self):\n",
    "def _is_valid(value):\n    return ",
    "with open(filename, 'rb') as f:\n",
]

#: Held-out stdlib files (the demo model's validation split; see its `training_report.json`).
HELD_OUT = ["fileinput.py", "tempfile.py", "traceback.py", "dis.py", "urllib/robotparser.py"]


@dataclass(slots=True)
class Accuracy:
    """Accuracy of one `kv_dtype` against the unquantized cache."""

    kv_dtype: str | None
    identical: int = 0
    prompts: int = 0
    first_divergence: list[int] = field(default_factory=list)  # per prompt, new_tokens if identical
    max_logit_error: float = 0.0
    mean_step_max_logit_error: float = 0.0
    step_top1_agreement: float = 1.0
    ppl: float = float("nan")


@torch.inference_mode()
def greedy(model, tokenizer, prompt: str, kv_dtype: str | None, new_tokens: int) -> torch.Tensor:
    """`[new_tokens]` greedy continuation of one prompt with a cache of `kv_dtype`."""
    inputs = tokenizer([prompt], return_tensors="pt")
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    out = model.generate(
        **inputs, **hf_paged.cache_kwargs(cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=tokenizer.pad_token_id,
    )
    return out[0, inputs.input_ids.shape[1] :]


@torch.inference_mode()
def forced_logits(model, ids: torch.Tensor, prompt_len: int, kv_dtype: str | None) -> torch.Tensor:
    """`[len - prompt_len + 1, vocab]` float32 logits: the prefill's last, then one decode step per token."""
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    kw = hf_paged.cache_kwargs(cache)
    steps = [model(input_ids=ids[None, :prompt_len], **kw, use_cache=True).logits[0, -1].float()]
    for t in range(prompt_len, ids.numel()):
        steps.append(model(input_ids=ids[None, t : t + 1], **kw, use_cache=True).logits[0, -1].float())
    return torch.stack(steps)


@torch.inference_mode()
def chunked_nll(model, ids: torch.Tensor, kv_dtype: str | None, chunk: int) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of `ids` (`[n]`) fed `chunk` tokens per forward through one
    cache, and the number of tokens scored."""
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    kw = hf_paged.cache_kwargs(cache)
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, chunk):
        piece = ids[start : min(start + chunk, ids.numel() - 1)]
        target = ids[start + 1 : start + 1 + piece.numel()]
        logits = model(input_ids=piece[None], **kw, use_cache=True).logits[0].float()
        total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += target.numel()
    return total, count


def held_out_texts(tokenizer, window: int, per_file: int = 1, files: list[str] | None = None) -> list[torch.Tensor]:
    """Token ids of held-out stdlib files: up to `per_file` consecutive windows of `window` tokens each (the
    demo model was trained on 256-token windows), from each file present here."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in files or HELD_OUT:
        path = root / name
        if path.is_file():
            ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids[0]
            out += [ids[i * window : (i + 1) * window] for i in range(min(per_file, ids.numel() // window))]
    return out


def measure(
    model,
    tokenizer,
    kv_dtypes: list[str | None],
    prompts: list[str],
    new_tokens: int = 32,
    ppl_window: int = 256,
    ppl_windows_per_file: int = 4,
    ppl_chunk: int = 64,
    ppl_files: list[str] | None = None,
) -> dict[str | None, Accuracy]:
    """Accuracy of every `kv_dtype` (None = the unquantized reference, measured too for its perplexity)."""
    results = {kv: Accuracy(kv) for kv in kv_dtypes}
    refs = [greedy(model, tokenizer, p, None, new_tokens) for p in prompts]
    prompt_ids = [tokenizer([p], return_tensors="pt").input_ids[0] for p in prompts]
    ref_logits = [forced_logits(model, torch.cat([ids, ref]), ids.numel(), None) for ids, ref in zip(prompt_ids, refs)]
    texts = held_out_texts(tokenizer, ppl_window, ppl_windows_per_file, ppl_files)
    for kv, acc in results.items():
        errors, agree, steps = [], 0, 0
        for prompt, ids, ref, ref_l in zip(prompts, prompt_ids, refs, ref_logits, strict=True):
            got = ref if kv is None else greedy(model, tokenizer, prompt, kv, new_tokens)
            diff = (got != ref).nonzero()
            acc.first_divergence.append(int(diff[0]) if diff.numel() else new_tokens)
            acc.identical += int(not diff.numel())
            acc.prompts += 1
            logits = ref_l if kv is None else forced_logits(model, torch.cat([ids, ref]), ids.numel(), kv)
            per_step = (logits - ref_l).abs().amax(dim=-1)
            errors.append(per_step)
            agree += int((logits.argmax(-1) == ref_l.argmax(-1)).sum())
            steps += per_step.numel()
        all_errors = torch.cat(errors)
        acc.max_logit_error = float(all_errors.max())
        acc.mean_step_max_logit_error = float(all_errors.mean())
        acc.step_top1_agreement = agree / steps
        nll = [chunked_nll(model, ids, kv, ppl_chunk) for ids in texts]
        total, count = sum(n for n, _ in nll), sum(c for _, c in nll)
        acc.ppl = math.exp(total / count) if count else float("nan")
    return results


def table(results: dict[str | None, Accuracy], new_tokens: int) -> str:
    """A markdown table of the results."""
    base = results.get(None)
    lines = [
        f"| kv_dtype | greedy identical ({new_tokens} tokens) | first divergence (median) | max logit err | "
        "mean per-step max logit err | step top-1 agree | ppl | ppl vs unquantized |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kv, a in results.items():
        median = sorted(a.first_divergence)[len(a.first_divergence) // 2] if a.first_divergence else 0
        rel = f"{100 * (a.ppl / base.ppl - 1):+.2f}%" if base is not None and base.ppl == base.ppl else "n/a"
        lines.append(
            f"| {kv or 'model dtype'} | {a.identical}/{a.prompts} | {median} | {a.max_logit_error:.4f} | "
            f"{a.mean_step_max_logit_error:.4f} | {100 * a.step_top1_agreement:.1f}% | {a.ppl:.3f} | {rel} |"
        )
    return "\n".join(lines)


@torch.inference_mode()
def granularity_errors(model, tokenizer, tokens: int = 512, block_size: int = 16) -> dict[str, dict[str, float]]:
    """Relative RMS error of K and V (all layers) of a held-out text quantized with one scale per token and KV
    head (what the pool stores) vs one scale per block of `block_size` tokens and KV head, per storage dtype.

    Returns:
        `{"int8/token": {"K": err, "V": err}, "int8/block": {...}, ...}`.
    """
    from hf_paged.memory import quant  # noqa: PLC0415

    ids = held_out_texts(tokenizer, tokens)[0]  # a window of `tokens` tokens
    cache = hf_paged.PagedCache()
    model(input_ids=ids[None], **hf_paged.cache_kwargs(cache), use_cache=True)
    out: dict[str, dict[str, float]] = {}
    for name in quant.KV_DTYPES:
        storage = quant.kv_format(name).storage_dtype
        for granularity in ("token", "block"):
            errors = {}
            for which in ("keys", "values"):
                num = den = 0.0
                for layer in cache.layers:
                    x = getattr(layer, which)[0].transpose(0, 1)  # [seq, num_kv_heads, head_dim]
                    if granularity == "token":
                        y = quant.fake_quantize(x, storage)
                    else:  # one scale per block and head: quantize the block's tokens as one vector per head
                        n = x.shape[0] // block_size * block_size
                        blocks = x[:n].reshape(-1, block_size, *x.shape[1:]).transpose(1, 2)
                        flat = blocks.reshape(*blocks.shape[:2], -1)  # [blocks, heads, block_size * head_dim]
                        y = quant.fake_quantize(flat, storage).reshape(blocks.shape).transpose(1, 2).reshape(n, *x.shape[1:])
                        x = x[:n]
                    num += float(((y - x) ** 2).sum())
                    den += float((x**2).sum())
                errors[which[0].upper()] = math.sqrt(num / den)
            out[f"{name}/{granularity}"] = errors
    return out
