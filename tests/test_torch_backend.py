"""The PyTorch path against the readable reference, on odd shapes (shared prefixes, windows, softcap, sinks)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hf_paged.memory.quant import dequantize, fake_quantize, quantize
from hf_paged.memory.slots import new_pool_tensor
from hf_paged.attention.torch_backend import torch_paged_attention, torch_write
from hf_paged.attention.torch_meta import LeadingBlocks, build_torch_meta
from reference import reference_paged_attention


def _case(seq_lens, query_lens, q_len, block_size, num_heads, num_kv_heads, head_dim, shared_blocks=0, seed=0,
          head_dim_v=None, prefill_blocks=None, run_stride=None):
    """Random pool and block tables; the first `shared_blocks` blocks of every row are the same ids. Values are
    `head_dim_v` wide (default `head_dim`). `prefill_blocks`: ids as a batched generate() on a fresh pool gave
    them before rows took their blocks in runs: each row's first `prefill_blocks` consecutive, row after row, then
    one block per row in turn. `run_stride`: ids as they are now (`BlockAllocator.allocate_runs`): row `r`'s
    blocks consecutive from `r * run_stride`."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = shared_blocks + sum(n - shared_blocks for n in need) + 3
    if run_stride is not None:
        num_blocks = max(num_blocks, run_stride * len(need) + 1)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shared = ids[:shared_blocks]
    pos = shared_blocks
    tables = []
    for n in need:
        tables.append(shared + ids[pos : pos + n - shared_blocks])
        pos += n - shared_blocks
    if prefill_blocks is not None:
        tables, next_id = [], 0
        for n in need:
            tables.append(list(range(next_id, next_id + min(n, prefill_blocks))))
            next_id += len(tables[-1])
        for j in range(prefill_blocks, max(need)):
            for table, n in zip(tables, need):
                if j < n:
                    table.append(next_id)
                    next_id += 1
    if run_stride is not None:
        tables = [list(range(r * run_stride, r * run_stride + n)) for r, n in enumerate(need)]
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim_v, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, q_len, head_dim, generator=gen)
    # The new K/V of this forward, as the attention function receives them (used when no row has history).
    new_k = torch.zeros(len(seq_lens), num_kv_heads, q_len, head_dim)
    new_v = torch.zeros(len(seq_lens), num_kv_heads, q_len, head_dim_v)
    for b, (s, n) in enumerate(zip(seq_lens, query_lens)):
        for i in range(n):
            p = s - n + i
            slot = tables[b][p // block_size], p % block_size
            new_k[b, :, q_len - n + i] = key_cache[slot]
            new_v[b, :, q_len - n + i] = value_cache[slot]
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return query, new_k, new_v, key_cache, value_cache, tables, bt


#: Leading blocks of each row laid out as a batched prefill on a fresh pool leaves them (`_case`'s prefill_blocks):
#: case index -> prefill blocks per row.
PREFILL_LAYOUT = {13: 4, 14: 4, 15: 3, 16: 2}
#: Rows that are each one run of blocks at a row stride (`_case`'s run_stride): case index -> row stride. The
#: cases 17-20 are read as one view of the pool; 21 is not (its last row is not among the longest): its leading
#: blocks are then read in place and the rest gathered (cascade).
RUN_LAYOUT = {17: 8, 18: 5, 19: 6, 20: 7, 21: 5}
#: Cases read whole as one strided view (no gather, no cascade).
IN_PLACE = {17, 18, 19, 20}

CASES = [
    # seq_lens, query_lens, q_len, block_size, heads, kv_heads, head_dim, shared, window, softcap, sinks
    ([54, 97, 129], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),
    ([54, 97, 129], [1, 1, 1], 1, 16, 8, 2, 32, 3, None, None, False),       # shared prefix (cascade)
    ([70, 70, 70, 70], [1, 1, 1, 1], 1, 16, 4, 4, 16, 4, None, None, False),  # beams
    ([41, 41, 41], [1, 1, 1], 1, 16, 4, 2, 16, 0, None, None, False),        # equal lengths: sliced, no mask
    ([17, 40], [5, 17], 17, 1, 4, 1, 16, 0, None, None, False),              # block_size 1, MQA, padding
    ([1000, 321], [5, 5], 5, 32, 8, 8, 16, 0, None, None, False),
    ([97, 129], [17, 5], 17, 16, 8, 2, 16, 0, 40, None, False),              # sliding window
    ([97, 129], [1, 1], 1, 16, 8, 2, 16, 2, None, 30.0, False),              # softcap + shared
    ([54, 97], [5, 1], 5, 16, 4, 2, 16, 0, None, None, True),                # sinks
    ([23, 9], [23, 9], 23, 16, 4, 2, 16, 0, None, None, False),              # prefill, no history
    ([23, 9], [23, 9], 23, 16, 4, 2, 16, 0, 8, 20.0, True),                  # prefill + every feature
    ([97], [1], 1, 16, 8, 2, 32, 0, None, None, False),                      # one row's decode, blocks gathered
    ([33], [1], 1, 4, 4, 1, 16, 0, None, 30.0, True),                        # one row's decode, softcap + sinks
    ([90, 90, 90], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),        # leading blocks at a row stride
    ([90, 90], [1, 1], 1, 16, 4, 2, 16, 0, None, 30.0, True),                # row stride + softcap + sinks
    ([52, 61, 58], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),        # row stride, unequal rows (mask)
    ([40, 40], [6, 3], 6, 8, 4, 2, 16, 0, None, None, False),                # row stride, chunked prefill + padding
    ([90, 90, 90], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),        # rows in runs: one view, sliced
    ([52, 58, 61], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),        # runs, unequal rows (mask)
    ([40, 40], [6, 3], 6, 8, 4, 2, 16, 0, None, None, False),                # runs, chunked prefill + padding
    ([90, 90], [1, 1], 1, 16, 4, 2, 16, 0, None, 30.0, True),                # runs + softcap + sinks
    ([61, 58, 40], [1, 1, 1], 1, 16, 8, 2, 32, 0, None, None, False),        # runs, last row shorter: cascade
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_torch_path_matches_reference(case, dtype, atol):
    seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, window, softcap, use_sinks = case
    index = CASES.index(case)
    prefill = PREFILL_LAYOUT.get(index)
    query, new_k, new_v, kc, vc, tables, bt = _case(
        seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, prefill_blocks=prefill,
        run_stride=RUN_LAYOUT.get(index),
    )
    sinks = torch.randn(heads) if use_sinks else None
    scale = 0.37
    query, new_k, new_v, kc, vc = (t.to(dtype) for t in (query, new_k, new_v, kc, vc))
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, bs, window, torch.device("cpu"))
    strided_leading = prefill is not None or (index in RUN_LAYOUT and index not in IN_PLACE)
    assert (meta.leading is not None) == (shared >= 2 or strided_leading)
    assert (meta.leading is not None and meta.leading.row_stride > 0) == strided_leading
    assert (meta.kv_valid is not None) == (q_len == 1 and window is None and len(set(seq_lens)) == 1)
    in_place = meta.contiguous_start is not None and meta.leading is None and len(seq_lens) > 1
    assert in_place == (index in IN_PLACE) and (meta.row_stride == RUN_LAYOUT[index] if in_place else True)
    out = torch_paged_attention(query, new_k, new_v, kc, vc, meta, scale, softcap, sinks)
    ref = reference_paged_attention(
        query.transpose(1, 2).float(), kc.float(), vc.float(), bt, torch.tensor(seq_lens), torch.tensor(query_lens),
        scale=scale, sliding_window=window, softcap=softcap, sinks=sinks,
    )
    real = torch.zeros(len(seq_lens), q_len, dtype=torch.bool)
    for b, n in enumerate(query_lens):
        real[b, q_len - n :] = True
    assert torch.allclose(out.float()[real], ref[real], atol=atol, rtol=atol)


#: Multi-latent attention: K 24 / V 16 (the matrix's tiny DeepSeek) and K 192 / V 128 (DeepSeek V2/V3).
MLA_CASES = [
    # seq_lens, query_lens, q_len, block_size, heads, kv_heads, head_dim, head_dim_v, shared, window, softcap, sinks
    ([54, 97, 129], [1, 1, 1], 1, 16, 8, 2, 24, 16, 0, None, None, False),     # decode, GQA
    ([54, 97, 129], [1, 1, 1], 1, 16, 4, 4, 192, 128, 3, None, None, False),   # decode, MHA, shared prefix (cascade)
    ([41, 41, 41], [1, 1, 1], 1, 16, 4, 2, 24, 16, 0, None, None, False),      # equal lengths: sliced, no mask
    ([17, 40], [5, 17], 17, 4, 4, 4, 24, 16, 0, None, None, False),            # mixed prefill, padding
    ([23, 9], [23, 9], 23, 16, 4, 4, 192, 128, 0, None, None, False),          # prefill, no history
    ([97, 129], [17, 5], 17, 16, 8, 2, 24, 16, 0, 40, 20.0, True),             # window + softcap + sinks (eager)
    ([60, 60, 60], [1, 1, 1], 1, 16, 4, 2, 24, 16, 0, None, None, False),      # leading blocks at a row stride
    ([60, 55, 60], [1, 1, 1], 1, 16, 4, 2, 24, 24, 0, None, None, False),      # the same, K and V alike (cascade)
    ([60, 55, 60], [1, 1, 1], 1, 16, 4, 2, 24, 16, 0, None, None, False),      # rows in runs: one view (mask)
]
#: MLA cases laid out as a batched prefill leaves them: case index -> prefill blocks per row.
MLA_PREFILL_LAYOUT = {6: 3, 7: 3}
#: MLA cases whose rows are each one run of blocks at a row stride: case index -> row stride.
MLA_RUN_LAYOUT = {8: 6}


@pytest.mark.parametrize("case", MLA_CASES, ids=[f"mla{i}" for i in range(len(MLA_CASES))])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "int8"])
def test_torch_path_value_head_dim_of_its_own(case, quantized):
    """K and V of different widths: the output has V's width and matches the reference (quantized: the reference
    over the dequantized pools)."""
    seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, dim_v, shared, window, softcap, use_sinks = case
    index = MLA_CASES.index(case)
    prefill = MLA_PREFILL_LAYOUT.get(index)
    query, new_k, new_v, kc, vc, tables, bt = _case(
        seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, seed=dim_v, head_dim_v=dim_v,
        prefill_blocks=prefill, run_stride=MLA_RUN_LAYOUT.get(index),
    )
    sinks = torch.randn(heads) if use_sinks else None
    scales = None
    if quantized:  # store the pools as int8 + scales; the new K/V are what the pool gives back
        (kq, ks), (vq, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
        kc, vc = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
        new_k, new_v = fake_quantize(new_k, torch.int8), fake_quantize(new_v, torch.int8)
        stored_k, stored_v, scales = kq, vq, (ks, vs)
    else:
        stored_k, stored_v = kc, vc
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, bs, window, torch.device("cpu"))
    assert (prefill is not None) == (meta.leading is not None and meta.leading.row_stride > 0)
    assert (index in MLA_RUN_LAYOUT) == (meta.contiguous_start is not None and meta.leading is None)
    out = torch_paged_attention(query, new_k, new_v, stored_k, stored_v, meta, 0.37, softcap, sinks, scales)
    assert out.shape == (len(seq_lens), q_len, heads, dim_v)
    ref = reference_paged_attention(
        query.transpose(1, 2), kc, vc, bt, torch.tensor(seq_lens), torch.tensor(query_lens),
        scale=0.37, sliding_window=window, softcap=softcap, sinks=sinks,
    )
    for b, n in enumerate(query_lens):
        torch.testing.assert_close(out[b, q_len - n :], ref[b, q_len - n :], atol=2e-5, rtol=2e-5)


