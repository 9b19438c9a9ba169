"""Quantized pools (int8 / float8 with per-token, per-KV-head float16 scales) in the Triton kernels, under the
interpreter: the write kernel stores exactly what the PyTorch path's quantizer stores, the attention kernel
(dequantizing inside its tile loop) matches the float32 reference over the dequantized pools, and generate()
with the Triton backend matches the PyTorch backend on quantized caches."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.memory import quant
from hf_paged.kernels import paged_attention, write_kv_cache
from helpers import left_padded, load, saved_model
from tests.reference import make_paged_inputs, reference_paged_attention

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPE_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


#: Cells of the write test that `make test` runs: int8 from every dtype, each float8 format from one (a float8 write
#: tries NUM_SCALE_CANDIDATES scales per token and head, slow under the interpreter); `make test-kernels` runs the
#: others (marked `kernels`).
_WRITE_MAKE_TEST = {("int8", torch.float32), ("int8", torch.float16), ("int8", torch.bfloat16),
                    ("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.bfloat16)}


@pytest.mark.parametrize(
    ("kv_dtype", "dtype"),
    [
        pytest.param(kv_dtype, dtype, id=f"{str(dtype).removeprefix('torch.')}-{kv_dtype}",
                     marks=() if (kv_dtype, dtype) in _WRITE_MAKE_TEST else pytest.mark.kernels)
        for kv_dtype in STORAGE
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ],
)
def test_write_kernel_stores_what_the_torch_quantizer_stores(kv_dtype, dtype):
    storage = STORAGE[kv_dtype]
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 2, 40  # head_dim 40: a masked (padded) tile
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=storage)
    value_cache = torch.zeros_like(key_cache)
    key_scale = torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16)
    value_scale = torch.zeros_like(key_scale)
    # magnitudes over six decades, a zero row, exact ties for int8 rounding
    key = (torch.randn(2, 9, num_kv_heads, head_dim) * torch.logspace(-3, 3, 9)[None, :, None, None]).to(dtype)
    key[0, 0] = 0.0
    value = torch.randn(2, 9, num_kv_heads, head_dim).to(dtype)
    value[1, 2, 0, :2] = torch.tensor([127.0, 0.5])  # amax 127: scale 1, 0.5 is a tie (rounds to 0)
    key[1, 3] = 1.0  # constant rows: several candidate scales give the same error, the first one wins
    value[0, 5, 1] = torch.linspace(-3.0, 3.0, head_dim).to(dtype)  # evenly spread, several exact on the grid
    if dtype != torch.float16:  # beyond float16's range: candidate scales clamped to its max; errors in 2**-127 units
        key[1, 5, 0] = torch.linspace(-2e7, 2e7, head_dim).to(dtype)
        key[1, 6, 1] = (torch.randn(head_dim) * 1e-30).to(dtype)  # rounds to zeros of both signs
    slots = torch.tensor([list(range(9)), [20 + i if i != 4 else -1 for i in range(9)]])
    write_kv_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
                   key_scale=key_scale, value_scale=value_scale)
    real = slots.view(-1) >= 0
    for new, cache, scale in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        want_q, want_s = quant.quantize(new.reshape(-1, num_kv_heads, head_dim)[real], storage)
        got_q = cache.view(-1, num_kv_heads, head_dim)[slots.view(-1)[real]]
        got_s = scale.view(-1, num_kv_heads)[slots.view(-1)[real]]
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert (key_scale.view(-1, num_kv_heads)[24] == 0).all()  # the padding token wrote nothing


def test_write_kernel_tries_the_quantizers_number_of_scales():
    import importlib

    assert importlib.import_module("hf_paged.kernels.write_kv_cache").NUM_SCALE_CANDIDATES == quant.NUM_SCALE_CANDIDATES


def _quantized_inputs(kv_dtype, **shape):
    inp = make_paged_inputs(dtype=torch.float32, **shape)
    scales, pools = [], []
    for cache in (inp.key_cache, inp.value_cache):
        # per-channel magnitudes like real keys (a few large channels), so scales differ by token and head
        cache = cache * torch.linspace(0.2, 4.0, cache.shape[-1])
        q, s = quant.quantize(cache, STORAGE[kv_dtype])
        pools.append(q)
        scales.append(s)
    return inp, pools, scales


CASES = [
    # (seq_lens, query_lens, q_len, block_size, num_heads, num_kv_heads, head_dim, num_splits, features)
    ([1, 54, 129, 300], [1, 1, 1, 1], 1, 16, 8, 2, 64, 1, {}),  # decode, GQA 4 (tl.dot tile)
    ([54, 300], [1, 1], 1, 16, 2, 2, 64, 3, {}),  # MHA decode: the multiply-reduce tile, split-KV
    ([17, 97, 129], [17, 5, 1], 17, 32, 4, 1, 80, 1, {"sliding_window": 9}),  # prefill + cached prefix
    ([54, 129], [17, 5], 17, 16, 8, 1, 96, 2, {"softcap": 3.0, "sinks": True}),
    ([40, 33], [3, 1], 3, 5, 4, 2, 64, 1, {}),  # a block size that is not a power of two
]


@pytest.mark.parametrize("index", range(len(CASES)))
@pytest.mark.parametrize("kv_dtype", list(STORAGE))
def test_attention_dequantizes_in_the_tile_loop(kv_dtype, index):
    seq_lens, query_lens, q_len, block_size, num_heads, num_kv_heads, head_dim, num_splits, features = CASES[index]
    dtype = [torch.float32, torch.float16, torch.bfloat16][(index + len(kv_dtype)) % 3]
    inp, (key_q, value_q), (key_s, value_s) = _quantized_inputs(
        kv_dtype, seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, seed=index,
    )
    features = dict(features)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(num_heads)
    query = inp.query.to(dtype)
    out = paged_attention(
        query=query, key_cache=key_q, value_cache=value_q, block_tables=inp.block_tables, seq_lens=inp.seq_lens,
        query_lens=inp.query_lens, scale=head_dim**-0.5, num_splits=num_splits, key_scale=key_s, value_scale=value_s,
        **features,
    )
    key_dq, value_dq = quant.dequantize(key_q, key_s, dtype), quant.dequantize(value_q, value_s, dtype)
    ref = reference_paged_attention(
        query, key_dq, value_dq, inp.block_tables, inp.seq_lens, inp.query_lens, scale=head_dim**-0.5, **features
    )
    tol = DTYPE_TOL[dtype] * 4  # values up to ~4x larger than the unit-variance reference cases
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_attention_refuses_scales_of_the_wrong_shape():
    inp, (key_q, value_q), (key_s, value_s) = _quantized_inputs(
        "int8", seq_lens=[20], query_lens=[1], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16
    )
    with pytest.raises(ValueError, match="value_scale must be a contiguous float16"):
        paged_attention(query=inp.query, key_cache=key_q, value_cache=value_q, block_tables=inp.block_tables,
                        seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.1, key_scale=key_s,
                        value_scale=value_s[:, :8])
    with pytest.raises(TypeError, match="share a dtype"):  # int8 pools without scales
        paged_attention(query=inp.query, key_cache=key_q, value_cache=value_q, block_tables=inp.block_tables,
                        seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", *(pytest.param(f, marks=pytest.mark.kernels) for f in STORAGE if f != "int8")])
def test_triton_generate_matches_torch_generate_on_quantized_blocks(monkeypatch, kv_dtype):
    """`make test` runs int8; `make test-kernels` the float8 formats (marked `kernels`: slow under the interpreter,
    see `_WRITE_MAKE_TEST`; the write and attention tests above run each float8 format in `make test`)."""
    path = saved_model("llama", head_dim=64)
    model = load(path, "paged")
    ids, mask = left_padded([5, 19], seed=21)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    torch_cache = hf_paged.PagedCache(block_size=8, kv_dtype=kv_dtype)
    torch_out = model.generate(**hf_paged.cache_kwargs(torch_cache), **kw)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    triton_cache = hf_paged.PagedCache(block_size=8, kv_dtype=kv_dtype)
    triton_out = model.generate(**hf_paged.cache_kwargs(triton_cache), **kw)
    assert torch.equal(torch_out.sequences, triton_out.sequences)
    # Layer 0 stores bit-identical blocks (same inputs, same quantizer). Deeper layers get inputs that differ by
    # float rounding (1e-7), which can move an element across an int8/fp8 rounding boundary (one step is ~1% of
    # the row's max), so logits agree to quantization noise, not to float rounding.
    for pools in ("key_caches", "value_caches", "key_scales", "value_scales"):
        torch_pool, triton_pool = getattr(torch_cache.pool, pools)[0], getattr(triton_cache.pool, pools)[0]
        assert torch.equal(quant.byte_view(torch_pool), quant.byte_view(triton_pool))
    for a, b in zip(torch_out.logits, triton_out.logits, strict=True):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=1e-2)
    triton_cache.pool.check()
