"""Run transformers' own generation tests with and without hf-paged and compare: `python -m tests.hf_suite.run`.

The tests are not ours: they live in `../shared/hf-tests` next to the repository (see its README), and are
laid out in a temporary folder with its `prepare` script. Without that folder this prints a skip message and
exits 0, so a clone on its own still passes.

What runs: the README's files (`tests/generation/test_utils.py` and transformers' own test modules of llama,
mistral, qwen2 and gemma2) plus `extra_families.py` of ours, which runs transformers' generic causal-LM tests
on every other model type the support table serves (`tests/matrix.py`), with the README's `-k` expression,
offline. The torch.compile tests (names containing "compil") run on the own modules only, unless
`--compile-tests all` (`make test-hf-all`). Two runs of that selection, at once (one thread each):
  baseline  plain transformers;
  paged     with `tests/hf_suite/plugin.py` loaded (`-p`), which forces attn_implementation="paged" and
            gives generate() a `hf_paged.PagedCache` wherever it would build its default DynamicCache.
Every test that passes in the baseline must pass in the paged run, except the tests listed in
`tests/hf_suite/expected_differences.txt` (tests that assert the type of the default cache). Baseline
failures are not compared; they are tests that download from the Hub (the runs are offline), which the
summary counts. Exits non-zero on any regression, or if the paged run never went through a PagedCache.

The suite was copied from transformers 5.23 (its tester modules import names that later versions dropped),
so by default both runs use transformers 5.23.0, installed with `pip install --no-deps --target` into
`OVERLAY_ROOT` (under the system temp dir; kept between runs, one version at a time) and put first on
PYTHONPATH; everything else comes from the environment. `--transformers installed` runs the suite on the
environment's own transformers instead. Everything else a run writes goes into a temporary folder that is
removed when it ends.

Options: `--families a,b` (only these model types), `--select EXPR` (ANDed with the `-k` expression),
`--side baseline|paged|both`, `--serial`, `--baseline-xml FILE` / `--paged-xml FILE` (reuse an earlier run's
JUnit XML, e.g. to rerun only the paged side against a kept baseline), `--out DIR` (keep the JUnit XML, logs
and plugin counts there), `--report FILE` (a Markdown list of the regressions with the last lines of each error).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUITE = ROOT.parent / "shared" / "hf-tests"
EXPECTED = HERE / "expected_differences.txt"

#: transformers version the suite's files were taken from (see ../shared/hf-tests/README.md).
SUITE_TRANSFORMERS = "5.23.0"
#: Our own module (`extra_families.py`): transformers' generic causal-LM tests on the support table's families
#: that the suite has no test module for, copied into the prepared suite at this path (with `families.json`).
EXTRA = "tests/models/hf_paged_extra/test_modeling_extra_families.py"
#: Model types of the support table whose own transformers test module the suite has.
OWN_MODULES = ("llama", "mistral", "qwen2", "gemma2")
FILES = [
    "tests/generation/test_utils.py",
    *(f"tests/models/{model_type}/test_modeling_{model_type}.py" for model_type in OWN_MODULES),
    EXTRA,
]
K_EXPR = "generate or cache or beam or sample or assisted or contrastive or prompt_lookup"
#: In the names of the tests that run generate() under torch.compile (compiling each family's model takes far
#: longer than all its other tests): by default they run on the suite's own modules only (`--compile-tests`).
COMPILE_KEYWORD = "compil"
#: Where the suite's transformers release is installed and kept between runs (one version at a time).
OVERLAY_ROOT = Path(tempfile.gettempdir()) / "hf-paged-hf-suite"
PLUGIN_MODULE = "plugin"  # tests/hf_suite/plugin.py, with tests/hf_suite on PYTHONPATH

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: Failure texts of a test that needed a download from the Hub (the suite runs offline).
HUB_MARKERS = ("couldn't connect to 'https://huggingface.co'", "offline mode", "LocalEntryNotFoundError",
               "OfflineModeIsEnabled")


@dataclass
class Outcome:
    status: str
    message: str = ""
    details: str = ""


def transformers_overlay(version: str) -> Path | None:
    """A folder holding transformers `version` alone (to put first on PYTHONPATH), or None if the
    environment already has that version.

    The folder (`OVERLAY_ROOT/transformers-<version>`, about 130 MB) is kept between runs, since installing it
    again takes longer than the check; any other version kept there is removed, so it never holds more than one.
    """
    import transformers  # noqa: PLC0415

    if transformers.__version__ == version:
        return None
    target = OVERLAY_ROOT / f"transformers-{version}"
    for other in OVERLAY_ROOT.glob("*") if OVERLAY_ROOT.is_dir() else ():
        if other != target:
            shutil.rmtree(other, ignore_errors=True) if other.is_dir() else other.unlink()
    if (target / f"transformers-{version}.dist-info").is_dir():
        print(f"hf-suite: transformers {version} for the suite: reusing {target} ({folder_mb(target)} MB, kept "
              f"between runs; `rm -rf {OVERLAY_ROOT}` frees it)", flush=True)
        return target
    shutil.rmtree(target, ignore_errors=True)  # an interrupted install
    print(f"hf-suite: installing transformers {version} for the suite into {target} (--no-deps; kept for the next "
          f"run, `rm -rf {OVERLAY_ROOT}` frees it)", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), f"transformers=={version}"],
        check=True,
    )
    return target


def folder_mb(path: Path) -> int:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20)


def pythonpath(*entries: Path | None) -> str:
    parts = [str(e) for e in entries if e is not None]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


#: Matrix overrides the generic tester does not take: the matrix's short sliding window (shorter than its
#: prompts, so that it matters) would meet the tester's right-padded `tril` attention masks, which a paged
#: cache refuses on sliding-window layers by design (README, "Right where transformers is right, or a clear
#: error"); the tester keeps its config's own window.
TESTER_OWN_SETTINGS = frozenset({"sliding_window"})


def families(only: set[str] | None = None) -> list[dict[str, object]]:
    """The served model types of the support table (`tests/matrix.py`) that run through `EXTRA`: every row
    that passes, except those with a module of their own in the suite (`OWN_MODULES`), with its config
    overrides but `TESTER_OWN_SETTINGS`; `only` keeps those whose model type or label it names."""
    sys.path.insert(0, str(ROOT / "tests"))
    from matrix import passing  # noqa: PLC0415

    return [
        {"model_type": case.model_type, "label": case.id,
         "config": {k: v for k, v in case.config.items() if k not in TESTER_OWN_SETTINGS}}
        for case in passing()
        if case.model_type not in OWN_MODULES and (only is None or only & {case.model_type, case.id})
    ]


@dataclass
class Selection:
    """What both sides run: the test files and the `-k` expression."""

    files: list[str]
    k_expr: str
    families: list[dict[str, object]]

    @classmethod
    def from_args(cls, only: str | None, select: str | None, compile_tests: str = "own") -> Selection:
        k_expr = K_EXPR
        if compile_tests == "own":  # (pytest's -k matches the module's name too)
            k_expr = f"({k_expr}) and not ({COMPILE_KEYWORD} and {Path(EXTRA).stem})"
        if select:
            k_expr = f"({k_expr}) and ({select})"
        if not only:
            return cls(list(FILES), k_expr, families())
        names = {name.strip() for name in only.split(",") if name.strip()}
        extra = families(names)
        files = [f"tests/models/{m}/test_modeling_{m}.py" for m in OWN_MODULES if m in names]
        unknown = names - set(OWN_MODULES) - {str(e["model_type"]) for e in extra} - {str(e["label"]) for e in extra}
        if unknown:
            raise SystemExit(f"hf-suite: --families: not a served model type of the support table: {sorted(unknown)}")
        return cls(files + ([EXTRA] if extra else []), k_expr, extra)


@dataclass
class SideRun:
    side: str
    xml: Path
    log: Path
    counts: Path | None
    proc: subprocess.Popen
    started: float


def start_pytest(dest: Path, out: Path, side: str, overlay: Path | None, selection: Selection, threads: int | None) -> SideRun:
    """Starts one side's pytest (its output goes to `out/<side>.log`)."""
    xml, log = out / f"{side}.xml", out / f"{side}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=180"]
    counts = None
    if side == "paged":
        counts = out / "paged_counts.json"
        env["HF_PAGED_SUITE_COUNTS"] = str(counts)
        env["PYTHONPATH"] = pythonpath(overlay, HERE)
        cmd += ["-p", PLUGIN_MODULE]
    else:
        env["PYTHONPATH"] = pythonpath(overlay)
    cmd += [*selection.files, "-k", selection.k_expr, f"--junitxml={xml}"]
    print(f"hf-suite: {side} run started", flush=True)
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=fh, stderr=subprocess.STDOUT)
    return SideRun(side, xml, log, counts, proc, time.monotonic())