def test_leading_blocks_layouts():
    """Leading blocks read in place: shared by every row (row stride 0), or consecutive in every row at one stride;
    a row that breaks the pattern, a freed block or fewer than 2 blocks or rows leave the rows gathered."""
    cpu = torch.device("cpu")
    shared = LeadingBlocks.of([[7, 3, 9, 1], [7, 3, 9, 2]], 4, cpu)
    assert shared.block_ids == [7, 3, 9] and shared.row_stride == 0 and shared.contiguous_start is None
    strided = LeadingBlocks.of([[0, 1, 2, 9], [3, 4, 5, 10], [6, 7, 8, 11]], 4, cpu)
    assert strided.block_ids == [0, 1, 2] and strided.row_stride == 3 and strided.contiguous_start == 0
    assert LeadingBlocks.of([[0, 1, 2, 9], [3, 4, 5, 10], [6, 7, 8, 11]], 2, cpu).block_ids == [0, 1]  # the limit
    assert LeadingBlocks.of([[0, 1, 2], [3, 4, 5], [7, 8, 9]], 3, cpu) is None  # row 2 off the stride
    assert LeadingBlocks.of([[4, 5, 6], [0, 1, 2]], 3, cpu) is None  # a negative stride
    assert LeadingBlocks.of([[-1, 1, 2], [3, 4, 5]], 3, cpu) is None  # a freed block
    assert LeadingBlocks.of([[0, 1, 2]], 3, cpu) is None and LeadingBlocks.of([[0, 5], [1, 6]], 2, cpu) is None


