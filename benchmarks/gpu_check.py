"""The one GPU check: `make gpu-check`.

    python -m benchmarks.gpu_check [--out DIR] [--skip tests,kernel-tests,doctor,generate,graphs,kernel-bench,launch]

Runs, in order, each step, and keeps going when one fails:
  1. `pytest -m gpu` - the GPU tests (kernels vs the reference on the device, generate() with PagedCache, the
     Engine eager and with CUDA graphs),
  2. the kernel tests that `make test` runs under the interpreter, here with the kernels compiled on the GPU,
  3. `python -m hf_paged doctor` - versions, backend, every kernel vs the PyTorch path, bandwidth,
  4. end-to-end `generate()` on a ~1.1B-parameter Llama built from a config (random weights, bf16):
     PagedCache + "paged" vs DynamicCache + "sdpa" vs StaticCache + "sdpa", alternating, same prompts,
  5. the compiled decode step on the same model: `Engine(compile="reduce-overhead")` (CUDA graphs replayed per
     batch bucket) vs the eager `Engine` vs `generate()` with StaticCache + `torch.compile` ("reduce-overhead"),
     decode tokens/s per batch size (`--graph-batches`), and whether the compiled engine's tokens equal the eager
     engine's.
  6. `python -m benchmarks.kernel_bench --quick` - decode bandwidth / prefill TFLOP/s vs SDPA,
  7. `python -m benchmarks.bench_launch` - host time per call of the Triton path's entry points and launcher,
Writes `gpu_check.csv` (one row per measurement), each step's log, and `summary.md` to --out, after every step.
Exits 0 when every step passed, 1 otherwise; without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "kernel-tests", "doctor", "generate", "graphs", "kernel-bench", "launch")
#: The kernel tests that `make test` runs under the interpreter, run on the GPU (those of the ahead-of-time compile,
#: the interpreter's fallback and the CPU benchmark smoke test are about the CPU session).
KERNEL_TESTS = ["tests/kernels/test_paged_attention.py", "tests/kernels/test_head_dims.py",
                "tests/kernels/test_quantized_kernels.py", "tests/kernels/test_cache_kernels.py",
                "tests/kernels/test_repeated_launches.py", "-m", "not gpu"]
#: ~1.1B parameters: Llama-3.2-1B-like widths, 16 layers, GQA 4 (32 query / 8 KV heads, head_dim 64).
LLAMA_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False,
)
FIELDS = ["step", "metric", "variant", "value", "unit", "detail", "device", "versions", "date"]


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _versions() -> str:
    import transformers  # noqa: PLC0415

    try:
        import triton  # noqa: PLC0415

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton_version}"


def run_step(name: str, command: list[str], out: Path, timeout: int, env: dict[str, str] | None = None
             ) -> tuple[bool, float, str]:
    """Run one command (with `env` added to the environment), log its output to `out/<name>.log`; (passed,
    seconds, last lines)."""
    start = time.perf_counter()
    print(f"== {name}: {' '.join(command)} (limit {timeout}s)", flush=True)
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        text, passed = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as error:
        text = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        text += f"\nTIMEOUT after {timeout}s"
        passed = False
    seconds = time.perf_counter() - start
    (out / f"{name}.log").write_text(text)
    tail = "\n".join(text.strip().splitlines()[-12:])
    print(tail, flush=True)
    print(f"== {name}: {'passed' if passed else 'FAILED'} in {seconds:.0f}s", flush=True)
    return passed, seconds, tail


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The fraction of `want`'s tokens that `got` reproduces before its first difference, row by row: on random
    weights in bf16, near-tied logits flip under another summation order, and every token after a flip differs."""
    kept = 0
    for a, b in zip(got, want, strict=True):
        kept += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return kept / max(1, sum(len(b) for b in want))


