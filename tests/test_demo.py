"""The README's demo command and greedy parity on the shipped model (issue 7 acceptance)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.tools.demo import PROMPTS, format_table, Row
from hf_paged.demo_model import DEMO_MODEL_PATH, load_demo_model

PARITY_PROMPTS = [
    "def ", "import os\n", "class ", "for i in range(", "    return ", "if __name__ == ", "try:\n    ",
    "with open(", "def __init__(self", "raise ValueError(", "# Copyright", "from collections import ",
    "self._", "while True:\n", "print(", "lambda x: ", "assert ", "elif ", "except ", "yield ",
]


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_demo_model()
    return model, tokenizer


def test_demo_command_runs_end_to_end():
    out = subprocess.run(
        [sys.executable, "-m", "hf_paged", "demo", "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "identical greedy text: yes" in out.stdout
    assert "PagedCache + paged" in out.stdout and "DynamicCache + sdpa" in out.stdout
    assert "prefix hits" in out.stdout
    assert "warm/cold TTFT" in out.stdout


def test_demo_refuses_a_bad_model_path(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "hf_paged", "demo", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=300,
    )
    assert missing.returncode == 2 and "no model directory at" in missing.stderr
    assert "Traceback" not in missing.stderr
    empty = subprocess.run(  # a directory without a model in it
        [sys.executable, "-m", "hf_paged", "demo", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert empty.returncode != 0
    assert "Could not load a causal LM" in empty.stderr


def test_format_table_aligns_columns():
    table = format_table([Row("a", 2.0, 10, 2**20, 2**21), Row("longer name", 1.0, 10, 0, 0, "3", "1", "16")])
    lines = table.splitlines()
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1
    assert "5.0" in lines[2] and "10.0" in lines[3]


@pytest.mark.parametrize("batched", [True, False], ids=["batch", "single"])
def test_greedy_parity_on_the_shipped_model(demo, batched):
    model, tokenizer = demo
    generated_paged, generated_ref = [], []
    groups = [PARITY_PROMPTS] if batched else [[p] for p in PARITY_PROMPTS]
    for prompts in groups:
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        kw = dict(**inputs, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        model.set_attn_implementation("sdpa")
        generated_ref.append(model.generate(**hf_paged.cache_kwargs(DynamicCache()), **kw))
        model.set_attn_implementation("paged")
        cache = hf_paged.PagedCache()
        generated_paged.append(model.generate(**hf_paged.cache_kwargs(cache), **kw))
        cache.pool.check()
    for paged, ref in zip(generated_paged, generated_ref, strict=True):
        assert torch.equal(paged, ref)
    assert len(PARITY_PROMPTS) == 20 and len(PROMPTS) >= 3
