"""Run transformers' own generation tests with and without hf-paged and compare: `python -m tests.hf_suite.run`.

The tests are not ours: they live in `../shared/hf-tests` next to the repository (see its README), and are
laid out in a temporary folder with its `prepare` script. Without that folder this prints a skip message and
exits 0, so a clone on its own still passes.

Two runs of the same command line (the README's files, plus `extra_families.py` of ours on ten more model
families, and the README's `-k` expression, offline):
  baseline  plain transformers;
  paged     with `tests/hf_suite/plugin.py` loaded (`-p`), which forces attn_implementation="paged" and
            gives generate() a `hf_paged.PagedCache` wherever it would build its default DynamicCache.
Every test that passes in the baseline must pass in the paged run, except the tests listed in
`tests/hf_suite/expected_differences.txt` (tests that assert the type of the default cache). Exits non-zero
on any regression, or if the paged run never went through a PagedCache.

The suite was copied from transformers 5.23 (its tester modules import names that later versions dropped),
so by default both runs use transformers 5.23.0, installed once with `pip install --no-deps --target` into a
folder under the system temp dir and put first on PYTHONPATH; everything else comes from the environment.
`--transformers installed` runs the suite on the environment's own transformers instead.

Options: `--side baseline|paged|both`, `--baseline-xml FILE` / `--paged-xml FILE` (reuse an earlier run's
JUnit XML, e.g. to rerun only the paged side against a kept baseline),
`--out DIR` (keep the JUnit XML, logs and plugin counts there), `--report FILE` (a Markdown list of the
regressions with the last lines of each error).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUITE = ROOT.parent / "shared" / "hf-tests"
EXPECTED = HERE / "expected_differences.txt"

#: transformers version the suite's files were taken from (see ../shared/hf-tests/README.md).
SUITE_TRANSFORMERS = "5.23.0"
#: Our own module (`extra_families.py`): transformers' generic causal-LM tests on families the suite has no
#: test module for, copied into the prepared suite at this path.
EXTRA = "tests/models/hf_paged_extra/test_modeling_extra_families.py"
FILES = [
    "tests/generation/test_utils.py",
    "tests/models/llama/test_modeling_llama.py",
    "tests/models/mistral/test_modeling_mistral.py",
    "tests/models/qwen2/test_modeling_qwen2.py",
    "tests/models/gemma2/test_modeling_gemma2.py",
    EXTRA,
]
K_EXPR = "generate or cache or beam or sample or assisted or contrastive or prompt_lookup"
PLUGIN_MODULE = "plugin"  # tests/hf_suite/plugin.py, with tests/hf_suite on PYTHONPATH

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Outcome:
    status: str
    message: str = ""
    details: str = ""


def transformers_overlay(version: str) -> Path | None:
    """A folder holding transformers `version` alone (to put first on PYTHONPATH), or None if the
    environment already has that version."""
    import transformers  # noqa: PLC0415

    if transformers.__version__ == version:
        return None
    target = Path(tempfile.gettempdir()) / "hf-paged-hf-suite" / f"transformers-{version}"
    if not (target / f"transformers-{version}.dist-info").is_dir():
        print(f"hf-suite: installing transformers {version} for the suite into {target} (--no-deps)", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target),
             f"transformers=={version}"],
            check=True,
        )
    return target


def pythonpath(*entries: Path | None) -> str:
    parts = [str(e) for e in entries if e is not None]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def run_pytest(dest: Path, out: Path, side: str, overlay: Path | None) -> tuple[Path, Path | None]:
    """Runs one side; returns (JUnit XML, plugin counts JSON or None)."""
    xml, log = out / f"{side}.xml", out / f"{side}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=180"]
    counts = None
    if side == "paged":
        counts = out / "paged_counts.json"
        env["HF_PAGED_SUITE_COUNTS"] = str(counts)
        env["PYTHONPATH"] = pythonpath(overlay, HERE)
        cmd += ["-p", PLUGIN_MODULE]
    else:
        env["PYTHONPATH"] = pythonpath(overlay)
    cmd += [*FILES, "-k", K_EXPR, f"--junitxml={xml}"]
    print(f"hf-suite: {side} run (log: {log})", flush=True)
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, cwd=dest, env=env, stdout=fh, stderr=subprocess.STDOUT)
    lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    print(f"hf-suite: {side}: pytest exit {proc.returncode}: {lines[-1] if lines else '(no output)'}", flush=True)
    if not xml.exists():
        raise SystemExit(f"hf-suite: the {side} run wrote no JUnit XML; see {log}")
    return xml, counts


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
    """`test id  reason` per line; `#` comments and blank lines ignored."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["both", "baseline", "paged"], default="both")
    parser.add_argument("--baseline-xml", type=Path, help="reuse this baseline JUnit XML instead of running it")
    parser.add_argument("--paged-xml", type=Path,
                        help="reuse this paged-run JUnit XML (and paged_counts.json beside it) instead of running it")
    parser.add_argument("--transformers", default=SUITE_TRANSFORMERS,
                        help=f"transformers version for the suite (default {SUITE_TRANSFORMERS}), or 'installed'")
    parser.add_argument("--out", type=Path, help="keep JUnit XML, logs and counts here (default: a temp dir)")
    parser.add_argument("--report", type=Path, help="write the regressions as Markdown here")
    args = parser.parse_args(argv)

    if not (SUITE / "prepare").is_file():
        print(f"hf-suite: skipped: ../shared/hf-tests not found (looked for {SUITE})")
        return 0

    overlay = None if args.transformers == "installed" else transformers_overlay(args.transformers)
    work = Path(tempfile.mkdtemp(prefix="hf-paged-hf-suite-"))
    out = args.out or work
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
    print(f"hf-suite: transformers {version}, suite prepared in {dest}", flush=True)
    try:
        return compare(args, dest, out, overlay, version)
    finally:  # the copy of the suite goes; logs and XML stay in `out`
        shutil.rmtree(work if out != work else dest, ignore_errors=True)


