"""The float8 rotation's figures in `docs/quantized-kv.md` ("Rotation (float8)"), on the shipped model.

    python -m benchmarks.quant_rotation errors                    # relative RMS error of K, V, scores, outputs
    python -m benchmarks.quant_rotation agreement                 # shipped rotation: 12 / 16 / 116 prompts
    python -m benchmarks.quant_rotation agreement --matrix none   # float8 not rotated (before)
    python -m benchmarks.quant_rotation agreement --matrix qr --keys-only

`agreement` prints, per kv_dtype, greedy agreement (32 tokens) on the first 12 and all 16 `PROMPTS`, the
largest and mean per-step max logit error and the perplexity change (`quant_accuracy.measure`), and greedy
agreement, mean per-step KL(unquantized ‖ quantized) and logit errors on the 12 first `PROMPTS` and on up to
24 `def` / `class` lines of each held-out stdlib file (`held_out_prompts`). `--matrix` swaps the rotation for a
seeded one (`signed`: Hadamard times random signs, `qr`: random orthogonal), `--keys-only` rotates keys and
queries only (as measured; reads through `readback` then are not rotated back: for measuring only);
`--rotate-int8` rotates int8 as well (not shipped).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sysconfig
from pathlib import Path

import torch

import hf_paged
import hf_paged.cache.paged_cache as cache_module
from hf_paged.attention import dispatch
from hf_paged.memory import quant, rotation
from hf_paged.demo_model import load_demo_model

from . import quant_accuracy as qa


def held_out_prompts(per_file: int = 24) -> list[str]:
    """Up to `per_file` distinct `def` / `class` lines (with their newline) of each held-out stdlib file, spread
    evenly over the file."""
    root, out = Path(sysconfig.get_paths()["stdlib"]), []
    for name in qa.HELD_OUT:
        path = root / name
        if not path.is_file():
            continue
        lines = [line for line in path.read_text(errors="replace").splitlines() if re.match(r"^\s*(def|class) ", line)]
        distinct = list(dict.fromkeys(lines))
        out += [line + "\n" for line in distinct[:: max(1, len(distinct) // per_file)][:per_file]]
    return out


def forced_stats(model, tokenizer, prompts: list[str], kv_dtype: str, new_tokens: int = 32) -> dict[str, float]:
    """Greedy agreement, mean KL(unquantized ‖ quantized), mean / max per-step max logit error and top-1
    agreement over teacher-forced steps (`quant_accuracy.forced_logits`)."""
    same, kls, errors, top1 = 0, [], [], []
    for prompt in prompts:
        ids = tokenizer([prompt], return_tensors="pt").input_ids[0]
        ref = qa.greedy(model, tokenizer, prompt, None, new_tokens)
        same += int(torch.equal(qa.greedy(model, tokenizer, prompt, kv_dtype, new_tokens), ref))
        want = qa.forced_logits(model, torch.cat([ids, ref]), ids.numel(), None)
        got = qa.forced_logits(model, torch.cat([ids, ref]), ids.numel(), kv_dtype)
        log_want, log_got = want.log_softmax(-1), got.log_softmax(-1)
        kls.append((log_want.exp() * (log_want - log_got)).sum(-1))
        errors.append((got - want).abs().amax(-1))
        top1.append(got.argmax(-1) == want.argmax(-1))
    errors_all = torch.cat(errors)
    return dict(identical=same, prompts=len(prompts), kl=float(torch.cat(kls).mean()),
                mean_step_max_logit_error=float(errors_all.mean()), max_logit_error=float(errors_all.max()),
                top1=float(torch.cat(top1).float().mean()))  # fmt: skip


def _install(matrix: str, keys_only: bool, rotate_int8: bool) -> None:
    if rotate_int8:
        quant.ROTATED_KV_DTYPES = quant.KV_DTYPES
    if matrix == "none":
        quant.ROTATED_KV_DTYPES = ()
        return
    if matrix != "hadamard":
        gen = torch.Generator().manual_seed(1 if matrix == "signed" else 0)
        build = rotation._build

        def seeded(head_dim: int) -> torch.Tensor:
            if matrix == "signed":
                return (torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1)[:, None] * build(head_dim)
            q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
            return (q * torch.sign(torch.diagonal(r))).float()

        rotation._build = seeded
    if keys_only:
        dispatch.kv_to_storage = lambda fmt, key, value: (rotation.to_storage(key), value)
        dispatch.from_storage = lambda out: out


@torch.inference_mode()
def errors(model, tokenizer, tokens: int = 512) -> None:
    """Relative RMS error of K, V, causal scores `q·k / sqrt(head_dim)` and attention outputs of every layer over
    `tokens` held-out tokens, per kv_dtype, not rotated and rotated."""
    captured = []
    original = dispatch.write_and_attend

    def grab(pool, plan, layer_idx, query, key, value, *args):
        captured.append((query[0].clone(), key[0].clone(), value[0].clone()))  # [heads, seq, head_dim]
        return original(pool, plan, layer_idx, query, key, value, *args)

    cache_module.write_and_attend = grab
    ids = qa.held_out_texts(tokenizer, tokens)[0]
    model(input_ids=ids[None], **hf_paged.cache_kwargs(hf_paged.PagedCache()), use_cache=True)
    cache_module.write_and_attend = original
    for name in quant.KV_DTYPES:
        storage = quant.kv_format(name).storage_dtype
        for rotated in (False, True):
            def fq(x: torch.Tensor) -> torch.Tensor:
                if not rotated:
                    return quant.fake_quantize(x, storage)
                return rotation.from_storage(quant.fake_quantize(rotation.to_storage(x), storage))

            sums = {key: [0.0, 0.0] for key in ("K", "V", "scores", "out")}
            for q, k, v in captured:
                groups, n = q.shape[0] // k.shape[0], q.shape[1]
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                outs = []
                for kk, vv in ((k, v), (fq(k), fq(v))):
                    s = q @ kk.repeat_interleave(groups, 0).transpose(1, 2) / math.sqrt(q.shape[-1])
                    o = torch.softmax(s.masked_fill(~causal, -math.inf), -1) @ vv.repeat_interleave(groups, 0)
                    outs.append((kk, vv, s[:, causal], o))
                for key, want, got in zip(sums, outs[0], outs[1], strict=True):
                    sums[key][0] += float(((got - want) ** 2).sum())
                    sums[key][1] += float((want**2).sum())
            figures = "  ".join(f"{key} {100 * math.sqrt(a / b):.2f}%" for key, (a, b) in sums.items())
            print(f"{name:9} {'rotated' if rotated else 'plain  '}  {figures}", flush=True)


def agreement(model, tokenizer, kv_dtypes: list[str], per_file: int) -> None:
    results = qa.measure(model, tokenizer, [None, *kv_dtypes], qa.PROMPTS, 32)
    held = held_out_prompts(per_file)
    for kv in kv_dtypes:
        acc = results[kv]
        row = dict(kv_dtype=kv, identical_12=sum(d == 32 for d in acc.first_divergence[:12]), identical_16=acc.identical,
                   max_logit_error=acc.max_logit_error, mean_step_max_logit_error=acc.mean_step_max_logit_error,
                   ppl=acc.ppl, ppl_change_pct=100 * (acc.ppl / results[None].ppl - 1),
                   first_12=forced_stats(model, tokenizer, qa.PROMPTS[:12], kv),
                   held_out=forced_stats(model, tokenizer, held, kv))  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["errors", "agreement"])
    parser.add_argument("--matrix", choices=["hadamard", "signed", "qr", "none"], default="hadamard")
    parser.add_argument("--keys-only", action="store_true")
    parser.add_argument("--rotate-int8", action="store_true", help="rotate int8 too (not shipped)")
    parser.add_argument("--kv-dtypes", default="int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--per-file", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_demo_model(attn_implementation="paged")
    if args.what == "errors":
        errors(model, tokenizer)
        return
    _install(args.matrix, args.keys_only, args.rotate_int8)
    agreement(model, tokenizer, args.kv_dtypes.split(","), args.per_file)


if __name__ == "__main__":
    main()
