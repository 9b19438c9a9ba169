"""The fixed orthogonal rotation of float8 K/V (`hf_paged/memory/rotation.py`): pools store `quantize(x @ R)`, attention
runs in the rotated space, and every reader of stored K/V gets them rotated back."""

from __future__ import annotations

import math

import pytest
import torch

import hf_paged
from hf_paged.memory import quant, rotation
from hf_paged.cache import readback
from helpers import left_padded, load, saved_model

ROTATED = list(quant.ROTATED_KV_DTYPES)
#: Relative RMS error a float8 round trip stays under (e4m3: 3 mantissa bits, e5m2: 2).
RMS_BOUND = {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1}


@pytest.mark.parametrize("head_dim", [1, 3, 16, 24, 40, 64, 80, 96, 128, 192])
def test_rotation_is_orthogonal_deterministic_and_spreads_every_channel(head_dim):
    r = rotation.rotation(head_dim)
    assert r.dtype == torch.float32 and r.shape == (head_dim, head_dim)
    torch.testing.assert_close(r.double() @ r.double().T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(rotation._build(head_dim), r)  # closed forms: the same on every process
    power = head_dim & -head_dim
    # every channel lands on at least `power` outputs, each with at most sqrt(2 / odd part) of its size
    assert ((r.abs() > 1e-6).sum(dim=1) >= power).all()
    assert r.abs().max() <= math.sqrt(2 / (head_dim // power)) / math.sqrt(power) + 1e-6 or head_dim == power
    if head_dim == power:  # Hadamard: every channel spread evenly
        torch.testing.assert_close(r.abs(), torch.full_like(r, head_dim**-0.5), atol=0, rtol=0)


def test_only_float8_formats_rotate():
    assert [name for name in quant.KV_DTYPES if quant.kv_format(name).rotate] == ROTATED == ["fp8_e4m3", "fp8_e5m2"]
    assert not rotation.rotates(None) and not rotation.rotates(quant.kv_format("int8"))
    x = torch.randn(3, 2, 40)
    torch.testing.assert_close(rotation.from_storage(rotation.to_storage(x)), x, atol=1e-6, rtol=0)
    assert rotation.to_storage(x.double()).dtype == torch.float64


def _prefill(model, kv_dtype, ids, mask):
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, **hf_paged.cache_kwargs(cache)).logits
    return cache, logits


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).pow(2).sum().sqrt() / want.pow(2).sum().sqrt())


@pytest.mark.parametrize("kv_dtype", ROTATED)
@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_stored_rotated_read_back_unrotated(monkeypatch, kv_dtype, attn):
    """Layer 0 (same input in both caches): `layer_kv` of a float8 cache is the unquantized K/V within float8's
    error, while the blocks themselves hold the rotated vectors. A reader that forgot to rotate back would be off
    by the whole vector (a relative error near 1.4)."""
    model = load(saved_model("llama", head_dim=64), attn)
    ids, mask = left_padded([30, 19], seed=4)
    plain, _ = _prefill(model, None, ids, mask)
    quantized, _ = _prefill(model, kv_dtype, ids, mask)
    assert quantized.pool.layer_storage(0)[0].dtype == quant.kv_format(kv_dtype).storage_dtype
    wants = [plain.layer_kv(0, which) for which in (0, 1)]
    for which, want in enumerate(wants):
        got = quantized.layer_kv(0, which)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert _relative_rms(got, want) < RMS_BOUND[kv_dtype]
    monkeypatch.setattr(readback, "from_storage", lambda x: x)  # read the blocks as stored
    for which, want in enumerate(wants):
        assert _relative_rms(quantized.layer_kv(0, which), rotation.to_storage(want)) < RMS_BOUND[kv_dtype]


def _forced_logits(model, kv_dtype, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """`[steps, vocab]` logits: the prefill's last, then one decode step per further token of `ids` (`[1, n]`)."""
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    kw = hf_paged.cache_kwargs(cache)
    with torch.inference_mode():
        steps = [model(input_ids=ids[:, :prompt_len], **kw).logits[0, -1]]
        steps += [model(input_ids=ids[:, t : t + 1], **kw).logits[0, -1] for t in range(prompt_len, ids.shape[1])]
    return torch.stack(steps)


@pytest.mark.parametrize("kv_dtype", ROTATED)
@pytest.mark.parametrize("attn", ["paged", "sdpa"])
def test_float8_logits_follow_the_unquantized_ones(kv_dtype, attn):
    """A prefill and decode steps (each reading its history from the blocks) give logits near the unquantized
    cache's: the query is rotated like the keys and the output rotated back on every path. (This peaked random
    model is sensitive: its largest logit error is 5-8% of the largest logit with e4m3, 20% with e5m2; without
    the output rotated back it exceeds the largest logit.)"""
    model = load(saved_model("llama", head_dim=64), attn)
    ids, _ = left_padded([40], seed=8)
    ref = _forced_logits(model, None, ids, 30)
    got = _forced_logits(model, kv_dtype, ids, 30)
    error = float((got - ref).abs().max())
    assert 0 < error < {"fp8_e4m3": 0.12, "fp8_e5m2": 0.3}[kv_dtype] * float(ref.abs().max())


@pytest.mark.parametrize("kv_dtype", ROTATED)
def test_prefix_hit_and_fork_read_the_rotated_blocks_back(kv_dtype):
    """A prefix hit (its first forward reads the shared blocks back) and a fork (copy-on-write) give what the
    cold cache gives; `layer_kv` of the fork is the cold cache's, and so is the hit's first layer (whose K/V
    depend on nothing but the tokens)."""
    model = load(saved_model("llama", head_dim=64), "paged")
    ids, mask = left_padded([70], seed=6)
    pool = hf_paged.KVPool(model.config, kv_dtype=kv_dtype)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0)
    cold_cache = pool.new_cache(ids, mask)
    with torch.inference_mode():
        cold = model.generate(**hf_paged.cache_kwargs(cold_cache), **kw)
        twin = cold_cache.fork()
        hit_cache = pool.new_cache(ids, mask)
        assert hit_cache.get_seq_length() >= 64
        hit = model.generate(**hf_paged.cache_kwargs(hit_cache), **kw)
    assert torch.equal(hit, cold) and pool.stats().prefix_hit_tokens >= 64
    for which in (0, 1):
        assert torch.equal(hit_cache.layer_kv(0, which), cold_cache.layer_kv(0, which))
        assert torch.equal(twin.layer_kv(1, which), cold_cache.layer_kv(1, which))
    pool.check()
