"""The finite set of kernel specializations the launchers can pick.

Every constexpr combination a launcher may choose is derived here, from the same functions the
launchers call, so that the ahead-of-time compile test (`tests/kernels/test_aot.py`) covers exactly
what ships. Anything runtime (scale, sliding window, sinks, strides, block_size, GQA ratio) is a
plain kernel argument and does not multiply this set.

Constexprs of the kernels (per GPU architecture):
  * paged attention: dtype x head_dim (every multiple of 8 up to 256) x tile {prefill, decode,
    small decode of 1/2/4 rows} x split-KV x KV_BLOCK (power-of-two block size, or 0 = generic);
    softcap, window and sinks are runtime flags
  * split-KV reduction: dtype x head_dim
  * cache write: dtype x head_dim
  * block copy: one kernel (raw 32-bit words)
On top of these, Triton's JIT specializes integer arguments equal to 1 and divisible by 16 and
pointers aligned to 16 bytes; `aot.py` derives the compile set from representative launches through
Triton's own binder, so it compiles what the JIT would build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
#: Every multiple of 8 up to 256: register tiles are padded to the next power of two and masked.
HEAD_DIMS: tuple[int, ...] = tuple(range(8, 257, 8))
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


#: Decode tiles with at most this many rows (query tokens x heads of one KV head: MHA decode, GQA 2
#: decode, MHA 2-token steps) multiply-reduce without tl.dot in a BLOCK_M of 1 or 2 rows instead of
#: wasting 15/16 or 14/16 of a 16-row dot tile. (At 4 rows the [4, BLOCK_N, 256] products leave too
#: few keys per step or spill; GQA 4 keeps the dot tile.)
SMALL_TILE_ROWS = 2
#: Elements of the [BLOCK_M, BLOCK_N, HEAD_DIM_PAD] products of a small fp16/bf16 tile: 32 fp32 per
#: thread at 4 warps (8192 spilled at head_dim 256 on sm_80/sm_90); half of it for fp32 inputs.
_SMALL_TILE_ELEMENTS = 4096


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kv_block(block_size: int) -> int:
    """The KV_BLOCK constexpr: a power-of-two block size is compiled in (block ids loaded once per
    tile or per block); any other size takes the generic path (0, one block id per key token)."""
    return block_size if block_size >= 1 and block_size & (block_size - 1) == 0 else 0


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
    use_dot: bool = True


def attention_tile(
    dtype: torch.dtype,
    head_dim: int,
    *,
    decode: bool,
    rows: int | None = None,
    head_dim_v: int | None = None,
    quantized: bool = False,
) -> AttentionTile:
    """Pick the tile for a dtype/head_dim: small-M ("decode") or large-M ("prefill").

    `head_dim_v`: the value head dim when it differs (multi-latent attention); tiles are sized for
    the wider of the two.
    `quantized`: int8/float8 pools (a converted K tile and an fp32 V tile live next to the loaded ones).
    `rows` (query tokens x query heads per KV head) of at most `SMALL_TILE_ROWS` in a decode
    selects a tile of exactly that many rows (rounded up to a power of two) computed without tl.dot.

    Register budget (per CTA, fp32 accumulators): acc is BLOCK_M x HEAD_DIM_PAD, the score tile
    BLOCK_M x BLOCK_N, plus the Q tile in the input dtype. The choices keep every shipped
    specialization free of spills on sm_80/sm_90 (checked by the AOT test).
    """
    mla = head_dim_v is not None and head_dim_v != head_dim  # a value head dim of its own
    pad = head_dim_pad(max(head_dim, head_dim_v or 0))
    # Two-row small tiles at head_dim 256 (2 x 8 keys) spilled 16 bytes on sm_80 or sm_90 whatever
    # the warps; they take the dot tile there.
    if decode and rows is not None and (rows == 1 or (rows <= SMALL_TILE_ROWS and pad <= 128)):
        block_m = next_pow2(rows)
        elements = _SMALL_TILE_ELEMENTS // (2 if dtype == torch.float32 else 1)  # fp32 K/V tiles: twice the registers
        block_n = max(8, min(64, elements // (block_m * pad)))
        # fp32 queries over float8 K 192 / V 128 pools spilled 8 bytes on sm_90 at 4 warps (8 warps: 58 registers)
        num_warps = 8 if mla and quantized and dtype == torch.float32 else 4
        return AttentionTile(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=2, use_dot=False)
    if dtype == torch.float32:  # exact fp32 (FMA) dots: one small tile for every query length
        # 4 warps, no software pipelining: 8 warps (d256, sm_80) and 2 stages (d64 generic block size on
        # sm_80, d128 split-KV on sm_90) each left ptxas spilling 8-16 bytes
        return AttentionTile(BLOCK_M=DECODE_BLOCK_M, BLOCK_N=16, num_warps=4, num_stages=1)
    block_n = 32 if pad > 128 else 64
    block_m = DECODE_BLOCK_M if decode else 64
    if decode and pad <= 64:  # 16 x 64 spilled 8-40 bytes on sm_90 (head_dim 16 generic block size, 64 split-KV)
        block_n = 32
    # Quantized decode tiles take 16 keys per step at head_dim > 128 (16 x 32 spilled 8-40 bytes on sm_80/sm_90,
    # d256 fp16/bf16) and at head_dim <= 64 (16 x 32 spilled 20 bytes on sm_90, d64 bf16 int8 GQA 4).
    if decode and quantized and (pad > 128 or pad <= 64):
        block_n = 16
    # decode at head_dim > 128 takes 8 warps: 4 spilled 16 bytes on sm_80 (masked head_dim 248, split-KV)
    num_warps = 4 if decode and pad <= 128 else 8
    if mla and not decode:  # K 192 / V 128 prefill: 8 warps spilled 24-32 bytes on sm_80; 4 warps use 188 registers
        num_warps = 4
    return AttentionTile(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=2)


def check_supported(dtype: torch.dtype, head_dim: int) -> None:
    """Raise a ValueError that says what is supported when (dtype, head_dim) is not shipped."""
    if dtype not in DTYPES:
        raise ValueError(f"paged kernels support dtypes {DTYPES}, got {dtype}; cast the model or KV cache")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged kernels support head_dim a multiple of 8 from 8 to 256, got {head_dim}")
