"""Packaging and registration: `kernels/triton/` ships as `hf_paged.kernels`, never as a top-level `kernels`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import hf_paged

ROOT = Path(__file__).resolve().parents[1]


def test_importing_us_does_not_change_is_kernels_available():
    code = (
        "import importlib.util\n"
        "from transformers.utils import is_kernels_available\n"
        "before = is_kernels_available()\n"
        "import hf_paged, hf_paged.kernels\n"
        "after = is_kernels_available()\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(before, after, spec is not None and 'hf_paged' in str(spec.origin))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    before, after, impersonated = out.stdout.split()
    assert before == after
    assert impersonated == "False"


def test_the_repository_root_does_not_shadow_an_installed_kernels_package(tmp_path):
    """Run from the repository root (the demo, the tests), the root is first on `sys.path`; transformers 5.25 on
    imports the hub package `kernels` it depends on. An installed package of that name (here a stand-in on the
    path right after the root, ahead of site-packages) is the one imported, not our `kernels/` folder."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("HUB = True\n")
    code = f"import sys; sys.path.insert(1, {str(tmp_path)!r}); import kernels; print(getattr(kernels, 'HUB', False))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["True"]


def test_wheel_ships_kernels_inside_our_namespace(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("hf_paged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_paged/kernels/__init__.py" in names
    assert "hf_paged/kernels/paged_attention.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    assert any(n.startswith("hf_paged/demo_model/") for n in names)


def test_register_is_idempotent():
    hf_paged.register()
    hf_paged.register()
    assert hf_paged.is_registered()
    assert AttentionInterface._global_mapping["paged"] is hf_paged.paged_attention_forward
    assert AttentionMaskInterface._global_mapping["paged"] is hf_paged.paged_mask


def test_invalid_block_size_is_refused():
    for bad in (0, -4, 2.5, "16", True):
        with pytest.raises(ValueError, match="block_size"):
            hf_paged.PagedCache(block_size=bad)


def test_paged_cache_with_no_arguments():
    cache = hf_paged.PagedCache()
    assert cache.get_seq_length() == 0
    assert cache.stats().blocks_in_use == 0
