"""Speculative decoding in `hf_paged.Engine`: prompt lookup vs no speculation on an input-grounded task.

Task: each prompt is a passage of standard-library code (the start of a module's first function, `PASSAGE_CHARS`
characters) followed by its own first line again, so the model is asked to repeat the passage; prompt lookup
drafts the continuation from the prompt (and from the request's own output). The 2.8M-parameter demo model copies
some passages and not others: `MODULES` are the 8 modules (of the 140 with a top-level function in Python 3.11's
standard library) whose passage it repeats best, ranked by output tokens per forward of a request alone with
`prompt_lookup_num_tokens=4` over 64 tokens; the selection is part of the task. Greedy, no EOS, every request
generates `NEW_TOKENS` tokens, so each variant does the same useful work; the outputs of every variant are
checked identical.

Variants, alternated in one run on the same model and prompts (`common.alternate`): `no_speculation`, and
`prompt_lookup_k{k}` (`prompt_lookup_num_tokens=k`) for k in `KS`. The `NUM_PROMPTS` requests run at each
concurrency of `CONCURRENCY` (`Engine(max_seqs=c)`). Rows: `output_tokens_per_s` per variant, `speedup`
(tokens/s over `no_speculation`'s, median of the per-round ratios), `acceptance_rate` (accepted / drafted, from
`engine.stats()`) and `tokens_per_step` (output tokens per forward).

    .venv/bin/python -m benchmarks.bench_spec                 # = python -m benchmarks.run_all --only spec
    taskset -c 1 chrt -f 50 .venv/bin/python -m benchmarks.bench_spec --threads 1   # steadier on a shared machine
"""

from __future__ import annotations

import statistics
import sys

from transformers import AutoTokenizer

import hf_paged
from hf_paged.demo_model.corpus import stdlib_root

from .common import Suite, alternate

NAME = "spec"
#: Modules whose first function starts a passage (the Python standard library of the running interpreter), chosen
#: where the demo model copies (see the module docstring); a module the interpreter lacks gives a filler passage.
MODULES = ["gzip.py", "glob.py", "runpy.py", "pprint.py", "asynchat.py", "selectors.py", "pickle.py", "rlcompleter.py"]
PASSAGE_CHARS = 300
NUM_PROMPTS = 8
NEW_TOKENS = 96
KS = [4, 8]
CONCURRENCY = [1, 4, 8]
REPEATS = 3


def make_prompts(suite: Suite, num: int) -> list[list[int]]:
    """Passage + its first line again, tokenized (the shipped tokenizer, or byte values for a random model)."""
    passages = []
    for name in MODULES:
        path = stdlib_root() / name
        text = path.read_text() if path.is_file() else ""
        start = max(text.find("\ndef "), 0)
        passages.append(text[start + 1 : start + 1 + PASSAGE_CHARS] or name * 20)
    try:
        tokenizer = AutoTokenizer.from_pretrained(suite.model_path, local_files_only=True)
        encode = tokenizer.encode
    except (OSError, ValueError):
        encode = lambda s: [b % suite.config.vocab_size for b in s.encode()]  # noqa: E731
    return [encode(p + "\n\n" + p.splitlines()[0]) for p in passages[:num]]


def run(suite: Suite, progress) -> None:
    num, new_tokens = suite.pick(NUM_PROMPTS, 3), suite.pick(NEW_TOKENS, 12)
    prompts = make_prompts(suite, num)
    ks = suite.pick(KS, [4])
    suite.notes["spec_task"] = (
        f"{num} prompts of {PASSAGE_CHARS} characters of stdlib code + its first line (mean "
        f"{statistics.mean(map(len, prompts)):.0f} tokens), {new_tokens} greedy tokens each, on the {suite.model_name}"
    )
    for concurrency in progress(suite.pick(CONCURRENCY, [2]), desc="speculative decoding"):
        outputs: dict[str, list[list[int]]] = {}

        def variant(name: str, k: int | None):
            def once() -> dict[str, float]:
                engine = hf_paged.Engine(suite.paged_model, max_batch_tokens=1024, max_seqs=concurrency)
                extra = {} if k is None else {"prompt_lookup_num_tokens": k}
                start = _now()
                out = engine.generate(prompts, max_new_tokens=new_tokens, progress=False, **extra)
                wall = _now() - start
                outputs.setdefault(name, out)
                stats = engine.stats()
                return {
                    "output_tokens_per_s": sum(map(len, out)) / wall,
                    "acceptance_rate": stats.acceptance_rate,
                    "tokens_per_step": stats.generated_tokens / stats.steps,
                }

            return once

        variants = {"no_speculation": variant("no_speculation", None)}
        variants.update({f"prompt_lookup_k{k}": variant(f"prompt_lookup_k{k}", k) for k in ks})
        results = alternate(variants, suite.pick(REPEATS, 1), warmup=suite.pick(1, 0))
        base = results["no_speculation"]
        for name, rounds in results.items():
            assert outputs[name] == outputs["no_speculation"], f"{name}: greedy output differs from no speculation"
            for metric, unit in (("output_tokens_per_s", "tokens/s"), ("acceptance_rate", ""), ("tokens_per_step", "tokens")):
                suite.add(NAME, metric, name, "concurrency", concurrency, [r[metric] for r in rounds], unit)
            ratios = [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(rounds, base, strict=True)]
            suite.add(NAME, "speedup", name, "concurrency", concurrency, ratios, "x")


def summary_rows(suite: Suite) -> list[tuple[str, str, str, str]]:
    """Headline rows for `run_all`'s table: per concurrency, the best k's tokens/s, speedup and acceptance."""
    out = []
    for c in sorted({r.x for r in suite.rows if r.benchmark == NAME}, key=float):
        rows = [r for r in suite.rows if r.benchmark == NAME and r.metric == "speedup" and r.x == c]
        best = max((r for r in rows if r.variant != "no_speculation"), key=lambda r: r.p50, default=None)
        if best is None:
            continue
        spec, base = (suite.get(NAME, "output_tokens_per_s", v, c) for v in (best.variant, "no_speculation"))
        rate = suite.get(NAME, "acceptance_rate", best.variant, c)
        figure = f"speculative decoding, concurrency {c}: output tokens/s"
        comparison = f"{best.p50:.2f}x; acceptance {rate.p50:.2f}"
        out.append((figure, f"{best.variant} {spec.p50:.3g}", f"no speculation {base.p50:.3g}", comparison))
    return out


def _now() -> float:
    import time  # noqa: PLC0415

    return time.perf_counter()


if __name__ == "__main__":
    from .run_all import main

    raise SystemExit(main(["--only", NAME, *sys.argv[1:]]))
