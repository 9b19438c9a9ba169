"""`benchmarks.compare`: temporary worktrees made and removed, both sides run alternately in fresh processes that
import their own tree, a benchmark missing from a tree said so, ratios flagged only beyond their spread."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compare

ROOT = Path(__file__).resolve().parent.parent


def _worktrees() -> set[str]:
    out = subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")}


@pytest.mark.slow
@pytest.mark.xdist_group("benchmarks")
def test_compare_runs_both_trees_alternately_and_removes_its_worktree(tmp_path, monkeypatch, capsys):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    seen = []
    measure = compare.measure

    def recorded(side, repeat, args):
        seen.append((side.label, side.tree, side.tree.is_dir(), str(side.tree.resolve()) in _worktrees()))
        return measure(side, repeat, args)

    monkeypatch.setattr(compare, "measure", recorded)
    argv = ["HEAD", "--smoke", "--bench", "decode", "--batch-sizes", "1", "--repeats", "2", "--out", str(tmp_path)]
    assert compare.main(argv) == 0

    # BASE in a temporary worktree that existed while it ran and is gone now; HEAD is this working tree.
    assert [label for label, *_ in seen] == ["BASE", "HEAD", "HEAD", "BASE"]
    base_tree = seen[0][1]
    assert base_tree != ROOT and seen[0][2] and seen[0][3]
    assert {tree for label, tree, *_ in seen if label == "HEAD"} == {ROOT}
    assert not base_tree.exists() and str(base_tree.resolve()) not in _worktrees()

    printed = capsys.readouterr().out
    assert "| figure | BASE " in printed and "decode paged/dynamic, batch 1, prompt 32, 4 new" in printed
    # Each side's processes imported their own tree's hf_paged and kernels (the driver checks it too).
    assert f"hf_paged from {base_tree / 'hf_paged'}, hf_paged.kernels from {base_tree / 'kernels' / 'triton'}" in printed
    assert f"hf_paged from {ROOT / 'hf_paged'}, hf_paged.kernels from {ROOT / 'kernels' / 'triton'}" in printed

    (path,) = tmp_path.glob("compare-*.csv")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == compare.CSV_COLUMNS
        rows = list(reader)
    assert {(r["side"], r["repeat"]) for r in rows} == {(s, str(i)) for s in ("BASE", "HEAD") for i in (0, 1)}
    assert all(float(r["value"]) > 0 for r in rows)
    assert len({r["figure"] for r in rows}) == 3  # paged, dynamic, their ratio at batch 1
    assert path.with_suffix(".md").read_text().startswith("| figure |")


@pytest.mark.parametrize("kernels", ["kernels/triton", "kernels"])
def test_a_tree_without_the_benchmark_is_reported_not_failed(tmp_path, kernels):
    """A tree whose `benchmarks` package lacks `bench_decode`: the worker imports that tree's `hf_paged` and
    kernels (not the installed checkout's), from `kernels/triton/` or, in trees before it, `kernels/`, and reports
    decode as missing."""
    for package in ("hf_paged", kernels, "benchmarks"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    command = [sys.executable, str(compare.WORKER), "--tree", str(tmp_path), "--bench", "decode", "--batch-sizes", "1",
               "--prompt", "8", "--new-tokens", "2", "--rounds", "1", "--threads", "1"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["hf_paged"] == str(tmp_path / "hf_paged" / "__init__.py")
    assert report["kernels"] == str(tmp_path / kernels / "__init__.py")
    assert "bench_decode" in report["benchmarks"]["decode"]["missing"]


def test_a_tree_with_a_kernels_package_does_not_shadow_the_hub_package(tmp_path):
    """In a tree before `kernels/triton/`, `kernels/__init__.py` sits where a top-level `kernels` is looked up
    first; transformers 5.25 on imports the hub package of that name. The worker finds it outside the tree."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    code = ("import sys, importlib.util\n"
            f"sys.path.insert(0, {str(compare.WORKER.parent)!r})\n"
            "import compare_worker\n"
            f"compare_worker.use_tree(compare_worker.Path({str(tmp_path)!r}))\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else None)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(tmp_path) not in done.stdout


@pytest.mark.xdist_group("benchmarks")
def test_the_engine_benchmark_measures_this_tree(tmp_path):
    """`--bench engine` in one worker process on this tree (smoke size): one throughput figure, no control."""
    command = [sys.executable, str(compare.WORKER), "--tree", str(compare.ROOT), "--bench", "engine", "--batch-sizes",
               "1", "--prompt", "8", "--new-tokens", "2", "--rounds", "1", "--threads", "1", "--smoke"]
    done = subprocess.run(command, cwd=compare.ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (figure,) = json.loads(done.stdout.splitlines()[-1])["benchmarks"]["engine"]["figures"]
    assert figure["name"].startswith("engine output tokens/s, 6 ") and figure["value"] > 0
    assert figure["higher_is_better"] and not figure["is_control"] and figure["control"] is None


def test_the_graph_benchmark_measures_this_tree():
    """`--bench graph` in one worker process on this tree (smoke size): the compiled engine's figures, and the
    single stream's beside its control, `StaticCache` + `torch.compile`."""
    command = [sys.executable, str(compare.WORKER), "--tree", str(compare.ROOT), "--bench", "graph", "--batch-sizes",
               "1", "--prompt", "8", "--new-tokens", "2", "--rounds", "1", "--threads", "1", "--smoke"]
    done = subprocess.run(command, cwd=compare.ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = {f["name"]: f for f in json.loads(done.stdout.splitlines()[-1])["benchmarks"]["graph"]["figures"]}
    assert len(figures) == 5 and all(f["value"] > 0 and f["higher_is_better"] for f in figures.values())
    static = figures["single-stream decode tokens/s, StaticCache + torch.compile"]
    assert static["is_control"]
    assert figures["single-stream decode tokens/s, Engine(compile=True)"]["control"] == static["name"]


def _measurement(side: str, repeat: int, values: dict[str, float], higher_is_better: bool = True,
                 controls: dict[str, str] | None = None):
    """A process's figures; `controls` maps a figure to its control (a figure of `values` too)."""
    controls = controls or {}
    m = compare.Measurement(side, repeat, "2026-01-01T00:00:00Z", "hf_paged/__init__.py", "kernels/__init__.py")
    m.figures = {name: {"name": name, "value": v, "unit": "x", "higher_is_better": higher_is_better,
                        "is_control": name in controls.values(), "control": controls.get(name)}
                 for name, v in values.items()}
    return m


def test_a_figure_is_flagged_only_beyond_the_spread_of_its_pairs():
    base = [1.0, 1.0, 1.0, 1.0]
    head = {"slower": [0.90, 0.92, 0.88, 0.91], "noisy": [0.90, 1.10, 0.95, 1.05], "faster": [1.2, 1.3, 1.25, 1.2]}
    runs = []
    for r in range(4):
        runs.append(_measurement("BASE", r, {name: base[r] for name in head}))
        runs.append(_measurement("HEAD", r, {name: values[r] for name, values in head.items()}))
    verdicts = {ratio.figure: ratio.verdict for ratio in compare.compare(runs)}
    assert verdicts == {"slower": "WORSE", "noisy": "", "faster": "better"}
    # Lower is better (a time): the same numbers read the other way round.
    timed = [_measurement(m.side, m.repeat, {k: f["value"] for k, f in m.figures.items()}, False) for m in runs]
    assert {r.figure: r.verdict for r in compare.compare(timed)} == {"slower": "better", "noisy": "", "faster": "WORSE"}
    # Two pairs are no spread to judge by.
    assert all(r.verdict == "" for r in compare.compare(runs[:4]))


def test_a_figure_with_a_control_is_flagged_only_beyond_the_control_s_movement():
    """The machine slowed down for HEAD's processes: the control (no hf-paged code) fell as much as the paged
    figure, so the paged figure is not flagged and the control is marked as moved; a paged figure falling
    where its control held is flagged."""
    controls = {"paged": "dynamic", "paged_alone": "dynamic_steady"}
    head = {"paged": [0.80, 0.75, 0.85], "dynamic": [0.78, 0.74, 0.88], "paged_alone": [0.80, 0.82, 0.79],
            "dynamic_steady": [0.99, 1.01, 1.0]}
    runs = []
    for r in range(3):
        runs.append(_measurement("BASE", r, dict.fromkeys(head, 100.0), controls=controls))
        runs.append(_measurement("HEAD", r, {name: 100.0 * v[r] for name, v in head.items()}, controls=controls))
    verdicts = {ratio.figure: ratio.verdict for ratio in compare.compare(runs)}
    assert verdicts == {"paged": "", "dynamic": "control moved", "paged_alone": "WORSE", "dynamic_steady": "control"}


def test_a_benchmark_missing_from_base_is_said_and_not_compared():
    base_side = compare.Side("BASE", "abc", "abc", Path("/base"))
    head_side = compare.Side("HEAD", "working tree", "def", Path("/head"))
    base = _measurement("BASE", 0, {})
    base.missing["host"] = "AttributeError: module 'benchmarks.bench_host' has no attribute 'measure'"
    head = _measurement("HEAD", 0, {"host us per decode step paged": 10.0})
    assert compare.compare([base, head]) == []
    (line,) = compare.missing_lines([base, head], (base_side, head_side))
    assert line.startswith("benchmark 'host' does not exist in BASE (abc)") and "no attribute 'measure'" in line


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak memory is read from Linux's /proc")
def test_the_growth_benchmark_measures_this_tree():
    """`--bench growth` in one worker process on this tree (smoke size): the peak memory of a decode that grows its
    pool, and that peak over the K/V bytes the pool ends with; lower is better."""
    command = [sys.executable, str(compare.WORKER), "--tree", str(compare.ROOT), "--bench", "growth", "--batch-sizes",
               "1", "--prompt", "8", "--new-tokens", "2", "--rounds", "1", "--threads", "1", "--smoke"]
    done = subprocess.run(command, cwd=compare.ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, ratio = json.loads(done.stdout.splitlines()[-1])["benchmarks"]["growth"]["figures"]
    assert peak["name"] == "growth: peak MiB while one row decodes to 300 tokens" and peak["unit"] == "MiB"
    assert ratio["unit"] == "x" and 0 < ratio["value"] and 0 < peak["value"]
    assert not peak["higher_is_better"] and not ratio["higher_is_better"]


def test_growth_runs_in_a_process_of_its_own(monkeypatch):
    """A benchmark of `OWN_PROCESS` gets a fresh worker process: memory another benchmark freed would be reused and
    hide its peak. The others share one process, and the side's figures merge both reports."""
    commands = []

    def fake_worker(command, cwd, env):
        bench = command[command.index("--bench") + 1]
        commands.append(bench)
        files = {"hf_paged": str(compare.ROOT / "hf_paged" / "__init__.py"),
                 "kernels": str(compare.ROOT / "kernels" / "triton" / "__init__.py")}
        return {**files, "benchmarks": {name: {"figures": [{"name": f"{name} figure", "value": 1.0}]}
                                        for name in bench.split(",")}}

    monkeypatch.setattr(compare, "run_json_process", fake_worker)
    args = compare.parse_args(["HEAD", "--bench", "decode,growth,host"])
    side = compare.Side("HEAD", "working tree", "abc", compare.ROOT)
    out = compare.measure(side, 0, args)
    assert commands == ["decode,host", "growth"]
    assert set(out.figures) == {"decode figure", "growth figure", "host figure"}
