"""Every shipped kernel specialization compiles for sm_80 and sm_90 without register spills, and
addresses into the KV pools are computed in int64.

The test session runs Triton in interpreter mode (TRITON_INTERPRET=1, set in conftest.py), where
kernels are not compilable JITFunctions, so compilation runs in a subprocess without that variable.
Triton ships ptxas, so no GPU or CUDA toolkit is needed. The compiles of whole specialization families are marked
`kernels` (`make test-kernels`); `make test` runs the checks on the compile set and its Triton IR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_without_interpreter(code: str, timeout: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.kernels
def test_sampled_specializations_compile_without_spills():
    """The register-heaviest families (head_dim padded to 256: every tile kind, split-KV, block-id
    path, dtype) compile without spills: a masked head dim (248) for sm_80, 256 for sm_90. The full
    set (~2700 specializations per GPU) is `python -m hf_paged.kernels.aot` (`--sample 1` compiles one
    per register-tile family)."""
    code = (
        "import json, dataclasses\n"
        "from hf_paged.kernels import aot\n"
        "results = []\n"
        "for cc, head_dim, mla in ((80, 248, ((192, 128),)), (90, 256, ())):\n"
        "    specs = aot.sample_specs(aot.kernel_specs(aot.scenarios((head_dim,), mla=mla, kv_dtypes=())))\n"
        "    results += aot.compile_all((cc,), workers=2, specs=specs)\n"
        "print(json.dumps([dataclasses.asdict(r) for r in results]))\n"
    )
    results = json.loads(_run_without_interpreter(code, timeout=900).strip().splitlines()[-1])
    assert len(results) > 40
    spilled = [r for r in results if r["spill_bytes"] != 0]
    assert not spilled, f"register spills: {spilled}"
    assert all(0 < r["n_regs"] <= 255 for r in results)


@pytest.mark.slow
@pytest.mark.kernels
def test_quantized_pool_specializations_compile_without_spills():
    """Quantized pools (int8 on sm_80 and sm_90, float8 on sm_90 only: its conversions need sm_89) at the
    widest register tiles (head_dim 256), one specialization per register-tile family. The whole quantized
    set: `python -m hf_paged.kernels.aot --quantized-only --sample 1`."""
    code = (
        "import json, dataclasses\n"
        "from hf_paged.kernels import aot\n"
        "scenarios = [sc for sc in aot.scenarios((256,), mla=()) if sc.kv_dtype is not None]\n"
        "specs = aot.sample_specs(aot.kernel_specs(scenarios))\n"
        "results = aot.compile_all((80, 90), workers=2, specs=specs)\n"
        "print(json.dumps([dataclasses.asdict(r) for r in results]))\n"
    )
    results = json.loads(_run_without_interpreter(code, timeout=1200).strip().splitlines()[-1])
    assert any("kv_float8_e4m3fn" in r["name"] for r in results if r["cc"] == 90)
    assert not any("float8" in r["name"] for r in results if r["cc"] == 80)
    assert any("kv_int8" in r["name"] for r in results if r["cc"] == 80)
    spilled = [r for r in results if r["spill_bytes"] != 0]
    assert not spilled, f"register spills: {spilled}"


def test_compile_set_has_jit_specializations_and_new_head_dims():
    """The compile set comes from Triton's binder: decode steps specialize q_len == 1, MHA
    specializes group_size == 1, strides divisible by 16 carry the attribute, and head dims that are
    not powers of two (72) are in it."""
    code = (
        "from hf_paged.kernels import aot\n"
        "for spec in aot.kernel_specs(aot.scenarios((72, 128))):\n"
        "    print(spec.name)\n"
    )
    names = _run_without_interpreter(code, timeout=300).splitlines()
    attn = [n for n in names if n.startswith("paged_attention_kernel(HEAD_DIM=72,")]
    assert attn and any("fp16-d72-h32kv32-decode" in n and "==1:q_len,group_size" in n for n in attn)
    assert any("-q128-" in n and "==1:q_len" not in n for n in attn)
    div16 = {n: n.split("%16:")[1].split(",") for n in names if n.startswith("paged_attention_kernel")}
    assert all("stride_q_token" in d for n, d in div16.items() if "HEAD_DIM=128," in n)  # stride 128
    assert not any("stride_q_token" in d for n, d in div16.items() if "HEAD_DIM=72," in n)  # stride 72
    assert any("KV_BLOCK=0" in n for n in attn) and any("USE_DOT=False" in n for n in attn)


def test_kv_addresses_are_int64():
    """In the Triton IR of the fp16 kernels, every pointer arithmetic on an fp16 tensor (query,
    K/V pools, output) and on the block-copy words takes int64 offsets, so `block_id * block
    stride` beyond 2**31 elements cannot wrap. (A pool that large cannot be allocated here.)"""
    code = (
        "import torch, triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from hf_paged.kernels import aot\n"
        "picked = {}\n"
        "for spec in aot.kernel_specs(aot.scenarios((72, 128), (torch.float16,))):\n"
        "    kind = spec.name.split('(')[0] + ('-generic' if 'KV_BLOCK=0' in spec.name else '')\n"
        "    kind += '-split' if 'SPLIT_KV=True' in spec.name else ''\n"
        "    if kind not in picked and ('HEAD_DIM=128' in spec.name or 'copy' in kind):\n"
        "        picked[kind] = spec; print('@@', kind); print(aot.lower_to_ttir(spec))\n"
    )
    ttir = _run_without_interpreter(code, timeout=300)
    sections = dict(re.findall(r"@@ (\S+)\n(.*?)(?=\n@@ |\Z)", ttir, flags=re.S))
    assert len(sections) >= 5, sorted(sections)
    for name, ir in sections.items():
        if name.startswith("split_kv_reduce"):
            continue
        addptrs = re.findall(r"tt\.addptr .*? : (.*)", ir)
        data_ptr = "!tt.ptr<i32>" if name.startswith("copy") else "!tt.ptr<f16>"
        checked = [a for a in addptrs if data_ptr in a]
        assert checked, f"{name}: no address arithmetic found"
        narrow = [a for a in checked if re.search(r"\bi32>?\s*$|xi32>", a.split(",")[-1])]
        assert not narrow, f"{name}: int32 offsets on data pointers: {narrow}"
