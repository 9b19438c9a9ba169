"""Chooses the kernels that write and read paged K/V: Triton on CUDA, PyTorch elsewhere.

`HF_PAGED_BACKEND=triton|torch` forces one (read whenever a forward chooses its path; a batch-1 decode
step that continues the step before keeps that step's path, see `FastDecode.next_token`). Forcing
`triton` on CPU tensors needs `TRITON_INTERPRET=1` set before triton is imported (tests do this).

Never crash a user: `triton_supports()` names the reason the Triton path cannot take a call (dtype,
head dim, device, Triton missing or too old, an earlier compile/launch failure of the same kernel),
`attention_backend()` turns that into a choice and warns once per reason, and `triton_failed()` records
a kernel that failed to compile or launch so that later calls go straight to the PyTorch path.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch


BACKENDS = ("triton", "torch")
#: Oldest Triton the kernels are written for (tl.dot input_precision, tl.reshape).
MIN_TRITON = (3, 0)
#: Oldest GPU the kernels are compiled and checked for (sm_80: bf16 tensor cores; see kernels/triton/aot.py).
MIN_CAPABILITY = (8, 0)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

_lock = threading.Lock()
_warned: set[str] = set()
_failed: dict[tuple, str] = {}  # (device type, dtype, head_dim) -> why the kernel failed


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def triton_problem() -> str | None:
    """Why Triton cannot be used at all in this process (not installed, too old), or None."""
    try:
        import triton  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001 - a broken install is as good as none
        return f"Triton is not importable ({type(error).__name__}: {error}); pip install 'triton>=3.0'"
    version = getattr(triton, "__version__", "0")
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_TRITON:
        return f"Triton {version} is older than {'.'.join(map(str, MIN_TRITON))}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_FLOAT8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d)
#: Storage dtypes of quantized K/V (`kv_dtype="int8" | "fp8_e4m3" | "fp8_e5m2"`) that the kernels dequantize.
QUANTIZED_STORAGE_DTYPES = (torch.int8, *_FLOAT8)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None."""
    if device.type == "cuda":
        capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if capability < MIN_CAPABILITY:
            return (f"GPU compute capability {capability[0]}.{capability[1]} is below "
                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the oldest the kernels are built for")
        return None
    if device.type == "cpu" and _interpreter():
        return None
    return f"tensors on {device.type}: the Triton kernels need a CUDA GPU"


def triton_supports(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> str | None:
    """None when the Triton path can take this attention call, else the reason it cannot.

    Args:
        query: `[batch, num_heads, q_len, head_dim]` (HF layout, as the attention function gets it).
        key_cache: the layer's K pool `[num_blocks, block_size, num_kv_heads, head_dim]` (or this step's
            keys `[batch, num_kv_heads, q_len, head_dim]`: only dtype, head dim and device are read).
        value_cache: the V pool (or values), checked like `key_cache` when given.
        sliding_window, softcap, sinks: the call's features.
    """
    problem = triton_problem() or device_problem(query.device)
    if problem:
        return problem
    if query.dtype not in TRITON_DTYPES:
        return f"dtype {query.dtype} (the Triton kernels take float16, bfloat16, float32)"
    head_dim = query.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} (the Triton kernels take multiples of 8 up to {MAX_HEAD_DIM})"
    for name, t in (("K", key_cache), ("V", value_cache)):
        if t is None:
            continue
        if t.dtype != query.dtype and t.dtype not in QUANTIZED_STORAGE_DTYPES:
            return f"{name} cache dtype {t.dtype} differs from the query's {query.dtype}"
        if t.dtype in _FLOAT8 and t.device.type == "cuda" and _capability(_index(t.device)) < (8, 9):
            return f"{name} cache dtype {t.dtype}: float8 conversions need compute capability 8.9 or newer"
        if name == "K" and t.shape[-1] != head_dim:
            return f"K head_dim {t.shape[-1]} differs from the query's {head_dim}"
        if name == "V" and (t.shape[-1] % 8 or not 8 <= t.shape[-1] <= MAX_HEAD_DIM):
            return f"V head_dim {t.shape[-1]} (the Triton kernels take multiples of 8 up to {MAX_HEAD_DIM})"
        if t.device != query.device:
            return f"{name} cache on {t.device}, query on {query.device}"
    if query.stride(-1) != 1:
        return "query head_dim is not contiguous"
    if sliding_window is not None and sliding_window < 1:
        return f"sliding_window {sliding_window} < 1"
    if softcap is not None and not softcap > 0:
        return f"softcap {softcap} <= 0"
    if sinks is not None and sinks.numel() != query.shape[1]:
        return f"sinks of shape {tuple(sinks.shape)} (one per query head expected)"
    failed = _failed.get((query.device.type, query.dtype, head_dim))
    if failed:
        return failed
    return None


def warn_fallback(reason: str) -> None:
    """Warn once per distinct reason that the PyTorch path runs instead of the Triton kernels."""
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(f"hf_paged: using the PyTorch path instead of the Triton kernels: {reason}", RuntimeWarning,
                  stacklevel=3)


def triton_failed(query: torch.Tensor, error: BaseException, what: str = "kernel") -> str:
    """Record that a Triton kernel failed (compile or launch) for this device type, dtype and head dim,
    so later calls take the PyTorch path; warns once. Returns the reason."""
    reason = f"the Triton {what} failed for {query.dtype}, head_dim {query.shape[-1]}: {type(error).__name__}: {error}"
    reason = reason if len(reason) < 400 else reason[:400] + "..."
    _failed[(query.device.type, query.dtype, query.shape[-1])] = reason
    warn_fallback(reason)
    return reason


def attention_backend(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> str:
    """`"triton"` or `"torch"` for one attention call: `backend_for()`, then `triton_supports()`; a
    Triton choice that cannot take the call falls back to `"torch"` with one warning per reason."""
    if backend_for(query.device) != "triton":
        return "torch"
    reason = triton_supports(query, key_cache, value_cache, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if reason is None:
        return "triton"
    warn_fallback(reason)
    return "torch"


def strict_triton() -> bool:
    """Kernel failures raise instead of falling back: `HF_PAGED_TRITON_STRICT=1|0`; by default on under
    TRITON_INTERPRET (tests), where a failure is a bug to see, not a GPU toolchain to work around."""
    value = os.environ.get("HF_PAGED_TRITON_STRICT", "").strip()
    return value not in ("", "0") if value else _interpreter()


def is_fallback_error(error: BaseException) -> bool:
    """Whether a kernel call's exception means "use the PyTorch path" (compile errors, unsupported
    inputs, a driver refusing the launch): everything but out-of-memory, which PyTorch would hit too,
    and nothing when `strict_triton()`."""
    return isinstance(error, Exception) and not isinstance(error, torch.OutOfMemoryError) and not strict_triton()


def backend_for(device: torch.device) -> str:
    """`"triton"` or `"torch"` for tensors on `device`, honouring `HF_PAGED_BACKEND`."""
    forced = os.environ.get("HF_PAGED_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"HF_PAGED_BACKEND must be one of {BACKENDS}, got {forced!r}.")
        return forced
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def triton_available() -> bool:
    """Triton importable and recent enough (see `triton_problem()` for why not)."""
    return triton_problem() is None


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], src: list[int], dst: list[int], block_size: int
) -> None:
    """Copies blocks `src[i] -> dst[i]` in every given layer (copy-on-write of partial blocks).

    Args:
        key_caches, value_caches: per layer, `[num_blocks, block_size, num_kv_heads, head_dim]`.
        src, dst: block ids, same length.
    """
    device = key_caches[0].device
    src_t = torch.tensor(src, dtype=torch.int64, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=device)
    caches = [*key_caches, *value_caches]
    if (
        backend_for(device) == "triton"
        and all(t.device == device and t.is_contiguous() for t in caches)
        and len({t[0].numel() * t.element_size() for t in caches}) == 1
        and (caches[0][0].numel() * caches[0].element_size()) % 4 == 0  # the kernel copies 32-bit words
        and triton_problem() is None
        and device_problem(device) is None
        and ("copy", device.type) not in _failed
    ):
        from hf_paged.kernels import copy_blocks as triton_copy_blocks  # noqa: PLC0415

        try:
            triton_copy_blocks(key_caches=key_caches, value_caches=value_caches, src_block_ids=src_t, dst_block_ids=dst_t)
            return
        except Exception as error:  # noqa: BLE001 - never crash a user: copy with PyTorch instead
            if not is_fallback_error(error):
                raise
            reason = f"the Triton block copy failed: {type(error).__name__}: {error}"[:400]
            _failed[("copy", device.type)] = reason
            warn_fallback(reason)
    for cache in (*key_caches, *value_caches):
        s, d = src_t.to(cache.device), dst_t.to(cache.device)
        cache.index_copy_(0, d, cache.index_select(0, s))
