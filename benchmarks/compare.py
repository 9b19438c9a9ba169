"""Compares the benchmarks of two commits side by side: `python -m benchmarks.compare BASE [HEAD] [--bench decode]`.

BASE (and HEAD, when given) is checked out into a temporary git worktree (`git worktree add --detach`), removed
afterwards, also on an error or Ctrl-C. Without HEAD the other side is this working tree as it is, uncommitted
changes included: the change being made is compared with its base. The two sides run alternately in fresh
processes in one run (BASE HEAD, HEAD BASE, BASE HEAD, ...), each process importing its own tree's `hf_paged`,
`hf_paged.kernels` and `benchmarks` (`compare_worker.py`, which reports the files it imported; the driver stops
if one is not its side's) with the same torch thread count (`--threads`, 1), so both see the same conditions.
Both sides use this environment's torch and transformers.

Per figure it prints BASE's and HEAD's medians over the processes and the ratio HEAD/BASE: the median of the
per-pair ratios (pair i = HEAD's i-th process over BASE's i-th) and their range, min-max. A figure whose every
pair lies on the worse side of 1, and of its control's range where it has one, is flagged `WORSE` (`better` the
other way); with fewer than 3 pairs nothing is flagged. A control (`DynamicCache`, which does not run hf-paged
code) shows how the machine's speed moved between the processes: one whose range excludes 1 is marked
`control moved`. The long-format CSV (figure, side, repeat, value, unit, commit, date), the table and a plot of the
per-pair ratios go to `--out` (`benchmarks/results/compare/`).

`make bench-compare BASE=<commit> [HEAD=<commit>] [BENCH=decode,host] [ARGS="--repeats 5"]` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .common import run_json_process

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "compare_worker.py"
BENCHMARKS = ("decode", "host", "engine", "graph", "growth")
CSV_COLUMNS = ["figure", "side", "repeat", "value", "unit", "commit", "date"]
#: Fewer pairs than this give no spread to judge by: nothing is flagged.
MIN_PAIRS_TO_FLAG = 3


@dataclass(slots=True)
class Side:
    """One side of the comparison: its label, the revision asked for, its commit and the tree it runs in."""

    label: str  # "BASE" or "HEAD"
    revision: str
    commit: str  # abbreviated hash, "+changes" when the working tree differs from it
    tree: Path


@dataclass(slots=True)
class Measurement:
    """One process's output: every figure of every benchmark it ran, or why a benchmark is missing."""

    side: str
    repeat: int
    date: str
    hf_paged: str
    kernels: str
    figures: dict[str, dict] = field(default_factory=dict)  # name -> figure (value, unit, higher_is_better)
    missing: dict[str, str] = field(default_factory=dict)  # benchmark -> reason


@dataclass(slots=True)
class Ratio:
    """A figure's comparison: medians of each side, per-pair ratios HEAD/BASE and their verdict."""

    figure: str
    unit: str
    base: float
    head: float
    ratios: list[float]
    verdict: str  # "WORSE", "better", "" (within the spread); for a control "control" or "control moved"


