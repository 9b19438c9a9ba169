"""The demo model's training corpus: which standard-library sources it reads, and the train/validation split.

The corpus is the source text of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, ``**/*.py``), visited in sorted order, without test suites,
``idlelib``, ``lib2to3``, installed packages, ``pydoc_data``, files larger than
:data:`MAX_FILE_BYTES` and machine-generated files. The split does not depend on the seed.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from pathlib import Path
from typing import Sequence

#: Directories (any path component below the stdlib root) that are never part of the corpus.
SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "__pycache__"}
)
#: Files larger than this are skipped (huge single files dominate and are often generated).
MAX_FILE_BYTES = 200_000
#: Markers, searched in the first ~1000 characters, of machine-generated sources.
GENERATED_MARKERS = re.compile(r"generated from|gencodec|automatically generated|auto-generated|do not edit", re.I)
#: Fraction of corpus files held out for validation.
VAL_FRACTION = 0.02


def stdlib_root() -> Path:
    """Return the directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_generated(text: str) -> bool:
    """Whether a source file announces itself as machine generated."""
    return GENERATED_MARKERS.search(text[:1000]) is not None


def collect_corpus(root: Path | None = None, max_files: int | None = None) -> list[tuple[str, str]]:
    """Collect ``(relative_path, text)`` for the corpus files below ``root``, in sorted path order.

    Args:
        root: directory to scan; defaults to :func:`stdlib_root`.
        max_files: keep only the first ``max_files`` eligible files (for tests).
    """
    root = stdlib_root() if root is None else Path(root)
    out: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or _is_generated(text):
            continue
        out.append((rel.as_posix(), text))
        if max_files is not None and len(out) >= max_files:
            break
    return out


def split_corpus(
    files: Sequence[tuple[str, str]], val_fraction: float = VAL_FRACTION
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split files into (train, validation), deterministically and independently of the seed.

    The ``max(1, round(val_fraction * n))`` files whose SHA-1 of the relative path is smallest are
    held out; both lists keep the input (sorted) order.
    """
    n_val = max(1, round(val_fraction * len(files))) if len(files) > 1 else 0
    ranked = sorted(files, key=lambda f: hashlib.sha1(f[0].encode("utf-8")).hexdigest())
    val_names = {name for name, _ in ranked[:n_val]}
    train = [f for f in files if f[0] not in val_names]
    val = [f for f in files if f[0] in val_names]
    return train, val
