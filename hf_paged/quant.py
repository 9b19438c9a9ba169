"""Quantized K/V storage: `kv_dtype="int8" | "fp8_e4m3" | "fp8_e5m2"`.

A quantized pool stores each layer's K and V as one byte per element plus one float16 scale per token and
KV head (`[num_blocks, block_size, num_kv_heads]`, next to the `[num_blocks, block_size, num_kv_heads,
head_dim]` data): `x ~= q * scale`, with `scale = max|x| / QMAX` over the token's head vector. A token's
scale depends on nothing but the token itself, so a write never touches earlier slots, and copy-on-write,
prefix sharing, dedupe of identical rows and rollback move or drop slots without requantizing anything.
Why this granularity (and not a scale per block and head): see `docs/quantized-kv.md`.

At head_dim 64 a token-head takes 64 + 2 bytes instead of 256 (float32) or 128 (bfloat16): 0.258x / 0.516x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The accepted `kv_dtype` names (None keeps the model's dtype).
KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
#: dtype of the per-token, per-head scales.
SCALE_DTYPE = torch.float16
_SCALE_MIN = torch.finfo(torch.float16).tiny  # smallest normal float16: a zero vector keeps a positive scale
_SCALE_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How a quantized pool stores K/V.

    Attributes:
        name: the `kv_dtype` it was made from.
        storage_dtype: dtype of the stored elements (int8 or a float8 dtype).
        qmax: largest stored magnitude; a token-head's max |x| maps to it.
    """

    name: str
    storage_dtype: torch.dtype
    qmax: float

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (one per token and KV head, for K and for V each)."""
        return torch.empty((), dtype=SCALE_DTYPE).element_size()


def kv_format(kv_dtype: str | None) -> KVFormat | None:
    """The storage format of a `kv_dtype`, or None for unquantized storage in the model's dtype.

    Raises:
        ValueError: an unknown name, or an fp8 name on a torch without float8 dtypes.
    """
    if kv_dtype is None:
        return None
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"kv_dtype must be one of {KV_DTYPES} or None (store K/V in the model's dtype), got {kv_dtype!r}."
        )
    if kv_dtype == "int8":
        return KVFormat(kv_dtype, torch.int8, 127.0)
    torch_name = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype]
    dtype = getattr(torch, torch_name, None)
    if dtype is None:
        raise ValueError(
            f"kv_dtype={kv_dtype!r} needs torch.{torch_name}, which this torch {torch.__version__} lacks; "
            "upgrade torch (2.1 or newer) or use kv_dtype='int8'."
        )
    return KVFormat(kv_dtype, dtype, float(torch.finfo(dtype).max))


def format_of(storage_dtype: torch.dtype) -> KVFormat | None:
    """The quantized format whose elements are `storage_dtype`, or None if that dtype is not a quantized one."""
    for name in KV_DTYPES:
        try:
            fmt = kv_format(name)
        except ValueError:
            continue
        if fmt is not None and fmt.storage_dtype == storage_dtype:
            return fmt
    return None


def quantize(x: torch.Tensor, storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes head vectors, one scale per vector.

    Args:
        x: `[..., head_dim]` floating point.
        storage_dtype: int8 or a float8 dtype.

    Returns:
        `(q [..., head_dim] storage_dtype, scale [...] float16)` with `x ~= q * scale`.
    """
    fmt = format_of(storage_dtype)
    if fmt is None:
        raise ValueError(f"{storage_dtype} is not a quantized K/V dtype (int8, float8_e4m3fn, float8_e5m2).")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / fmt.qmax).clamp(min=_SCALE_MIN, max=_SCALE_MAX).to(SCALE_DTYPE)
    scaled = (xf / scale.float().unsqueeze(-1)).clamp(-fmt.qmax, fmt.qmax)
    if storage_dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(storage_dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q * scale` in `dtype`.

    Args:
        q: `[..., head_dim]` stored elements; scale: `[...]` their scales.
    """
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def fake_quantize(x: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """`x` as a quantized pool would give it back (`[..., head_dim]`, in `x`'s dtype)."""
    q, scale = quantize(x, storage_dtype)
    return dequantize(q, scale, x.dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A one-byte storage tensor viewed as uint8 (PyTorch's CPU `index_copy_` has no float8 kernel)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t
