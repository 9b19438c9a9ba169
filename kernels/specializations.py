"""The finite set of kernel specializations the launchers can pick.

Every constexpr combination a launcher may choose is derived here, from the same functions the
launchers call, so that the ahead-of-time compile test (`tests/kernels/test_aot.py`) covers exactly
what ships. Anything runtime (scale, sliding window, sinks, strides, block_size, GQA ratio) is a
plain kernel argument and does not multiply this set.

Shipped set (per GPU architecture):
  * paged attention: dtype x head_dim x {prefill tile, decode tile, decode tile split-KV}
    (fp32 uses one tile for prefill and decode; softcap, window and sinks are runtime flags)
  * split-KV reduction: dtype x head_dim
  * cache write: dtype x head_dim
  * block copy: element size (2 or 4 bytes)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS: tuple[int, ...] = (64, 80, 96, 128, 256)
#: Query rows (tokens x heads of one KV head) in the decode tile; tl.dot needs M >= 16 on GPU.
DECODE_BLOCK_M = 16

TRITON_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
}


def head_dim_pad(head_dim: int) -> int:
    """Head dim rounded up to a power of two (>= 16), the width of the register tiles."""
    return max(16, 1 << (head_dim - 1).bit_length())


@dataclass(frozen=True, slots=True)
class AttentionTile:
    """Tile sizes and launch options of one paged-attention specialization.

    BLOCK_M counts query rows (query tokens x query heads of one KV head), BLOCK_N counts key
    tokens per inner step. Neither is related to the KV storage `block_size`.
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


def attention_tile(dtype: torch.dtype, head_dim: int, *, decode: bool) -> AttentionTile:
    """Pick the tile for a dtype/head_dim, small-M ("decode") or large-M ("prefill").

    Register budget (per CTA, fp32 accumulators): acc is BLOCK_M x HEAD_DIM_PAD, the score tile
    BLOCK_M x BLOCK_N, plus the Q tile in the input dtype. The choices keep every shipped
    specialization free of spills on sm_80/sm_90 (checked by the AOT test).
    """
    pad = head_dim_pad(head_dim)
    if dtype == torch.float32:  # exact fp32 (FMA) dots: one small tile for every query length
        return AttentionTile(BLOCK_M=DECODE_BLOCK_M, BLOCK_N=16, num_warps=8 if pad > 128 else 4, num_stages=2)
    else:
        block_n = 32 if pad > 128 else 64
        block_m = DECODE_BLOCK_M if decode else 64
    return AttentionTile(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if decode else 8, num_stages=2)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One shipped paged-attention specialization."""

    dtype: torch.dtype
    head_dim: int
    decode: bool
    split_kv: bool

    @property
    def tile(self) -> AttentionTile:
        return attention_tile(self.dtype, self.head_dim, decode=self.decode)

    @property
    def name(self) -> str:
        kind = "split" if self.split_kv else ("decode" if self.decode else "prefill")
        return f"attn-{TRITON_DTYPE_NAMES[self.dtype]}-d{self.head_dim}-{kind}"


def attention_specs() -> list[AttentionSpec]:
    """All paged-attention specializations the launcher can select (split-KV only with the decode tile)."""
    specs = []
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for decode, split_kv in ((False, False), (True, False), (True, True)):
                if dtype == torch.float32 and not decode:
                    continue  # same tile as decode for fp32, see attention_tile
                specs.append(AttentionSpec(dtype, head_dim, decode, split_kv))
    return specs


def check_supported(dtype: torch.dtype, head_dim: int) -> None:
    """Raise a ValueError that says what is supported when (dtype, head_dim) is not shipped."""
    if dtype not in DTYPES:
        raise ValueError(f"paged kernels support dtypes {DTYPES}, got {dtype}; cast the model or KV cache")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged kernels support head_dim in {HEAD_DIMS}, got {head_dim}")
