"""Quantized K/V accuracy on a few families of the model matrix (tiny random models with peaked logits, as the
tests build them): `python -m benchmarks.quant_matrix [--prompts 8] [--tokens 16]`.

Per family and kv_dtype: prompts whose greedy tokens are identical to the unquantized cache's, and the max
|logit difference| over teacher-forced decode steps along the unquantized continuation, relative to the
largest |logit| (these models' logits reach the hundreds, so absolute errors are not comparable with the
shipped model's).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import hf_paged  # noqa: E402
from tests.matrix import MODELS, load, saved_case  # noqa: E402

FAMILIES = ("llama", "qwen2", "gemma2", "phi3", "gpt2", "gpt_oss")
KV_DTYPES = (None, "int8", "fp8_e4m3", "fp8_e5m2")


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor, kv_dtype: str | None, tokens: int) -> torch.Tensor:
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    out = model.generate(input_ids=ids, **hf_paged.cache_kwargs(cache), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :]


@torch.inference_mode()
def _forced(model, ids: torch.Tensor, kv_dtype: str | None) -> torch.Tensor:
    """`[steps, vocab]` logits: prefill of all but the last 16 tokens, then one decode step per token."""
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    kw = hf_paged.cache_kwargs(cache)
    start = ids.shape[1] - 16
    steps = [model(input_ids=ids[:, :start], **kw, use_cache=True).logits[0, -1].float()]
    for t in range(start, ids.shape[1]):
        steps.append(model(input_ids=ids[:, t : t + 1], **kw, use_cache=True).logits[0, -1].float())
    return torch.stack(steps)


def measure(family: str, prompts: int, tokens: int) -> dict[str | None, tuple[int, float]]:
    case = next(c for c in MODELS if c.model_type == family and c.expect == "pass")
    model = load(saved_case(case), "paged")
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, 128, (1, int(n)), generator=gen) for n in torch.randint(8, 40, (prompts,), generator=gen)]
    refs = [_greedy(model, ids, None, tokens) for ids in inputs]
    ref_logits = [_forced(model, torch.cat([ids, ref[None]], dim=1), None) for ids, ref in zip(inputs, refs)]
    out = {}
    for kv in KV_DTYPES:
        same = sum(torch.equal(_greedy(model, ids, kv, tokens), ref) for ids, ref in zip(inputs, refs, strict=True))
        rel = max(
            float((_forced(model, torch.cat([ids, ref[None]], dim=1), kv) - rl).abs().max() / rl.abs().max())
            for ids, ref, rl in zip(inputs, refs, ref_logits, strict=True)
        )
        out[kv] = (same, rel)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"| family | kv_dtype | greedy identical ({args.tokens} tokens) | max logit err / max logit |")
    print("|---|---|---|---|")
    for family in args.families:
        for kv, (same, rel) in measure(family, args.prompts, args.tokens).items():
            if kv is not None:
                print(f"| {family} | {kv} | {same}/{args.prompts} | {rel:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