# ---------------------------------------------------------------------------- git worktrees
def _git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve(revision: str) -> str:
    """The full commit hash of `revision`; an unknown revision raises, saying what to give."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except RuntimeError:
        raise ValueError(f"{revision!r} is not a commit of {ROOT}: give a commit hash, branch or tag "
                         "(`git log --oneline` lists them)") from None


@contextlib.contextmanager
def checked_out(base: str, head: str | None) -> Iterator[tuple[Side, Side]]:
    """BASE, and HEAD when given, checked out into temporary worktrees (HEAD None: this working tree as it is),
    removed on leaving, however it is left."""
    base_commit, head_commit = resolve(base), resolve(head) if head else None
    temp = Path(tempfile.mkdtemp(prefix="hf_paged_compare_"))
    added: list[Path] = []
    try:

        def worktree(label: str, revision: str, commit: str) -> Side:
            path = temp / label.lower()
            added.append(path)  # before adding: an interrupted `add` is cleaned up too
            _git("worktree", "add", "--detach", "--quiet", str(path), commit)
            return Side(label, revision, commit[:9], path)

        base_side = worktree("BASE", base, base_commit)
        if head_commit is None:
            commit = _git("rev-parse", "--short=9", "HEAD")
            changed = bool(_git("status", "--porcelain", "--untracked-files=no"))
            head_side = Side("HEAD", "working tree", commit + ("+changes" if changed else ""), ROOT)
        else:
            head_side = worktree("HEAD", head, head_commit)
        yield base_side, head_side
    finally:
        removed = [subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                                  capture_output=True).returncode == 0 for path in added]
        shutil.rmtree(temp, ignore_errors=True)
        if not all(removed):  # git's record of a worktree whose folder is gone: forget it
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


# ---------------------------------------------------------------------------- measuring
#: Benchmarks that run in a fresh process of their own (peak memory: what another benchmark freed would be reused).
OWN_PROCESS = ("growth",)


def worker_command(side: Side, args: argparse.Namespace, bench: list[str]) -> list[str]:
    return [sys.executable, str(WORKER), "--tree", str(side.tree), "--bench", ",".join(bench),
            "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt", str(args.prompt),
            "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds), "--threads", str(args.threads)] + (
            ["--smoke"] if args.smoke else [])


def measure(side: Side, repeat: int, args: argparse.Namespace) -> Measurement:
    """One fresh process of `side` (and one more for each of `OWN_PROCESS` chosen): its own tree's packages,
    `args.threads` threads everywhere."""
    threads = str(args.threads)
    env = {**os.environ, "PYTHONPATH": str(side.tree), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    shared = [name for name in args.bench if name not in OWN_PROCESS]
    groups = ([shared] if shared else []) + [[name] for name in args.bench if name in OWN_PROCESS]
    reports = [run_json_process(worker_command(side, args, bench), cwd=side.tree, env=env) for bench in groups]
    for report in reports:
        for key in ("hf_paged", "kernels"):
            if not Path(report[key]).resolve().is_relative_to(side.tree.resolve()):
                raise RuntimeError(f"{side.label}'s process imported {key} from {report[key]}, not from its tree "
                                   f"{side.tree}: check PYTHONPATH and the editable install")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = Measurement(side.label, repeat, date, reports[0]["hf_paged"], reports[0]["kernels"])
    for report in reports:
        for name, result in report["benchmarks"].items():
            if "missing" in result:
                out.missing[name] = result["missing"]
            for item in result.get("figures", []):
                out.figures[item["name"]] = item
    return out


def run_alternately(sides: tuple[Side, Side], args: argparse.Namespace) -> list[Measurement]:
    """`args.repeats` processes per side, alternating which side goes first (A B, B A, A B, ...)."""
    out: list[Measurement] = []
    for repeat in range(args.repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            started = time.perf_counter()
            out.append(measure(side, repeat, args))
            print(f"  {side.label} ({side.commit}) process {repeat + 1}/{args.repeats}: "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------- comparing
def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max): a figure is flagged only when every pair of processes agrees."""
    return min(values), statistics.median(values), max(values)


def compare(measurements: list[Measurement]) -> list[Ratio]:
    """Per figure both sides measured: medians and per-pair ratios HEAD/BASE, flagged where their range (min-max)
    lies beyond 1 and beyond their control's range."""
    by_side = {label: {m.repeat: m for m in measurements if m.side == label} for label in ("BASE", "HEAD")}
    names = [name for m in measurements if m.side == "HEAD" for name in m.figures]
    paired: dict[str, list[tuple[dict, dict]]] = {}
    for name in dict.fromkeys(names):
        pairs = [(by_side["BASE"][r].figures[name], head.figures[name]) for r, head in by_side["HEAD"].items()
                 if r in by_side["BASE"] and name in by_side["BASE"][r].figures and name in head.figures]
        if pairs:
            paired[name] = pairs
    band = {name: spread([h["value"] / b["value"] for b, h in pairs]) for name, pairs in paired.items()}
    out = []
    for name, pairs in paired.items():
        about = pairs[0][1]
        lowest, _, highest = band[name]
        low, _, high = band.get(about["control"] or "", (1.0, 1.0, 1.0))
        low, high = min(low, 1.0), max(high, 1.0)
        worse, better = (highest < low, lowest > high) if about["higher_is_better"] else (lowest > high, highest < low)
        if len(pairs) < MIN_PAIRS_TO_FLAG:
            verdict = "control" if about["is_control"] else ""
        elif about["is_control"]:
            verdict = "control moved" if highest < 1 or lowest > 1 else "control"
        else:
            verdict = "WORSE" if worse else "better" if better else ""
        base = statistics.median(b["value"] for b, _ in pairs)
        head = statistics.median(h["value"] for _, h in pairs)
        out.append(Ratio(name, about["unit"], base, head, [h["value"] / b["value"] for b, h in pairs], verdict))
    return out


def format_table(ratios: list[Ratio], sides: tuple[Side, Side]) -> str:
    base, head = sides
    lines = [f"| figure | BASE {base.commit} | HEAD {head.commit} | HEAD/BASE (median of pairs) | min-max | verdict |",
             "|---|---|---|---|---|---|"]
    for r in ratios:
        lowest, median, highest = spread(r.ratios)
        lines.append(f"| {r.figure} ({r.unit}) | {r.base:.4g} | {r.head:.4g} | {median:.3f} | {lowest:.3f}-{highest:.3f} "
                     f"| {r.verdict} |")
    return "\n".join(lines)


def missing_lines(measurements: list[Measurement], sides: tuple[Side, Side]) -> list[str]:
    """One line per benchmark a side's tree does not have, with the reason."""
    seen: dict[tuple[str, str], str] = {}
    for m in measurements:
        for name, reason in m.missing.items():
            seen.setdefault((m.side, name), reason)
    commit = {side.label: side.commit for side in sides}
    return [f"benchmark {name!r} does not exist in {label} ({commit[label]}), nothing to compare it with: {reason}"
            for (label, name), reason in seen.items()]