def generate_benchmark(
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    *,
    device: str = "cuda",
    config_kwargs: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """End-to-end generate() on a ~1B Llama (random weights, bf16): time, tokens/s, peak memory per variant
    (`device`/`config_kwargs`/`dtype` exist so the CPU test can run the same code on a tiny model)."""
    import hf_paged  # noqa: PLC0415
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: PLC0415

    device = torch.device(device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    config = LlamaConfig(**(config_kwargs or LLAMA_1B))
    with device:
        model = LlamaForCausalLM(config).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"   model: Llama from config, {params / 1e9:.2f}B parameters, {dtype}, random weights", flush=True)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1::2, : prompt_len // 4] = 0  # left padding on every other row
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def variant(name: str):
        if name == "paged":
            model.set_attn_implementation("paged")
            return hf_paged.PagedCache()
        model.set_attn_implementation("sdpa")
        if name == "dynamic":
            return DynamicCache()
        return StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)

    names = ["paged", "dynamic", "static"]
    seconds: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, int] = {}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(repeats + 1):  # the first round warms up (Triton compiles, cuBLAS picks)
        order = names[rep % 3 :] + names[: rep % 3]
        for name in order:
            cache = variant(name)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            with torch.inference_mode():
                result = model.generate(**kwargs, **hf_paged.cache_kwargs(cache))
            if cuda:
                torch.cuda.synchronize(device)
            if rep:
                seconds[name].append(time.perf_counter() - start)
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated(device) if cuda else 0)
            tokens[name] = result[:, prompt_len:].cpu()
            del cache
    rows = []
    base = statistics.median(seconds["dynamic"])
    for name in names:
        median = statistics.median(seconds[name])
        detail = f"batch {batch}, prompt {prompt_len} (every other row left-padded by {prompt_len // 4}), {new_tokens} new"
        rows.append(dict(step="generate", metric="seconds", variant=name, value=f"{median:.4f}", unit="s", detail=detail))
        rows.append(dict(step="generate", metric="tokens_per_s", variant=name,
                         value=f"{batch * new_tokens / median:.1f}", unit="tok/s", detail=detail))
        rows.append(dict(step="generate", metric="time_vs_dynamic", variant=name, value=f"{median / base:.3f}",
                         unit="x", detail=detail))
        rows.append(dict(step="generate", metric="peak_memory", variant=name, value=f"{peak[name] / 2**30:.2f}",
                         unit="GiB", detail="torch.cuda.max_memory_allocated, model included"))
        same = agreement(tokens[name].tolist(), tokens["dynamic"].tolist())
        rows.append(dict(step="generate", metric="tokens_before_first_difference", variant=name, value=f"{same:.3f}",
                         unit="fraction", detail="random weights: near-flat logits, bf16 ties may flip"))
        print(f"   {name:8s} {median:.3f}s  {batch * new_tokens / median:8.1f} tok/s  {median / base:.2f}x  "
              f"peak {peak[name] / 2**30:.2f} GiB  tokens before the first difference from dynamic {same:.1%}", flush=True)
    return rows


def graph_benchmark(
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    *,
    device: str = "cuda",
    config_kwargs: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    mode: str = "reduce-overhead",
) -> list[dict]:
    """Decode tokens/s of the compiled engine, the eager engine and StaticCache + `torch.compile` `generate()` on a
    ~1B Llama (random weights), per batch size; each variant warms up once (compiles, records) before its timed run.
    Decode tokens/s counts the tokens after each request's first over the time after the first token."""
    import hf_paged  # noqa: PLC0415
    from transformers import CompileConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    device = torch.device(device)
    torch.manual_seed(0)
    config = LlamaConfig(**(config_kwargs or LLAMA_1B))
    with device:
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("paged")
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen)
        configs = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        detail = f"batch {batch}, prompt {prompt_len}, {new_tokens} new, {dtype}"

        def engine_run(engine) -> tuple[float, list[list[int]]]:
            firsts: dict[int, float] = {}
            tokens: dict[int, list[int]] = {}
            for index, token, _ in engine.stream(prompts.tolist(), configs):
                firsts.setdefault(index, time.perf_counter())
                tokens.setdefault(index, []).append(token)
            end = time.perf_counter()
            return batch * (new_tokens - 1) / (end - min(firsts.values())), [tokens[i] for i in range(batch)]

        results: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for name, engine in (("engine_eager", hf_paged.Engine(model, max_seqs=max(batches))),
                             ("engine_compiled", hf_paged.Engine(model, max_seqs=max(batches), compile=mode))):
            start = time.perf_counter()
            engine_run(engine)  # warm-up (the compiled engine compiles and records every bucket here)
            if name == "engine_compiled":
                rows.append(dict(step="graphs", metric="warm_up_seconds", variant=name,
                                 value=f"{time.perf_counter() - start:.1f}", unit="s",
                                 detail=f"buckets {engine.graphs.buckets}"))
            results[name], outputs[name] = engine_run(engine)
        model.set_attn_implementation("sdpa")
        compile_config = CompileConfig(fullgraph=True, mode=mode)
        compile_config._compile_all_devices = True  # (on CUDA transformers compiles anyway; this also covers CPU)

        def static_run() -> float:
            from .common import StepClock  # noqa: PLC0415

            clock = StepClock()
            with torch.inference_mode():
                model.generate(input_ids=prompts.to(device), attention_mask=torch.ones_like(prompts).to(device),
                               cache_implementation="static", compile_config=compile_config,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               logits_processor=[clock], pad_token_id=0)
            return clock.decode_tokens_per_s(batch)

        static_run()
        results["static_compiled"] = static_run()
        model.set_attn_implementation("paged")
        for name, value in results.items():
            rows.append(dict(step="graphs", metric="decode_tokens_per_s", variant=name, value=f"{value:.1f}",
                             unit="tok/s", detail=detail))
        same = agreement(outputs["engine_compiled"], outputs["engine_eager"])
        rows.append(dict(step="graphs", metric="tokens_before_first_difference", variant="engine_compiled",
                         value=f"{same:.3f}", unit="fraction", detail="random weights: bf16 near-ties may flip"))
        print(f"   batch {batch}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in results.items())
              + f"; compiled engine's tokens before the first difference from the eager one's: {same:.0%}", flush=True)
    return rows


