"""Command line: `python -m hf_paged demo|doctor|serve [--model PATH] ...` (also the `hf-paged` console script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hf_paged demo [--model PATH_OR_ID] [--max-new-tokens N] [--dtype float32|bfloat16|float16]")
        print("       python -m hf_paged doctor [--model PATH] [--dtype ...] [--no-bench]")
        print("       python -m hf_paged serve [MODEL_PATH_OR_ID] [--host 127.0.0.1] [--port 8000] ... (--help for all)")
        return 0
    if argv[0] == "serve":
        from .serve.cli import main as serve_main  # noqa: PLC0415

        return serve_main(argv[1:])
    if argv[0] == "doctor":
        import os  # noqa: PLC0415

        import torch  # noqa: PLC0415 - before triton: without CUDA the kernels must run interpreted

        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if not torch.cuda.is_available() and not interpret:
            if "triton" in sys.modules:  # imported with `import hf_paged` (transformers): start afresh
                env = dict(os.environ, TRITON_INTERPRET="1")
                args = [sys.executable, "-m", "hf_paged", *argv]
                sys.stdout.flush()
                os.execve(sys.executable, args, env)
            os.environ["TRITON_INTERPRET"] = "1"
        from .doctor import main as doctor_main  # noqa: PLC0415

        return doctor_main(argv[1:])
    if argv[0] != "demo":
        print(f"unknown command {argv[0]!r}; the commands are 'demo', 'doctor' and 'serve'", file=sys.stderr)
        return 2
    from .demo import main as demo_main  # noqa: PLC0415

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
