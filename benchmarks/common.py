"""Shared pieces of the CPU benchmark suite: the model, request traces, alternating timers, percentiles,
memory readings and the long-format CSV.

Every comparison is measured side by side in one run: `alternate()` runs the variants in rotating order
(A B C, B C A, C A B, ...) on the same model and prompts, so slow drifts of a shared machine hit every
variant alike. Memory figures are read from the caches themselves (`stats()`, tensors' `nbytes`).
"""

from __future__ import annotations

import copy
import csv
import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hf_paged import contiguous_cache_bytes
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LogitsProcessor

import hf_paged
from hf_paged.demo_model import DEMO_MODEL_PATH

CSV_COLUMNS = [
    "benchmark", "metric", "variant", "parameter", "x", "p20", "p50", "p80", "unit", "repeats",
    "device", "versions", "date",
]

# The demo model's shape (4 layers, 2 KV heads of head_dim 64): used with random weights until it ships.
DEMO_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=320,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


@dataclass(slots=True)
class Row:
    """One long-format CSV row: a metric of a variant at one parameter value, as p20/p50/p80."""

    benchmark: str
    metric: str
    variant: str
    parameter: str
    x: float | int | str
    p20: float
    p50: float
    p80: float
    unit: str
    repeats: int
    device: str = ""
    versions: str = ""
    date: str = ""


@dataclass
class Suite:
    """State of one run: the two models, the scale (smoke or full), the rows collected so far."""

    paged_model: torch.nn.Module
    sdpa_model: torch.nn.Module
    model_name: str
    model_path: Path
    smoke: bool
    rows: list[Row] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def config(self):
        """The paged model's config: a `KVPool` reads the attention implementation from the config it gets."""
        return self.paged_model.config

    def pick(self, full, smoke):
        """`smoke` in a smoke run, `full` otherwise."""
        return smoke if self.smoke else full

    def add(self, benchmark: str, metric: str, variant: str, parameter: str, x, values, unit: str) -> Row:
        values = [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
        p20, p50, p80 = percentiles(values)
        row = Row(benchmark, metric, variant, parameter, x, p20, p50, p80, unit, len(values))
        self.rows.append(row)
        return row

    def get(self, benchmark: str, metric: str, variant: str, x=None) -> Row | None:
        for row in self.rows:
            if (row.benchmark, row.metric, row.variant) == (benchmark, metric, variant) and (x is None or row.x == x):
                return row
        return None


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """p20, p50, p80 (linear interpolation)."""
    p20, p50, p80 = np.percentile(np.asarray(values, dtype=np.float64), [20, 50, 80])
    return float(p20), float(p50), float(p80)


def alternate(variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 0) -> dict[str, list]:
    """Runs every variant `warmup` times, then `repeats` rounds in rotating order.

    A variant returns None (its wall time is recorded, in seconds) or its own measurement (a number or a
    dict of numbers), recorded as is.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    out: dict[str, list] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = _now()
            value = variants[name]()
            out[name].append(_now() - start if value is None else value)
    return out


def _now() -> float:
    import time  # noqa: PLC0415

    return time.perf_counter()


class StepClock(LogitsProcessor):
    """Records the time of every decoding step (generate calls logits processors once per new token)."""

    def __init__(self) -> None:
        self.start = _now()
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(_now())
        return scores

    @property
    def first_token_s(self) -> float:
        return self.times[0] - self.start

    def decode_tokens_per_s(self, batch: int) -> float:
        """Tokens per second over the steps after the first (prefill excluded)."""
        return batch * (len(self.times) - 1) / (self.times[-1] - self.times[0])


def run_json_process(command: list[str], cwd: Path, env: dict[str, str] | None = None):
    """Runs `command` in a fresh process in `cwd` (with `env`, default this process's) and returns the JSON value
    of the last line it prints: how a benchmark measures in fresh processes. A failed process raises with the end
    of its stderr."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    if done.returncode or not lines:
        what = f"exit status {done.returncode}" if done.returncode else "no result line on stdout"
        raise RuntimeError(f"{' '.join(command)} (in {cwd}) failed ({what}); the end of its stderr:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- model and prompts
def load_suite(smoke: bool) -> Suite:
    """The demo model when its weights exist, else a random Llama of the same shape (saved and loaded back)."""
    if (DEMO_MODEL_PATH / "model.safetensors").is_file():
        path, name = DEMO_MODEL_PATH, "demo model (trained, 4 layers, 2 KV heads x 64, fp32)"
    else:
        path = Path(tempfile.mkdtemp(prefix="hf_paged_bench_")) / "model"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**DEMO_SHAPE)).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(3.0)  # peaked logits, so greedy outputs are comparable
        model.save_pretrained(path)
        name = "random Llama, demo model's shape (4 layers, 2 KV heads x 64, fp32)"
    paged = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=torch.float32).eval()
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    for m in (paged, sdpa):
        m.generation_config.pad_token_id = 0
        m.generation_config.eos_token_id = None
    return Suite(paged, sdpa, name, Path(path), smoke)