def finish_pytest(run: SideRun) -> tuple[Path, Path | None]:
    """Waits for one side; returns (JUnit XML, plugin counts JSON or None)."""
    code = run.proc.wait()
    minutes, seconds = divmod(round(time.monotonic() - run.started), 60)
    lines = run.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    print(f"hf-suite: {run.side} run took {minutes}m{seconds:02d}s; pytest exit {code} "
          f"(failures are compared below): {lines[-1] if lines else '(no output)'}", flush=True)
    if not run.xml.exists():
        print("\n".join(lines[-40:]))
        raise SystemExit(f"hf-suite: the {run.side} run wrote no JUnit XML (its log's last lines are above)")
    return run.xml, run.counts


def node_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id of a JUnit test case (`tests.a.test_b.Class` + `test_c` -> `tests/a/test_b.py::Class::test_c`).

    (JUnit's `file` names the file that defines the test, a mixin's for inherited tests, so the module is
    found from the class name: its longest prefix that is a file under `root`.)
    """
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def read_junit(xml: Path, root: Path) -> dict[str, Outcome]:
    """Per-test outcomes of a pytest JUnit XML run in `root`, keyed by pytest node id."""
    results: dict[str, Outcome] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        nodeid = node_id(case.get("classname", ""), case.get("name", ""), root)
        outcome = Outcome(PASSED)
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = Outcome(FAILED, child.get("message", ""), child.text or "")
                break
            if child.tag == "skipped":
                outcome = Outcome(SKIPPED, child.get("message", ""))
        previous = results.get(nodeid)
        if previous is None or previous.status == PASSED:  # a teardown error after a pass counts
            results[nodeid] = outcome
    return results


def read_expected(path: Path = EXPECTED) -> dict[str, str]:
    """`test id  reason` per line (a test id may hold `*` wildcards, `fnmatch`-style); `#` comments and blank
    lines ignored."""
    expected: dict[str, str] = {}
    if not path.exists():
        return expected
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        test_id, _, reason = line.partition(" ")
        if not reason.strip():
            raise SystemExit(f"hf-suite: {path.name}: {test_id} has no reason")
        expected[test_id] = reason.strip()
    return expected


def counts(results: dict[str, Outcome]) -> dict[str, int]:
    out = {PASSED: 0, FAILED: 0, SKIPPED: 0}
    for outcome in results.values():
        out[outcome.status] += 1
    return out


def fmt(c: dict[str, int]) -> str:
    return f"{c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped"


def last_lines(text: str, n: int = 12) -> str:
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def write_report(path: Path, regressions: list[str], paged: dict[str, Outcome], header: list[str]) -> None:
    parts = ["# hf-suite regressions (transformers' generation tests, hf-paged swapped in)", "", *header, ""]
    for test_id in regressions:
        outcome = paged.get(test_id, Outcome("missing", "not run in the paged run"))
        parts += [f"## `{test_id}`", "", f"{outcome.status}: {outcome.message.splitlines()[0] if outcome.message else ''}",
                  "", "```", last_lines(outcome.details or outcome.message), "```", ""]
    path.write_text("\n".join(parts), encoding="utf-8")


def needs_hub(outcome: Outcome) -> bool:
    """Whether a failure is a download from the Hugging Face Hub, which the suite's offline runs cannot do."""
    text = f"{outcome.message}\n{outcome.details[-2000:]}"
    return any(marker in text for marker in HUB_MARKERS)


