"""Launcher for paged attention over ragged, left-padded rows (mixed prefill + decode)."""

from __future__ import annotations

import functools
import os

import torch
import triton

from .launch import Launch, Repeatable, device_context
from ._attention_kernels import _paged_attention_kernel, _split_kv_reduce_kernel
from .write_kv_cache import _check_scales
from .specializations import DECODE_BLOCK_M, attention_tile, check_supported, head_dim_pad, kv_block

#: No sliding window: every causal key is visible (p - k < 2**31 - 1 always holds).
_NO_WINDOW = 2**31 - 1
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 512
_SPLIT_MIN_CONTEXT = 2048


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreter_bf16(dtype: torch.dtype) -> bool:
    """Triton 3.9's interpreter multiplies bf16 tiles in tl.dot as raw integers; upcast there only."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_num_splits(*, num_programs: int, max_context: int, q_len: int, num_sms: int) -> int:
    """Split-KV (flash-decoding) heuristic; 1 means the single-pass kernel.

    Split only when the single pass leaves the GPU mostly idle and the context is long:
      * the decode tile is in use (each row's query tokens fit one tile, i.e. decode or short
        speculative steps; `q_len <= 16`),
      * the context upper bound `max_context` (block table width x block_size, known on the host
        without a sync) is at least 2048 tokens,
      * fewer programs than SMs.
    Then split so that about two programs run per SM, with at least 512 keys per split and at
    most 32 splits. Splits past a row's real length exit immediately.
    """
    if q_len > DECODE_BLOCK_M or max_context < _SPLIT_MIN_CONTEXT or num_programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, num_programs)
    by_length = max_context // _MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def _fail(cls: type[Exception], message: str) -> None:
    raise cls(message)


def check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError/TypeError naming the first input `paged_attention` cannot take."""
    for name, t in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_lens", query_lens),
    ):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 4 or key_cache.dim() != 4:
        _fail(
            ValueError,
            f"query must be [batch, q_len, heads, head_dim] and key_cache [blocks, block_size, "
            f"kv_heads, head_dim]; got {tuple(query.shape)} and {tuple(key_cache.shape)}",
        )
    batch, q_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = key_cache.shape
    check_supported(query.dtype, head_dim)
    if value_cache.dim() != 4:
        _fail(
            ValueError,
            f"value_cache must be [blocks, block_size, kv_heads, head_dim_v], got {tuple(value_cache.shape)}",
        )
    check_supported(query.dtype, value_cache.shape[3])
    if kv_head_dim != head_dim or value_cache.shape[:3] != key_cache.shape[:3]:
        _fail(
            ValueError,
            f"K/V pool shapes {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not match "
            f"query head_dim {head_dim}",
        )
    quantized = key_scale is not None or value_scale is not None
    if quantized:
        _check_scales(key_cache, value_cache, key_scale, value_scale)
    elif not key_cache.dtype == value_cache.dtype == query.dtype:
        _fail(
            TypeError, f"query ({query.dtype}) and KV pools ({key_cache.dtype}/{value_cache.dtype}) must share a dtype"
        )
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens, query_lens)}
    if len(devices) != 1:
        _fail(ValueError, f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        _fail(ValueError, "KV pools must be contiguous")
    if query.stride(3) != 1 and head_dim > 1:
        _fail(ValueError, "query head_dim must be contiguous (stride 1)")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(ValueError, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 1:
        _fail(ValueError, "block_size must be >= 1")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        _fail(
            TypeError,
            f"block_tables must be int32 [batch={batch}, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}",
        )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        _fail(ValueError, "block_tables rows must be contiguous")
    for name, t in (("seq_lens", seq_lens), ("query_lens", query_lens)):
        if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or not t.is_contiguous():
            _fail(TypeError, f"{name} must be a contiguous int32 [batch={batch}], got {t.dtype} {tuple(t.shape)}")
    if sliding_window is not None and sliding_window < 1:
        _fail(ValueError, f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        _fail(ValueError, f"softcap must be > 0, got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        _fail(ValueError, f"sinks must be [num_heads={num_heads}], got {tuple(sinks.shape)}")
    out_shape = (*query.shape[:3], value_cache.shape[3])
    if out is not None and (
        tuple(out.shape) != out_shape
        or out.dtype != query.dtype
        or not out.is_contiguous()
        or out.device != query.device
    ):
        _fail(ValueError, f"out must be a contiguous {query.dtype} tensor of shape {out_shape} on {query.device}")


def attention_launches(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    num_splits: int | None,
    num_sms: int | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> list[Launch]:
    """The launches of one `paged_attention` call (inputs already checked). Shared with `aot.py`,
    which feeds it representative tensors on the meta device to compile what the JIT would build."""
    batch, q_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    head_dim_v = value_cache.shape[3]
    device = query.device
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    if sinks is not None:
        sinks = sinks.to(device=device, dtype=torch.float32).contiguous()

    group_size = num_heads // num_kv_heads
    decode = q_len * min(group_size, DECODE_BLOCK_M) <= DECODE_BLOCK_M
    rows = q_len * group_size
    quantized = key_scale is not None
    tile = attention_tile(query.dtype, head_dim, decode=decode, rows=rows, head_dim_v=head_dim_v, quantized=quantized)

    def layout(tile):
        heads_per_tile = min(group_size, tile.BLOCK_M)
        num_head_chunks = triton.cdiv(group_size, heads_per_tile)
        num_q_tiles = triton.cdiv(q_len, tile.BLOCK_M // heads_per_tile)
        return heads_per_tile, num_head_chunks, num_q_tiles

    heads_per_tile, num_head_chunks, num_q_tiles = layout(tile)
    num_programs = num_q_tiles * batch * num_kv_heads * num_head_chunks
    if num_splits is None:
        num_splits = 1
        if decode and (num_sms is not None or query.is_cuda):
            num_splits = choose_num_splits(
                num_programs=num_programs,
                max_context=block_tables.shape[1] * block_size,
                q_len=q_len,
                num_sms=num_sms if num_sms is not None else _num_sms(query.device.index or 0),
            )
    if int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = int(num_splits)
    split_kv = num_splits > 1
    if split_kv and not decode:  # split-KV ships with the decode tiles only
        tile = attention_tile(query.dtype, head_dim, decode=True, rows=rows, head_dim_v=head_dim_v, quantized=quantized)
        heads_per_tile, num_head_chunks, num_q_tiles = layout(tile)

    if split_kv:
        partial = torch.empty((batch, q_len, num_heads, num_splits, head_dim_v), dtype=torch.float32, device=device)
        row_max = torch.empty((batch, q_len, num_heads, num_splits), dtype=torch.float32, device=device)
        row_sum = torch.empty_like(row_max)
        target, max_arg, sum_arg = partial, row_max, row_sum
    else:
        target, max_arg, sum_arg = out, dummy, dummy

    launches = [
        Launch(
            _paged_attention_kernel,
            (num_q_tiles, batch, num_kv_heads * num_head_chunks * num_splits),
            dict(
                out_ptr=target,
                max_ptr=max_arg,
                sum_ptr=sum_arg,
                query_ptr=query,
                key_cache_ptr=key_cache,
                value_cache_ptr=value_cache,
                key_scale_ptr=key_scale if key_scale is not None else dummy,
                value_scale_ptr=value_scale if value_scale is not None else dummy,
                block_tables_ptr=block_tables,
                seq_lens_ptr=seq_lens,
                query_lens_ptr=query_lens,
                sinks_ptr=sinks if sinks is not None else dummy,
                scale=float(scale),
                softcap=float(softcap) if softcap is not None else 1.0,
                sliding_window=int(sliding_window) if sliding_window is not None else _NO_WINDOW,
                has_sinks=int(sinks is not None),
                use_softcap=int(softcap is not None),
                q_len=q_len,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                group_size=group_size,
                heads_per_tile=heads_per_tile,
                num_head_chunks=num_head_chunks,
                num_splits=num_splits,
                block_size=block_size,
                stride_q_batch=query.stride(0),
                stride_q_token=query.stride(1),
                stride_q_head=query.stride(2),
                stride_bt_batch=block_tables.stride(0),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad(head_dim),
                BLOCK_M=tile.BLOCK_M,
                BLOCK_N=tile.BLOCK_N,
                KV_BLOCK=kv_block(block_size),
                USE_DOT=tile.use_dot,
                SPLIT_KV=split_kv,
                HEAD_DIM_V=head_dim_v,
                HEAD_DIM_V_PAD=head_dim_pad(head_dim_v),
                DOT_IN_FP32=_interpreter_bf16(query.dtype),
                QUANTIZED=key_scale is not None,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
            ),
        )
    ]
    if split_kv:
        launches.append(
            Launch(
                _split_kv_reduce_kernel,
                (batch * q_len * num_heads,),
                dict(
                    out_ptr=out,
                    partial_ptr=partial,
                    max_ptr=row_max,
                    sum_ptr=row_sum,
                    num_splits=num_splits,
                    HEAD_DIM=head_dim_v,
                    HEAD_DIM_PAD=head_dim_pad(head_dim_v),
                    num_warps=4,
                ),
            )
        )
    return launches


def paged_attention(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    step: dict | None = None,
) -> torch.Tensor:
    """Causal attention of ragged, left-padded queries over a paged KV cache.

    Args:
        query: `[batch, q_len, num_heads, head_dim]`, fp16/bf16/fp32, head_dim a multiple of 8 up
            to 256, any strides with the last dim contiguous (HF's `[B, H, Q, D]` transposed). Row
            `b` has `query_lens[b]` real tokens right-aligned on the q axis; the rest is padding and
            gets zeros.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD),
            contiguous, same dtype as `query`; the value head dim may differ from the key's
            (multi-latent attention, e.g. K 192 / V 128; a multiple of 8 up to 256).
        block_tables: int32 `[batch, max_blocks_per_seq]`; key at logical position `k` of row `b`
            lives in block `block_tables[b, k // block_size]`. Entries never read may be -1.
        seq_lens: int32 `[batch]`, tokens stored per row including this step's.
        query_lens: int32 `[batch]`, `0 <= query_lens[b] <= min(q_len, seq_lens[b])`.
        scale: multiplier of `q.k`.
        sliding_window: key `k` visible to query position `p` iff `p - sliding_window < k <= p`.
        softcap: logits become `softcap * tanh(logits / softcap)`.
        sinks: `[num_heads]` extra per-head logit in the softmax denominator (no value).
        out: optional contiguous `[batch, q_len, num_heads, head_dim_v]` output, query dtype.
        num_splits: force the split-KV count (1 = single pass); `None` uses `choose_num_splits`.
        key_scale, value_scale: for int8 / float8 pools (any query dtype), float16 `[num_blocks, block_size,
            num_kv_heads]` contiguous per-token scales (`K = key_cache * key_scale`); dequantized inside the
            tile loop: a key's scale multiplies its score column, a value tile is scaled in fp32 on load.
        step: a dict the caller keeps across calls (the layers of a forward, and the next forwards), empty at
            first. A call checks its inputs and keeps its launches there; a later call whose tensors have the same
            shapes, strides, dtypes and devices and whose scalars are the same is launched with its own tensors,
            neither checked nor laid out again (`launch.Repeatable`: a tensor passed before is not read again, so
            do not change a tensor's shape or strides in place between calls with one `step`).

    Returns:
        Contiguous `[batch, q_len, num_heads, head_dim_v]` tensor in the query dtype (zeros for an
        empty batch or padding rows).

    Raises:
        ValueError / TypeError naming the input that is not supported.
    """
    inputs = scalars = None
    if step is not None:
        if sinks is not None:  # (as the launches take them, so that a later call's are found by identity)
            sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
        inputs = (query, key_cache, value_cache, sinks, key_scale, value_scale, out, block_tables, seq_lens, query_lens)
        scalars = (scale, sliding_window, softcap, num_splits)
        repeat = step.get("attention")
        if repeat is not None and repeat.matches(inputs, scalars):
            if out is None:
                out = torch.empty((*query.shape[:3], value_cache.shape[3]), dtype=query.dtype, device=query.device)
            with device_context(query):
                repeat.run(_with_out(inputs, out))
            return out
    check_attention_inputs(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_lens,
        sliding_window,
        softcap,
        sinks,
        out,
        key_scale,
        value_scale,
    )
    if out is None:
        out = torch.empty((*query.shape[:3], value_cache.shape[3]), dtype=query.dtype, device=query.device)
    batch, q_len, num_heads, _ = query.shape
    if batch == 0 or q_len == 0 or num_heads == 0:
        return out
    with device_context(query):
        launches = attention_launches(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_lens=query_lens,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
            out=out,
            num_splits=num_splits,
            key_scale=key_scale,
            value_scale=value_scale,
        )
        if step is not None:
            tensors = _with_out(inputs, out)
            repeat = Repeatable(inputs, scalars, launches, tensors)
            if repeat.complete:
                step["attention"] = repeat
        for launch in launches:
            launch()
    return out


def _with_out(inputs: tuple, out: torch.Tensor) -> tuple:
    """A call's launch inputs (`paged_attention`'s `inputs` order) with its output tensor in place."""
    return (*inputs[:6], out, *inputs[7:])
