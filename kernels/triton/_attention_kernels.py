"""Triton kernels for paged attention: one pass over the keys, and the split-KV reduction.

Layout reminders (see `paged_attention.py` for the full contract):
  query:        [batch, q_len, num_heads, head_dim], any strides, head_dim contiguous
  key/value:    [num_blocks, block_size, num_kv_heads, head_dim] (NHD), contiguous
  block_tables: int32 [batch, max_blocks_per_seq]
A program owns BLOCK_M "rows" = (query token, query head) pairs that share one KV head, so every
K/V tile is loaded once for all query heads of its group (GQA/MQA). Keys are walked BLOCK_N tokens
at a time, tiles aligned to BLOCK_N. A power-of-two `block_size` is a constexpr (KV_BLOCK) and
block ids are loaded once per tile (KV_BLOCK >= BLOCK_N) or once per block of the tile; any other
block size takes a generic path with one id per key token. Tiles of 1-4 rows (MHA decode) skip
tl.dot (which needs 16 rows on a GPU) and multiply-reduce in fp32 instead, so no row is wasted.
head_dim may be any multiple of 8: tiles are HEAD_DIM_PAD (next power of two) wide and masked.
All pointer offsets are computed in int64, summed before they touch a pointer (so the IR
shows one int64 offset per access; `test_kv_addresses_are_int64` checks it).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
#: Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) free of inf - inf.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); saturates cleanly to +-1 when exp overflows/underflows.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # no split: [batch, q_len, num_heads, HEAD_DIM_V] contiguous, query dtype
    #           split:    fp32 [batch, q_len, num_heads, num_splits, HEAD_DIM_V] unnormalised partials
    max_ptr,  # split: fp32 [batch, q_len, num_heads, num_splits] running max (log2 units); else unused
    sum_ptr,  # split: fp32 [batch, q_len, num_heads, num_splits] softmax denominators; else unused
    query_ptr,  # [batch, q_len, num_heads, HEAD_DIM], strides below, last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM], contiguous
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM_V], contiguous
    key_scale_ptr,  # QUANTIZED: float16 [num_blocks, block_size, num_kv_heads] (K ~= key_cache * scale)
    value_scale_ptr,  # QUANTIZED: float16 [num_blocks, block_size, num_kv_heads]
    block_tables_ptr,  # int32 [batch, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [batch] tokens stored, including this step's
    query_lens_ptr,  # int32 [batch] real (right-aligned) query tokens
    sinks_ptr,  # fp32 [num_heads] (read only when has_sinks)
    scale,  # fp32 multiplier of q.k
    softcap,  # fp32, used when use_softcap
    sliding_window,  # int32: key k visible to position p iff p - k < sliding_window
    has_sinks,  # int32 0/1
    use_softcap,  # int32 0/1 (a uniform runtime branch: rare feature, halves the shipped set)
    q_len,
    num_heads,
    num_kv_heads,
    group_size,  # num_heads // num_kv_heads
    heads_per_tile,  # query heads of one KV head per program (<= BLOCK_M)
    num_head_chunks,  # cdiv(group_size, heads_per_tile)
    num_splits,  # 1 unless SPLIT_KV
    block_size,  # KV storage tokens per block (read only when KV_BLOCK == 0)
    stride_q_batch,
    stride_q_token,
    stride_q_head,
    stride_bt_batch,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr,  # block_size when it is a power of two (block ids loaded per tile), else 0
    USE_DOT: tl.constexpr,  # tl.dot (BLOCK_M >= 16); else broadcast-multiply-sum for 1-4 row tiles
    SPLIT_KV: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # value head dim (== HEAD_DIM except multi-latent attention, e.g. K 192 / V 128)
    HEAD_DIM_V_PAD: tl.constexpr,
    DOT_IN_FP32: tl.constexpr = False,  # only under TRITON_INTERPRET for bf16: its bf16 tl.dot is wrong
    QUANTIZED: tl.constexpr = False,  # int8/fp8 pools with per-token, per-KV-head scales
):
    pid_q = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_z = tl.program_id(2)
    split = pid_z % num_splits
    head_chunk = pid_z // num_splits
    kv_head = head_chunk // num_head_chunks
    chunk = head_chunk % num_head_chunks

    # ---- rows of this program: (query token, query head) pairs --------------------------------
    tokens_per_tile = BLOCK_M // heads_per_tile
    rows = tl.arange(0, BLOCK_M)
    token_in_tile = rows // heads_per_tile
    head_in_group = chunk * heads_per_tile + rows % heads_per_tile
    q_idx = pid_q * tokens_per_tile + token_in_tile  # index on the q_len axis
    head = kv_head * group_size + head_in_group
    row_ok = (token_in_tile < tokens_per_tile) & (head_in_group < group_size) & (q_idx < q_len)

    seq_len = tl.load(seq_lens_ptr + batch)
    query_len = tl.load(query_lens_ptr + batch)
    num_pad = q_len - query_len
    row_real = row_ok & (q_idx >= num_pad)
    pos = seq_len - q_len + q_idx  # logical position of each row's query token

    # ---- key range [kv_start, kv_end) needed by the real rows of this tile ---------------------
    first_q = tl.maximum(pid_q * tokens_per_tile, num_pad)
    last_q = tl.minimum(pid_q * tokens_per_tile + tokens_per_tile, q_len) - 1
    kv_start = tl.maximum(seq_len - q_len + first_q - sliding_window + 1, 0)
    kv_end = tl.maximum(seq_len - q_len + last_q + 1, kv_start)
    if last_q < first_q:
        kv_end = kv_start
    # Tiles start on multiples of BLOCK_N (so a tile never straddles a power-of-two KV block it
    # does not fully cover); keys before kv_start are masked.
    tiles_from = (kv_start // BLOCK_N) * BLOCK_N
    if SPLIT_KV:
        chunk_len = tl.cdiv(tl.cdiv(kv_end - tiles_from, num_splits), BLOCK_N) * BLOCK_N
        tiles_from = tiles_from + split * chunk_len
        kv_start = tl.maximum(kv_start, tiles_from)
        kv_end = tl.minimum(kv_end, tiles_from + chunk_len)
    if kv_end <= kv_start:  # nothing to attend: no tile (and no block-table read past the row's blocks)
        tiles_from = kv_end

    # ---- load Q, initialise the online softmax (a sink is an extra logit with no value) -------
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offs = batch * stride_q_batch + q_idx.to(tl.int64) * stride_q_token + head.to(tl.int64) * stride_q_head
    q = tl.load(query_ptr + (q_offs[:, None] + dims[None, :]), mask=row_real[:, None] & dim_ok[None, :], other=0.0)
    # (vector & scalar-bool promotes to int32 under the interpreter, so combine as integers)
    sink_on = has_sinks * (split == 0).to(tl.int32)
    use_sink = (row_ok.to(tl.int32) * sink_on) != 0
    sink = tl.load(sinks_ptr + head, mask=use_sink, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.where(use_sink, sink, NEG_BIG)
    l_i = tl.where(use_sink, 1.0, 0.0)
    dims_v = tl.arange(0, HEAD_DIM_V_PAD)
    dim_v_ok = dims_v < HEAD_DIM_V
    acc = tl.zeros((BLOCK_M, HEAD_DIM_V_PAD), dtype=tl.float32)
    # fp32 inputs use exact fp32 dots (small tiles, see specializations.py); 3xTF32 spilled at d256.
    precision: tl.constexpr = "ieee"
    if not USE_DOT:
        q_f32 = q.to(tl.float32)

    bt_row_ptr = block_tables_ptr + batch * stride_bt_batch
    for tile_start in range(tiles_from, kv_end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        k_ok = (k_pos >= kv_start) & (k_pos < kv_end)
        # Slot of every key token of the tile. With a power-of-two block size (a constexpr) the
        # block ids are loaded once per block, not once per key token.
        if KV_BLOCK >= BLOCK_N:  # the tile lies in one block: one block id
            block_id = tl.load(bt_row_ptr + tile_start // KV_BLOCK).to(tl.int64)
            slots = block_id * KV_BLOCK + ((tile_start % KV_BLOCK) + tl.arange(0, BLOCK_N))
        elif KV_BLOCK > 0:  # the tile covers BLOCK_N // KV_BLOCK whole blocks
            NUM_IDS: tl.constexpr = BLOCK_N // KV_BLOCK
            blk = tile_start // KV_BLOCK + tl.arange(0, NUM_IDS)
            blk_ok = ((blk + 1) * KV_BLOCK > kv_start) & (blk * KV_BLOCK < kv_end)
            ids = tl.load(bt_row_ptr + blk, mask=blk_ok, other=0).to(tl.int64)
            slots = tl.reshape(ids[:, None] * KV_BLOCK + tl.arange(0, KV_BLOCK)[None, :], (BLOCK_N,))
        else:  # any other block size: one id per key token
            block_ids = tl.load(bt_row_ptr + k_pos // block_size, mask=k_ok, other=0)
            slots = block_ids.to(tl.int64) * block_size + (k_pos % block_size)
        # Offsets from the contiguous NHD layout with constexpr HEAD_DIM, so the compiler can prove
        # HEAD_DIM-wide contiguity and alignment and vectorise the gathers.
        kv_offs = (slots * num_kv_heads + kv_head) * HEAD_DIM
        if QUANTIZED:  # a key's scale multiplies its score column: q.(k_q * s) == (q.k_q) * s
            scale_offs = slots * num_kv_heads + kv_head
            k_scale = (tl.load(key_scale_ptr + scale_offs, mask=k_ok, other=0.0).to(tl.float32) * scale)[None, :]
        else:
            k_scale = scale
        if USE_DOT:
            k = tl.load(key_cache_ptr + (kv_offs[None, :] + dims[:, None]), mask=k_ok[None, :] & dim_ok[:, None], other=0.0)
            if QUANTIZED:  # int8 and fp8 values are exact in every query dtype
                k = k.to(tl.float32) if DOT_IN_FP32 else k.to(q.dtype)
            if DOT_IN_FP32:
                scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=precision) * k_scale
            else:
                scores = tl.dot(q, k, input_precision=precision) * k_scale
        else:
            k = tl.load(key_cache_ptr + (kv_offs[:, None] + dims[None, :]), mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
            scores = tl.sum(q_f32[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * k_scale
        if use_softcap != 0:
            scores = softcap * _tanh(scores / softcap)
        scores = scores * LOG2E
        age = pos[:, None] - k_pos[None, :]  # >= 0 for causal keys
        visible = row_real[:, None] & k_ok[None, :] & (age >= 0) & (age < sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_offs = (slots * num_kv_heads + kv_head) * HEAD_DIM_V
        v = tl.load(value_cache_ptr + (v_offs[:, None] + dims_v[None, :]), mask=k_ok[:, None] & dim_v_ok[None, :], other=0.0)
        if QUANTIZED:  # dequantize the tile in fp32, then round to the query dtype like the PyTorch path
            v_scale = tl.load(value_scale_ptr + scale_offs, mask=k_ok, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        if USE_DOT:
            if DOT_IN_FP32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=precision)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=precision)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # ---- write ----------------------------------------------------------------------------------
    row_lin = (batch * q_len + q_idx.to(tl.int64)) * num_heads + head.to(tl.int64)
    store_mask = row_ok[:, None] & dim_v_ok[None, :]
    if SPLIT_KV:
        part = row_lin * num_splits + split
        tl.store(out_ptr + (part[:, None] * HEAD_DIM_V + dims_v[None, :]), acc, mask=store_mask)
        tl.store(max_ptr + part, m_i, mask=row_ok)
        tl.store(sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # padding rows: acc == 0 -> zeros
        out_ptrs = out_ptr + (row_lin[:, None] * HEAD_DIM_V + dims_v[None, :])
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,  # [batch * q_len * num_heads, HEAD_DIM] contiguous, query dtype
    partial_ptr,  # fp32 [batch * q_len * num_heads, num_splits, HEAD_DIM]
    max_ptr,  # fp32 [batch * q_len * num_heads, num_splits]
    sum_ptr,  # fp32 [batch * q_len * num_heads, num_splits]
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m_all = NEG_BIG
    for s in range(num_splits):
        m_all = tl.maximum(m_all, tl.load(max_ptr + row * num_splits + s))
    total = 0.0
    acc = tl.zeros((HEAD_DIM_PAD,), dtype=tl.float32)
    for s in range(num_splits):
        weight = tl.exp2(tl.load(max_ptr + row * num_splits + s) - m_all)
        total += weight * tl.load(sum_ptr + row * num_splits + s)
        part = tl.load(partial_ptr + ((row * num_splits + s) * HEAD_DIM + dims), mask=dim_ok, other=0.0)
        acc += weight * part
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + (row * HEAD_DIM + dims), out.to(out_ptr.dtype.element_ty), mask=dim_ok)