def describe_baseline(baseline: dict[str, Outcome]) -> str:
    c = counts(baseline)
    failed = [o for o in baseline.values() if o.status == FAILED]
    hub = sum(needs_hub(o) for o in failed)
    why = f"{hub} need the Hugging Face Hub, offline here"
    if len(failed) > hub:
        why += f"; {len(failed) - hub} fail with plain transformers {SUITE_TRANSFORMERS} for reasons of their own"
    return (f"{c[PASSED]} passed, {c[FAILED]} failed ({why}: not compared), {c[SKIPPED]} skipped")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["both", "baseline", "paged"], default="both")
    parser.add_argument("--baseline-xml", type=Path, help="reuse this baseline JUnit XML instead of running it")
    parser.add_argument("--paged-xml", type=Path,
                        help="reuse this paged-run JUnit XML (and paged_counts.json beside it) instead of running it")
    parser.add_argument("--transformers", default=SUITE_TRANSFORMERS,
                        help=f"transformers version for the suite (default {SUITE_TRANSFORMERS}), or 'installed'")
    parser.add_argument("--families", help="only these model types (comma-separated; the support table's labels "
                        "work too), without tests/generation/test_utils.py")
    parser.add_argument("--select", help="a -k expression ANDed with the suite's")
    parser.add_argument("--compile-tests", choices=["own", "all"], default="own",
                        help="run the torch.compile tests on the suite's own modules only (default) or on every family")
    parser.add_argument("--serial", action="store_true",
                        help="run the two sides one after the other (default: at once, one thread each)")
    parser.add_argument("--out", type=Path, help="keep JUnit XML, logs and counts here (default: removed at the end)")
    parser.add_argument("--report", type=Path, help="write the regressions as Markdown here")
    args = parser.parse_args(argv)

    if not (SUITE / "prepare").is_file():
        print(f"hf-suite: skipped: ../shared/hf-tests not found (looked for {SUITE})")
        return 0

    selection = Selection.from_args(args.families, args.select, args.compile_tests)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that the cleanup below runs
    overlay = None if args.transformers == "installed" else transformers_overlay(args.transformers)
    work = Path(tempfile.mkdtemp(prefix="hf-paged-hf-suite-run-"))
    try:
        out = args.out or work / "out"
        out.mkdir(parents=True, exist_ok=True)
        dest = work / "hf-tests"
        env = dict(os.environ, PYTHONPATH=pythonpath(overlay))
        subprocess.run(["bash", str(SUITE / "prepare"), str(dest), sys.executable], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        extra = dest / EXTRA
        extra.parent.mkdir(parents=True, exist_ok=True)
        (extra.parent / "__init__.py").touch()
        shutil.copyfile(HERE / "extra_families.py", extra)
        version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                                 env=env, capture_output=True, text=True, check=True).stdout.strip()
        known = subprocess.run(
            [sys.executable, "-c", "from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as m; "
             "print(' '.join(m))"], env=env, capture_output=True, text=True, check=True).stdout.split()
        newer = [str(e["label"]) for e in selection.families if e["model_type"] not in known]
        if newer:
            selection.families = [e for e in selection.families if e["model_type"] in known]
            print(f"hf-suite: not in transformers {version}, the suite's release, so not run here: {', '.join(newer)} "
                  "(`make test-models` checks them on the installed release)", flush=True)
        (extra.parent / "families.json").write_text(json.dumps(selection.families, indent=1), encoding="utf-8")
        own = [m for m in OWN_MODULES if any(f"/{m}/" in f for f in selection.files)]
        generic = [str(e["label"]) for e in selection.families]
        print(f"hf-suite: transformers {version}; {len(own) + len(generic)} model types: their own test modules for "
              f"{', '.join(own) or 'none'}; the generic causal-LM tests for {', '.join(generic) or 'none'}", flush=True)
        return compare(args, selection, dest, out, overlay, version)
    finally:  # everything of this run goes, unless --out keeps the logs and XML
        shutil.rmtree(work, ignore_errors=True)
        if not args.out:
            print(f"hf-suite: this run's temporary folder is removed (--out DIR keeps its logs and JUnit XML)")