def compare(args: argparse.Namespace, dest: Path, out: Path, overlay: Path | None, version: str) -> int:
    """Runs (or reads) both sides and compares them; returns the exit status."""
    baseline = paged = None
    if args.baseline_xml:
        baseline = read_junit(args.baseline_xml, dest)
    elif args.side in ("both", "baseline"):
        baseline = read_junit(run_pytest(dest, out, "baseline", overlay)[0], dest)
    plugin_counts = None
    if args.paged_xml:
        xml, counts_file = args.paged_xml, args.paged_xml.parent / "paged_counts.json"
        paged = read_junit(xml, dest)
    elif args.side in ("both", "paged"):
        xml, counts_file = run_pytest(dest, out, "paged", overlay)
        paged = read_junit(xml, dest)
    if paged is not None:
        if counts_file is not None and counts_file.exists():
            plugin_counts = json.loads(counts_file.read_text(encoding="utf-8"))

    header = [f"transformers {version}; `{' '.join(FILES)}` -k `{K_EXPR}`"]
    if baseline is not None:
        header.append(f"baseline: {fmt(counts(baseline))}")
        print(f"hf-suite: baseline: {fmt(counts(baseline))}")
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
    passed_before = sorted(t for t, o in baseline.items() if o.status == PASSED)
    lost = [t for t in passed_before if paged.get(t, Outcome("missing")).status != PASSED]
    regressions = [t for t in lost if t not in expected]
    allowed = [t for t in lost if t in expected]
    fixed = sorted(t for t, o in paged.items() if o.status == PASSED and baseline.get(t, Outcome(FAILED)).status != PASSED)
    stale = sorted(t for t in expected if t not in lost)
    header.append(f"regressions: {len(regressions)} (expected differences: {len(allowed)} of {len(expected)} listed)")
    for test_id in allowed:
        print(f"hf-suite: expected difference: {test_id}: {expected[test_id]}")
    for test_id in stale:
        print(f"hf-suite: note: {test_id} is listed in {EXPECTED.name} but did not regress")
    for test_id in fixed:
        print(f"hf-suite: note: passes only with hf-paged: {test_id}")
    for test_id in regressions:
        outcome = paged.get(test_id, Outcome("missing", "not run in the paged run"))
        first = outcome.message.splitlines()[0] if outcome.message else ""
        print(f"hf-suite: REGRESSION: {test_id}: {outcome.status}: {first[:300]}")
    if args.report:
        write_report(args.report, regressions, paged, header)
    print(f"hf-suite: {len(regressions)} regressions, {len(allowed)} expected differences")
    return 1 if regressions else status


if __name__ == "__main__":
    sys.exit(main())