def write_report(out: Path, results: list[tuple[str, bool, float, str]], rows: list[dict]) -> list[str]:
    """Write `gpu_check.csv` and `summary.md` for the steps run so far; the names of the failed steps."""
    stamp = dict(device=_device_name(), versions=_versions(), date=datetime.datetime.now(datetime.UTC).isoformat())
    passed_rows = [dict(step=name, metric="passed", variant="", value=int(passed), unit="bool", detail=f"{seconds:.0f}s")
                   for name, passed, seconds, _ in results]
    with (out / "gpu_check.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows + passed_rows:
            writer.writerow({**row, **stamp})
    lines = [f"# GPU check — {stamp['device']}", "", f"{stamp['versions']}; {platform.platform()}; {stamp['date']}", "",
             "| step | result | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {'passed' if p else 'FAILED'} | {s:.0f} |" for n, p, s, _ in results]
    if rows:
        lines += ["", "generate() (median of alternating repeats) and the compiled engine:", "",
                  "| step | variant | metric | value | unit | detail |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['variant']} | {r['metric']} | {r['value']} | {r['unit']} | {r.get('detail', '')} |"
                  for r in rows]
    failed = [(n, t) for n, p, _, t in results if not p]
    for name, tail in failed:
        lines += ["", f"## {name} failed", "", "```", tail, "```"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return [name for name, _ in failed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to skip, of {','.join(STEPS)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph-batches", default="1,8", help="batch sizes of the 'graphs' step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}). "
              "Run `make gpu-check` on a GPU machine; on CPU use `make test` and `python -m hf_paged doctor`.",
              file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; steps are {STEPS}")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    graph_batches = tuple(int(b) for b in args.graph_batches.split(","))
    started = time.perf_counter()
    results: list[tuple[str, bool, float, str]] = []
    rows: list[dict] = []

    def in_process(name: str, title: str, measure) -> None:
        print(f"== {name}: {title}", flush=True)
        start = time.perf_counter()
        try:
            rows.extend(measure())
            results.append((name, True, time.perf_counter() - start, ""))
        except Exception as error:  # noqa: BLE001 - report and keep the other results
            (out / f"{name}.log").write_text(traceback.format_exc())
            results.append((name, False, time.perf_counter() - start, f"{type(error).__name__}: {error}"))
            print(f"== {name}: FAILED: {type(error).__name__}: {error}", flush=True)

    # The order puts correctness first and the longest step last; the report is rewritten after every step, so a run
    # cut short by a time limit still leaves what it measured.
    # Both test sessions run the kernels compiled; the kernel tests' session also makes its tensors on the GPU
    # (tests/conftest.py: HF_PAGED_TEST_DEVICE). transformers' Hub kernels stay off: the sessions are offline.
    compiled = {"TRITON_INTERPRET": "0", "USE_HUB_KERNELS": "0"}
    on_gpu = {"HF_PAGED_TEST_DEVICE": "cuda"}
    steps = {
        "tests": lambda: results.append(("tests", *run_step(
            "tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"], out, 180, compiled))),
        "kernel-tests": lambda: results.append(("kernel-tests", *run_step(
            "kernel-tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8", *KERNEL_TESTS], out, 180,
            on_gpu))),
        "doctor": lambda: results.append(("doctor", *run_step("doctor", [py, "-m", "hf_paged", "doctor"], out, 150))),
        "generate": lambda: in_process(
            "generate", "~1.1B Llama, PagedCache+paged vs DynamicCache+sdpa vs StaticCache+sdpa",
            lambda: generate_benchmark(args.batch, args.prompt_len, args.new_tokens, args.repeats)),
        "kernel-bench": lambda: results.append(("kernel-bench", *run_step(
            "kernel-bench", [py, "-m", "benchmarks.kernel_bench", "--quick", "--out", str(out / "kernel_bench")],
            out, 180))),
        "launch": lambda: results.append(("launch", *run_step(
            "launch", [py, "-m", "benchmarks.bench_launch", "--out", str(out)], out, 60))),
        "graphs": lambda: in_process(
            "graphs", "~1.1B Llama, Engine(compile='reduce-overhead') vs Engine vs StaticCache + torch.compile",
            lambda: graph_benchmark(graph_batches, args.prompt_len, args.new_tokens)),
    }
    failed: list[str] = []
    for name in STEPS:
        if name not in skip:
            steps[name]()
            failed = write_report(out, results, rows)
    print(f"== done in {time.perf_counter() - started:.0f}s: {len(results) - len(failed)}/{len(results)} steps passed; "
          f"{out / 'summary.md'}, {out / 'gpu_check.csv'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
