"""Command line: `hf-paged demo|doctor|serve ...` (also `python -m hf_paged ...`); `hf-paged COMMAND --help`
describes each command's options."""

from __future__ import annotations

import sys

#: The commands and what each does (the first lines of `hf-paged --help`).
COMMANDS = {
    "demo": "the default cache and PagedCache side by side: texts, KV memory, decode speed",
    "doctor": "versions, device, attention path; Triton kernels checked against the PyTorch path",
    "serve": "an OpenAI-compatible HTTP server on the continuous-batching Engine",
}


def usage() -> str:
    """`hf-paged --help`: the commands, one line each."""
    lines = ["usage: hf-paged COMMAND [OPTIONS]   (or: python -m hf_paged COMMAND [OPTIONS])", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help  this text (COMMAND --help: the command's options)",
              "  --version   the installed hf-paged, torch and transformers versions"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        from . import __version__  # noqa: PLC0415

        print(f"hf-paged {__version__} (torch {torch.__version__}, transformers {transformers.__version__})")
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
        from .tools.doctor import main as doctor_main  # noqa: PLC0415

        return doctor_main(argv[1:])
    if argv[0] != "demo":
        print(f"hf-paged: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} (hf-paged --help)",
              file=sys.stderr)
        return 2
    from .tools.demo import main as demo_main  # noqa: PLC0415

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
