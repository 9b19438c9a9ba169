"""generate() with the Triton backend forced (kernels run under TRITON_INTERPRET=1) matches the PyTorch one."""

from __future__ import annotations

import importlib

import pytest
import torch

import hf_paged
from helpers import left_padded, load, saved_model

pytest.importorskip("triton", reason="triton is a Linux dependency of hf-paged; install it to run the kernels")


@pytest.mark.parametrize(
    "model_type,overrides",
    [("llama", {}), ("mistral", {"sliding_window": 16})],
    ids=["llama", "mistral-sliding"],
)
def test_triton_backend_matches_torch_backend(monkeypatch, model_type, overrides):
    path = saved_model(model_type, head_dim=64, **overrides)
    model = load(path, "paged")
    ids, mask = left_padded([5, 19], seed=21)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    torch_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=8)), **kw)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    triton_cache = hf_paged.PagedCache(block_size=8)
    triton_out = model.generate(**hf_paged.cache_kwargs(triton_cache), **kw)
    assert torch.equal(torch_out.sequences, triton_out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(torch_out.logits, triton_out.logits, strict=True))
    assert diff < 1e-3
    triton_cache.pool.check()


def test_triton_copy_on_write_in_beam_search(monkeypatch):
    path = saved_model("llama", head_dim=64)
    model = load(path, "paged")
    ids, mask = left_padded([11], seed=22)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    torch_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=8)), **kw)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    triton_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=8)), **kw)
    assert torch.equal(torch_out, triton_out)


def test_backend_env_is_read_at_call_time(monkeypatch):
    from hf_paged.backend import backend_for

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    assert backend_for(torch.device("cpu")) == "triton"
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    assert backend_for(torch.device("cpu")) == "torch"
    monkeypatch.delenv("HF_PAGED_BACKEND")
    assert backend_for(torch.device("cpu")) == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        backend_for(torch.device("cpu"))


def test_triton_launches_carried_across_decode_steps(monkeypatch):
    """Block size 4 and 14 new tokens: the laid-out launches are repeated across steps while the tables keep their
    width and laid out again each time they grow a column; sampling two sequences per prompt (rows sharing
    blocks, copy-on-write) gives the PyTorch path's tokens with the same seed."""
    path = saved_model("llama", head_dim=64)
    model = load(path, "paged")
    ids, mask = left_padded([3, 9], seed=23)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=14, do_sample=True, top_k=4, num_return_sequences=2,
              pad_token_id=0)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    torch.manual_seed(0)
    torch_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=4)), **kw)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    attention = importlib.import_module("hf_paged.kernels.paged_attention")
    laid_out, lay_out = [], attention.attention_launches
    monkeypatch.setattr(
        attention, "attention_launches", lambda **kw: laid_out.append(kw["block_tables"].shape) or lay_out(**kw)
    )
    torch.manual_seed(0)
    triton_cache = hf_paged.PagedCache(block_size=4)
    triton_out = model.generate(**hf_paged.cache_kwargs(triton_cache), **kw)
    assert torch.equal(torch_out, triton_out)
    triton_cache.pool.check()
    # 14 forwards of 2 layers: laid out for the prompt, the first decode step and each new table width only.
    assert len(laid_out) == len(set(laid_out)) + 1 < 10, laid_out


def test_padding_query_after_real_tokens_takes_the_pytorch_path(monkeypatch):
    """Right padding fed one column at a time (`prefill_chunk_size=1`): the last chunk is padding in every row, and
    transformers computes its next token from that padding query, which sees the row's real tokens. The kernels
    give padding queries zeros, so such a forward takes the PyTorch path and matches it (found by the fuzzer with
    the Triton path forced; it gave another token before)."""
    path = saved_model("llama")
    model = load(path, "paged")
    ids = torch.randint(5, 120, (2, 9), generator=torch.Generator().manual_seed(24))
    mask = torch.ones_like(ids)
    mask[:, 5:7] = 0  # a hole
    mask[:, -1] = 0  # right padding
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, prefill_chunk_size=1,
              pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    torch_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=1)), **kw)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    triton_out = model.generate(**hf_paged.cache_kwargs(hf_paged.PagedCache(block_size=1)), **kw)
    assert torch.equal(torch_out.sequences, triton_out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(torch_out.logits, triton_out.logits, strict=True))
    assert diff < 1e-3
