"""Train the small demo model that hf-paged ships, end to end, from nothing but the local Python install.

Usage::

    python -m hf_paged.demo_model.train --out DIR [--minutes M] [--threads N] [--seed S] [--steps K]

Pipeline (every stage is seeded / deterministically ordered):

1. **Corpus** - the source text of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``, ``**/*.py``), visited in sorted order, skipping test suites
   (``test/``, ``tests/``), ``idlelib``, ``lib2to3``, ``site-packages``/``dist-packages``,
   ``pydoc_data``, files larger than :data:`MAX_FILE_BYTES` and machine-generated files (codec
   tables made by ``gencodec.py`` and anything announcing itself as generated). A fixed ~2% of the
   files - those whose SHA-1 of the relative path sorts first - is held out for validation; the
   split does not depend on the seed.
2. **Tokenizer** - byte-level BPE trained with the ``tokenizers`` library on the training files
   only. The single special token ``<|endoftext|>`` (id 0) is bos, eos *and* pad
   (``pad_token_id == eos_token_id``): callers must pass an explicit ``attention_mask`` when they
   pad. Padding side is ``left`` because generation batches are left-padded. No token is added
   automatically when encoding.
3. **Model** - a randomly initialised (seeded) ``LlamaForCausalLM``: GQA (4 query heads sharing 2
   KV heads), ``head_dim`` 64, RoPE, ``max_position_embeddings`` 4096, tied input/output
   embeddings, 4 layers; sized so that the float32 safetensors file plus tokenizer files stay
   under 12 MB.
4. **Training** - on CPU: every file is encoded and followed by ``<|endoftext|>``, the files are
   concatenated into one token stream, cut into windows of ``--seq-len`` tokens, and the windows
   are visited in a seeded random order (a fresh permutation and a fresh window offset per epoch).
   AdamW, linear warmup then cosine decay to 10% of the peak LR, gradient clipping at 1.0.
   ``--minutes`` is a wall-clock budget for the optimisation loop: the warmup steps (whose LR does
   not depend on the total) are timed to plan the total number of steps, and every
   ``--replan-every`` steps the plan is revised from the recent step rate (the CPU is shared), in a
   way that keeps the LR continuous. The data order depends only on the seed; the LR schedule only
   on the recorded plan. ``training_report.json`` holds a ``reproduce`` command
   (``--plan S0:T0,S1:T1,...`` or ``--steps K``) that replays the run without any timing - bit-exact
   on the same CPU, thread count and library versions.
5. **Outputs** in ``--out``: ``model.safetensors`` + ``config.json``, ``generation_config.json``
   (greedy, ``max_new_tokens=64``), ``tokenizer.json`` + ``tokenizer_config.json`` and
   ``training_report.json`` (held-out loss and perplexity, steps, tokens seen, timings, seed,
   corpus statistics, Python/library versions and three greedy samples with their top-1 logit
   margins).

Each stage lives in its own module of this package: :mod:`.corpus`, :mod:`.tokenizer`,
:mod:`.model`, :mod:`.schedule` (data order and LR schedule), :mod:`.loop` (the optimisation
loop) and :mod:`.evaluation`; this module holds the command line and writes the outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from .corpus import collect_corpus, split_corpus, stdlib_root
from .evaluation import SAMPLE_PROMPTS, evaluate, greedy_samples
from .loop import run_training
from .model import TINY_SPEC, ModelSpec, build_model, count_parameters
from .schedule import format_plan
from .tokenizer import encode_stream, train_tokenizer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line interface of the training script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory (created)")
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget of the training loop")
    p.add_argument(
        "--steps", type=int, default=None, help="number of optimiser steps (skips timing; cosine ends there unless --plan)"
    )
    p.add_argument(
        "--plan", default=None, help="replay a schedule plan 'S0:T0,S1:T1,...' from a training report (skips timing)"
    )
    p.add_argument("--replan-every", type=int, default=50, help="steps between budget re-plans (0: plan once)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (and tokenizer threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=40, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200, help="steps between quick held-out evals (0: off)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (tests)")
    p.add_argument("--tiny", action="store_true", help="tiny model/vocab for tests (not the shipped spec)")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm bar")
    return p.parse_args(argv)


def _spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model spec selected by ``--tiny`` and the per-field overrides."""
    spec = ModelSpec(**asdict(TINY_SPEC)) if args.tiny else ModelSpec()
    for field, value in (
        ("vocab_size", args.vocab_size),
        ("hidden_size", args.hidden_size),
        ("intermediate_size", args.intermediate_size),
        ("num_hidden_layers", args.layers),
    ):
        if value is not None:
            setattr(spec, field, value)
    return spec


