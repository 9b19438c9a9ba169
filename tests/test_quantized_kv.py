"""Quantized K/V blocks (issue 16): `kv_dtype="int8" | "fp8_e4m3" | "fp8_e5m2"` on the PyTorch path."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.memory import quant
from helpers import left_padded, load, saved_model

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module")
def llama():
    return load(saved_model("llama"), "paged")


def _generate(model, kv_dtype, *, pool=None, cache=None, **kwargs):
    cache = cache if cache is not None else hf_paged.PagedCache(pool=pool, kv_dtype=None if pool else kv_dtype)
    torch.manual_seed(kwargs.pop("seed", 0))
    with torch.inference_mode():
        out = model.generate(**hf_paged.cache_kwargs(cache), pad_token_id=0, **kwargs)
    return out, cache


# ---------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("bad", ["int4", "fp8", "float16", torch.int8, 8])
def test_unknown_kv_dtype_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        hf_paged.KVPool(kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        hf_paged.PagedCache(kv_dtype=bad)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_without_float8_dtypes_is_refused_at_construction(monkeypatch, kv_dtype):
    monkeypatch.delattr(torch, {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype])
    with pytest.raises(ValueError, match="use kv_dtype='int8'"):
        hf_paged.KVPool(kv_dtype=kv_dtype)
    hf_paged.KVPool(kv_dtype="int8")  # int8 needs nothing more


def test_cache_on_a_pool_refuses_another_kv_dtype():
    pool = hf_paged.KVPool(kv_dtype="int8")
    with pytest.raises(ValueError, match="differs from the pool's kv_dtype"):
        hf_paged.PagedCache(pool=pool, kv_dtype="fp8_e4m3")
    assert hf_paged.PagedCache(pool=pool, kv_dtype="int8").pool is pool


# ---------------------------------------------------------------------------------------------- quantizer
@pytest.mark.parametrize("kv_dtype,rel", [("int8", 1 / 254), ("fp8_e4m3", 1 / 16), ("fp8_e5m2", 1 / 8)])
def test_round_trip_error_is_bounded_per_token_head(kv_dtype, rel):
    fmt = quant.kv_format(kv_dtype)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    q, scale = quant.quantize(x, fmt.storage_dtype)
    assert q.dtype == fmt.storage_dtype and scale.shape == (50, 3) and scale.dtype == quant.SCALE_DTYPE
    back = quant.dequantize(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if kv_dtype == "int8":  # absolute error: half a step of amax / 127 (a scale is at least float16's tiny)
        assert ((back - x).abs() <= torch.clamp(amax / 127, min=torch.finfo(torch.float16).tiny) * 0.505).all()
    else:  # relative error of the normal range (elements above 1/64 of the row's max)
        normal = x.abs() > amax / 64
        assert ((back - x).abs()[normal] <= x.abs()[normal] * rel * 1.01).all()
    zero_q, zero_scale = quant.quantize(torch.zeros(2, 64), fmt.storage_dtype)  # zero rows keep a positive scale
    assert (zero_scale > 0).all() and (quant.dequantize(zero_q, zero_scale, torch.float32) == 0).all()


@pytest.mark.parametrize("kv_dtype,gain", [("int8", 0.0), ("fp8_e4m3", 0.12), ("fp8_e5m2", 0.12)])
def test_the_chosen_scale_minimizes_each_vectors_error_among_the_candidates(monkeypatch, kv_dtype, gain):
    """float8: every vector's squared error is at most the one `max|x| / QMAX` gives (the first candidate), the
    scale lies in [that, twice that), and over many key-like vectors the RMS error drops by at least `gain`.
    int8 keeps `max|x| / QMAX`."""
    storage = quant.kv_format(kv_dtype).storage_dtype
    torch.manual_seed(0)
    x = torch.randn(400, 2, 64) * torch.linspace(0.2, 4.0, 64)[torch.randperm(64)] * torch.logspace(-2, 2, 400)[:, None, None]
    q, scale = quant.quantize(x, storage)
    monkeypatch.setattr(quant, "NUM_SCALE_CANDIDATES", 1)
    plain_q, plain_scale = quant.quantize(x, storage)
    tiny = torch.finfo(torch.float16).tiny
    assert torch.equal(plain_scale, (x.abs().amax(-1) / quant.kv_format(kv_dtype).qmax).clamp(min=tiny).to(torch.float16))
    error = (quant.dequantize(q, scale, torch.float32) - x).pow(2).sum(-1)
    plain_error = (quant.dequantize(plain_q, plain_scale, torch.float32) - x).pow(2).sum(-1)
    assert (error <= plain_error * (1 + 1e-5)).all()
    assert ((scale >= plain_scale) & (scale.float() < 2 * plain_scale.float())).all()
    if kv_dtype == "int8":
        assert torch.equal(scale, plain_scale) and torch.equal(q, plain_q)
    else:
        assert (error.sum() / plain_error.sum()).sqrt() < 1 - gain


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_bytes_per_token_and_stats_count_the_scales(llama, kv_dtype):
    ids, mask = left_padded([40, 23], seed=3)
    _, plain = _generate(llama, None, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    _, cache = _generate(llama, kv_dtype, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    plain_stats, stats = plain.stats(), cache.stats()
    assert stats.kv_dtype == kv_dtype and plain_stats.kv_dtype is None
    assert stats.blocks_in_use == plain_stats.blocks_in_use and stats.tokens_stored == plain_stats.tokens_stored
    # TINY: 2 layers x (K and V) x blocks x 16 slots x 2 KV heads x (16 one-byte elements + one float16 scale).
    expected_scales = 2 * 2 * stats.blocks_in_use * 16 * 2 * 2
    assert stats.scale_bytes_in_use == expected_scales > 0
    assert stats.bytes_in_use == 2 * 2 * stats.blocks_in_use * 16 * 2 * 16 + expected_scales
    assert stats.scale_bytes_reserved > 0 and stats.bytes_reserved >= stats.bytes_in_use
    assert stats.bytes_in_use * 64 == plain_stats.bytes_in_use * 18  # head_dim 16: 16 + 2 bytes vs 16 x 4
    pool = cache.pool
    assert pool.bytes_per_token_head(64, torch.float32) / (64 * 4) <= 0.27
    assert pool.bytes_per_token_head(64, torch.bfloat16) / (64 * 2) <= 0.53


def test_max_memory_admits_about_four_times_the_blocks_of_float32(llama):
    ids, mask = left_padded([10], seed=1)
    sizes = {}
    for kv_dtype in (None, "int8"):
        pool = hf_paged.KVPool(llama.config, max_memory=200_000, kv_dtype=kv_dtype)
        _generate(llama, None, pool=pool, input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        sizes[kv_dtype] = pool.stats().blocks_total
        assert pool.stats().bytes_reserved <= 200_000
    assert sizes["int8"] >= 3.5 * sizes[None]  # head_dim 16: 64 bytes a token-head in float32, 18 in int8


# ---------------------------------------------------------------------------------------------- check()
def test_check_verifies_the_scales_of_filled_slots(llama):
    ids, mask = left_padded([20], seed=2)
    _, cache = _generate(llama, "int8", input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    pool = cache.pool
    pool.check()
    block = cache.rows.tables[0][0][0]
    with torch.inference_mode():  # the pool's tensors were made under generate()'s inference mode
        pool.value_scales[1][block, 3, 0] = 0.0
    with pytest.raises(AssertionError, match="V scales of filled slots"):
        pool.check()
    with torch.inference_mode():
        pool.value_scales[1][block, 3, 0] = 1.0
        pool.key_scales[0][block, 0, 1] = float("nan")
    with pytest.raises(AssertionError, match="K scales of filled slots"):
        pool.check()
    with torch.inference_mode():  # a slot no row holds may keep any scale
        pool.key_scales[0][block, 0, 1] = 1.0
        pool.key_scales[0][pool.key_scales[0].shape[0] - 1, 15, 0] = 0.0
    pool.check()


# ---------------------------------------------------------------------------------------------- reads
def test_layer_keys_and_attention_weights_are_dequantized(llama):
    ids, mask = left_padded([30], seed=4)
    _, plain = _generate(llama, None, input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    _, cache = _generate(llama, "int8", input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for i, (layer_q, layer_p) in enumerate(zip(cache.layers, plain.layers, strict=True)):
        for got, ref in ((layer_q.keys, layer_p.keys), (layer_q.values, layer_p.values)):
            assert got.dtype == torch.float32 and got.shape == ref.shape
            err = (got - ref).abs().amax(-1)
            # Layer 0 sees the same input: half an int8 step; later layers also carry the earlier layers' error.
            assert (err <= ref.abs().amax(-1) * (0.505 / 127 if i == 0 else 0.1) + 1e-6).all()
    with torch.inference_mode():
        out = llama(input_ids=ids[:, :5], **hf_paged.cache_kwargs(hf_paged.PagedCache(kv_dtype="int8")),
                    output_attentions=True)
    assert all(torch.allclose(a.sum(-1), torch.ones(())) for a in out.attentions)


# ---------------------------------------------------------------------------------------------- generate()
FEATURES = {
    "greedy_padded": dict(lengths=[37, 12, 25], kwargs=dict(do_sample=False, max_new_tokens=20)),
    "beams": dict(lengths=[37], kwargs=dict(num_beams=4, do_sample=False, max_new_tokens=20)),
    # top_k=1: sampled rows stay comparable (multinomial draws over tiny probability changes would not be)
    "samples": dict(lengths=[40], kwargs=dict(num_return_sequences=4, do_sample=True, top_k=1, max_new_tokens=12)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_int8_generate_matches_unquantized_on_peaked_model(llama, feature):
    """Peaked logits (the tiny test models): int8's error flips no token, so any mistake in writing, copying
    (beams, samples share blocks copy-on-write) or reading quantized blocks shows as a changed sequence."""
    spec = FEATURES[feature]
    ids, mask = left_padded(spec["lengths"], seed=7)
    ref, _ = _generate(llama, None, input_ids=ids, attention_mask=mask, **spec["kwargs"])
    for kv_dtype in QUANTIZED:
        out, cache = _generate(llama, kv_dtype, input_ids=ids, attention_mask=mask, **spec["kwargs"])
        cache.pool.check()
        if kv_dtype == "int8":
            assert torch.equal(out, ref)


def test_dedupe_and_copy_on_write_give_the_same_quantized_outputs(llama):
    """Rows stored once and copied on write give exactly what every row stored on its own gives."""
    ids, mask = left_padded([40], seed=9)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=14)
    for kv_dtype in QUANTIZED:
        shared, cache = _generate(llama, kv_dtype, **kw)
        separate, _ = _generate(llama, None, cache=hf_paged.PagedCache(kv_dtype=kv_dtype, dedupe_rows=False), **kw)
        assert torch.equal(shared, separate)
        assert cache.stats().blocks_shared > 0 or cache.stats().blocks_in_use > 0
        cache.pool.check()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_fork_continues_like_the_original(llama, kv_dtype):
    ids, mask = left_padded([21], seed=5)
    cache = hf_paged.PagedCache(kv_dtype=kv_dtype)
    first, _ = _generate(llama, None, cache=cache, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    twin = cache.fork()
    more = torch.ones_like(first)
    a, _ = _generate(llama, None, cache=cache, input_ids=first, attention_mask=more, do_sample=False, max_new_tokens=6)
    b, _ = _generate(llama, None, cache=twin, input_ids=first, attention_mask=more, do_sample=False, max_new_tokens=6)
    assert torch.equal(a, b)
    cache.pool.check()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_prefix_hit_reads_quantized_blocks_like_a_cold_prefill(llama, kv_dtype):
    ids, mask = left_padded([70], seed=6)
    pool = hf_paged.KVPool(llama.config, kv_dtype=kv_dtype)
    cold, _ = _generate(llama, None, cache=pool.new_cache(ids, mask), input_ids=ids, attention_mask=mask,
                        do_sample=False, max_new_tokens=10)
    hit_cache = pool.new_cache(ids, mask)
    assert hit_cache.get_seq_length() >= 64
    hit, _ = _generate(llama, None, cache=hit_cache, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    assert torch.equal(hit, cold)
    assert pool.stats().prefix_hit_tokens >= 64
    pool.check()


def test_sliding_window_model_int8_matches_unquantized():
    model = load(saved_model("mistral", sliding_window=8), "paged")
    ids, mask = left_padded([30, 19], seed=8)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    ref, _ = _generate(model, None, **kw)
    out, cache = _generate(model, "int8", **kw)
    assert torch.equal(out, ref)
    cache.pool.check()


def test_gather_mode_stores_quantized_and_returns_dequantized():
    """With another attention (sdpa), update() returns the gathered K/V: dequantized, in the model's dtype."""
    model = load(saved_model("llama"), "sdpa")
    ids, mask = left_padded([26], seed=10)
    ref, _ = _generate(model, None, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    out, cache = _generate(model, "int8", input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    assert cache.pool.key_caches[0].dtype == torch.int8
    assert torch.equal(out, ref)
    cache.pool.check()


# ---------------------------------------------------------------------------------------------- shipped model
@pytest.mark.slow
def test_greedy_agreement_on_the_shipped_model():
    """The issue's targets: 32 greedy tokens per prompt, batch 1, against the unquantized cache."""
    from benchmarks.quant_accuracy import PROMPTS, greedy
    from hf_paged.demo_model import load_demo_model

    model, tokenizer = load_demo_model(attn_implementation="paged")
    prompts = PROMPTS[:12]
    refs = [greedy(model, tokenizer, p, None, 32) for p in prompts]
    agree = {
        kv: sum(torch.equal(greedy(model, tokenizer, p, kv, 32), r) for p, r in zip(prompts, refs, strict=True))
        for kv in ("int8", "fp8_e4m3")
    }
    assert agree["int8"] >= 10
    assert agree["fp8_e4m3"] >= 8  # the target; measured 9/12 with the rotation (docs/quantized-kv.md)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_cache_read_gathered_shows_its_first_forward_the_kv_as_stored(kv_dtype):
    """A quantized PagedCache under sdpa (read gathered) hands the first layer of its first forward the new K/V as
    the pool will give them back (quantized, dequantized, rotated there and back), as every later forward sees
    them: a prefix hit gives the cold prefill's logits."""
    model = load(saved_model("llama"), "sdpa")
    ids, mask = left_padded([40], seed=11)
    pool = hf_paged.KVPool(model.config, block_size=8, kv_dtype=kv_dtype)
    options = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=0,
                   return_dict_in_generate=True, output_logits=True)
    logits = []
    for _ in range(2):  # cold, then a prefix hit of the first 32 tokens
        cache = pool.new_cache(ids, mask)
        logits.append(model.generate(**options, **hf_paged.cache_kwargs(cache)).logits[0])
        cache.release()
    assert pool.stats().prefix_hit_rate > 0
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
