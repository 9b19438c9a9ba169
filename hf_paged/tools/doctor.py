"""`python -m hf_paged doctor [--model PATH]`: is this machine ready for hf-paged, and are its kernels right here?

Prints the versions (python, torch, transformers, triton, hf_paged), the device, the backend the
`"paged"` attention picks for each attention shape and why; then runs every Triton kernel (cache write,
paged attention incl. split-KV, block copy) on the device against the PyTorch path
(`hf_paged.attention.torch_backend`) for the model's shapes (head_dim, GQA ratio, dtype, sliding window, softcap,
sinks; from the config at `--model`, or a default set) and prints the largest errors. It ends with a short
bandwidth micro-benchmark of the path the device runs: the Triton kernels on a GPU, the PyTorch path on CPU
(`--no-bench` skips it). Exits 1 on any mismatch, 0 otherwise; 2 for arguments it cannot use (a `--model` with
no readable config), in one line.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here before triton
is imported) at small shapes: slow, but it checks the numerics of the same kernel code.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, replace

import torch

from ..errors import UnsupportedModelError
from .cli_args import model_path_or_id

#: Largest |triton - torch| accepted, per dtype (outputs are O(1)).
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Shape:
    """One attention configuration of a model."""

    name: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    head_dim_v: int | None = None  # the stored values' width where it differs from the keys' (with reads_gathered)
    reads_gathered: bool = False  # the model expands what its cache stores, so it reads the blocks gathered

    def describe(self) -> str:
        features = [f"window {self.sliding_window}"] if self.sliding_window else []
        features += [f"softcap {self.softcap}"] if self.softcap else []
        features += ["sinks"] if self.sinks else []
        dtype = str(self.dtype).replace("torch.", "")
        gqa = self.num_heads // self.num_kv_heads
        if self.reads_gathered:
            value_width = self.head_dim_v or self.head_dim
            return (
                f"{self.name}: stores K {self.head_dim} / V {value_width} wide, {self.num_kv_heads} KV head(s) "
                f"per layer, {self.num_heads} query heads, {dtype}"
            )
        return (
            f"{self.name}: head_dim {self.head_dim}, {self.num_heads} heads / {self.num_kv_heads} KV heads "
            f"(GQA {gqa}), {dtype}" + (", " + ", ".join(features) if features else "")
        )


DEFAULT_SHAPES = (
    Shape("llama-like", 128, 32, 8, torch.bfloat16),
    Shape("mha", 64, 12, 12, torch.float16),
    Shape("gemma2-like", 256, 8, 4, torch.bfloat16, sliding_window=4096, softcap=50.0),
    Shape("gpt-oss-like", 64, 64, 8, torch.bfloat16, sliding_window=128, sinks=True),
    Shape("odd-head-dim", 72, 16, 2, torch.float32),
)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def shapes_from_config(path: str, dtype: torch.dtype | None) -> list[Shape]:
    """The attention shapes of the model at `path` (a local directory or hub id already cached)."""
    from transformers import AutoConfig  # noqa: PLC0415

    from hf_paged.memory.layers import layout_from_config  # noqa: PLC0415
    from hf_paged.support import reads_gathered  # noqa: PLC0415

    config = AutoConfig.from_pretrained(path)
    layout_from_config(config)  # a model no paged cache serves (pure state-space, chunked attention): refused here
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    head_dim_v = None
    gathered = reads_gathered(config)
    if gathered and getattr(text, "qk_rope_head_dim", None):
        # Multi-latent attention (DeepSeek V2/V3): update() gets the compressed latent and the rotary key as one
        # "KV head" each (K: kv_lora_rank wide, V: qk_rope_head_dim wide); the model expands them afterwards.
        kv_heads, head_dim, head_dim_v = 1, text.kv_lora_rank, text.qk_rope_head_dim
    if dtype is None:
        configured = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
        if isinstance(configured, str):
            configured = getattr(torch, configured, None)
        dtype = configured if configured in TOLERANCE else torch.bfloat16
    window = getattr(text, "sliding_window", None)
    layer_types = set(getattr(text, "layer_types", None) or [])
    softcap = getattr(text, "attn_logit_softcapping", None)
    sinks = getattr(text, "model_type", "") in ("gpt_oss",)
    name = getattr(text, "model_type", "model")
    shapes = [Shape(name, head_dim, heads, kv_heads, dtype, None, softcap, sinks, head_dim_v, gathered)]
    if window and (not layer_types or "sliding_attention" in layer_types):
        if layer_types and "full_attention" in layer_types:
            shapes.append(Shape(f"{name} (sliding layers)", head_dim, heads, kv_heads, dtype, window, softcap, sinks))
        else:
            shapes = [replace(shapes[0], sliding_window=window)]
    return shapes


def _small(shape: Shape) -> Shape:
    """The interpreter's version of a shape: the same head_dim, GQA ratio and features, fewer heads."""
    group = shape.num_heads // shape.num_kv_heads
    kv_heads = 1 if group > 1 else 2
    window = None if shape.sliding_window is None else min(shape.sliding_window, 24)
    return replace(shape, num_heads=kv_heads * group, num_kv_heads=kv_heads, sliding_window=window)


