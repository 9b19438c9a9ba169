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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

#: The one special token; it serves as bos, eos and pad.
EOS_TOKEN = "<|endoftext|>"
#: Directories (any path component below the stdlib root) that are never part of the corpus.
SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "__pycache__"}
)
#: Files larger than this are skipped (huge single files dominate and are often generated).
MAX_FILE_BYTES = 200_000
#: Markers, searched in the first ~1000 characters, of machine-generated sources.
GENERATED_MARKERS = re.compile(r"generated from|gencodec|automatically generated|auto-generated|do not edit", re.I)
#: Fraction of corpus files held out for validation.
VAL_FRACTION = 0.02
#: Prompts of the greedy samples written into the training report.
SAMPLE_PROMPTS: tuple[str, ...] = ("def ", "import os\n", "class ")


@dataclass
class ModelSpec:
    """Architecture and tokenizer sizes of the model to train."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 320
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0


#: A very small spec for tests (``--tiny``): trains in seconds, does not meet the shipping spec.
TINY_SPEC = ModelSpec(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """Return the directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_generated(text: str) -> bool:
    """Whether a source file announces itself as machine generated."""
    return GENERATED_MARKERS.search(text[:1000]) is not None


def collect_corpus(root: Path | None = None, max_files: int | None = None) -> list[tuple[str, str]]:
    """Collect ``(relative_path, text)`` for the corpus files below ``root``, in sorted path order.

    Args:
        root: directory to scan; defaults to :func:`stdlib_root`.
        max_files: keep only the first ``max_files`` eligible files (for tests).
    """
    root = stdlib_root() if root is None else Path(root)
    out: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or _is_generated(text):
            continue
        out.append((rel.as_posix(), text))
        if max_files is not None and len(out) >= max_files:
            break
    return out


