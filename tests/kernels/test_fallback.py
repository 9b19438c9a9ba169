"""Never crash a user: what the Triton path does not cover is named by `triton_supports`, and a kernel
that fails falls back to the PyTorch path with one warning (interpreter on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_paged import backend
from hf_paged.attention.plan import ForwardPlan, GroupPlan
from hf_paged.attention.triton_path import slot_mapping
from tests.reference import make_paged_inputs, reference_paged_attention


@pytest.fixture(autouse=True)
def _fresh_backend_state(monkeypatch):
    monkeypatch.setenv("HF_PAGED_TRITON_STRICT", "0")  # the interpreter makes kernel failures raise by default
    backend._warned.clear()
    backend._failed.clear()
    yield
    backend._warned.clear()
    backend._failed.clear()


def _hf_query(dtype=torch.float16, head_dim=64, heads=4):
    return torch.randn(2, heads, 3, head_dim).to(dtype)  # [B, H, Q, D]


def test_triton_supports_names_the_reason():
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    assert backend.triton_supports(_hf_query(), pool) is None
    assert "dtype" in backend.triton_supports(_hf_query(torch.float64), pool.double())
    assert "head_dim 20" in backend.triton_supports(_hf_query(head_dim=20), torch.zeros(4, 16, 2, 20))
    assert "head_dim 264" in backend.triton_supports(_hf_query(head_dim=264), torch.zeros(4, 16, 2, 264))
    assert "differs" in backend.triton_supports(_hf_query(), pool.float())
    assert "softcap" in backend.triton_supports(_hf_query(), pool, softcap=0.0)
    assert "sinks" in backend.triton_supports(_hf_query(), pool, sinks=torch.zeros(3))
    assert backend.triton_supports(_hf_query(), pool, sinks=torch.zeros(4), sliding_window=8, softcap=30.0) is None


def test_cpu_without_interpreter_and_old_triton(monkeypatch):
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in backend.triton_supports(_hf_query(), pool)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "triton_problem", lambda: "Triton 2.1.0 is older than 3.0")
    assert "older" in backend.triton_supports(_hf_query(), pool)


def test_attention_backend_warns_once_per_reason(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    pool = torch.zeros(4, 16, 2, 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert backend.attention_backend(_hf_query(torch.float32, head_dim=20), pool) == "torch"
    assert len(caught) == 1 and "head_dim 20" in str(caught[0].message)
    assert backend.attention_backend(_hf_query(torch.float32), torch.zeros(4, 16, 2, 64)) == "triton"
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    assert backend.attention_backend(_hf_query(torch.float32), torch.zeros(4, 16, 2, 64)) == "torch"


def _plan(inp, q_len):
    tables = [[int(b) for b in row if b >= 0] for row in inp.block_tables]
    seq_lens, query_lens = inp.seq_lens.tolist(), inp.query_lens.tolist()
    block_size = inp.key_cache.shape[1]
    rows, slots = [], []
    for b, (s, n) in enumerate(zip(seq_lens, query_lens)):
        for j in range(q_len - n, q_len):
            pos = s - q_len + j
            rows.append(b * q_len + j)
            slots.append(tables[b][pos // block_size] * block_size + pos % block_size)
    return ForwardPlan(q_len, query_lens, seq_lens, [GroupPlan(tables, rows, slots, None)], block_size, None)


@pytest.mark.parametrize("query_lens,q_len", [([1, 1], 1), ([5, 3], 5), ([17, 17], 17)])
def test_kernel_failure_falls_back_to_torch_path(monkeypatch, query_lens, q_len):
    """A kernel that fails (here: a simulated compile error) gives the PyTorch path's result, one
    warning, and `triton_supports` reports the failure from then on; with or without the step's K/V."""
    import hf_paged.kernels as kernels
    from hf_paged.attention.triton_path import triton_attention, triton_write

    def broken(**kwargs):
        raise RuntimeError("simulated compilation failure")

    seq_lens = [max(23, query_lens[0]), max(9, query_lens[1])] if q_len != 17 else [17, 17]
    inp = make_paged_inputs(seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=4, num_kv_heads=2,
                            head_dim=32, block_size=4, seed=q_len)  # fmt: skip
    plan = _plan(inp, q_len)
    query = inp.query.transpose(1, 2)  # HF layout [B, H, Q, D]
    ref = reference_paged_attention(inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens,
                                    inp.query_lens, scale=0.2)  # fmt: skip
    # this step's K/V as HF hands them over, read from the pool (the write is a no-op rewrite)
    slots = slot_mapping(plan, 0, query.device)
    key = inp.key_cache.view(-1, 2, 32)[slots.clamp(min=0)].transpose(1, 2)
    value = inp.value_cache.view(-1, 2, 32)[slots.clamp(min=0)].transpose(1, 2)
    monkeypatch.setattr(kernels, "paged_attention", broken)
    monkeypatch.setattr(kernels, "write_kv_cache", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        triton_write(plan, 0, key, value, inp.key_cache, inp.value_cache)
        for kv in ((key, value), (None, None)):
            out = triton_attention(plan, 0, query, inp.key_cache, inp.value_cache, 0.2, None, None, None, *kv)
            real = torch.arange(q_len)[None, :] >= (q_len - inp.query_lens.long())[:, None]
            torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # one for the write, one for the attention
    assert all("simulated compilation failure" in m for m in messages)
    assert "failed" in backend.triton_supports(query, inp.key_cache)


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("HF_PAGED_TRITON_STRICT", "1")
    assert not backend.is_fallback_error(RuntimeError("compile"))
    monkeypatch.setenv("HF_PAGED_TRITON_STRICT", "0")
    assert backend.is_fallback_error(RuntimeError("compile"))
    assert not backend.is_fallback_error(torch.OutOfMemoryError("oom"))
    monkeypatch.delenv("HF_PAGED_TRITON_STRICT")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.strict_triton()


def test_copy_blocks_falls_back(monkeypatch):
    import hf_paged.kernels as kernels

    def broken(**kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    monkeypatch.setattr(kernels, "copy_blocks", broken)
    caches = [torch.randn(5, 4, 2, 8) for _ in range(2)]
    want = [c.clone() for c in caches]
    with pytest.warns(RuntimeWarning, match="no kernel today"):
        backend.copy_blocks([caches[0]], [caches[1]], [1, 4], [0, 2], block_size=4)
    for c, w in zip(caches, want):
        w[[0, 2]] = w[[1, 4]]
        assert torch.equal(c, w)
