"""The command line (`hf-paged` / `python -m hf_paged`): real help, a version, and one-line errors for wrong
arguments, never a traceback."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from hf_paged.__main__ import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0 and main([]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "doctor", "serve"):
        assert f"  {name} " in out
    assert set(COMMANDS) == {"demo", "doctor", "serve"}
    assert "--version" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"hf-paged {hf_paged.__version__} (torch {torch.__version__}, transformers {transformers.__version__})"
    )


def test_an_unknown_command_is_one_line(capsys):
    assert main(["serv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'serv'" in err and "demo, doctor, serve" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, got 0"),
        (["demo", "--max-new-tokens", "many"], "--max-new-tokens: 'many' is not a whole number"),
        (["demo", "--model", "/no/such/path"], "--model: no model directory at /no/such/path"),
        (["doctor", "--model", "./no/such/path"], "--model: no model directory at ./no/such/path"),
        (["serve", "/no/such/path"], "model: no model directory at /no/such/path"),
        (["serve", "--max-seqs", "0"], "--max-seqs: must be at least 1, got 0"),
        (["serve", "--max-memory", "abc"], "--max-memory: 'abc' is not a whole number"),
        (["serve", "--max-memory", "120%"], "--max-memory: a share of free memory is more than 0% and at most 100%"),
        (["serve", "--max-queue", "-1"], "--max-queue: must be at least 0, got -1"),
        (["serve", "--drain-timeout", "-5"], "--drain-timeout: must be a finite number of at least 0, got -5"),
        (["serve", "--chat-template", "/no/such/template.jinja"], "--chat-template: no file at /no/such/template.jinja"),
        (["serve", "--kv-dtype", "None"], "--kv-dtype: invalid choice: 'None'"),
    ],
)
def test_wrong_arguments_are_an_argparse_error(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
