"""The README runs as written (issue 28 item 7).

Python blocks: every ```python block of README.md runs, in order, in one fresh Python process with one
namespace, as the README says a reader runs them (the first block under "Usage" loads the shipped model); the
OpenAI client block talks to an `hf-paged serve` this test starts on the shipped model, on a free port written
in place of the README's 8000. Shell blocks and the `hf-paged serve` synopsis: every command they name exists
(make targets, `hf-paged` subcommands and their options, pip extras, server routes); nothing is run, so
`make test` never runs from a test.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from hf_paged.__main__ import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.xdist_group("readme")


def blocks(language: str) -> list[tuple[int, str]]:
    """`(line number, code)` of every fenced block of `language` ("" for untagged), in README order."""
    return [(README[: m.start()].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(README) if m.group(1) == language]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"hf-paged serve exited with {server.returncode}: {server.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"hf-paged serve did not answer /health within {timeout_s} s")


#: Runs the blocks given as JSON on stdin in one namespace; a failing block is named by its README line.
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for line, code in json.load(sys.stdin):
    print(f"== README.md block at line {line}", flush=True)
    exec(compile(code, f"README.md block at line {line}", "exec"), namespace)
"""


def test_every_python_block_runs_as_written(tmp_path):
    python = blocks("python")
    assert len(python) >= 8, "the README's Python examples went missing"
    port = _free_port()
    served = [(line, code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")) for line, code in python]
    assert sum(code != original for (_, code), (_, original) in zip(served, python, strict=True)) == 1
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "hf_paged", "serve", "--port", str(port), "--max-memory", str(64 * 2**20)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_healthy(server, port, timeout_s=120)
        done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(served), cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("== README.md block at line") == len(python)


def test_the_usage_block_loads_the_shipped_model_with_the_public_names():
    (_, usage), *_ = [(line, code) for line, code in blocks("python") if "from_pretrained" in code]
    assert "from hf_paged.demo_model import DEMO_MODEL_PATH" in usage and "path = DEMO_MODEL_PATH" in usage
    assert "hf_paged/demo_model/weights/" in README


def _shell_commands() -> list[tuple[int, str]]:
    """Each command line of the bash blocks (continuations joined, comments dropped) and the untagged blocks
    that show a command's synopsis."""
    found = [(line, " ".join(code.split())) for line, code in blocks("") if code.startswith("hf-paged ")]
    for line, code in blocks("bash"):
        for command in code.replace("\\\n", " ").splitlines():
            command = command.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                found.append((line, command))
    return found


def _help(subcommand: str) -> str:
    """`hf-paged SUBCOMMAND --help`, in this process (the command's own `main`, as `hf_paged.__main__` calls it)."""
    from hf_paged.serve.cli import main as serve_main
    from hf_paged.tools.demo import main as demo_main
    from hf_paged.tools.doctor import main as doctor_main

    mains = {"demo": demo_main, "doctor": doctor_main, "serve": serve_main}
    assert set(mains) == set(COMMANDS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        mains[subcommand](["--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def test_every_shell_command_names_what_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    routes = set(re.findall(r'@\w+\.(?:get|post)\("([^"]+)"', (ROOT / "hf_paged/serve/app.py").read_text()))
    helps: dict[str, str] = {}
    commands = _shell_commands()
    assert len(commands) >= 6
    for line, command in commands:
        words = shlex.split(command.replace("[", "").replace("]", "").replace("|", " ")) if command.startswith(
            "hf-paged ") else shlex.split(command)
        where = f"README.md line {line}: {command}"
        if words[0] == "make":
            assert words[1] in targets, where
        elif words[0].endswith("hf-paged") or words[:3] == ["python", "-m", "hf_paged"]:
            subcommand = words[1] if words[0].endswith("hf-paged") else words[3]
            assert subcommand in COMMANDS, where
            text = helps.setdefault(subcommand, _help(subcommand))
            for option in (w for w in words if w.startswith("--")):
                assert re.search(rf"{re.escape(option)}\b", text), f"{where}: {option} not in {subcommand} --help"
        elif words[:2] == ["pip", "install"]:
            for extra in re.findall(r"\[([\w,-]+)\]", command):
                assert set(extra.split(",")) <= extras, where
        elif words[0] == "curl":
            (url,) = [w for w in words if w.startswith("localhost:") or w.startswith("http")]
            assert "/" + url.split("/", 1)[1] in routes, where
        else:
            raise AssertionError(f"{where}: the test does not know this command; teach it what to check")


def test_inline_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`(?:[A-Z_]+=\S+ )*make ([\w-]+)", README))
    assert {"demo", "test", "bench", "bench-compare"} <= named
    assert named <= targets, named - targets
