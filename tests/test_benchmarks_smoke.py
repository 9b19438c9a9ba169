"""A seconds-long run of the whole benchmark suite at toy sizes: CSV columns, plots and summary exist."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import run_all  # noqa: E402
from benchmarks.common import CSV_COLUMNS, Suite  # noqa: E402


@pytest.mark.slow
@pytest.mark.xdist_group("benchmarks")
def test_smoke_suite_writes_csv_plots_summary(tmp_path, capsys):
    assert run_all.main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    benchmarks = {r["benchmark"] for r in rows}
    assert {"memory", "capacity", "decode", "ttft", "sharing_samples", "sharing_beams", "block_size"} <= benchmarks
    assert {"serving_throughput", "serving_latency", "spec", "kv_sharing"} <= benchmarks
    served = {r["variant"] for r in rows if r["benchmark"] == "serving_throughput"}
    assert served == {"engine", "generate_b8", "generate_b16", "generate_batch"}
    assert {"paged", "dynamic", "static"} <= {r["variant"] for r in rows if r["benchmark"] == "decode"}
    for row in rows:
        assert float(row["p20"]) <= float(row["p50"]) <= float(row["p80"])
    for name in ("memory", "capacity", "decode", "ttft", "sharing", "block_size", "serving", "spec"):
        png = tmp_path / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    # Memory figures are read from the caches: a left-padded batch holds fewer paged bytes than DynamicCache.
    kv = {r["variant"]: float(r["p50"]) for r in rows if r["benchmark"] == "padded_batch" and r["metric"] == "kv_bytes"}
    assert 0 < kv["paged"] < kv["dynamic"]
    printed = capsys.readouterr().out
    assert "| figure |" in printed and "(i) decode" in printed



def test_beam_copies_stay_within_one_block_per_beam():
    from benchmarks.beam_copies import copied_per_reorder
    from hf_paged.demo_model import load_demo_model

    model, _ = load_demo_model(attn_implementation="paged")
    block_kib = 16 * 4  # 16 tokens x 4 KiB of K/V per token (4 layers, 2 KV heads x 64, fp32)
    for context in (40, 300):
        assert 0 < copied_per_reorder(model, context, num_beams=4, new_tokens=6) <= 4 * block_kib


def test_triton_host_benchmark_times_the_triton_path_with_stubbed_launches(monkeypatch):
    """`bench_triton_host` runs the Triton path (not the PyTorch one) with every launch stubbed, and restores
    the launcher and the backend setting afterwards."""
    from benchmarks import bench_triton_host
    from hf_paged.attention import dispatch
    from hf_paged.kernels import launch

    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    routes = []
    original_route = dispatch._route

    def route(*args, **kwargs):
        routes.append(original_route(*args, **kwargs))
        return routes[-1]

    monkeypatch.setattr(dispatch, "_route", route)
    call = launch.Launch.__call__
    results = bench_triton_host.measure(steps=2, repeats=1)
    assert routes and all(r is None for r in routes)  # (None: the Triton path takes the call)
    assert launch.Launch.__call__ is call and "HF_PAGED_BACKEND" not in os.environ
    assert set(results) == {"first", "middle", "last", "mean"}
    assert all(len(v) == 1 and v[0] > 0 for v in results.values())


def test_host_benchmark_measures_one_cache_alone_or_both_side_by_side():
    """`bench_host.measure` with one variant runs only that cache (`--one-cache-per-process`: no default step runs
    between two paged ones) and pairs nothing; with both it pairs each paged forward with a default one."""
    from benchmarks import bench_host

    alone = bench_host.measure(steps=2, repeats=1, variants=("paged",))
    assert list(alone) == ["paged"] and "step_added" not in alone["paged"][0] and alone["paged"][0]["step"] > 0
    both = bench_host.measure(steps=2, repeats=1)
    assert set(both) == {"paged", "dynamic"} and "step_added" in both["paged"][0]


@pytest.mark.xdist_group("benchmarks")
def test_a_subset_updates_its_own_rows_and_keeps_the_others(tmp_path):
    """`--only capacity` over an existing results.csv: capacity's rows are replaced, another benchmark's row stays
    with its own date, and the full run's summary.md is left alone (the subset's summary goes beside it)."""
    old_decode = dict(zip(CSV_COLUMNS, ["decode", "decode_tokens_per_s", "paged", "batch_size", "8", "1", "2", "3",
                                        "tokens/s", "3", "old machine", "old versions", "2026-01-01T00:00:00Z"]))
    old_capacity = {**old_decode, "benchmark": "capacity", "metric": "stale"}
    with open(tmp_path / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows([old_decode, old_capacity])
    (tmp_path / "summary.md").write_text("curated\n")
    assert run_all.main(["--smoke", "--only", "capacity", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert old_decode in rows
    capacity = [r for r in rows if r["benchmark"] == "capacity"]
    assert capacity and all(r["metric"] != "stale" and r["date"] != old_decode["date"] for r in capacity)
    assert (tmp_path / "summary.md").read_text() == "curated\n"
    summary = (tmp_path / "summary-capacity.md").read_text()
    assert "| figure |" in summary and "capacity (simulation)" in summary
    assert "n/a" not in summary and "(i) decode" not in summary
    assert (tmp_path / "capacity.png").is_file() and not (tmp_path / "decode.png").exists()  # its own figure only
    with open(tmp_path / "results.csv", "rb") as f:
        assert b"\r\n" not in f.read()  # the line ends the committed file has


def test_the_summary_shows_only_the_benchmarks_that_ran():
    """A suite holding decode rows only (what `--only decode` collects) summarizes into decode's rows: (i) and
    (vi), no n/a rows for sharing, TTFT or the others."""
    suite = Suite(paged_model=None, sdpa_model=None, model_name="test", model_path=Path("."), smoke=True)
    for variant, value in (("paged", 900.0), ("dynamic", 1000.0), ("static", 950.0)):
        suite.add("decode", "decode_tokens_per_s", variant, "batch,context,new_tokens", "8,512,128", [value], "tokens/s")
    for variant, value in (("prefix_caching_on", 970.0), ("prefix_caching_off", 1000.0)):
        suite.add("decode", "decode_tokens_per_s", variant, "batch,context,new_tokens", "8,512,64", [value], "tokens/s")
    rows = run_all.summary(suite)
    assert [row[0].split(" ")[0] for row in rows] == ["(i)", "(vi)"]
    assert rows[0][3] == "paged/dynamic 0.90x"
    assert not any("n/a" in cell for row in rows for cell in row)
    assert run_all.summary(Suite(None, None, "test", Path("."), smoke=True)) == []


def test_gqa_fold_benchmark_times_both_routes_and_names_decode_attentions(tmp_path, capsys):
    """`bench_gqa_fold --smoke`: both variants timed per shape, mask and key count, and the route `decode_attention`
    takes by its threshold (2 query heads per KV head: folded only from `FOLD_GQA_MIN_BYTES` of keys)."""
    from benchmarks import bench_gqa_fold  # noqa: PLC0415
    from hf_paged.attention.torch_backend import FOLD_GQA_MIN_BYTES  # noqa: PLC0415

    assert bench_gqa_fold.main(["--smoke", "--out", str(tmp_path)]) == 0
    with (tmp_path / "gqa_fold.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2  # shapes x key counts x (no mask, padding mask)
    for row in rows:
        assert float(row["enable_gqa_us"]) > 0 and float(row["fold_us"]) > 0
        assert row["decode_attention_folds"] == str(int(row["key_bytes"]) >= FOLD_GQA_MIN_BYTES)
    assert "fold/gqa" in capsys.readouterr().out