def test_torch_write_value_head_dim_of_its_own():
    """`torch_write` puts K and V of different widths into their own pools, int8 scales included."""
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 3, 5, 24, generator=gen), torch.randn(2, 3, 5, 16, generator=gen)
    slots = torch.tensor([9, 3, 0, 17, 30, 4, 5, 6, 7, 8], dtype=torch.int64)
    for scaled in (False, True):
        dtype = torch.int8 if scaled else torch.float32
        kc, vc = torch.zeros(8, 4, 3, 24, dtype=dtype), torch.zeros(8, 4, 3, 16, dtype=dtype)
        scales = (torch.zeros(8, 4, 3, dtype=torch.float16), torch.zeros(8, 4, 3, dtype=torch.float16)) if scaled else None
        torch_write(kc, vc, key, value, None, slots, scales)
        for cache, new, scale in zip((kc, vc), (key, value), scales or (None, None), strict=True):
            got = cache.view(-1, 3, cache.shape[3])[slots]
            if scale is not None:
                got = dequantize(got, scale.view(-1, 3)[slots], torch.float32)
            want = new.transpose(1, 2).reshape(10, 3, -1)
            torch.testing.assert_close(got, want, atol=0.05 if scaled else 0, rtol=0)


@pytest.mark.parametrize("pool", ["contiguous", "at-offset", "head-major", "int8", "int8-head-major", "other-dtype"])
def test_one_token_write_by_its_slot(pool):
    """A decode step of one row (`single_slot`, no index tensor) writes exactly its slot, K and V each in their
    own width: through a strided view of the pool tensors (also at an offset into their storage, and head-major),
    through the indexed copy for quantized pools and K/V in another dtype than the pool."""
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(1, 3, 1, 24, generator=gen), torch.randn(1, 3, 1, 16, generator=gen)
    dtype = {"int8": torch.int8, "int8-head-major": torch.int8, "other-dtype": torch.float64}.get(pool, torch.float32)
    head_major = pool.endswith("head-major")
    cpu = torch.device("cpu")
    kc, vc = new_pool_tensor((10, 4, 3, 24), dtype, cpu, head_major), new_pool_tensor((10, 4, 3, 16), dtype, cpu, head_major)
    assert kc.is_contiguous() == vc.is_contiguous() == (not head_major)
    if pool == "at-offset":
        kc, vc = torch.zeros(12, 4, 3, 24)[2:], torch.zeros(12, 4, 3, 16)[2:]
    scales = (torch.zeros(10, 4, 3, dtype=torch.float16), torch.zeros(10, 4, 3, dtype=torch.float16)) if dtype == torch.int8 else None
    before = (kc.clone(), vc.clone())
    torch_write(kc, vc, key, value, None, None, scales, single_slot=29)
    for cache, old, new, scale in zip((kc, vc), before, (key, value), scales or (None, None), strict=True):
        got = cache.reshape(-1, 3, cache.shape[3])
        if scale is not None:
            got = dequantize(got, scale.view(-1, 3), torch.float32)
        torch.testing.assert_close(got[29].float(), new[0, :, 0].float(), atol=0.05 if scale is not None else 0, rtol=0)
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[29] = False
        assert torch.equal(cache.reshape(-1, 3, cache.shape[3])[untouched], old.reshape(-1, 3, cache.shape[3])[untouched])
    with pytest.raises(ValueError, match="write_slots or single_slot"):
        torch_write(kc, vc, key, value, None, None)


