"""The README's demo command and greedy parity on the shipped model (issue 7 acceptance; issue 28 item 7: the
model's size, a separator between prompt and continuation, alternating timed runs with medians, a ratio and a
verdict)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.tools.demo import PROMPTS, Row, alternate, describe_model, format_table, verdict
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
        [sys.executable, "-m", "hf_paged", "demo", "--max-new-tokens", "12", "--repeats", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "LlamaForCausalLM, 2.8M parameters, 4 layers, float32" in text.splitlines()[0]
    assert "identical greedy text: yes" in text
    assert "PagedCache + paged" in text and "DynamicCache + sdpa" in text
    assert "prefix hits" in text
    assert "warm/cold TTFT" in text
    assert text.count("x the default cache's tokens/s (medians of 2 alternating runs each); ") == 2
    for i, prompt in enumerate(PROMPTS, start=1):  # each prompt, then a separator, then its continuation
        block = text.split(f"--- prompt {i} ---\n", 1)[1]
        assert block.startswith(prompt.rstrip("\n") + f"\n--- continuation {i} (PagedCache) ---\n")


def test_demo_refuses_a_bad_model_path(tmp_path, capsys):
    """`hf_paged.__main__.main` in this process (the command itself runs above): a refusal is a SystemExit, whose
    code is the exit status (a message: printed to stderr, status 1); any other exception, a traceback, fails here."""
    from hf_paged.__main__ import main

    with pytest.raises(SystemExit) as missing:
        main(["demo", "--model", str(tmp_path / "nope")])
    assert missing.value.code == 2 and "no model directory at" in capsys.readouterr().err
    with pytest.raises(SystemExit) as empty:  # a directory without a model in it
        main(["demo", "--model", str(tmp_path)])
    assert empty.value.code not in (0, None)
    assert "Could not load a causal LM" in str(empty.value.code)


def test_format_table_aligns_columns():
    table = format_table([Row("a", [2.0, 1.0, 4.0], 10, 2**20, 2**21), Row("longer name", [1.0], 10, 0, 0, "3", "1", "16")])
    lines = table.splitlines()
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1
    assert "5.0 (2.5-10.0)" in lines[2] and "10.0" in lines[3] and "(" not in lines[3]
    ttft = format_table([Row("a", [0.002, 0.001, 0.004], 1, 0, 0)], ttft=True)
    assert "2.0 ms (1.0-4.0)" in ttft


def test_alternate_warms_up_then_takes_turns():
    calls = []
    results = alternate([lambda: calls.append("a") or len(calls), lambda: calls.append("b") or len(calls)], 3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then the order reversed every other round
    assert [len(seconds) for seconds, _ in results] == [3, 3]
    assert [last for _, last in results] == [7, 8]


def test_verdict_says_faster_only_when_every_run_is():
    slow, fast = Row("ref", [2.0, 2.2, 2.1], 10, 0, 0), Row("paged", [1.0, 1.1, 0.9], 10, 0, 0)
    assert verdict(slow, fast) == ("speed: PagedCache 2.10x the default cache's tokens/s (medians of 3 alternating "
                                   "runs each); PagedCache faster here: every run")
    assert verdict(fast, slow).endswith("0.48x the default cache's tokens/s (medians of 3 alternating runs each); "
                                        "PagedCache slower here: every run")
    overlapping = Row("paged", [1.0, 2.5, 1.9], 10, 0, 0)
    assert verdict(slow, overlapping).endswith("no clear difference here: the runs overlap")


def test_the_demo_counts_the_model_parameters(demo):
    model, _ = demo
    assert "LlamaForCausalLM, 2.8M parameters, 4 layers, float32" in describe_model(model, None)
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    counted = sum(p.numel() for p in tiny.parameters())
    assert counted < 10_000 and f"{counted / 1e3:.1f}K parameters, 1 layers" in describe_model(tiny, "tiny")


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


def test_demo_says_why_a_model_it_loaded_is_refused(tmp_path):
    """A model refused at load under `"paged"` (bloom: attention code of its own) is named as such, not as a path
    that holds no model."""
    from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

    from hf_paged.tools.demo import load

    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(DEMO_MODEL_PATH)).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as refused:
        load(str(tmp_path), torch.float32)
    assert str(refused.value.code).startswith("This model cannot use a paged KV cache: ")
    assert "attention code of its own" in str(refused.value.code)
