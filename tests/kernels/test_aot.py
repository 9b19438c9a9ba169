"""Every shipped kernel specialization compiles for sm_80 and sm_90 without register spills, and
addresses into the KV pools are computed in int64.

The test session runs Triton in interpreter mode (TRITON_INTERPRET=1, set in conftest.py), where
kernels are not compilable JITFunctions, so compilation runs in a subprocess without that variable.
Triton ships ptxas, so no GPU or CUDA toolkit is needed.
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
def test_every_specialization_compiles_without_spills():
    code = (
        "import json, dataclasses\n"
        "from hf_paged.kernels.aot import compile_all\n"
        "print(json.dumps([dataclasses.asdict(r) for r in compile_all((80, 90), workers=2)]))\n"
    )
    results = json.loads(_run_without_interpreter(code, timeout=1500).strip().splitlines()[-1])
    from hf_paged.kernels.aot import kernel_specs

    assert len(results) == 2 * len(kernel_specs())
    spilled = [r for r in results if r["spill_bytes"] != 0]
    assert not spilled, f"register spills: {spilled}"
    assert all(0 < r["n_regs"] <= 255 for r in results)


def test_kv_addresses_are_int64():
    """In the Triton IR of the fp16 kernels, every pointer arithmetic on an fp16 tensor (query,
    K/V pools, output) and on the block-copy words takes int64 offsets, so `block_id * block
    stride` beyond 2**31 elements cannot wrap. (A pool that large cannot be allocated here.)"""
    code = (
        "import torch, triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from hf_paged.kernels import aot\n"
        "names = {'attn-fp16-d128-prefill', 'attn-fp16-d128-split', 'write-fp16-d128', 'copy-blocks'}\n"
        "for spec in aot.kernel_specs():\n"
        "    if spec.name in names:\n"
        "        print('@@', spec.name); print(aot.lower_to_ttir(spec))\n"
    )
    ttir = _run_without_interpreter(code, timeout=300)
    sections = dict(re.findall(r"@@ (\S+)\n(.*?)(?=\n@@ |\Z)", ttir, flags=re.S))
    assert len(sections) == 4
    for name, ir in sections.items():
        addptrs = re.findall(r"tt\.addptr .*? : (.*)", ir)
        data_ptr = "!tt.ptr<i32>" if name == "copy-blocks" else "!tt.ptr<f16>"
        checked = [a for a in addptrs if data_ptr in a]
        assert checked, f"{name}: no address arithmetic found"
        narrow = [a for a in checked if re.search(r"\bi32>?\s*$|xi32>", a.split(",")[-1])]
        assert not narrow, f"{name}: int32 offsets on data pointers: {narrow}"
