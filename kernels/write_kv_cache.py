"""Launcher for the cache write: new K/V tokens -> their slots in the paged pools."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, device_context
from .specializations import check_supported, head_dim_pad


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [batch, q_len, num_kv_heads, HEAD_DIM], strides below, last dim contiguous
    value_ptr,  # [batch, q_len, num_kv_heads, HEAD_DIM_V], own strides, last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM], contiguous
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM_V], contiguous
    slot_mapping_ptr,  # int64 [batch * q_len], contiguous; -1 = padding, skip
    q_len,
    num_kv_heads,
    stride_k_batch,
    stride_k_token,
    stride_k_head,
    stride_v_batch,
    stride_v_token,
    stride_v_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # == HEAD_DIM except multi-latent attention (e.g. K 192 / V 128)
    HEAD_DIM_V_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # flat index over batch * q_len
    kv_head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        batch = token // q_len
        t = token % q_len
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        k_src = batch * stride_k_batch + t * stride_k_token + kv_head * stride_k_head
        v_src = batch * stride_v_batch + t * stride_v_token + kv_head * stride_v_head
        dst = (slot * num_kv_heads + kv_head) * HEAD_DIM  # contiguous NHD pool, int64
        key = tl.load(key_ptr + (k_src + dims), mask=dim_ok)
        tl.store(key_cache_ptr + (dst + dims), key, mask=dim_ok)
        dims_v = tl.arange(0, HEAD_DIM_V_PAD)
        dim_v_ok = dims_v < HEAD_DIM_V
        dst_v = (slot * num_kv_heads + kv_head) * HEAD_DIM_V
        value = tl.load(value_ptr + (v_src + dims_v), mask=dim_v_ok)
        tl.store(value_cache_ptr + (dst_v + dims_v), value, mask=dim_v_ok)


def write_launches(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[Launch]:
    """The launch of one `write_kv_cache` call (inputs already checked; shared with `aot.py`)."""
    batch, q_len, num_kv_heads, head_dim = key.shape
    if batch * q_len * num_kv_heads == 0:
        return []
    kwargs = dict(
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping.contiguous(),
        q_len=q_len,
        num_kv_heads=num_kv_heads,
        stride_k_batch=key.stride(0),
        stride_k_token=key.stride(1),
        stride_k_head=key.stride(2),
        stride_v_batch=value.stride(0),
        stride_v_token=value.stride(1),
        stride_v_head=value.stride(2),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad(head_dim),
        HEAD_DIM_V=value.shape[3],
        HEAD_DIM_V_PAD=head_dim_pad(value.shape[3]),
        num_warps=1,
    )
    return [Launch(_write_kv_cache_kernel, (batch * q_len, num_kv_heads), kwargs)]


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into their slots.

    Args:
        key, value: `[batch, q_len, num_kv_heads, head_dim]`, any strides with the last dim
            contiguous (HF's `[B, KVH, Q, D]` transposed), same dtype as the pools; head_dim a
            multiple of 8 up to 256. Values may have their own head dim (multi-latent attention).
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD),
            contiguous; written in place.
        slot_mapping: int64 `[batch, q_len]`; token `(b, t)` goes to slot
            `slot_mapping[b, t]` (= block_id * block_size + offset); -1 skips the token (padding).

    Raises:
        ValueError / TypeError naming the input that is not supported.
    """
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if key.dim() != 4 or key_cache.dim() != 4:
        raise ValueError(f"key must be [batch, q_len, kv_heads, head_dim] and key_cache [blocks, block_size, "
                         f"kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(key_cache.shape)}")  # fmt: skip
    batch, q_len, num_kv_heads, head_dim = key.shape
    check_supported(key.dtype, head_dim)
    if value.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value shape {tuple(value.shape)} does not match key shape {tuple(key.shape)}")
    head_dim_v = value.shape[3]
    check_supported(value.dtype, head_dim_v)
    if (tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim) or value_cache.dim() != 4
            or value_cache.shape[:3] != key_cache.shape[:3] or value_cache.shape[3] != head_dim_v):  # fmt: skip
        raise ValueError(f"KV pools {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not hold "
                         f"{num_kv_heads} heads of dim {head_dim}")  # fmt: skip
    if not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        raise TypeError(f"dtypes of K/V ({key.dtype}/{value.dtype}) and pools ({key_cache.dtype}/"
                        f"{value_cache.dtype}) differ")  # fmt: skip
    if len({t.device for t in (key, value, key_cache, value_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, pools and slot_mapping must be on one device")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV pools must be contiguous")
    if key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("key/value head_dim must be contiguous (stride 1)")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (batch, q_len):
        raise TypeError(f"slot_mapping must be int64 [batch={batch}, q_len={q_len}], got {slot_mapping.dtype} "
                        f"{tuple(slot_mapping.shape)}")  # fmt: skip
    launches = write_launches(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    with device_context(key):
        for launch in launches:
            launch()