def write_csv(measurements: list[Measurement], sides: tuple[Side, Side], path: Path) -> None:
    commit = {side.label: side.commit for side in sides}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for m in measurements:
            for item in m.figures.values():
                writer.writerow([item["name"], m.side, m.repeat, f"{item['value']:.6g}", item["unit"], commit[m.side], m.date])


def plot(ratios: list[Ratio], sides: tuple[Side, Side], path: Path) -> Path | None:
    """Per-pair ratios HEAD/BASE per figure, their median marked; None where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ratios) + 1.5))
    for y, r in enumerate(ratios):
        color = {"WORSE": "tab:red", "better": "tab:green"}.get(r.verdict, "tab:blue")
        ax.plot(r.ratios, [y] * len(r.ratios), "o", color=color, alpha=0.6)
        ax.plot([statistics.median(r.ratios)], [y], "|", color="black", markersize=14)
    ax.axvline(1.0, color="gray", linewidth=1)
    ax.set_yticks(range(len(ratios)), [r.figure for r in ratios], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"HEAD {sides[1].commit} / BASE {sides[0].commit}, per pair of processes (| = median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", metavar="BASE", help="the commit to compare against (hash, branch, tag)")
    parser.add_argument("head", metavar="HEAD", nargs="?", help="the other commit (default: this working tree as it is)")
    parser.add_argument("--bench", default="decode", help=f"comma-separated, of {', '.join(BENCHMARKS)} (default decode)")
    parser.add_argument("--batch-sizes", default=None, help="decode batch sizes (default 1,8,32,64; smoke 1,2)")
    parser.add_argument("--prompt", type=int, default=None, help="decode prompt tokens per row (default 512; smoke 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode new tokens (default 128; smoke 4)")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per side (pairs of ratios)")
    parser.add_argument("--rounds", type=int, default=1, help="alternated runs per point inside a process (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, seconds per process (for tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/compare", help="folder of CSV, table, plot")
    args = parser.parse_args(argv)
    args.bench = [name.strip() for name in args.bench.split(",") if name.strip()]
    unknown = sorted(set(args.bench) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: choose among {', '.join(BENCHMARKS)}")
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,2" if args.smoke else "1,8,32,64")).split(",")]
    args.prompt = args.prompt or (32 if args.smoke else 512)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 128)
    if args.repeats < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--repeats, --rounds and --threads must be at least 1")
    return args


def _stop_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # leaves through the worktrees' cleanup


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.perf_counter()
    try:
        with checked_out(args.base, args.head) as sides:
            print(f"BASE {sides[0].commit} ({sides[0].revision}) vs HEAD {sides[1].commit} ({sides[1].revision}): "
                  f"{', '.join(args.bench)}, {args.repeats} processes per side, alternately, {args.threads} thread(s)",
                  file=sys.stderr, flush=True)
            measurements = run_alternately(sides, args)
    except ValueError as error:  # an unknown commit: nothing was checked out
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing compared; the temporary worktrees are removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    ratios = compare(measurements)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = args.out / f"compare-{sides[0].commit}-{sides[1].commit}-{stamp}"
    write_csv(measurements, sides, stem.with_suffix(".csv"))
    png = plot(ratios, sides, stem.with_suffix(".png")) if ratios else None
    imported = {m.side: f"hf_paged from {Path(m.hf_paged).parent}, hf_paged.kernels from {Path(m.kernels).parent}"
                for m in measurements}
    moved = [r.figure for r in ratios if r.verdict == "control moved"]
    noise = [f"control moved: {', '.join(moved)} does not run hf-paged code, yet changed between the sides' "
             "processes: the machine's speed moved during the run; absolute figures are judged against it, the "
             "paged/dynamic ratios are measured within each process; rerun on a quieter machine or with more "
             "--repeats for absolute figures"] if moved else []
    text = "\n".join(
        [format_table(ratios, sides), ""]
        + missing_lines(measurements, sides)
        + noise
        + [f"BASE {sides[0].commit} ({sides[0].revision}) imported {imported['BASE']}",
           f"HEAD {sides[1].commit} ({sides[1].revision}) imported {imported['HEAD']}",
           f"settings: {', '.join(args.bench)}; decode batch sizes {args.batch_sizes}, prompt {args.prompt}, "
           f"{args.new_tokens} new tokens{' (smoke)' if args.smoke else ''}; {args.repeats} processes per side, "
           f"{args.rounds} round(s) per process, {args.threads} thread(s)",
           f"ratio: HEAD/BASE per pair of processes; flagged when all pairs lie beyond 1 and beyond its control's range "
           f"(from {MIN_PAIRS_TO_FLAG} pairs)",
           f"load average (1, 5, 15 min): before {load_before}; after {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
           f"wall time: {time.perf_counter() - started:.0f} s",
           f"written: {stem.with_suffix('.csv')}" + (f", {png}" if png else "")]
    )
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
