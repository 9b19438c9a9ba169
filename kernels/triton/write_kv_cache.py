"""Launcher for the cache write: new K/V tokens -> their slots in the paged pools."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, Repeatable, device_context
from .specializations import check_supported, head_dim_pad


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [batch, q_len, num_kv_heads, HEAD_DIM], strides below, last dim contiguous
    value_ptr,  # [batch, q_len, num_kv_heads, HEAD_DIM_V], own strides, last dim contiguous
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM], contiguous
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM_V], contiguous
    key_scale_ptr,  # QUANTIZED: float16 [num_blocks, block_size, num_kv_heads], written with the slot
    value_scale_ptr,  # QUANTIZED: float16 [num_blocks, block_size, num_kv_heads]
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
    QUANTIZED: tl.constexpr = False,  # int8/fp8 pools: store x / scale, one scale per token and head
    QMAX: tl.constexpr = 127.0,
    MANT_BITS: tl.constexpr = 0,  # 0: int8 (round to integers); float8: its mantissa bits (e4m3: 3, e5m2: 2)
    MIN_EXP: tl.constexpr = 0,  # float8: exponent of its smallest normal (e4m3: -6, e5m2: -14)
    NUM_SCALE_CANDIDATES: tl.constexpr = 1,  # scales tried per token-head (float8: hf_paged.memory.quant's; int8: 1)
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
        dims_v = tl.arange(0, HEAD_DIM_V_PAD)
        dim_v_ok = dims_v < HEAD_DIM_V
        dst_v = (slot * num_kv_heads + kv_head) * HEAD_DIM_V
        value = tl.load(value_ptr + (v_src + dims_v), mask=dim_v_ok)
        if QUANTIZED:
            scale_dst = slot * num_kv_heads + kv_head
            key = _quantize(
                key.to(tl.float32), dim_ok, key_scale_ptr + scale_dst, QMAX, MANT_BITS, MIN_EXP, NUM_SCALE_CANDIDATES
            )
            value = _quantize(
                value.to(tl.float32),
                dim_v_ok,
                value_scale_ptr + scale_dst,
                QMAX,
                MANT_BITS,
                MIN_EXP,
                NUM_SCALE_CANDIDATES,
            )
        tl.store(key_cache_ptr + (dst + dims), key.to(key_cache_ptr.dtype.element_ty), mask=dim_ok)
        tl.store(value_cache_ptr + (dst_v + dims_v), value.to(value_cache_ptr.dtype.element_ty), mask=dim_v_ok)


#: Scales are float16, at least its smallest normal (a zero vector keeps a positive scale); see hf_paged/memory/quant.py.
_SCALE_MIN = tl.constexpr(6.103515625e-05)
_SCALE_MAX = tl.constexpr(65504.0)
_SCALE_MAX_CODE = tl.constexpr(0x7BFF)  # float16 bits of _SCALE_MAX
#: Scales tried per float8 token-head (int8: one): hf_paged.memory.quant.NUM_SCALE_CANDIDATES (this package imports nothing of hf_paged;
#: tests/kernels/test_quantized_kernels.py checks the two agree).
NUM_SCALE_CANDIDATES = 32


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _to_grid(x, scale, QMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """`x / scale` (float32 over a float16 scalar) clamped to +-QMAX and rounded half to even onto the storage
    grid (integers for int8, float8's values otherwise), so the cast that follows is exact: the same values as
    torch's casts on every target, the interpreter included. `div_rn`: IEEE division, as torch's (`/` is
    approximate on NVIDIA GPUs)."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale.to(tl.float32)), -QMAX), QMAX)
    if MANT_BITS == 0:
        return _round_half_even(y)
    # float8: the grid step at |y| is 2 ** (exponent(y) - MANT_BITS), subnormals use the smallest normal's
    biased_exp = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127)
    step = ((biased_exp - MANT_BITS) << 23).to(tl.float32, bitcast=True)
    rounded = tl.abs(_round_half_even(tl.math.div_rn(y, step)) * step)
    # y's sign bit on the result, as torch's cast keeps it, -0.0 included (compiled for a GPU, a negation of 0.0
    # gives +0.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_error(x, ok, scale, unit, QMAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Squared error of `x` stored with `scale`, an exact int64 (`hf_paged.memory.quant.scale_error`): the same in
    any summation order, so the kernel picks the scale the PyTorch quantizer picks."""
    grid = _to_grid(x, scale, QMAX, MANT_BITS, MIN_EXP)
    error = ((grid * scale.to(tl.float32) - x) * unit).to(tl.int64)  # grid * scale is exact: fused or not
    error = tl.where(ok, error, 0)
    return tl.sum(error * error, axis=0)


@triton.jit
def _quantize(
    x,
    ok,
    scale_ptr,
    QMAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    NUM_SCALE_CANDIDATES: tl.constexpr,
):
    """`x` on the storage grid for the scale of smallest squared error among NUM_SCALE_CANDIDATES float16
    scales from `max|x| / QMAX` up to just under twice it (`hf_paged.memory.quant.quantize`, the first smallest on a
    tie); stores the float16 scale."""
    amax = tl.max(tl.where(ok, tl.abs(x), 0.0), axis=0)
    first = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX), _SCALE_MIN), _SCALE_MAX).to(tl.float16)
    # errors count units of amax / 2**20: unit = 2 ** (20 - floor(log2 amax)), from amax's exponent bits
    biased_exp = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 20)
    unit = ((274 - biased_exp) << 23).to(tl.float32, bitcast=True)
    first_code = first.to(tl.int16, bitcast=True).to(tl.int32)
    scale = first
    best = _scale_error(x, ok, first, unit, QMAX, MANT_BITS, MIN_EXP)
    for k in range(1, NUM_SCALE_CANDIDATES):
        code = tl.minimum(first_code + k * (1024 // NUM_SCALE_CANDIDATES), _SCALE_MAX_CODE)
        candidate = code.to(tl.int16).to(tl.float16, bitcast=True)
        error = _scale_error(x, ok, candidate, unit, QMAX, MANT_BITS, MIN_EXP)
        better = error < best
        scale = tl.where(better, candidate, scale)
        best = tl.where(better, error, best)
    tl.store(scale_ptr, scale)
    return _to_grid(x, scale, QMAX, MANT_BITS, MIN_EXP)


def write_launches(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> list[Launch]:
    """The launch of one `write_kv_cache` call (inputs already checked; shared with `aot.py`)."""
    batch, q_len, num_kv_heads, head_dim = key.shape
    if batch * q_len * num_kv_heads == 0:
        return []
    quantized = key_scale is not None
    dummy = torch.empty(1, dtype=torch.float16, device=key.device)
    kwargs = dict(
        key_scale_ptr=key_scale if quantized else dummy,
        value_scale_ptr=value_scale if quantized else dummy,
        QUANTIZED=quantized,
        QMAX=_qmax(key_cache.dtype) if quantized else 127.0,
        MANT_BITS=_float8_grid(key_cache.dtype)[0],
        MIN_EXP=_float8_grid(key_cache.dtype)[1],
        NUM_SCALE_CANDIDATES=NUM_SCALE_CANDIDATES if quantized and key_cache.dtype != torch.int8 else 1,
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


def _float8_grid(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, exponent of the smallest normal) of a float8 storage dtype; (0, 0) for any other."""
    grids = {getattr(torch, "float8_e4m3fn", None): (3, -6), getattr(torch, "float8_e5m2", None): (2, -14)}
    return grids.get(dtype, (0, 0))


