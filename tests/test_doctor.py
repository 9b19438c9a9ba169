"""`python -m hf_paged doctor` on CPU: versions, device, backend and every kernel against the PyTorch path
(under the Triton interpreter), the bandwidth of the PyTorch path, exit status 0; a mismatch exits 1, a model
whose config cannot be read is a one-line error (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _doctor(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the doctor sets it itself
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "hf_paged", "doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_doctor_default_shapes_on_cpu():
    done = _doctor()
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    for needle in ("== versions", "python ", "torch ", "transformers ", "triton ", "hf_paged ", "== device",
                   "Triton interpreter (TRITON_INTERPRET=1)", "backend: torch", "== bandwidth (CPU: the PyTorch path",
                   "GB/s of K/V", "== OK"):
        assert needle in out, needle
    for check in ("write", "attention prefill", "attention decode", "attention split-kv", "copy"):
        lines = [line for line in out.splitlines() if line.strip().startswith(check + " ")]
        assert len(lines) == 5 and all(line.rstrip().split("[")[0].endswith("ok ") for line in lines), lines
    assert "head_dim 72" in out and "sinks" in out and "softcap" in out and "window" in out


def test_doctor_reads_the_model_config(tmp_path, capsys):
    """In this process: `doctor.main`'s return value is the command's exit status (the CLI itself runs above)."""
    from transformers import LlamaConfig

    from hf_paged.tools import doctor

    LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                intermediate_size=64, vocab_size=32).save_pretrained(tmp_path)
    status = doctor.main(["--model", str(tmp_path), "--dtype", "float32"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "head_dim 24, 4 heads / 2 KV heads (GQA 2), float32" in out
    assert "attention split-kv" in out and "== OK" in out


def test_doctor_exits_nonzero_on_a_mismatch(monkeypatch, capsys):
    from hf_paged.tools import doctor

    monkeypatch.setattr(doctor, "check_copy", lambda *args: 1.0)
    monkeypatch.setattr(doctor, "DEFAULT_SHAPES", (doctor.Shape("tiny", 16, 2, 1, torch.float32),))
    assert doctor.main(["--no-bench"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "1 check(s) failed" in out
    assert "== bandwidth: skipped (--no-bench)" in out


def test_the_bandwidth_benchmark_runs_the_pytorch_path_on_cpu():
    from hf_paged.tools import doctor

    attention, copy = doctor.bandwidth(torch.device("cpu"))
    assert attention.startswith("  decode attention, PyTorch path (batch 4, context 1024, 32/8 heads, d128, float32)")
    assert copy.startswith("  block copy, PyTorch path (128 blocks x 2 pools)")
    assert all(float(line.split(", ")[-1].split(" GB/s")[0]) > 0 for line in (attention, copy))


def test_a_model_without_a_readable_config_is_one_line(tmp_path, monkeypatch, capsys):
    from hf_paged.tools import doctor

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))  # main() sets it if unset
    (tmp_path / "config.json").write_text("{}")  # a directory, but no model in it
    with pytest.raises(SystemExit) as exit_:
        doctor.main(["--model", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --model: cannot read a model config from {tmp_path}: " in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m hf_paged doctor: error: --model")
    with pytest.raises(SystemExit) as exit_:  # a hub id that is not cached (offline); any other exception fails here
        doctor.main(["--model", "no-such-model-id"])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert "--model: cannot read a model config from no-such-model-id" in err
    assert "== versions" not in out  # refused before anything runs


def test_a_model_no_paged_cache_serves_is_one_line(tmp_path, monkeypatch, capsys):
    """A pure state-space model (no attention heads in its config): one line naming why, exit 2."""
    from transformers import AutoConfig

    from hf_paged.tools import doctor

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        doctor.main(["--model", str(tmp_path)])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert f"--model: {tmp_path} is not served by hf-paged: Model type 'mamba'" in err and "Traceback" not in err
    assert "== versions" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_gpu_check_says_it_needs_cuda(capsys):
    from benchmarks import gpu_check

    assert gpu_check.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_check_generate_step_runs_on_a_tiny_cpu_model():
    """The end-to-end step's code (three caches, alternating, CSV rows) on a tiny Llama on CPU."""
    from benchmarks import gpu_check

    tiny = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    rows = gpu_check.generate_benchmark(2, 12, 5, 1, device="cpu", config_kwargs=tiny, dtype=torch.float32)
    variants = {r["variant"] for r in rows}
    assert variants == {"paged", "dynamic", "static"}
    equal = {r["variant"]: float(r["value"]) for r in rows if r["metric"] == "tokens_before_first_difference"}
    assert equal["dynamic"] == 1.0 and equal["paged"] > 0.5


def test_gpu_check_agreement_counts_tokens_before_the_first_difference():
    from benchmarks.gpu_check import agreement

    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6
def test_doctor_reads_what_a_multi_latent_model_stores(tmp_path, capsys):
    """DeepSeek V3 hands update() its compressed latent (kv_lora_rank wide) and rotary key (qk_rope_head_dim
    wide) as one KV head each, and reads them back gathered: the doctor says so instead of checking kernels at
    a head_dim the model never uses."""
    from transformers import DeepseekV3Config

    from hf_paged.tools import doctor

    DeepseekV3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, kv_lora_rank=48, q_lora_rank=32,
                     qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, intermediate_size=64,
                     moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                     vocab_size=32).save_pretrained(tmp_path)
    (shape,) = doctor.shapes_from_config(str(tmp_path), torch.float32)
    assert (shape.num_kv_heads, shape.head_dim, shape.head_dim_v, shape.reads_gathered) == (1, 48, 16, True)
    status = doctor.main(["--model", str(tmp_path), "--dtype", "float32"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "stores K 48 / V 16 wide, 1 KV head(s) per layer, 4 query heads, float32" in out
    assert "no Triton kernel serves it" in out and "== OK" in out