def split_corpus(
    files: Sequence[tuple[str, str]], val_fraction: float = VAL_FRACTION
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split files into (train, validation), deterministically and independently of the seed.

    The ``max(1, round(val_fraction * n))`` files whose SHA-1 of the relative path is smallest are
    held out; both lists keep the input (sorted) order.
    """
    n_val = max(1, round(val_fraction * len(files))) if len(files) > 1 else 0
    ranked = sorted(files, key=lambda f: hashlib.sha1(f[0].encode("utf-8")).hexdigest())
    val_names = {name for name, _ in ranked[:n_val]}
    train = [f for f in files if f[0] not in val_names]
    val = [f for f in files if f[0] in val_names]
    return train, val


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int, model_max_length: int = 4096):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` gets id 0 and is used as bos, eos and pad; padding is on the left.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Encode ``texts`` and concatenate them, each followed by the eos token, into one 1-D stream."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def build_model(spec: ModelSpec, eos_id: int, seed: int):
    """Create a randomly initialised (seeded) float32 ``LlamaForCausalLM`` for ``spec``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        hidden_act="silu",
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_bias=False,
        mlp_bias=False,
        use_cache=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --------------------------------------------------------------------------------------------------
# Data order, schedule, evaluation
# --------------------------------------------------------------------------------------------------


def batch_iterator(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Yield ``(batch_size, seq_len)`` windows of the packed stream in a seeded order, forever.

    Each epoch draws a random start offset in ``[0, seq_len)`` (so window boundaries move between
    epochs) and a random permutation of the windows, both from a generator seeded with ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    n = stream.numel()
    if n < seq_len * batch_size + seq_len:
        raise ValueError(f"token stream ({n} tokens) too short for batch {batch_size} x {seq_len}")
    while True:
        offset = int(torch.randint(0, seq_len, (1,), generator=gen))
        n_windows = (n - offset) // seq_len
        windows = stream[offset : offset + n_windows * seq_len].view(n_windows, seq_len)
        order = torch.randperm(n_windows, generator=gen)
        for i in range(0, n_windows - batch_size + 1, batch_size):
            yield windows[order[i : i + batch_size]]


def parse_plan(text: str) -> list[tuple[int, int]]:
    """Parse a schedule plan ``"S0:T0,S1:T1,..."`` (or a bare total ``"T"``) into ``[(S, T), ...]``."""
    plan: list[tuple[int, int]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        start, _, total = part.rpartition(":")
        plan.append((int(start) if start else 0, int(total)))
    if not plan or any(b[0] < a[0] for a, b in zip(plan, plan[1:])):
        raise ValueError(f"bad plan {text!r}: want increasing 'step:total' pairs")
    return plan


def format_plan(plan: Sequence[tuple[int, int]]) -> str:
    """Inverse of :func:`parse_plan`."""
    return ",".join(f"{s}:{t}" for s, t in plan)


def decay_progress(step: int, warmup_steps: int, plan: Sequence[tuple[int, int]]) -> float:
    """Fraction in ``[0, 1]`` of the cosine decay done at ``step`` under a (re)planned schedule.

    ``plan`` is a list of ``(from_step, total_steps)`` entries: from ``from_step`` on, the remaining
    decay is spread linearly over the steps left until ``total_steps``. Re-planning therefore keeps
    the learning rate continuous, and the schedule is a pure function of the plan, which the
    training report records so that a run can be replayed exactly with ``--plan``.
    """
    if step < warmup_steps or not plan:
        return 0.0
    anchor, done = warmup_steps, 0.0
    total = plan[0][1]
    for start, new_total in plan:
        if start > step:
            break
        if start > anchor:
            done += (1.0 - done) * min(1.0, (start - anchor) / max(1, total - anchor))
            anchor = start
        total = new_total
    return min(1.0, done + (1.0 - done) * (step - anchor) / max(1, total - anchor))


def lr_at(step: int, plan: Sequence[tuple[int, int]], warmup_steps: int, peak_lr: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over ``warmup_steps`` then cosine decay to ``min_ratio * peak_lr`` at the planned end."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = decay_progress(step, warmup_steps, plan)
    return peak_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(
    model, stream: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None = None
) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``stream``.

    Returns ``(mean_loss, n_predicted_tokens)``; the tail shorter than 2 tokens is dropped.
    """
    was_training = model.training
    model.eval()
    data = stream if max_tokens is None else stream[:max_tokens]
    total, count = 0.0, 0
    chunks = [data[i : i + seq_len] for i in range(0, data.numel(), seq_len)]
    chunks = [c for c in chunks if c.numel() >= 2]
    for i in range(0, len(chunks), batch_size):
        group = chunks[i : i + batch_size]
        same = [c for c in group if c.numel() == seq_len]
        rest = [c for c in group if c.numel() != seq_len]
        for batch in ([torch.stack(same)] if same else []) + [c[None] for c in rest]:
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += targets.numel()
    model.train(was_training)
    return total / max(1, count), count


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 64) -> list[dict]:
    """Greedy continuations of ``prompts`` with statistics of the top-1 vs top-2 logit margin."""
    model.eval()
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        res = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = res.sequences[0, enc["input_ids"].shape[1] :]
        margins = []
        for logits in res.logits:
            top2 = torch.topk(logits[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        out.append(
            {
                "prompt": prompt,
                "completion": tokenizer.decode(new, skip_special_tokens=False),
                "new_tokens": int(new.numel()),
                "min_top1_margin": min(margins) if margins else None,
                "median_top1_margin": statistics.median(margins) if margins else None,
            }
        )
    return out


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


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
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = batch_iterator(train_stream, args.seq_len, args.batch_size, args.seed)
    budget_s = args.minutes * 60.0
    warmup = max(1, args.warmup)
    # The schedule plan: fixed by --plan/--steps, otherwise timed during warmup (whose LR does not
    # depend on the total) and re-planned every --replan-every steps from the recent step rate, so
    # that the decay ends on the wall-clock budget even when the shared CPU gets busier or quieter.
    plan: list[tuple[int, int]] | None = None
    if args.plan is not None:
        plan = parse_plan(args.plan)
    elif args.steps is not None:
        plan = [(0, args.steps)]
    fixed_plan = plan is not None
    stop_at = args.steps if args.steps is not None else None  # with --plan, --steps cuts the run short
    step_times: list[float] = []  # wall-clock time at the end of each step
    step, tokens_seen, stopped_early = 0, 0, False
    loss_ema: float | None = None
    quick_evals: list[dict] = []
    model.train()
    t_train = time.time()
    bar = tqdm(
        total=plan[-1][1] if plan else None,
        disable=args.no_progress,
        mininterval=5.0,
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    while plan is None or step < (stop_at if stop_at is not None else plan[-1][1]):
        lr = lr_at(step, plan or [], warmup, args.lr)
        for group in optim.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        tokens_seen += batch.numel()
        loss_val = loss.item()
        loss_ema = loss_val if loss_ema is None else 0.98 * loss_ema + 0.02 * loss_val
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}", refresh=False)
        now = time.time()
        step_times.append(now)
        elapsed = now - t_train
        if not fixed_plan:
            if plan is None and step >= 3 and (step >= warmup or elapsed >= 0.2 * budget_s):
                per_step = (now - step_times[1]) / (step - 2)
                plan = [(0, max(step, int(budget_s / per_step)))]
                bar.total = plan[-1][1]
                log(f"timing: {per_step:.3f} s/step -> {plan[-1][1]} steps for {args.minutes:g} min")
            elif (
                plan is not None
                and args.replan_every
                and step % args.replan_every == 0
                and plan[-1][1] - step > args.replan_every
            ):
                window = min(len(step_times) - 1, 2 * args.replan_every)
                per_step = (now - step_times[-1 - window]) / window
                total = step + max(1, int((budget_s - elapsed) / per_step))
                if abs(total - plan[-1][1]) > 0.02 * plan[-1][1]:
                    plan.append((step, total))
                    bar.total = total
                    log(f"re-plan at step {step}: {per_step:.3f} s/step recently -> {total} steps in all")
        if args.eval_every and step % args.eval_every == 0 and plan is not None and step < plan[-1][1]:
            vl, _ = evaluate(model, val_stream, args.seq_len, args.batch_size, max_tokens=8 * args.seq_len)
            quick_evals.append({"step": step, "val_loss_quick": round(vl, 4), "train_loss_ema": round(loss_ema, 4)})
            log(f"step {step}/{plan[-1][1]}: train loss (ema) {loss_ema:.3f}, quick held-out loss {vl:.3f}, lr {lr:.2e}")
        if not fixed_plan and elapsed > 1.15 * budget_s + 30.0:
            stopped_early = True
            log(f"over budget at step {step}/{plan[-1][1] if plan else '?'}; stopping")
            break
    bar.close()
    train_s = time.time() - t_train

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
        "final_train_loss_ema": round(loss_ema, 5) if loss_ema is not None else None,
        "steps": step,
        "plan": format_plan(plan or []),
        "stopped_early": stopped_early,
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(1, train_stream.numel()), 3),
        "train_minutes": round(train_s / 60.0, 3),
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
            "warmup_steps": warmup,
            "weight_decay": args.weight_decay,
            "betas": [0.9, 0.95],
            "grad_clip": 1.0,
        },
        "quick_evals": quick_evals,
        "samples": samples,
        "reproduce": _reproduce_command(args, plan or [], step),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved to {out} ({_dir_size(out) / 1e6:.2f} MB)")
    return report


if __name__ == "__main__":
    main()
