"""Chooses the kernels that write and read paged K/V: Triton on CUDA, PyTorch elsewhere.

`HF_PAGED_BACKEND=triton|torch` forces one (read at every call). Forcing `triton` on CPU tensors needs
`TRITON_INTERPRET=1` set before triton is imported (tests do this).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("triton", "torch")


def backend_for(device: torch.device) -> str:
    """`"triton"` or `"torch"` for tensors on `device`, honouring `HF_PAGED_BACKEND`."""
    forced = os.environ.get("HF_PAGED_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"HF_PAGED_BACKEND must be one of {BACKENDS}, got {forced!r}.")
        return forced
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


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
    if backend_for(device) == "triton" and all(t.device == device for t in key_caches + value_caches):
        from hf_paged.kernels import copy_blocks as triton_copy_blocks  # noqa: PLC0415

        triton_copy_blocks(key_caches=key_caches, value_caches=value_caches, src_block_ids=src_t, dst_block_ids=dst_t)
        return
    for cache in (*key_caches, *value_caches):
        s, d = src_t.to(cache.device), dst_t.to(cache.device)
        cache.index_copy_(0, d, cache.index_select(0, s))
