"""Held-out shapes: head dims that are not powers of two (tiles padded and masked), every block-id
path (power-of-two block size below/above the key tile, generic sizes), small decode tiles (MHA) and
empty/all-padding batches, against the float32 reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.memory import quant
from hf_paged.kernels import paged_attention, write_kv_cache
from hf_paged.kernels.specializations import attention_tile, kv_block
from tests.reference import make_paged_inputs, reference_paged_attention, seeded

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (head_dim, num_heads, num_kv_heads, block_size, seq_lens, query_lens, q_len, num_splits, dtype, features)
CASES = [
    (8, 4, 4, 16, [1, 37, 130], [1, 1, 1], 1, 1, torch.float16, {}),  # MHA decode: 1-row tiles
    (24, 8, 2, 1, [23, 61], [7, 3], 7, 1, torch.float32, {"sliding_window": 11}),  # block size 1
    (40, 8, 1, 32, [97, 5], [1, 1], 1, 3, torch.bfloat16, {"softcap": 4.0}),  # GQA 8 decode, split
    (72, 4, 4, 32, [75, 33], [2, 2], 2, 1, torch.float16, {"sinks": True}),  # MHA q_len 2: 2-row tile
    (112, 8, 2, 16, [131, 19], [19, 19], 19, 1, torch.float16, {}),  # GQA 4 prefill over a prefix
    (160, 4, 1, 16, [53, 1], [1, 1], 1, 1, torch.float32, {"sliding_window": 20}),  # GQA 4, d160
    (192, 8, 8, 32, [67, 17], [5, 1], 5, 1, torch.bfloat16, {}),  # MHA multi-token, left padding
    (256, 8, 1, 1, [29, 13], [1, 1], 1, 2, torch.float16, {"scale": 0.3}),  # MQA d256 block 1, split
    (24, 2, 1, 12, [77, 41], [1, 1], 1, 1, torch.float32, {}),  # generic block size, 2-row tile
    (40, 8, 2, 64, [150, 3], [9, 3], 9, 1, torch.float16, {"sliding_window": 70}),  # block > key tile
    (112, 2, 2, 128, [200], [1], 1, 4, torch.float32, {"sinks": True}),  # block 128, MHA split
    (8, 16, 2, 5, [33, 70, 9], [4, 0, 4], 4, 1, torch.bfloat16, {"softcap": 2.0}),  # GQA 8, no-token row
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"d{CASES[i][0]}-case{i}")
def test_held_out_shapes(case):
    head_dim, heads, kv_heads, block_size, seq_lens, query_lens, q_len, splits, dtype, features = CASES[case]
    inp = make_paged_inputs(
        seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=100 + case,
    )
    features = dict(features)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(heads) * 2
    scale = features.pop("scale", head_dim**-0.5)
    out = paged_attention(
        query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables,
        seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=scale, num_splits=splits, **features,
    )
    ref = reference_paged_attention(
        inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens, inp.query_lens,
        scale=scale, **features,
    )
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    padding = torch.arange(q_len)[None, :] < (q_len - inp.query_lens.long())[:, None]
    assert torch.all(out[padding] == 0)


def test_tiles_cover_every_path():
    """The cases above reach the small (no-dot) tiles of 1, 2 and 4 rows, the dot tiles, and all
    three block-id paths."""
    small = {attention_tile(torch.float16, 64, decode=True, rows=r).BLOCK_M for r in (1, 2)}
    assert small == {1, 2}
    assert not attention_tile(torch.float16, 64, decode=True, rows=1).use_dot
    assert attention_tile(torch.float16, 64, decode=True, rows=3).use_dot
    assert kv_block(16) == 16 and kv_block(1) == 1 and kv_block(12) == 0 and kv_block(5) == 0


@pytest.mark.parametrize("head_dim,dtype", [(8, torch.float16), (24, torch.float32), (72, torch.bfloat16),
                                            (160, torch.float16), (192, torch.float32)])
def test_write_held_out_head_dims(head_dim, dtype):
    batch, q_len, kv_heads, block_size, num_blocks = 2, 3, 2, 16, 5
    gen = seeded(head_dim)
    key = torch.randn(batch, kv_heads, q_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    value = torch.randn(batch, kv_heads, q_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: batch * q_len].view(batch, q_len)
    slots[1, 0] = -1
    write_kv_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    real = slots >= 0
    want_k, want_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    want_k.view(-1, kv_heads, head_dim)[slots[real]] = key[real]
    want_v.view(-1, kv_heads, head_dim)[slots[real]] = value[real]
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_empty_batch_and_all_padding_rows():
    inp = make_paged_inputs(seq_lens=[9, 4], query_lens=[0, 0], q_len=3, num_heads=4, num_kv_heads=2,
                            head_dim=24, block_size=16)
    out = paged_attention(query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache,
                          block_tables=inp.block_tables, seq_lens=inp.seq_lens, query_lens=inp.query_lens,
                          scale=0.2)
    assert out.shape == inp.query.shape and torch.all(out == 0)
    empty = paged_attention(
        query=inp.query[:0], key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables[:0],
        seq_lens=inp.seq_lens[:0], query_lens=inp.query_lens[:0], scale=0.2,
    )
    assert empty.shape == (0, 3, 4, 24)
    before = inp.key_cache.clone()
    key = torch.randn(0, 3, 2, 24)
    write_kv_cache(key=key, value=key, key_cache=inp.key_cache, value_cache=inp.value_cache,
                   slot_mapping=torch.empty(0, 3, dtype=torch.int64))
    padding_only = torch.full((2, 3), -1, dtype=torch.int64)
    key = torch.randn(2, 3, 2, 24)
    write_kv_cache(key=key, value=key, key_cache=inp.key_cache, value_cache=inp.value_cache, slot_mapping=padding_only)
    assert torch.equal(inp.key_cache, before)


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(head_dim=20), ValueError),
        (dict(head_dim=264), ValueError),
        (dict(dtype=torch.float64), ValueError),
        (dict(seq_lens_dtype=torch.int64), TypeError),
        (dict(kv_dtype=torch.float16), TypeError),
        (dict(num_heads=3), ValueError),
        (dict(softcap=0.0), ValueError),
        (dict(sliding_window=0), ValueError),
    ],
)
def test_invalid_inputs_raise_errors_with_messages(change, error):
    head_dim = change.get("head_dim", 16)
    dtype = change.get("dtype", torch.float32)
    inp = make_paged_inputs(seq_lens=[5], query_lens=[1], num_heads=change.get("num_heads", 2), num_kv_heads=2,
                            head_dim=head_dim, block_size=4, dtype=dtype)
    seq_lens = inp.seq_lens.to(change.get("seq_lens_dtype", torch.int32))
    key_cache = inp.key_cache.to(change.get("kv_dtype", dtype))
    with pytest.raises(error, match=r"\w+"):
        paged_attention(
            query=inp.query, key_cache=key_cache, value_cache=key_cache, block_tables=inp.block_tables,
            seq_lens=seq_lens, query_lens=inp.query_lens, scale=1.0,
            **{k: change[k] for k in ("softcap", "sliding_window") if k in change},
        )


def _reference_mla(inp, value_cache, **kwargs):
    """The float32 reference for a value head dim of its own: zero-pad every head dim to the widest
    (zeros change neither q.k nor the kept value columns) and slice the output."""
    width = max(inp.query.shape[-1], value_cache.shape[-1])

    def pad(t):
        return torch.nn.functional.pad(t.float(), (0, width - t.shape[-1]))

    out = reference_paged_attention(pad(inp.query), pad(inp.key_cache), pad(value_cache), inp.block_tables,
                                    inp.seq_lens, inp.query_lens, **kwargs)
    return out[..., : value_cache.shape[-1]]


@pytest.mark.parametrize(
    "head_dim,head_dim_v,heads,kv_heads,seq_lens,query_lens,q_len,splits,dtype",
    [
        (192, 128, 4, 4, [41, 9], [1, 1], 1, 1, torch.bfloat16),  # MHA decode (1-row tile)
        (192, 128, 8, 2, [70, 33], [1, 1], 1, 3, torch.float16),  # GQA 4 decode, split-KV
        (40, 24, 4, 1, [29, 12], [7, 4], 7, 1, torch.float32),  # prefill over a prefix, V narrower
        (24, 72, 2, 2, [19, 5], [2, 2], 2, 1, torch.float16),  # V wider than K, 2-row tile
        # the int8 test's last cell unquantized: a 64 x 64 dot tile over several blocks at K 24 / V 16 in float16
        (24, 16, 4, 4, [23, 9], [23, 9], 23, 1, torch.float16),
    ],
)
def test_value_head_dim_of_its_own(head_dim, head_dim_v, heads, kv_heads, seq_lens, query_lens, q_len, splits, dtype):
    """Multi-latent attention: K/Q head dim 192 and V head dim 128 (and other pairs), attention and write."""
    inp = make_paged_inputs(seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=head_dim_v)
    gen = seeded(1)
    value_cache = torch.randn(*inp.key_cache.shape[:3], head_dim_v, generator=gen).to(dtype)
    out = paged_attention(query=inp.query, key_cache=inp.key_cache, value_cache=value_cache,
                          block_tables=inp.block_tables, seq_lens=inp.seq_lens, query_lens=inp.query_lens,
                          scale=head_dim**-0.5, num_splits=splits)
    assert out.shape == (len(seq_lens), q_len, heads, head_dim_v)
    ref = _reference_mla(inp, value_cache, scale=head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])

    key = torch.randn(2, kv_heads, 3, head_dim, generator=gen).to(dtype).transpose(1, 2)
    value = torch.randn(2, kv_heads, 3, head_dim_v, generator=gen).to(dtype).transpose(1, 2)
    slots = torch.tensor([[-1, 4, 17], [30, 2, 9]])
    key_cache, value_cache = inp.key_cache.clone(), value_cache.clone()
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_kv_cache(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    real = slots >= 0
    want_k.view(-1, kv_heads, head_dim)[slots[real]] = key[real]
    want_v.view(-1, kv_heads, head_dim_v)[slots[real]] = value[real]
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize(
    "head_dim,head_dim_v,heads,kv_heads,seq_lens,query_lens,q_len,splits,dtype",
    [
        (192, 128, 4, 4, [41, 9], [1, 1], 1, 1, torch.float16),  # MHA decode
        (192, 128, 8, 2, [70, 33], [1, 1], 1, 3, torch.bfloat16),  # GQA 4 decode, split-KV
        (24, 16, 4, 2, [29, 12], [7, 4], 7, 1, torch.float32),  # prefill over a prefix (the matrix's DeepSeek)
        (24, 16, 4, 4, [23, 9], [23, 9], 23, 1, torch.float16),  # prefill, no history
    ],
)
def test_int8_value_head_dim_of_its_own_matches_torch_path(head_dim, head_dim_v, heads, kv_heads, seq_lens,
                                                           query_lens, q_len, splits, dtype):
    """Quantized pools with K and V of their own widths: the Triton write stores what `torch_write` stores, and
    the Triton attention over them matches the PyTorch path's."""
    from hf_paged.attention.torch_backend import torch_paged_attention, torch_write  # noqa: PLC0415
    from hf_paged.attention.torch_meta import build_torch_meta  # noqa: PLC0415

    # one pool block beside the rows' (a read of a wrong block still shows): every slot is written below, one
    # interpreted program per token and KV head
    inp = make_paged_inputs(seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=head_dim_v,
                            extra_blocks=1)
    gen = seeded(2)
    num_blocks = inp.key_cache.shape[0]
    # fill every slot through the Triton write (int8 + scales), and a copy through torch_write
    key = torch.randn(1, kv_heads, num_blocks * 16, head_dim, generator=gen).to(dtype)
    value = torch.randn(1, kv_heads, num_blocks * 16, head_dim_v, generator=gen).to(dtype)
    pools = []
    for _ in range(2):
        pools.append((torch.zeros(num_blocks, 16, kv_heads, head_dim, dtype=torch.int8),
                      torch.zeros(num_blocks, 16, kv_heads, head_dim_v, dtype=torch.int8),
                      torch.zeros(num_blocks, 16, kv_heads, dtype=torch.float16),
                      torch.zeros(num_blocks, 16, kv_heads, dtype=torch.float16)))
    slots = torch.arange(num_blocks * 16, dtype=torch.int64)
    kc, vc, ks, vs = pools[0]
    write_kv_cache(key=key.transpose(1, 2), value=value.transpose(1, 2), key_cache=kc, value_cache=vc,
                   slot_mapping=slots[None], key_scale=ks, value_scale=vs)
    torch_write(pools[1][0], pools[1][1], key, value, None, slots, (pools[1][2], pools[1][3]))
    for a, b in zip(pools[0], pools[1], strict=True):
        assert torch.equal(a, b)

    out = paged_attention(query=inp.query, key_cache=kc, value_cache=vc, block_tables=inp.block_tables,
                          seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=head_dim**-0.5, num_splits=splits,
                          key_scale=ks, value_scale=vs)
    assert out.shape == (len(seq_lens), q_len, heads, head_dim_v)
    tables = [[int(b) for b in row if b >= 0] for row in inp.block_tables]
    # the PyTorch path on the CPU (the host-side path it is; a GPU session's tensors are copied over)
    kc, vc, ks, vs = kc.cpu(), vc.cpu(), ks.cpu(), vs.cpu()
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, 16, None, torch.device("cpu"))
    query = inp.query.transpose(1, 2).cpu()  # [batch, heads, q_len, head_dim]
    # this step's K/V as the pool gives them back (the direct path of a prefill reads them)
    new_k = torch.zeros(len(seq_lens), kv_heads, q_len, head_dim, dtype=dtype, device="cpu")
    new_v = torch.zeros(len(seq_lens), kv_heads, q_len, head_dim_v, dtype=dtype, device="cpu")
    for b, (s, n) in enumerate(zip(seq_lens, query_lens)):
        for i in range(n):
            p = s - n + i
            blk, off = tables[b][p // 16], p % 16
            new_k[b, :, q_len - n + i] = quant.dequantize(kc[blk, off], ks[blk, off], dtype)
            new_v[b, :, q_len - n + i] = quant.dequantize(vc[blk, off], vs[blk, off], dtype)
    want = torch_paged_attention(query, new_k, new_v, kc, vc, meta, head_dim**-0.5, scales=(ks, vs))
    out = out.cpu()
    for b, n in enumerate(query_lens):
        torch.testing.assert_close(out[b, q_len - n :].float(), want[b, q_len - n :].float(), atol=TOL[dtype] * 2,
                                   rtol=TOL[dtype] * 2)
