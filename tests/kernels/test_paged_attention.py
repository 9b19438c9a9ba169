"""Paged attention kernel vs the float32 reference, on odd shapes (interpreter on CPU).

The full cross product is far too slow for the interpreter, so cases are explicit lists chosen for
pairwise coverage: every query length, context length, block size, GQA ratio, head dim, dtype,
feature flag and split mode appears, and each feature meets several of the others.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import paged_attention
from tests.reference import make_paged_inputs, reference_paged_attention

DTYPE_TOL = [
    (torch.float32, 2e-5, 2e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]


def _run(inp, num_splits, **features):
    scale = features.pop("scale", inp.query.shape[-1] ** -0.5)
    out = paged_attention(
        query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables,
        seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=scale, num_splits=num_splits, **features,
    )
    ref = reference_paged_attention(
        inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens, inp.query_lens,
        scale=scale, **features,
    )
    return out, ref


# (seq_lens, query_lens, q_len, block_size, num_heads, num_kv_heads, head_dim, num_splits, features)
CASES = [
    # decode, one row per context length, GQA 4, block 16
    ([1, 54, 97, 129, 1000], [1, 1, 1, 1, 1], 1, 16, 8, 2, 64, 1, {}),
    ([1, 54, 97, 129, 1000], [1, 1, 1, 1, 1], 1, 16, 8, 2, 64, 4, {}),
    # left padding (incl. a row with no new tokens), block size 1, MHA
    ([5, 54, 17], [5, 2, 0], 5, 1, 2, 2, 64, 1, {}),
    ([17, 97, 129], [17, 5, 1], 17, 32, 4, 1, 80, 1, {"sliding_window": 9}),
    ([17, 97, 129], [17, 5, 1], 17, 32, 4, 1, 80, 3, {"sliding_window": 9}),
    # GQA 8 (MQA), prefill chunks attending a cached prefix
    ([54, 129], [17, 5], 17, 16, 8, 1, 96, 1, {"softcap": 3.0}),
    ([54, 129], [17, 5], 17, 16, 8, 1, 96, 2, {"softcap": 3.0, "sliding_window": 40}),
    ([1000, 97], [5, 1], 5, 32, 8, 1, 128, 1, {"sinks": True}),
    ([1000, 97], [5, 1], 5, 32, 8, 1, 128, 5, {"sinks": True, "softcap": 20.0}),
    ([97, 5], [5, 5], 5, 1, 4, 4, 256, 1, {"scale": 0.37, "sinks": True}),
    ([129, 54], [1, 1], 1, 1, 16, 4, 256, 3, {"scale": 1.3, "sliding_window": 33}),
    # heads per KV head beyond the decode tile (32 query heads share one KV head)
    ([54, 97], [1, 1], 1, 16, 32, 1, 64, 2, {"softcap": 5.0}),
]


def _pairwise_params():
    """The first two cases in every dtype; the others rotate through the dtypes."""
    params = []
    for index, case in enumerate(CASES):
        tols = DTYPE_TOL if index < 2 else [DTYPE_TOL[index % 3]]
        for dtype, atol, rtol in tols:
            params.append(pytest.param(index, dtype, atol, rtol, id=f"case{index}-{str(dtype)[6:]}"))
    return params


@pytest.mark.parametrize("index,dtype,atol,rtol", _pairwise_params())
def test_paged_attention_matches_reference(index, dtype, atol, rtol):
    seq_lens, query_lens, q_len, block_size, num_heads, num_kv_heads, head_dim, num_splits, features = CASES[index]
    inp = make_paged_inputs(
        seq_lens=seq_lens, query_lens=query_lens, q_len=q_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=index,
    )
    features = dict(features)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(num_heads) * 2
    out, ref = _run(inp, num_splits, **features)
    assert out.shape == (len(seq_lens), q_len, num_heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    padding = torch.arange(q_len)[None, :] < (q_len - inp.query_lens.long())[:, None]
    assert torch.all(out[padding] == 0), "padding query positions must be zeros"


def test_freed_window_blocks_are_never_read():
    """Blocks entirely outside the sliding window are -1 in the table (freed) and must not be read."""
    inp = make_paged_inputs(
        seq_lens=[129], query_lens=[1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=3
    )
    window = 20  # query at position 128 sees keys 109..128 -> blocks 6, 7, 8
    ref = reference_paged_attention(
        inp.query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens, inp.query_lens,
        scale=0.125, sliding_window=window,
    )
    inp.block_tables[0, :6] = -1
    for num_splits in (1, 3):
        out = paged_attention(
            query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables,
            seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.125, sliding_window=window,
            num_splits=num_splits,
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_out_argument_and_strided_query():
    """`out=` is filled in place; a query whose q axis is not the transposed HF layout also works."""
    inp = make_paged_inputs(
        seq_lens=[54, 17], query_lens=[5, 5], num_heads=4, num_kv_heads=4, head_dim=64, block_size=32, seed=4
    )
    query = inp.query.contiguous()[:, :, :, :]  # [B, Q, H, D] contiguous instead of a transposed view
    out = torch.full_like(query, float("nan"))
    result = paged_attention(
        query=query, key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables,
        seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=0.125, out=out,
    )
    assert result is out
    ref = reference_paged_attention(
        query, inp.key_cache, inp.value_cache, inp.block_tables, inp.seq_lens, inp.query_lens, scale=0.125
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_split_heuristic():
    from hf_paged.kernels import choose_num_splits

    assert choose_num_splits(num_programs=8, max_context=32768, q_len=1, num_sms=132) == 32
    assert choose_num_splits(num_programs=8, max_context=4096, q_len=1, num_sms=132) == 8
    assert choose_num_splits(num_programs=512, max_context=32768, q_len=1, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_context=1024, q_len=1, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_context=32768, q_len=64, num_sms=132) == 1


def test_rejects_unsupported_head_dim():
    inp = make_paged_inputs(seq_lens=[5], query_lens=[1], num_heads=2, num_kv_heads=2, head_dim=52, block_size=16)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(
            query=inp.query, key_cache=inp.key_cache, value_cache=inp.value_cache, block_tables=inp.block_tables,
            seq_lens=inp.seq_lens, query_lens=inp.query_lens, scale=1.0,
        )
