"""Tests of the shipped demo model (``hf_paged.demo_model``) and of the script that trains it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_paged.demo_model import DEMO_MODEL_PATH, load_demo_model

MAX_BYTES = 12_000_000
SNIPPET = (
    "import os\n\n\nclass Foo(Bar):\n    \"\"\"Doc — ünïcode.\"\"\"\n\n"
    "    def f(self, x: int = 3) -> list[str]:\n\t\treturn [str(i) for i in range(x)]  # done\n"
)


@pytest.fixture(scope="module")
def demo():
    """The shipped model and tokenizer, loaded once."""
    return load_demo_model()


def test_shipped_files_and_size() -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (DEMO_MODEL_PATH / name).is_file(), name
    total = sum(f.stat().st_size for f in DEMO_MODEL_PATH.iterdir() if f.is_file())
    assert total <= MAX_BYTES, total


def test_config_meets_spec() -> None:
    cfg = AutoConfig.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)
    assert cfg.model_type == "llama"
    assert cfg.num_attention_heads > cfg.num_key_value_heads >= 1
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim >= 64
    assert cfg.max_position_embeddings >= 4096
    assert cfg.tie_word_embeddings
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id
    gen = json.loads((DEMO_MODEL_PATH / "generation_config.json").read_text())
    assert gen["do_sample"] is False and gen["eos_token_id"] == cfg.eos_token_id


def test_auto_classes_load_offline(demo) -> None:
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    assert model.dtype == torch.float32
    assert not demo[0].training


def test_tokenizer_round_trip(demo) -> None:
    _, tok = demo
    ids = tok(SNIPPET)["input_ids"]
    assert tok.eos_token_id not in ids  # nothing is added automatically
    assert tok.decode(ids) == SNIPPET
    assert tok.padding_side == "left"
    assert tok.pad_token_id == tok.eos_token_id == tok.bos_token_id


def test_greedy_generation_is_deterministic(demo) -> None:
    model, tok = demo
    enc = tok("def ", return_tensors="pt")
    a = model.generate(**enc, max_new_tokens=8, do_sample=False)
    b = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert a.shape[1] > enc["input_ids"].shape[1]
    assert torch.equal(a, b)


def test_left_padded_batch_matches_single(demo) -> None:
    model, tok = demo
    prompts = ["import os\n", "class Foo:\n    def "]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch["input_ids"].shape[1] :]
    for row, prompt in zip(out, prompts):
        enc = tok(prompt, return_tensors="pt")
        single = model.generate(**enc, max_new_tokens=6, do_sample=False)[0, enc["input_ids"].shape[1] :]
        assert row[: single.numel()].tolist() == single.tolist()


def test_load_demo_model_dtype() -> None:
    model, _ = load_demo_model(dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16


def _run_train(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "hf_paged.demo_model.train", "--out", str(out), "--tiny", "--max-files", "20",
           "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--no-progress", "--eval-every", "0", *extra]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)  # a loaded CI machine is slow
    return json.loads((out / "training_report.json").read_text())


def test_train_script_tiny(tmp_path: Path) -> None:
    report = _run_train(tmp_path / "budget", "--minutes", "0.05")
    assert report["steps"] >= 3 and report["corpus_files"] == 20
    for key in ("held_out_loss", "held_out_ppl", "tokens_seen", "train_minutes", "seed", "python_version", "samples"):
        assert key in report
    assert len(report["samples"]) == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "budget", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "budget", local_files_only=True)
    assert tok.padding_side == "left" and tok.pad_token_id == tok.eos_token_id
    out = model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] >= 2


def test_train_script_is_deterministic(tmp_path: Path) -> None:
    r1 = _run_train(tmp_path / "a", "--steps", "3", "--seed", "7")
    r2 = _run_train(tmp_path / "b", "--steps", "3", "--seed", "7")
    assert r1["held_out_loss"] == r2["held_out_loss"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_replanned_schedule_is_continuous() -> None:
    from hf_paged.demo_model.schedule import format_plan, lr_at, parse_plan

    plan = parse_plan("0:100,50:80,60:140")
    assert format_plan(plan) == "0:100,50:80,60:140"
    lrs = [lr_at(s, plan, 10, 1.0) for s in range(0, 141)]
    assert lrs[9] == pytest.approx(1.0) and lrs[140] == pytest.approx(0.1)
    assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay after warmup
    assert max(abs(b - a) for a, b in zip(lrs[10:], lrs[11:])) < 0.05  # no jumps at re-plans