def _reproduce_command(args: argparse.Namespace, plan: Sequence[tuple[int, int]], steps: int) -> str:
    """Command line that repeats this run exactly: its non-default options plus its schedule plan."""
    defaults = vars(parse_args(["--out", "x"]))
    parts = ["python -m hf_paged.demo_model.train", f"--out {args.out}", f"--threads {args.threads}", f"--seed {args.seed}"]
    for key, value in vars(args).items():
        if key in {"out", "threads", "seed", "minutes", "steps", "plan", "replan_every", "no_progress"}:
            continue
        if value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    if len(plan) == 1 and plan[0][1] == steps:
        parts.append(f"--steps {steps}")
    else:
        parts.append(f"--plan {format_plan(plan)}")
        if not plan or plan[-1][1] != steps:
            parts.append(f"--steps {steps}")
    return " ".join(parts)


def _dir_size(path: Path) -> int:
    """Total size in bytes of the regular files directly inside ``path``."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the whole pipeline; return (and write) the training report."""
    args = parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if args.threads == 1 else "true")
    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm
    import tokenizers
    import transformers
    from transformers import GenerationConfig

    transformers.logging.set_verbosity_error()
    spec = _spec_from_args(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        tqdm.write(f"[train {time.time() - t_start:7.1f}s] {msg}", file=sys.stderr)

    # 1. corpus
    files = collect_corpus(max_files=args.max_files)
    train_files, val_files = split_corpus(files)
    log(
        f"corpus: {len(files)} files ({sum(len(t) for _, t in files) / 1e6:.2f} M chars) from {stdlib_root()}; "
        f"{len(train_files)} train / {len(val_files)} held out"
    )

    # 2. tokenizer
    tokenizer = train_tokenizer([t for _, t in train_files], spec.vocab_size, spec.max_position_embeddings)
    spec.vocab_size = len(tokenizer)
    eos_id = tokenizer.eos_token_id
    train_stream = encode_stream(tokenizer, [t for _, t in train_files])
    val_stream = encode_stream(tokenizer, [t for _, t in val_files])
    chars = sum(len(t) for _, t in train_files)
    log(
        f"tokenizer: vocab {spec.vocab_size}, eos/bos/pad id {eos_id}; train {train_stream.numel()} tokens "
        f"({chars / train_stream.numel():.2f} chars/token), held-out {val_stream.numel()} tokens"
    )

    # 3. model
    model = build_model(spec, eos_id, args.seed)
    n_params = count_parameters(model)
    log(f"model: {asdict(spec)}; {n_params:,} parameters")

    # 4. training
    run = run_training(model, train_stream, val_stream, args, log)

    # held-out evaluation
    val_loss, val_tokens = evaluate(model, val_stream, args.seq_len, args.batch_size)
    log(f"held-out: loss {val_loss:.4f} nats/token, ppl {math.exp(val_loss):.2f} over {val_tokens} tokens")

    # 5. save
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        max_new_tokens=64,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)  # safetensors writes 0600; shipped package data must be world-readable
    samples = greedy_samples(model, tokenizer, SAMPLE_PROMPTS, max_new_tokens=64)
    for s in samples:
        log(f"sample {s['prompt']!r} (min margin {s['min_top1_margin']:.3f}):\n{s['prompt']}{s['completion']}")

    report = {
        "held_out_loss": round(val_loss, 5),
        "held_out_ppl": round(math.exp(val_loss), 4),
        "held_out_tokens": val_tokens,
        "held_out_files": [name for name, _ in val_files],
        "final_train_loss_ema": round(run.loss_ema, 5) if run.loss_ema is not None else None,
        "steps": run.steps,
        "plan": format_plan(run.plan),
        "stopped_early": run.stopped_early,
        "tokens_seen": run.tokens_seen,
        "epochs": round(run.tokens_seen / max(1, train_stream.numel()), 3),
        "train_minutes": round(run.train_s / 60.0, 3),
        "total_minutes": round((time.time() - t_start) / 60.0, 3),
        "budget_minutes": args.minutes,
        "seed": args.seed,
        "threads": args.threads,
        "corpus_files": len(files),
        "train_files": len(train_files),
        "train_tokens": int(train_stream.numel()),
        "corpus_root": str(stdlib_root()),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "parameters": n_params,
        "model_spec": asdict(spec),
        "hyperparameters": {
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "peak_lr": args.lr,
            "min_lr_ratio": 0.1,
            "warmup_steps": run.warmup_steps,
            "weight_decay": args.weight_decay,
            "betas": [0.9, 0.95],
            "grad_clip": 1.0,
        },
        "quick_evals": run.quick_evals,
        "samples": samples,
        "reproduce": _reproduce_command(args, run.plan, run.steps),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved to {out} ({_dir_size(out) / 1e6:.2f} MB)")
    return report


if __name__ == "__main__":
    main()