def compare(args: argparse.Namespace, selection: Selection, dest: Path, out: Path, overlay: Path | None,
            version: str) -> int:
    """Runs (or reads) both sides and compares them; returns the exit status."""
    run_baseline = not args.baseline_xml and args.side in ("both", "baseline")
    run_paged = not args.paged_xml and args.side in ("both", "paged")
    at_once = run_baseline and run_paged and not args.serial
    threads = 1 if at_once else None
    runs, started = {}, []
    try:
        for side, wanted in (("baseline", run_baseline), ("paged", run_paged)):
            if wanted:
                started.append(start_pytest(dest, out, side, overlay, selection, threads))
                if not at_once:
                    runs[side] = finish_pytest(started[-1])
        if at_once:
            runs = {run.side: finish_pytest(run) for run in started}
    finally:  # interrupted: no pytest of this run outlives it
        for run in started:
            if run.proc.poll() is None:
                run.proc.terminate()
                run.proc.wait()

    baseline = paged = None
    if args.baseline_xml:
        baseline = read_junit(args.baseline_xml, dest)
    elif run_baseline:
        baseline = read_junit(runs["baseline"][0], dest)
    plugin_counts = counts_file = None
    if args.paged_xml:
        xml, counts_file = args.paged_xml, args.paged_xml.parent / "paged_counts.json"
        paged = read_junit(xml, dest)
    elif run_paged:
        xml, counts_file = runs["paged"]
        paged = read_junit(xml, dest)
    if counts_file is not None and counts_file.exists():
        plugin_counts = json.loads(counts_file.read_text(encoding="utf-8"))

    header = [f"transformers {version}; `{' '.join(selection.files)}` -k `{selection.k_expr}`"]
    if baseline is not None:
        header.append(f"baseline: {describe_baseline(baseline)}")
        print(f"hf-suite: baseline: {describe_baseline(baseline)}")
    if paged is None:
        return 0
    header.append(f"paged:    {fmt(counts(paged))}")
    print(f"hf-suite: paged:    {fmt(counts(paged))}")
    status = 0
    if plugin_counts is None or not plugin_counts["counts"].get("paged_attend"):
        print("hf-suite: FAILED: the paged run never read a PagedCache (plugin counts: "
              f"{plugin_counts and plugin_counts['counts']})")
        status = 1
    else:
        summary = ", ".join(f"{k}={v}" for k, v in sorted(plugin_counts["counts"].items()))
        n_tests = len(plugin_counts["tests_on_paged_path"])
        print(f"hf-suite: paged path taken: {summary}; {n_tests} tests read a PagedCache")
        header.append(f"plugin counts: {summary}; {n_tests} tests read a PagedCache")
    if baseline is None:
        return status

    expected = read_expected()

    def listed(test_id: str) -> str | None:
        return next((pattern for pattern in expected if fnmatch.fnmatchcase(test_id, pattern)), None)

    passed_before = sorted(t for t, o in baseline.items() if o.status == PASSED)
    lost = [t for t in passed_before if paged.get(t, Outcome("missing")).status != PASSED]
    regressions = [t for t in lost if listed(t) is None]
    allowed = [t for t in lost if listed(t) is not None]
    fixed = sorted(t for t, o in paged.items() if o.status == PASSED and baseline.get(t, Outcome(FAILED)).status != PASSED)
    stale = sorted(t for t in baseline if listed(t) is not None and t not in lost)
    header.append(f"regressions: {len(regressions)} (expected differences: {len(allowed)}, {len(expected)} lines listed)")
    for test_id in allowed:
        print(f"hf-suite: expected difference: {test_id}: {expected[listed(test_id)]}")
    for test_id in stale:
        print(f"hf-suite: note: {test_id} is listed in {EXPECTED.name} but did not regress")
    for test_id in fixed:
        print(f"hf-suite: note: passes only with hf-paged: {test_id}")
    for test_id in regressions:
        outcome = paged.get(test_id, Outcome("missing", "not run in the paged run"))
        first = outcome.message.splitlines()[0] if outcome.message else ""
        print(f"hf-suite: REGRESSION: {test_id}: {outcome.status}: {first[:300]}")
        print("    " + last_lines(outcome.details or outcome.message, 6).replace("\n", "\n    "))
    if args.report:
        write_report(args.report, regressions, paged, header)
    print(f"hf-suite: {len(regressions)} regressions, {len(allowed)} expected differences")
    return 1 if regressions else status


if __name__ == "__main__":
    sys.exit(main())
