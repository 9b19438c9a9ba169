"""A fixed orthogonal rotation of quantized K/V head vectors (`docs/quantized-kv.md`, "Rotation").

A pool whose format rotates (`KVFormat.rotate`) stores `quantize(x @ R)` instead of `quantize(x)`, with one
fixed orthogonal `R` `[head_dim, head_dim]` per head width. Attention needs no un-rotation of the stored keys and
values: scores are invariant, `(q R)·(k R) = q·k`, and the output of rotated values is the rotated output,
`sum_j p_j (v_j R) = (sum_j p_j v_j) R`. So a forward rotates its query and new K/V (`to_storage`), both
backends attend in the rotated space, and the output is rotated back (`from_storage`); whatever reads stored
K/V as such (`readback.read_slots`) rotates them back. Copies of blocks and scales move rotated data as is.

Why: float8's error is relative to each element, so the error of a score `q·k` grows with `sum_i q_i^2 k_i^2`,
which is large when q and k are both large in the same few channels (as RoPE's low frequencies make them). `R`
spreads every channel over all of them.

`R` is built from closed forms, the same on every process and rank: for `head_dim = 2**a * m` (m odd) it is
`H ⊗ C`, the normalized Sylvester-Hadamard matrix of order `2**a` (every entry `±2**(-a/2)`: a channel is
spread evenly over all) times the orthonormal DCT-II matrix of order `m` (`[[1]]` for a power of two).
"""

from __future__ import annotations

import math

import torch

from .quant import KVFormat, fake_quantize

_MATRICES: dict[tuple[int, torch.device], torch.Tensor] = {}


def rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation of a head width: float32 `[head_dim, head_dim]`, orthogonal, on `device` (built once per
    width and device)."""
    device = torch.device(device)
    key = (head_dim, device)
    if key not in _MATRICES:
        _MATRICES[key] = _build(head_dim).to(device)
    return _MATRICES[key]


def _build(head_dim: int) -> torch.Tensor:
    """`H_{2**a} ⊗ C_m` in float64 on the CPU, rounded to float32 (`head_dim = 2**a * m`, m odd)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}.")
    power = head_dim & -head_dim  # largest power of two dividing head_dim
    odd = head_dim // power
    hadamard = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    while hadamard.shape[0] < power:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard /= math.sqrt(power)
    freq = torch.arange(odd, dtype=torch.float64, device="cpu")[:, None]
    pos = torch.arange(odd, dtype=torch.float64, device="cpu")[None, :]
    dct = torch.cos(math.pi * (2 * pos + 1) * freq / (2 * odd)) * math.sqrt(2 / odd)
    dct[0] = 1 / math.sqrt(odd)  # row j: frequency j over positions k (orthonormal DCT-II)
    return torch.kron(hadamard, dct).float()


def rotates(fmt: KVFormat | None) -> bool:
    """Whether a pool of this format stores rotated K/V (None: unquantized, never)."""
    return fmt is not None and fmt.rotate


def to_storage(x: torch.Tensor) -> torch.Tensor:
    """`x @ R` (`[..., head_dim]`, computed in float32, returned in `x`'s dtype): a query, key or value moved into
    the rotated space that a rotating pool stores."""
    return (x.float() @ rotation(x.shape[-1], x.device)).to(x.dtype)


def from_storage(x: torch.Tensor) -> torch.Tensor:
    """`x @ R^T` (`[..., head_dim]`, computed in float32, returned in `x`'s dtype): stored (dequantized) K/V or an
    attention output moved back out of the rotated space."""
    return (x.float() @ rotation(x.shape[-1], x.device).T).to(x.dtype)


def kv_to_storage(fmt: KVFormat | None, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New K and V (`[..., head_dim]` and `[..., head_dim_v]`) as a pool of `fmt` stores them: rotated if it rotates,
    else unchanged."""
    return (to_storage(key), to_storage(value)) if rotates(fmt) else (key, value)


def as_stored(fmt: KVFormat | None, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New K and V (`[..., head_dim]` and `[..., head_dim_v]`) as a pool of `fmt` gives them back once written:
    quantized and dequantized (in the rotated space when it rotates), in their own dtype; unchanged when unquantized."""
    if fmt is None:
        return key, value
    key, value = kv_to_storage(fmt, key, value)
    key, value = fake_quantize(key, fmt.storage_dtype), fake_quantize(value, fmt.storage_dtype)
    return (from_storage(key), from_storage(value)) if rotates(fmt) else (key, value)
