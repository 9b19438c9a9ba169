"""Ahead-of-time compilation of the kernel specializations, for a GPU that is not here.

`python -m hf_paged.kernels.aot [--cc 80 90] [--sample N]` compiles the specializations to cubins
with Triton's bundled ptxas and reports registers and spill bytes (the `ptxas -v` log of the
compile; `CompiledKernel.n_spills` is only filled in when a driver loads the binary). It exits with
status 1 if anything spills. Must run without `TRITON_INTERPRET`.

The compile set is what Triton's JIT would build for representative model shapes: each scenario
(dtype, head_dim, heads/KV heads, q_len, block size, split-KV) runs the launchers' own
`*_launches` functions on tensors of the meta device, and each launch goes through Triton's binder,
which applies the JIT's integer specializations (== 1, divisible by 16) and pointer alignment.
Scenarios that lead to the same specialization are compiled once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget

from ._attention_kernels import _paged_attention_kernel, _split_kv_reduce_kernel
from .copy_blocks import _copy_blocks_kernel, copy_launches
from .launch import Launch
from .paged_attention import attention_launches
from .specializations import DTYPES, HEAD_DIMS, TRITON_DTYPE_NAMES, head_dim_pad
from .write_kv_cache import _write_kv_cache_kernel, write_launches

#: (num_heads, num_kv_heads): MHA, GQA 4, GQA 8 (Llama-3-8B), MQA.
HEAD_LAYOUTS: tuple[tuple[int, int], ...] = ((32, 32), (32, 8), (32, 4), (8, 1))
#: Block sizes: the default 16, 32, and a non-power-of-two one (generic path).
BLOCK_SIZES: tuple[int, ...] = (16, 32, 12)
_MAX_CONTEXT = 4096 + 37  # block-table widths that are not multiples of 16, as a plan builds them


@dataclass(frozen=True)
class Scenario:
    """Representative launcher inputs (a step of a model with these shapes)."""

    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_len: int
    block_size: int
    num_splits: int
    head_dim_v: int | None = None  # multi-latent attention: a value head dim of its own
    kv_dtype: torch.dtype | None = None  # quantized pools: int8 / float8 storage with float16 scales

    @property
    def name(self) -> str:
        kind = "decode" if self.q_len == 1 else f"q{self.q_len}"
        split = f"-split{self.num_splits}" if self.num_splits > 1 else ""
        dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else "")
        kv = f"-kv_{str(self.kv_dtype).removeprefix('torch.')}" if self.kv_dtype is not None else ""
        return (
            f"{TRITON_DTYPE_NAMES[self.dtype]}{kv}-{dims}-h{self.num_heads}kv{self.num_kv_heads}"
            f"-{kind}-bs{self.block_size}{split}"
        )

    @property
    def min_cc(self) -> int:
        """Oldest compute capability the scenario is shipped for (float8 conversions need sm_89)."""
        return 89 if self.kv_dtype in FLOAT8_DTYPES else 0


#: Storage dtypes of quantized pools; float8 ones run (and are compiled) on sm_89 and newer only.
FLOAT8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_DTYPES: tuple[torch.dtype, ...] = (torch.int8, *FLOAT8_DTYPES)
#: Head dims of the quantized scenarios: one per padded register width, plus a masked one.
QUANTIZED_HEAD_DIMS: tuple[int, ...] = (64, 80, 128, 256)

#: (K, V) head dims of multi-latent attention (DeepSeek-style K 192 / V 128).
MLA_HEAD_DIMS: tuple[tuple[int, int], ...] = ((192, 128),)


def scenarios(head_dims=HEAD_DIMS, dtypes=DTYPES, mla=MLA_HEAD_DIMS, kv_dtypes=KV_DTYPES) -> list[Scenario]:
    """Decode (with and without split-KV) and prefill for every head layout at block size 16; the
    other block sizes for decode and prefill of GQA 4; MLA head dims for MHA and GQA 4 (plain and quantized pools
    of every `kv_dtypes`); quantized pools
    (`kv_dtypes`) at `QUANTIZED_HEAD_DIMS` (of those in `head_dims`) for every head layout and the generic
    block size."""
    out = []
    for dtype in dtypes:
        for kv_dtype in kv_dtypes:
            for head_dim in (d for d in QUANTIZED_HEAD_DIMS if d in head_dims):
                for heads, kv_heads in HEAD_LAYOUTS:
                    for q_len, splits in ((1, 1), (1, 8), (2, 1), (128, 1)):
                        out.append(Scenario(dtype, head_dim, heads, kv_heads, q_len, 16, splits, None, kv_dtype))
                for q_len in (1, 128):
                    out.append(Scenario(dtype, head_dim, 32, 8, q_len, BLOCK_SIZES[-1], 1, None, kv_dtype))
    for dtype in dtypes:
        for head_dim in head_dims:
            for heads, kv_heads in HEAD_LAYOUTS:
                for q_len, splits in ((1, 1), (1, 8), (2, 1), (128, 1)):
                    out.append(Scenario(dtype, head_dim, heads, kv_heads, q_len, 16, splits))
            for block_size in BLOCK_SIZES[1:]:
                for q_len in (1, 128):
                    out.append(Scenario(dtype, head_dim, 32, 8, q_len, block_size, 1))
        for head_dim, head_dim_v in mla:
            for kv_dtype in (None, *kv_dtypes):  # MLA pools quantized too (float8 ones from sm_89)
                for heads, kv_heads in ((32, 32), (32, 8)):
                    for q_len, splits in ((1, 1), (1, 8), (128, 1)):
                        out.append(Scenario(dtype, head_dim, heads, kv_heads, q_len, 16, splits, head_dim_v, kv_dtype))
    return out


def scenario_launches(sc: Scenario) -> list[Launch]:
    """The launches of one step of `sc`: cache write, attention (+ reduction), block copy."""
    meta = dict(device="meta")
    batch = 2
    num_blocks = 2 * -(-_MAX_CONTEXT // sc.block_size) + 1
    query = torch.empty(batch, sc.num_heads, sc.q_len, sc.head_dim, dtype=sc.dtype, **meta).transpose(1, 2)
    key = torch.empty(batch, sc.num_kv_heads, sc.q_len, sc.head_dim, dtype=sc.dtype, **meta).transpose(1, 2)
    head_dim_v = sc.head_dim_v or sc.head_dim
    value = torch.empty(batch, sc.num_kv_heads, sc.q_len, head_dim_v, dtype=sc.dtype, **meta).transpose(1, 2)
    pool_shape = (num_blocks, sc.block_size, sc.num_kv_heads, sc.head_dim)
    key_cache = torch.empty(pool_shape, dtype=sc.kv_dtype or sc.dtype, **meta)
    value_cache = torch.empty((*pool_shape[:3], head_dim_v), dtype=sc.kv_dtype or sc.dtype, **meta)
    scales = {}
    if sc.kv_dtype is not None:
        scales = dict(
            key_scale=torch.empty(pool_shape[:3], dtype=torch.float16, **meta),
            value_scale=torch.empty(pool_shape[:3], dtype=torch.float16, **meta),
        )
    block_tables = torch.empty(batch, -(-_MAX_CONTEXT // sc.block_size), dtype=torch.int32, **meta)
    lens = torch.empty(batch, dtype=torch.int32, **meta)
    launches = write_launches(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.empty(batch, sc.q_len, dtype=torch.int64, **meta),
        **scales,
    )
    launches += attention_launches(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=lens,
        query_lens=lens,
        scale=0.125,
        sliding_window=None,
        softcap=None,
        sinks=None,
        out=torch.empty((*query.shape[:3], head_dim_v), dtype=sc.dtype, **meta),
        num_splits=sc.num_splits,
        **scales,
    )
    ids = torch.empty(3, dtype=torch.int64, **meta)
    launches += copy_launches(key_caches=[key_cache], value_caches=[key_cache], src_block_ids=ids, dst_block_ids=ids)
    return launches


#: The kernels by name (compile jobs cross process boundaries by name: a JITFunction does not pickle).
_KERNELS = {
    k.__name__: k
    for k in (_paged_attention_kernel, _split_kv_reduce_kernel, _write_kv_cache_kernel, _copy_blocks_kernel)
}


@dataclass(frozen=True)
class KernelSpec:
    """One compile: the kernel and what Triton's binder made of a launch's arguments."""

    name: str
    kernel_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    num_warps: int
    num_stages: int
    min_cc: int = 0  # compiled for compute capabilities >= this only

    @property
    def kernel(self):  # triton JITFunction
        return _KERNELS[self.kernel_name]

    @property
    def key(self) -> tuple:
        return (
            self.kernel_name,
            tuple(sorted(self.signature.items())),
            tuple(sorted((str(k), v) for k, v in self.constexprs.items())),
            tuple(sorted((str(k), str(v)) for k, v in self.attrs.items())),
            self.num_warps,
            self.num_stages,
        )


@functools.lru_cache(maxsize=None)
def _binder(kernel_name: str, cc: int):
    from triton.runtime.jit import create_function_from_signature

    kernel = _KERNELS[kernel_name]
    backend = triton.compiler.make_backend(GPUTarget("cuda", cc, 32))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def _spec_of(launch: Launch, name: str, cc: int = 90, min_cc: int = 0) -> KernelSpec:
    """Run Triton's JIT binder on a launch's arguments: the signature, constexprs and integer/pointer
    specializations (`tt.divisibility`, `== 1` folded to constants) exactly as a launch would compile."""
    kernel = launch.kernel
    backend, binder = _binder(kernel.__name__, cc)
    kwargs = dict(launch.kwargs)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    declared = {p.name for p in kernel.params if p.is_constexpr}
    names = kernel.arg_names
    ones = [n for n, v in signature.items() if v == "constexpr" and n not in declared]  # JIT: int == 1
    div16 = [names[i] for (i,), a in attrs.items() if a and not names[i].endswith("_ptr")]  # JIT: int % 16 == 0
    c = {names[i]: v for (i,), v in constexprs.items()}
    tiles = ",".join(
        f"{k}={c[k]}"
        for k in ("HEAD_DIM", "HEAD_DIM_V", "BLOCK_M", "BLOCK_N", "KV_BLOCK", "USE_DOT", "SPLIT_KV")
        if k in c
    )
    full = f"{kernel.__name__.strip('_')}({tiles}) [{name}] ==1:{','.join(ones)} %16:{','.join(div16)}"
    return KernelSpec(
        full, kernel.__name__, signature, constexprs, attrs, options.num_warps, options.num_stages, min_cc
    )


def kernel_specs(scenario_list: list[Scenario] | None = None) -> list[KernelSpec]:
    """Every distinct specialization the scenarios launch (default: `scenarios()`, the full set)."""
    seen: dict[tuple, KernelSpec] = {}
    for sc in scenarios() if scenario_list is None else scenario_list:
        for launch in scenario_launches(sc):
            spec = _spec_of(launch, sc.name, min_cc=sc.min_cc)
            known = seen.setdefault(spec.key, spec)
            if spec.min_cc < known.min_cc:  # also launched by a scenario shipped for older GPUs
                seen[spec.key] = spec
    return list(seen.values())


def sample_specs(specs: list[KernelSpec], per_family: int = 1) -> list[KernelSpec]:
    """A sample that keeps, for each kernel x dtype x register-tile shape (HEAD_DIM_PAD, BLOCK_M,
    BLOCK_N, USE_DOT, SPLIT_KV) the largest head dims: register pressure depends on those."""
    families: dict[tuple, list[KernelSpec]] = {}
    for spec in specs:
        c = {str(k): v for k, v in spec.constexprs.items()}
        names = spec.kernel.arg_names
        c = {
            names[k[0]]: v
            for k, v in spec.constexprs.items()
            if names[k[0]]
            in ("HEAD_DIM_PAD", "HEAD_DIM_V_PAD", "BLOCK_M", "BLOCK_N", "USE_DOT", "SPLIT_KV", "KV_BLOCK")
        }
        dtype = next((t for n, t in spec.signature.items() if n in ("query_ptr", "key_ptr")), "")
        dtype += "/" + spec.signature.get("key_cache_ptr", "")  # quantized pools: their storage dtype too
        kv = c.get("KV_BLOCK", -1)
        kv_kind = "none" if kv == -1 else ("generic" if kv == 0 else "pow2")
        fam = (
            spec.kernel.__name__,
            dtype,
            c.get("HEAD_DIM_PAD"),
            c.get("HEAD_DIM_V_PAD"),
            c.get("BLOCK_M"),
            c.get("BLOCK_N"),
            c.get("USE_DOT"),
            c.get("SPLIT_KV"),
            kv_kind,
        )
        families.setdefault(fam, []).append(spec)
    out = []
    for members in families.values():
        members.sort(
            key=lambda s: -max(
                (v for k, v in s.constexprs.items() if s.kernel.arg_names[k[0]] == "HEAD_DIM"), default=0
            )
        )
        out.extend(members[:per_family])
    return out


@dataclass(frozen=True)
class AotResult:
    name: str
    cc: int
    n_regs: int
    spill_bytes: int  # spill stores + spill loads reported by ptxas
    seconds: float


def _source(spec: KernelSpec):
    return triton.compiler.ASTSource(
        fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs, attrs=spec.attrs
    )


def _compile(spec: KernelSpec, cc: int):
    options = dict(num_warps=spec.num_warps, num_stages=spec.num_stages)
    return triton.compile(_source(spec), target=GPUTarget("cuda", cc, 32), options=options)


def lower_to_ttir(spec: KernelSpec, cc: int = 80) -> str:
    """Triton IR straight from the kernel source, before any optimisation pass (fast; for
    inspecting address arithmetic). Uses Triton's compiler front end directly."""
    from triton._C.libtriton import ir

    target = GPUTarget("cuda", cc, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options(dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(options)
    module = _source(spec).make_ir(target, options, codegen_fns, backend.get_module_map(), context)
    return str(module)


def compile_spec(spec: KernelSpec, cc: int) -> AotResult:
    """Compile one specialization for `sm_{cc}`; registers and spills come from the `ptxas -v` log
    of Triton's own ptxas invocation (printed when `knobs.nvidia.dump_ptxas_log` is set)."""
    start = time.perf_counter()
    log = io.StringIO()
    # Bypass Triton's on-disk cache: a cache hit would skip ptxas and leave no log to read.
    with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope():
        triton.knobs.nvidia.dump_ptxas_log = True
        triton.knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            _compile(spec, cc)
    text = log.getvalue()
    regs = max(int(r) for r in re.findall(r"Used (\d+) registers", text))
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return AotResult(spec.name, cc, regs, spills, time.perf_counter() - start)


def _compile_job(args: tuple[KernelSpec, int]) -> AotResult:
    spec, cc = args
    return compile_spec(spec, cc)


def compile_all(
    ccs: tuple[int, ...] = (80, 90), workers: int | None = None, specs: list[KernelSpec] | None = None
) -> list[AotResult]:
    """Compile `specs` (default: the full set, `kernel_specs()`) for every compute capability in
    `ccs`, in parallel."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET for AOT compiles")
    specs = kernel_specs() if specs is None else specs
    jobs = [(spec, cc) for cc in ccs for spec in specs if cc >= spec.min_cc]
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        return list(pool.map(_compile_job, jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument(
        "--sample", type=int, default=0, help="compile only N specializations per register-tile family (0: all)"
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="restrict the head dims")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    parser.add_argument("--quantized-only", action="store_true", help="only the quantized-pool scenarios")
    parser.add_argument(
        "--mla-only", action="store_true", help="only the multi-latent attention scenarios (K/V head dims of their own)"
    )
    args = parser.parse_args(argv)
    head_dims = tuple(args.head_dims) if args.head_dims else HEAD_DIMS
    if args.mla_only:
        chosen = [sc for sc in scenarios(()) if sc.head_dim_v is not None]
    elif args.quantized_only:
        chosen = [sc for sc in scenarios(head_dims, mla=()) if sc.kv_dtype is not None]
    else:
        chosen = scenarios(head_dims, mla=()) if args.head_dims else None
    specs = kernel_specs(chosen)
    total = len(specs)
    if args.sample:
        specs = sample_specs(specs, args.sample)
    print(f"{len(specs)} of {total} specializations x cc {args.cc}", flush=True)
    results = compile_all(tuple(args.cc), args.workers, specs)
    print(f"{'specialization':100s} {'cc':>3s} {'regs':>5s} {'spill B':>8s} {'s':>6s}")
    for r in results:
        print(f"{r.name:100s} {r.cc:3d} {r.n_regs:5d} {r.spill_bytes:8d} {r.seconds:6.1f}")
    spilled = [r for r in results if r.spill_bytes]
    print(f"{len(results)} compiles, max {max(r.n_regs for r in results)} registers, {len(spilled)} with spills")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
