"""Quantized K/V storage: `kv_dtype="int8" | "fp8_e4m3" | "fp8_e5m2"`.

A quantized pool stores each layer's K and V as one byte per element plus one float16 scale per token and
KV head (`[num_blocks, block_size, num_kv_heads]`, next to the `[num_blocks, block_size, num_kv_heads,
head_dim]` data): `x ~= q * scale`, with `scale = max|x| / QMAX` over the token's head vector. A token's
scale depends on nothing but the token itself, so a write never touches earlier slots, and copy-on-write,
prefix sharing, dedupe of identical rows and rollback move or drop slots without requantizing anything.
Why this granularity (and not a scale per block and head): see `docs/quantized-kv.md`. float8 pools quantize
each head vector rotated by a fixed orthogonal matrix (`rotation.py`); the functions here quantize what they are
given (the rotated vectors, for those pools), and the Triton write kernel stores bit-identically what they store.

At head_dim 64 a token-head takes 64 + 2 bytes instead of 256 (float32) or 128 (bfloat16): 0.258x / 0.516x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The accepted `kv_dtype` names (None keeps the model's dtype).
KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
#: The formats whose pools store each head vector rotated by a fixed orthogonal matrix (`rotation.py`): float8,
#: whose error is relative to each element. int8 stores K/V as they are (its blocks are what they were before).
ROTATED_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
#: dtype of the per-token, per-head scales.
SCALE_DTYPE = torch.float16
_SCALE_MIN = torch.finfo(torch.float16).tiny  # smallest normal float16: a zero vector keeps a positive scale
_SCALE_MAX = torch.finfo(torch.float16).max
_SCALE_MAX_CODE = 0x7BFF  # float16 bits of _SCALE_MAX: a candidate scale never becomes inf
#: Scales tried per float8 token-head vector (see `quantize`): they sample one octave, 1024 // 32 = 32 codes
#: apart. int8 keeps `max|x| / QMAX` (one candidate): the search gains it 3% RMS error, doubles its worst
#: element error (half a step of a scale up to twice as large) and flips a token of the peaked test models.
NUM_SCALE_CANDIDATES = 32
_CANDIDATE_CHUNK = 1 << 21  # elements per `[vectors, candidates, head_dim]` temporary of `quantize`


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How a quantized pool stores K/V.

    Attributes:
        name: the `kv_dtype` it was made from.
        storage_dtype: dtype of the stored elements (int8 or a float8 dtype).
        qmax: largest stored magnitude; a token-head's max |x| maps to it.
        rotate: whether the pool stores each head vector rotated (`x @ R`, `rotation.py`) before quantizing it.
    """

    name: str
    storage_dtype: torch.dtype
    qmax: float
    rotate: bool = False

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.storage_dtype, device="cpu").element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (one per token and KV head, for K and for V each)."""
        return torch.empty((), dtype=SCALE_DTYPE, device="cpu").element_size()


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
        return KVFormat(kv_dtype, torch.int8, 127.0, kv_dtype in ROTATED_KV_DTYPES)
    torch_name = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_dtype]
    dtype = getattr(torch, torch_name, None)
    if dtype is None:
        raise ValueError(
            f"kv_dtype={kv_dtype!r} needs torch.{torch_name}, which this torch {torch.__version__} lacks; "
            "upgrade torch (2.1 or newer) or use kv_dtype='int8'."
        )
    return KVFormat(kv_dtype, dtype, float(torch.finfo(dtype).max), kv_dtype in ROTATED_KV_DTYPES)


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
    """Quantizes head vectors, one scale per vector; for float8, the scale that minimizes the vector's squared error.

    int8 uses `max|x| / QMAX`. For float8 the candidates are `NUM_SCALE_CANDIDATES` float16 scales from `max|x| / QMAX` (rounded to float16) up to
    just under twice it, `1024 // NUM_SCALE_CANDIDATES` float16 codes apart; none clips more than the first
    one does. Each is scored by `scale_error(x, q, scale)` of the vector it gives, and the first smallest wins.
    Every vector is still quantized on its own, and reads stay `q * scale`.

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
    first = (amax / fmt.qmax).clamp(min=_SCALE_MIN, max=_SCALE_MAX).to(SCALE_DTYPE)
    if NUM_SCALE_CANDIDATES > 1 and storage_dtype != torch.int8 and first.numel():
        # all candidates at once, `[vectors, NUM_SCALE_CANDIDATES(, head_dim)]`, a bounded number of vectors at a time
        flat_x, flat_first, flat_unit = xf.reshape(-1, xf.shape[-1]), first.reshape(-1), _error_unit(amax).reshape(-1)
        steps = torch.arange(NUM_SCALE_CANDIDATES, dtype=torch.int16, device=x.device) * (1024 // NUM_SCALE_CANDIDATES)
        chunk = max(1, _CANDIDATE_CHUNK // (NUM_SCALE_CANDIDATES * xf.shape[-1]))
        chosen = []
        for start in range(0, flat_x.shape[0], chunk):
            part = flat_x[start : start + chunk, None, :]
            codes = flat_first[start : start + chunk].view(torch.int16)[:, None] + steps
            candidates = codes.clamp(max=_SCALE_MAX_CODE).view(SCALE_DTYPE)
            error = scale_error(part, _to_grid(part, candidates, fmt), candidates, flat_unit[start : start + chunk, None])
            chosen.append(candidates.gather(1, error.argmin(dim=1, keepdim=True))[:, 0])  # argmin: the first smallest
        first = torch.cat(chosen).view(first.shape)
    return _to_grid(xf, first, fmt).to(storage_dtype), first


def _to_grid(xf: torch.Tensor, scale: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """`xf / scale` (`[..., head_dim]` float32 over `[...]` float16) clamped to +-QMAX and rounded half to even
    onto the storage grid, as float32 values that the cast to the storage dtype keeps exactly."""
    scaled = (xf / scale.float().unsqueeze(-1)).clamp(-fmt.qmax, fmt.qmax)
    return scaled.round() if fmt.storage_dtype == torch.int8 else scaled.to(fmt.storage_dtype).float()


def _error_unit(amax: torch.Tensor) -> torch.Tensor:
    """`[...]` float32 power of two `2 ** (20 - floor(log2 amax))` (exponent bits of `amax`, float32): an error
    times it, truncated to an integer, counts units of at most `amax / 2**20`."""
    biased_exp = ((amax.view(torch.int32) >> 23) & 0xFF).clamp(min=20)  # amax < 2**-107 (or 0): unit 2**127
    return ((274 - biased_exp) << 23).view(torch.float32)


def scale_error(xf: torch.Tensor, grid: torch.Tensor, scale: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Squared reconstruction error of each vector, as an exact int64 so that any summation order (the Triton
    write kernel's included) gives the same number and the same choice of scale.

    `grid * scale` is exact in float32 (at most 8 significant bits times float16's 11), so `grid * scale - xf`
    is rounded once, the same way with or without a fused multiply-add; times `unit` (a power of two) and
    truncated it is an integer below 2**22 in magnitude, whose squares sum exactly in int64.

    Args:
        xf: `[..., head_dim]` float32; grid: `[..., head_dim]` float32 values on the storage grid;
        scale: `[...]` float16; unit: `[...]` float32 from `_error_unit`.

    Returns:
        `[...]` int64.
    """
    error = ((grid * scale.float().unsqueeze(-1) - xf) * unit.unsqueeze(-1)).to(torch.int64)
    return (error * error).sum(dim=-1)


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


def check_scales(where: str, key_scale: torch.Tensor, value_scale: torch.Tensor, slots: list[int]) -> None:
    """Raises AssertionError unless the K and V scales (`[num_blocks, block_size, num_kv_heads]` each) of every
    slot in `slots` are finite and positive; `where` names the layer in the message."""
    index = torch.tensor(slots, dtype=torch.int64, device=key_scale.device)
    for name, scale in (("K", key_scale), ("V", value_scale)):
        values = scale.view(-1, scale.shape[2]).index_select(0, index).float()
        bad = ~(torch.isfinite(values) & (values > 0)).all(dim=1)
        assert not bool(bad.any()), (
            f"{where}: {name} scales of filled slots {index[bad].tolist()[:8]} are not finite and positive"
        )