@pytest.mark.parametrize("index", sorted(IN_PLACE), ids=[f"case{i}" for i in sorted(IN_PLACE)])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "int8"])
def test_rows_in_runs_read_in_place_give_the_gathered_bits(index, quantized):
    """Rows that are each one run of blocks at a row stride are read as one view of the pool: every row's output
    has the bits of the same rows gathered."""
    seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, window, softcap, use_sinks = CASES[index]
    query, new_k, new_v, kc, vc, tables, _ = _case(
        seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, run_stride=RUN_LAYOUT[index]
    )
    sinks = torch.randn(heads) if use_sinks else None
    scales = None
    if quantized:
        (kc, ks), (vc, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
        new_k, new_v, scales = fake_quantize(new_k, torch.int8), fake_quantize(new_v, torch.int8), (ks, vs)
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, bs, window, torch.device("cpu"))
    assert meta.gather_table is None and meta.row_stride == RUN_LAYOUT[index] and meta.leading is None
    width = meta.num_gather
    rows = [list(range(meta.contiguous_start + r * meta.row_stride, meta.contiguous_start + r * meta.row_stride + width))
            for r in range(len(seq_lens))]
    gathered = dataclasses.replace(meta, contiguous_start=None, row_stride=0, gather_table=torch.tensor(rows))
    in_place = torch_paged_attention(query, new_k, new_v, kc, vc, meta, 0.37, softcap, sinks, scales)
    assert torch.equal(in_place, torch_paged_attention(query, new_k, new_v, kc, vc, gathered, 0.37, softcap, sinks, scales))


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same blocks in a head-major pool tensor (what `BlockPool` makes for the PyTorch path)."""
    return new_pool_tensor(tuple(cache.shape), cache.dtype, cache.device, head_major=True).copy_(cache)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "int8"])
def test_head_major_pool_gives_the_token_major_bits(case, quantized):
    """A head-major pool (each KV head's slots adjacent) is read to the bits of the token-major one, wherever the
    rows' blocks lie (gathered, shared, at a row stride, in runs read as one view), and a write lands in the same
    slots."""
    seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, window, softcap, use_sinks = case
    index = CASES.index(case)
    query, new_k, new_v, kc, vc, tables, _ = _case(
        seq_lens, query_lens, q_len, bs, heads, kv_heads, dim, shared, prefill_blocks=PREFILL_LAYOUT.get(index),
        run_stride=RUN_LAYOUT.get(index),
    )
    sinks = torch.randn(heads) if use_sinks else None
    scales = None
    if quantized:
        (kc, ks), (vc, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
        new_k, new_v, scales = fake_quantize(new_k, torch.int8), fake_quantize(new_v, torch.int8), (ks, vs)
    hk, hv = _head_major(kc), _head_major(vc)
    assert kv_heads == 1 or not hk.is_contiguous()
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, bs, window, torch.device("cpu"))
    want = torch_paged_attention(query, new_k, new_v, kc, vc, meta, 0.37, softcap, sinks, scales)
    assert torch.equal(torch_paged_attention(query, new_k, new_v, hk, hv, meta, 0.37, softcap, sinks, scales), want)
    slots = torch.randperm(kc.shape[0] * bs, generator=torch.Generator().manual_seed(index))[: len(seq_lens) * q_len]
    key = torch.randn(len(seq_lens), kv_heads, q_len, dim)
    torch_write(kc, vc, key, key, None, slots, scales and tuple(s.clone() for s in scales))
    torch_write(hk, hv, key, key, None, slots, scales and tuple(s.clone() for s in scales))
    assert torch.equal(hk, kc) and torch.equal(hv, vc)


@pytest.mark.parametrize(
    "seq_len,query_len,window,head_dim_v",
    [(70, 1, None, 16), (70, 1, 20, 16), (70, 9, None, 16), (70, 1, None, 24), (33, 33, None, 16)],
    ids=["decode", "decode-window", "prefill-with-history", "mla-widths", "prefill"],
)
def test_one_row_in_consecutive_blocks_is_read_as_a_view(seq_len, query_len, window, head_dim_v):
    """A single row whose blocks are consecutive is attended through one strided view of the pool (no gather):
    the result matches the reference, also when the pool tensors start at an offset into their storage."""
    block_size, heads, kv_heads, head_dim, first = 16, 4, 2, 16, 3
    gen = torch.Generator().manual_seed(seq_len + query_len)
    blocks = -(-seq_len // block_size)
    table = list(range(first, first + blocks))
    # Pools that are views at an offset of a larger tensor, with blocks of noise before and after the row's.
    key_cache = torch.randn(2 + first + blocks + 2, block_size, kv_heads, head_dim, generator=gen)[2:]
    value_cache = torch.randn(2 + first + blocks + 2, block_size, kv_heads, head_dim_v, generator=gen)[2:]
    query = torch.randn(1, heads, query_len, head_dim, generator=gen)
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim_v)
    positions = torch.arange(seq_len - query_len, seq_len) + first * block_size
    new_k, new_v = flat_k[positions].transpose(0, 1)[None], flat_v[positions].transpose(0, 1)[None]
    meta = build_torch_meta([table], [seq_len], [query_len], query_len, block_size, window, torch.device("cpu"))
    assert meta.direct == (query_len == seq_len)
    assert meta.direct or (meta.contiguous_start in table and meta.gather_table is None)  # (a window skips blocks)
    out = torch_paged_attention(query, new_k, new_v, key_cache, value_cache, meta, 0.37)
    ref = reference_paged_attention(
        query.transpose(1, 2), key_cache, value_cache, torch.tensor([table], dtype=torch.int32),
        torch.tensor([seq_len]), torch.tensor([query_len]), scale=0.37, sliding_window=window,
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


#: Cases gathered per row group: decode (sliced, no mask), decode of unequal rows (mask), a chunk with history
#: and padding, sliding window + softcap + sinks, int8 K/V, MLA widths.
GROUP_CASES = [
    # seq_lens, query_lens, q_len, window, softcap, sinks, quantized, head_dim_v
    ([70, 70, 70, 70, 70], [1] * 5, 1, None, None, False, False, 16),
    ([54, 97, 129, 33, 80], [1] * 5, 1, None, None, False, False, 16),
    ([54, 97, 129, 33, 80], [3, 5, 1, 5, 2], 5, None, None, False, False, 16),
    ([54, 97, 129, 33, 80], [1] * 5, 1, 40, 20.0, True, False, 16),
    ([54, 97, 129, 33, 80], [1] * 5, 1, None, None, False, True, 16),
    ([54, 97, 129, 33, 80], [1] * 5, 1, None, None, False, False, 24),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=[f"group{i}" for i in range(len(GROUP_CASES))])
def test_rows_gathered_in_groups_give_each_row_the_same_bits(case, monkeypatch):
    """Rows whose gathered K/V exceed `GATHER_CHUNK_BYTES` are gathered and attended a group at a time: every
    row's output is the one of a single gather over all rows, for every group size: bitwise without a mask (the
    decode of equally long rows), to the last bit of float32 with one (SDPA's masked kernel rounds by batch)."""
    import hf_paged.attention.torch_backend as backend

    seq_lens, query_lens, q_len, window, softcap, use_sinks, quantized, dim_v = case
    query, new_k, new_v, kc, vc, tables, _ = _case(seq_lens, query_lens, q_len, 4, 8, 2, 16, seed=7, head_dim_v=dim_v)
    sinks = torch.randn(8) if use_sinks else None
    scales = None
    if quantized:
        (kc, ks), (vc, vs) = quantize(kc, torch.int8), quantize(vc, torch.int8)
        new_k, new_v, scales = fake_quantize(new_k, torch.int8), fake_quantize(new_v, torch.int8), (ks, vs)
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, 4, window, torch.device("cpu"))
    assert meta.gather_table is not None and meta.leading is None
    whole = torch_paged_attention(query, new_k, new_v, kc, vc, meta, 0.37, softcap, sinks, scales)
    calls = []
    original = backend._gathered
    def counted(cache, m, *args):
        calls.append(m.gather_table.shape[0])
        return original(cache, m, *args)

    monkeypatch.setattr(backend, "_gathered", counted)
    per_row = meta.num_gather * 4 * 2 * (16 + dim_v) * query.element_size()
    for rows in (1, 2, 3, 4):
        calls.clear()
        monkeypatch.setattr(backend, "GATHER_CHUNK_BYTES", rows * per_row)
        grouped = torch_paged_attention(query, new_k, new_v, kc, vc, meta, 0.37, softcap, sinks, scales)
        if meta.mask is None:
            assert torch.equal(grouped, whole)
        else:
            torch.testing.assert_close(grouped, whole, atol=2e-7, rtol=2e-7)
        assert max(calls) <= rows and sum(calls) == 2 * len(seq_lens)  # K and V of every row, once