def paired_vlms(config, scale: float) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random vision-language model of `config`, its weights scaled by `scale` (peaked logits): `(paged, sdpa)`, the
    same weights loaded with `"paged"` for its language model (sdpa for the rest) and with sdpa everywhere."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    torch.manual_seed(0)
    sdpa = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for param in sdpa.parameters():
            param.mul_(scale)
    impl = {"text_config": "paged", "vision_config": "sdpa", "": "sdpa"}
    paged = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    paged.load_state_dict(sdpa.state_dict())
    return paged, sdpa


def random_prompts(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`: random prompts of the given lengths, left-padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


# Request-length distributions matching the means reported in the vLLM paper (lognormal shapes).
TRACES = {"sharegpt": (161.0, 338.0), "alpaca": (19.0, 58.0)}


def sample_trace(name: str, num: int, seed: int, max_total: int = 2048) -> list[tuple[int, int]]:
    """`num` (input_len, output_len) pairs, lognormal with the trace's means, total clipped to `max_total`."""
    mean_in, mean_out = TRACES[name]
    rng = np.random.default_rng(seed)
    sigma = 0.8
    out = []
    for _ in range(num):
        n_in = max(1, int(rng.lognormal(np.log(mean_in) - sigma**2 / 2, sigma)))
        n_out = max(1, int(rng.lognormal(np.log(mean_out) - sigma**2 / 2, sigma)))
        n_in = min(n_in, max_total - 1)
        out.append((n_in, min(n_out, max_total - n_in)))
    return out


# ---------------------------------------------------------------------------- memory readings
tensor_cache_bytes = contiguous_cache_bytes


def tensor_cache_slots(cache) -> int:
    """Token slots (rows x columns) of the first layer of a DynamicCache/StaticCache."""
    keys = cache.layers[0].keys
    return keys.shape[0] * keys.shape[2]


class PeakRSS:
    """Peak resident memory growth of this process inside the block, in bytes (Linux `VmHWM`, reset
    through `/proc/self/clear_refs`). None where that is unavailable."""

    def __enter__(self) -> PeakRSS:
        self.bytes: int | None = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._before = _status_kb("VmRSS")
        except OSError:
            self._before = None
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            self.bytes = max(0, (_status_kb("VmHWM") - self._before) * 1024)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(key)


# ---------------------------------------------------------------------------- machine and CSV
def machine_info() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return {
        "device": f"cpu: {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "versions": f"hf_paged {hf_paged.__version__}; torch {torch.__version__}; transformers {transformers.__version__}; "
        f"python {platform.python_version()}",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load": load,
    }


def write_csv(rows: list[Row], path: Path, info: dict[str, str], keep_others: bool = False) -> None:
    """Writes `rows` (stamped with `info`'s device, versions and date) as the CSV at `path`. With `keep_others`,
    the rows already there of every benchmark that `rows` does not hold stay as they were, with their own stamps
    (a run of some benchmarks updates their rows only)."""
    kept: list[dict] = []
    if keep_others and path.is_file():
        fresh = {row.benchmark for row in rows}
        with open(path, newline="") as f:
            kept = [record for record in csv.DictReader(f) if record["benchmark"] not in fresh]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
        for row in rows:
            record = asdict(row)
            record.update(device=info["device"], versions=info["versions"], date=info["date"])
            for key in ("p20", "p50", "p80"):
                record[key] = f"{record[key]:.6g}"
            writer.writerow(record)
