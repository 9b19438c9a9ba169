"""Command line: `python -m hf_paged demo [--model PATH] ...` (also the `hf-paged` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hf_paged demo [--model PATH_OR_ID] [--max-new-tokens N] [--dtype float32|bfloat16|float16]")
        return 0
    if argv[0] != "demo":
        print(f"unknown command {argv[0]!r}; the only command is 'demo'", file=sys.stderr)
        return 2
    from .demo import main as demo_main  # noqa: PLC0415

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
