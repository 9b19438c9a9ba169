"""Ahead-of-time compilation of every shipped specialization, for a GPU that is not here.

`python -m hf_paged.kernels.aot [--cc 80 90]` compiles each specialization from
`specializations.py` to a cubin with Triton's bundled ptxas, and reports registers and spill bytes
(the `ptxas -v` log of the compile; `CompiledKernel.n_spills` is only filled in when a driver
loads the binary). It exits
with status 1 if anything spills. Must run without `TRITON_INTERPRET`.

Argument specialization mirrors what the JIT sees for HF-shaped inputs: data pointers 16-byte
aligned and `stride_*` arguments divisible by 16 (true when head_dim is a multiple of 16, as for
every shipped head dim), except the block-table row stride, which is arbitrary.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget

from ._attention_kernels import _paged_attention_kernel, _split_kv_reduce_kernel
from .copy_blocks import _WORDS_PER_PROGRAM, _copy_blocks_kernel
from .specializations import DTYPES, HEAD_DIMS, TRITON_DTYPE_NAMES, attention_specs, head_dim_pad
from .write_kv_cache import _write_kv_cache_kernel

_ARBITRARY_INTS = {"stride_bt_batch"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel specialization: which kernel, its pointer dtypes and constexprs."""

    name: str
    kernel: object  # triton JITFunction
    pointer_dtypes: dict[str, str]  # arg name -> triton type, e.g. {"query_ptr": "*fp16"}
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int = 2
    floats: tuple[str, ...] = field(default=())


def _attention_kernel_specs() -> list[KernelSpec]:
    out = []
    for spec in attention_specs():
        dt, tile = TRITON_DTYPE_NAMES[spec.dtype], spec.tile
        constexprs = dict(
            HEAD_DIM=spec.head_dim,
            HEAD_DIM_PAD=head_dim_pad(spec.head_dim),
            BLOCK_M=tile.BLOCK_M,
            BLOCK_N=tile.BLOCK_N,
            SPLIT_KV=spec.split_kv,
            DOT_IN_FP32=False,  # True only under the interpreter
        )
        split_out = "*fp32" if spec.split_kv else f"*{dt}"
        ptrs = {"out_ptr": split_out, "max_ptr": "*fp32", "sum_ptr": "*fp32", "sinks_ptr": "*fp32"}
        ptrs |= {n: f"*{dt}" for n in ("query_ptr", "key_cache_ptr", "value_cache_ptr")}
        ptrs |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_lens_ptr")}
        out.append(
            KernelSpec(spec.name, _paged_attention_kernel, ptrs, constexprs, tile.num_warps, tile.num_stages,
                       floats=("scale", "softcap"))
        )  # fmt: skip
    return out


def kernel_specs() -> list[KernelSpec]:
    """Every specialization the launchers can launch."""
    specs = _attention_kernel_specs()
    for dtype in DTYPES:
        dt = TRITON_DTYPE_NAMES[dtype]
        for head_dim in HEAD_DIMS:
            dims = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad(head_dim))
            reduce_ptrs = {"out_ptr": f"*{dt}", "partial_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32"}
            specs.append(KernelSpec(f"reduce-{dt}-d{head_dim}", _split_kv_reduce_kernel, reduce_ptrs, dims, 4))
            write_ptrs = {n: f"*{dt}" for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
            write_ptrs["slot_mapping_ptr"] = "*i64"
            specs.append(KernelSpec(f"write-{dt}-d{head_dim}", _write_kv_cache_kernel, write_ptrs, dims, 1))
    copy_ptrs = {n: "*i64" for n in ("cache_ptrs_ptr", "src_block_ids_ptr", "dst_block_ids_ptr")}
    specs.append(KernelSpec("copy-blocks", _copy_blocks_kernel, copy_ptrs, dict(BLOCK=_WORDS_PER_PROGRAM), 4))
    return specs


@dataclass(frozen=True)
class AotResult:
    name: str
    cc: int
    n_regs: int
    spill_bytes: int  # spill stores + spill loads reported by ptxas
    seconds: float


def _source(spec: KernelSpec):
    kernel = spec.kernel
    declared = {p.name for p in kernel.params if p.is_constexpr}
    assert declared == set(spec.constexprs), f"{spec.name}: constexprs {declared} != {set(spec.constexprs)}"
    signature = {}
    for name in kernel.arg_names:
        if name in spec.constexprs:
            signature[name] = "constexpr"
        elif name in spec.pointer_dtypes:
            signature[name] = spec.pointer_dtypes[name]
        else:
            signature[name] = "fp32" if name in spec.floats else "i32"
    aligned = [
        i for i, n in enumerate(kernel.arg_names)
        if n.endswith("_ptr") or (n.startswith("stride_") and n not in _ARBITRARY_INTS)
    ]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=spec.constexprs, attrs=attrs)


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


def _compile_index(args: tuple[int, int]) -> AotResult:
    index, cc = args
    return compile_spec(kernel_specs()[index], cc)


def compile_all(ccs: tuple[int, ...] = (80, 90), workers: int | None = None) -> list[AotResult]:
    """Compile every specialization for every compute capability in `ccs`, in parallel."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET for AOT compiles"
    jobs = [(i, cc) for cc in ccs for i in range(len(kernel_specs()))]
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        return list(pool.map(_compile_index, jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    results = compile_all(tuple(args.cc), args.workers)
    print(f"{'specialization':40s} {'cc':>3s} {'regs':>5s} {'spill B':>8s} {'s':>6s}")
    for r in results:
        print(f"{r.name:40s} {r.cc:3d} {r.n_regs:5d} {r.spill_bytes:8d} {r.seconds:6.1f}")
    spilled = [r for r in results if r.spill_bytes]
    print(f"{len(results)} compiles, {len(spilled)} with spills")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