def _pools(shape: Shape, seq_lens, block_size, device, gen):
    """Random pools and shuffled block tables (the largest block id always used)."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").tolist()
    perm.remove(num_blocks - 1)
    perm.insert(0, num_blocks - 1)
    tables, used = [], 0
    for n in blocks:
        tables.append(perm[used : used + n])
        used += n
    shape_ = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(shape_, generator=gen, device="cpu").to(device=device, dtype=shape.dtype)
    value_cache = torch.randn(shape_, generator=gen, device="cpu").to(device=device, dtype=shape.dtype)
    return key_cache, value_cache, tables


def _slots(tables, seq_lens, query_lens, q_len, block_size) -> torch.Tensor:
    slots = torch.full((len(seq_lens), q_len), -1, dtype=torch.int64, device="cpu")
    for b, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for j in range(q_len - n, q_len):
            pos = s - q_len + j
            slots[b, j] = tables[b][pos // block_size] * block_size + pos % block_size
    return slots


def check_attention(shape: Shape, case: str, device: torch.device, gen: torch.Generator) -> float:
    """Max |triton - torch path| of one attention call (`case`: prefill / decode / split-kv)."""
    from hf_paged.kernels import paged_attention  # noqa: PLC0415
    from hf_paged.attention.torch_backend import torch_paged_attention  # noqa: PLC0415
    from hf_paged.attention.torch_meta import build_torch_meta  # noqa: PLC0415

    block_size = 16
    small = device.type != "cuda"
    if case == "prefill":
        seq_lens, query_lens = ([45, 13], [13, 9]) if small else ([1500, 700], [700, 300])
        q_len, splits = max(query_lens), 1
    else:
        seq_lens = [61, 7] if small else [4100, 900]
        query_lens, q_len = [1, 1], 1
        splits = 3 if case == "split-kv" else 1
    key_cache, value_cache, tables = _pools(shape, seq_lens, block_size, device, gen)
    host = dict(generator=gen, device="cpu")  # (drawn on the host from the CPU generator, then moved)
    query = torch.randn(len(seq_lens), shape.num_heads, q_len, shape.head_dim, **host).to(device, shape.dtype)
    sinks = torch.randn(shape.num_heads, **host).to(device) if shape.sinks else None
    scale = shape.head_dim**-0.5
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    out = paged_attention(
        query=query.transpose(1, 2),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        scale=scale,
        sliding_window=shape.sliding_window,
        softcap=shape.softcap,
        sinks=sinks,
        num_splits=splits,
    )
    slots = _slots(tables, seq_lens, query_lens, q_len, block_size).to(device)
    new_k = key_cache.view(-1, shape.num_kv_heads, shape.head_dim)[slots.clamp(min=0)].transpose(1, 2)
    new_v = value_cache.view(-1, shape.num_kv_heads, shape.head_dim)[slots.clamp(min=0)].transpose(1, 2)
    meta = build_torch_meta(tables, seq_lens, query_lens, q_len, block_size, shape.sliding_window, device)
    ref = torch_paged_attention(query, new_k, new_v, key_cache, value_cache, meta, scale, shape.softcap, sinks)
    real = torch.arange(q_len, device=device)[None, :] >= (q_len - torch.tensor(query_lens, device=device))[:, None]
    return (out[real].float() - ref[real].float()).abs().max().item()


def check_write(shape: Shape, device: torch.device, gen: torch.Generator) -> float:
    """Max |triton - torch| of the pools after writing one left-padded step (0 expected)."""
    from hf_paged.kernels import write_kv_cache  # noqa: PLC0415
    from hf_paged.attention.torch_backend import torch_write  # noqa: PLC0415

    seq_lens, query_lens, q_len, block_size = [20, 9], [5, 3], 5, 16
    _, _, tables = _pools(shape, seq_lens, block_size, device, gen)
    num_blocks = max(max(t) for t in tables) + 1
    pools = [
        torch.zeros(num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
        for _ in range(4)
    ]
    host = dict(generator=gen, device="cpu")  # (drawn on the host from the CPU generator, then moved)
    key = torch.randn(2, shape.num_kv_heads, q_len, shape.head_dim, **host).to(device, shape.dtype)
    value = torch.randn(2, shape.num_kv_heads, q_len, shape.head_dim, **host).to(device, shape.dtype)
    slots = _slots(tables, seq_lens, query_lens, q_len, block_size).to(device)
    write_kv_cache(
        key=key.transpose(1, 2),
        value=value.transpose(1, 2),
        key_cache=pools[0],
        value_cache=pools[1],
        slot_mapping=slots,
    )
    flat = slots.flatten()
    index = torch.nonzero(flat >= 0).flatten()
    torch_write(pools[2], pools[3], key, value, index, flat[index])
    return max(
        (pools[0].float() - pools[2].float()).abs().max().item(),
        (pools[1].float() - pools[3].float()).abs().max().item(),
    )


def check_copy(shape: Shape, device: torch.device, gen: torch.Generator) -> float:
    """Max |triton - torch| after copying blocks in two layers (0 expected)."""
    from hf_paged.kernels import copy_blocks  # noqa: PLC0415

    pools = [
        torch.randn(6, 16, shape.num_kv_heads, shape.head_dim, generator=gen, device="cpu").to(device, shape.dtype)
        for _ in range(4)
    ]
    want = [p.clone() for p in pools]
    src = torch.tensor([5, 0], dtype=torch.int64, device=device)
    dst = torch.tensor([1, 3], dtype=torch.int64, device=device)
    copy_blocks(key_caches=pools[:2], value_caches=pools[2:], src_block_ids=src, dst_block_ids=dst)
    for w in want:
        w.index_copy_(0, dst, w.index_select(0, src))
    return max((p.float() - w.float()).abs().max().item() for p, w in zip(pools, want, strict=True))


def bandwidth(device: torch.device) -> list[str]:
    """Decode attention over a long context and a block copy on the path `device` runs (the Triton kernels on
    CUDA, the PyTorch path otherwise, at a smaller size): effective GB/s of K/V read."""
    from hf_paged import backend  # noqa: PLC0415
    from hf_paged.attention.torch_backend import torch_paged_attention  # noqa: PLC0415
    from hf_paged.attention.torch_meta import build_torch_meta  # noqa: PLC0415
    from hf_paged.memory.slots import new_pool_tensor  # noqa: PLC0415

    cuda = device.type == "cuda"
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    batch, context, dtype = (32, 4096, torch.bfloat16) if cuda else (4, 1024, torch.float32)
    blocks_per_row = context // block_size
    pool = (batch * blocks_per_row, block_size, kv_heads, head_dim)
    # the layout a pool takes on this path: token-major for the Triton kernels, head-major for the PyTorch path
    key_cache = new_pool_tensor(pool, dtype, device, head_major=not cuda).normal_()
    value_cache = new_pool_tensor(pool, dtype, device, head_major=not cuda).normal_()
    tables = torch.randperm(batch * blocks_per_row, device=device).view(batch, blocks_per_row).to(torch.int32)
    query = torch.randn(batch, 1, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    n = min(256, pool[0] // 2)  # blocks copied: 0..n-1 onto n..2n-1
    if cuda:
        from hf_paged.kernels import copy_blocks, paged_attention  # noqa: PLC0415

        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        ones = torch.ones(batch, dtype=torch.int32, device=device)
        src = torch.arange(n, dtype=torch.int64, device=device)
        dst = torch.arange(n, 2 * n, dtype=torch.int64, device=device)
        path = "Triton"

        def attend() -> None:
            paged_attention(
                query=query,
                key_cache=key_cache,
                value_cache=value_cache,
                block_tables=tables,
                seq_lens=lens,
                query_lens=ones,
                scale=scale,
            )

        def copy() -> None:
            copy_blocks(key_caches=[key_cache], value_caches=[value_cache], src_block_ids=src, dst_block_ids=dst)

    else:
        table_lists = tables.tolist()
        meta = build_torch_meta(table_lists, [context] * batch, [1] * batch, 1, block_size, None, device)
        last = torch.tensor([row[-1] for row in table_lists], device=device)  # each row's newest token's block
        new_k = key_cache[last, -1].unsqueeze(2)  # [batch, num_kv_heads, 1, head_dim]
        new_v = value_cache[last, -1].unsqueeze(2)
        path = "PyTorch path"

        def attend() -> None:
            torch_paged_attention(query.transpose(1, 2), new_k, new_v, key_cache, value_cache, meta, scale)

        def copy() -> None:
            backend.copy_blocks([key_cache], [value_cache], list(range(n)), list(range(n, 2 * n)), block_size)

    seconds = _timed(attend, device, repeats=20 if cuda else 5)
    kv_bytes = 2 * key_cache.numel() * key_cache.element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    lines = [
        f"  decode attention, {path} (batch {batch}, context {context}, {heads}/{kv_heads} heads, d{head_dim}, "
        f"{dtype_name}): {seconds * 1e6:.0f} us, {kv_bytes / seconds / 1e9:.1f} GB/s of K/V"
    ]
    seconds = _timed(copy, device, repeats=20 if cuda else 5)
    copied = 2 * 2 * n * key_cache[0].numel() * key_cache.element_size()  # read + write, K and V
    lines.append(
        f"  block copy, {path} ({n} blocks x 2 pools): {seconds * 1e6:.0f} us, " f"{copied / seconds / 1e9:.1f} GB/s"
    )
    return lines


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Mean seconds of `fn()` over `repeats` calls after one warm-up call (CUDA events on a GPU)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1000 / repeats


def versions() -> list[str]:
    from importlib import metadata  # noqa: PLC0415

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    lines = [f"python        {platform.python_version()} ({sys.executable})"]
    lines.append(f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    lines.append(f"transformers  {version('transformers')}")
    lines.append(f"triton        {version('triton')}")
    lines.append(f"hf_paged      {version('hf-paged')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged doctor", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=model_path_or_id,
        help="local model directory (or cached hub id) whose attention shapes to check",
    )
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="override the model's dtype")
    parser.add_argument("--no-bench", action="store_true", help="skip the bandwidth micro-benchmark")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model:
        try:
            shapes = shapes_from_config(args.model, dtype)
        except UnsupportedModelError as error:
            parser.error(f"--model: {args.model} is not served by hf-paged: {str(error).strip().splitlines()[0]}")
        except (OSError, ValueError) as error:  # no config.json, an unknown model type, a hub id not cached
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            parser.error(f"--model: cannot read a model config from {args.model}: {reason}")
    else:
        shapes = [replace(s, dtype=dtype) if dtype else s for s in DEFAULT_SHAPES]

    from hf_paged import backend  # noqa: PLC0415

    print("== versions")
    for line in versions():
        print("  " + line)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print("== device")
    if cuda:
        props = torch.cuda.get_device_properties(device)
        major, minor = torch.cuda.get_device_capability(device)
        print(
            f"  {device}: {props.name}, compute capability {major}.{minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        )
    else:
        interp = "TRITON_INTERPRET=1" if _interpreted() else "TRITON_INTERPRET unset (triton was imported first)"
        print(
            f"  cpu ({os.cpu_count()} cores), no CUDA: kernels checked under the Triton interpreter ({interp}), "
            "at small shapes"
        )

    if args.model:
        print(f"== model {args.model}")
    else:
        print("== default shapes (pass --model PATH for a model's own)")

    failures = 0
    triton_problem = backend.triton_problem()
    for shape in shapes:
        print(f"-- {shape.describe()}")
        if shape.reads_gathered:
            # Its update() K/V go through the gather path (PyTorch writes and reads); K and V differ in bytes per
            # block, so copy-on-write copies with PyTorch too (`backend.copy_blocks`).
            print(
                "  backend: torch (the model expands what its cache stores after update(), so its K/V are written "
                "and read gathered by the PyTorch path); no Triton kernel serves it: nothing to check"
            )
            continue
        query = torch.empty(1, shape.num_heads, 1, shape.head_dim, dtype=shape.dtype, device=device)
        pool = torch.empty(1, 16, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
        chosen = backend.backend_for(device)
        reason = backend.triton_supports(
            query,
            pool,
            sliding_window=shape.sliding_window,
            softcap=shape.softcap,
            sinks=torch.zeros(shape.num_heads, device=device) if shape.sinks else None,
        )
        if chosen == "triton" and reason is None:
            print("  backend: triton (CUDA tensors and a supported shape)")
        elif chosen == "triton":
            print(f"  backend: torch (fallback: {reason})")
        elif os.environ.get("HF_PAGED_BACKEND"):
            print(f"  backend: torch (HF_PAGED_BACKEND={os.environ['HF_PAGED_BACKEND']})")
        else:
            print(f"  backend: torch ({reason or f'tensors on {device.type}: the PyTorch path'})")
        if triton_problem:
            print(f"  kernels: not checked ({triton_problem})")
            continue
        run = shape if cuda else _small(shape)
        if run != shape:
            print(
                f"  checked at {run.num_heads} heads / {run.num_kv_heads} KV heads"
                + (f", window {run.sliding_window}" if run.sliding_window else "")
            )
        tol = TOLERANCE[shape.dtype]
        gen = torch.Generator().manual_seed(0)
        checks = [("write", lambda: check_write(run, device, gen), 0.0)]
        for case in ("prefill", "decode", "split-kv"):
            checks.append((f"attention {case}", lambda case=case: check_attention(run, case, device, gen), tol))
        checks.append(("copy", lambda: check_copy(run, device, gen), 0.0))
        for name, fn, limit in checks:
            start = time.perf_counter()
            try:
                err = fn()
            except Exception as error:  # noqa: BLE001 - report every failure, keep checking
                failures += 1
                print(f"  {name:20s} FAILED: {type(error).__name__}: {str(error)[:300]}")
                continue
            ok = err <= limit
            failures += not ok
            print(
                f"  {name:20s} max abs error {err:.3g} (limit {limit:g}) {'ok' if ok else 'MISMATCH'} "
                f"[{time.perf_counter() - start:.1f}s]"
            )
    if args.no_bench:
        print("== bandwidth: skipped (--no-bench)")
    elif cuda and triton_problem:
        print(f"== bandwidth: skipped (the Triton kernels cannot run: {triton_problem})")
    else:
        print("== bandwidth" + ("" if cuda else ' (CPU: the PyTorch path, which the "paged" attention runs here)'))
        try:
            for line in bandwidth(device):
                print(line)
        except Exception as error:  # noqa: BLE001
            failures += 1
            print(f"  FAILED: {type(error).__name__}: {error}")
    print(f"== {'OK' if failures == 0 else f'{failures} check(s) failed'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
