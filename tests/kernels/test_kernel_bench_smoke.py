"""The kernel benchmark's CPU-side parts (shapes, timing loop, CSV, plots) via --smoke."""

from __future__ import annotations

import csv

from benchmarks import kernel_bench


def test_kernel_bench_smoke(tmp_path, capsys):
    assert kernel_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    with (tmp_path / "kernel_bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == set(kernel_bench.FIELDS)
    benchmarks = {r["benchmark"] for r in rows}
    assert {"copy_bandwidth", "decode_time", "decode_bandwidth", "decode_copy_fraction", "prefill_tflops"} <= benchmarks
    assert {"hf_paged", "sdpa_contiguous"} <= {r["variant"] for r in rows}
    assert all(float(r["p20"]) <= float(r["p50"]) <= float(r["p80"]) for r in rows)
    assert list(tmp_path.glob("*.png"))
    assert "decode_bandwidth" in capsys.readouterr().out