def _qmax(dtype: torch.dtype) -> float:
    return 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)


def write_kv_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    step: dict | None = None,
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
        key_scale, value_scale: for int8 / float8 pools, float16 `[num_blocks, block_size, num_kv_heads]`,
            contiguous: each token-head is stored as `x / scale` rounded onto the storage grid, its scale in
            the same slot: `max|x| / 127` for int8; for float8 the scale of smallest squared error among
            `NUM_SCALE_CANDIDATES` from `max|x| / QMAX` (the dtype's max) up to twice it. None for pools in the K/V dtype.
        step: a dict the caller keeps across calls (the layers of a forward, and the next forwards), empty at
            first: a call checks its inputs and keeps its launch there; a later call whose tensors have the same
            shapes, strides, dtypes and devices is launched with its own tensors, neither checked nor laid out again
            (`launch.Repeatable`: a tensor passed before is not read again, so do not change a tensor's shape or
            strides in place between calls with one `step`).

    Raises:
        ValueError / TypeError naming the input that is not supported.
    """
    inputs = (key, value, key_cache, value_cache, key_scale, value_scale, slot_mapping)
    if step is not None:
        repeat = step.get("write")
        if repeat is not None and repeat.matches(inputs, ()):
            with device_context(key):
                repeat.run(inputs)
            return
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if key.dim() != 4 or key_cache.dim() != 4:
        raise ValueError(
            f"key must be [batch, q_len, kv_heads, head_dim] and key_cache [blocks, block_size, "
            f"kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(key_cache.shape)}"
        )
    batch, q_len, num_kv_heads, head_dim = key.shape
    check_supported(key.dtype, head_dim)
    if value.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value shape {tuple(value.shape)} does not match key shape {tuple(key.shape)}")
    head_dim_v = value.shape[3]
    check_supported(value.dtype, head_dim_v)
    if (
        tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim)
        or value_cache.dim() != 4
        or value_cache.shape[:3] != key_cache.shape[:3]
        or value_cache.shape[3] != head_dim_v
    ):
        raise ValueError(
            f"KV pools {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not hold "
            f"{num_kv_heads} heads of dim {head_dim}"
        )
    quantized = key_scale is not None or value_scale is not None
    if quantized:
        _check_scales(key_cache, value_cache, key_scale, value_scale)
    if (
        key.dtype != value.dtype
        or key_cache.dtype != value_cache.dtype
        or (key.dtype != key_cache.dtype and not quantized)
    ):
        raise TypeError(
            f"dtypes of K/V ({key.dtype}/{value.dtype}) and pools ({key_cache.dtype}/" f"{value_cache.dtype}) differ"
        )
    if len({t.device for t in (key, value, key_cache, value_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, pools and slot_mapping must be on one device")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("KV pools must be contiguous")
    if key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("key/value head_dim must be contiguous (stride 1)")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (batch, q_len):
        raise TypeError(
            f"slot_mapping must be int64 [batch={batch}, q_len={q_len}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    launches = write_launches(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
        key_scale=key_scale,
        value_scale=value_scale,
    )
    if step is not None:
        repeat = Repeatable(inputs, (), launches, inputs)
        if repeat.complete:
            step["write"] = repeat
    with device_context(key):
        for launch in launches:
            launch()


#: Storage dtypes of quantized pools.
QUANTIZED_DTYPES = tuple(
    d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d
)


def _check_scales(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key_scale: torch.Tensor | None, value_scale: torch.Tensor | None
) -> None:
    """Raise a ValueError/TypeError unless the pools are int8/float8 with float16 `[num_blocks, block_size,
    num_kv_heads]` contiguous scales on their device. Shared with `paged_attention`."""
    if key_scale is None or value_scale is None:
        raise ValueError("pass both key_scale and value_scale for a quantized pool, or neither")
    if key_cache.dtype not in QUANTIZED_DTYPES or value_cache.dtype != key_cache.dtype:
        raise TypeError(f"scales are for int8/float8 pools, got {key_cache.dtype}/{value_cache.dtype}")
    for name, t in (("key_scale", key_scale), ("value_scale", value_scale)):
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.float16
            or tuple(t.shape) != tuple(key_cache.shape[:3])
            or not t.is_contiguous()
            or t.device != key_cache.device
        ):
            raise ValueError(
                f"{name} must be a contiguous float16 {tuple(key_cache.shape[:3])} tensor on " f"{key_cache.device}"
            )
