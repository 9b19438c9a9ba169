"""Argument types shared by the command line's subcommands (`demo`, `doctor`, `serve`): a wrong value is one
line from argparse (`usage: ...` and `error: ...`, exit status 2), never a traceback from deeper down."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def model_path_or_id(text: str) -> str:
    """A local model directory, or a hub id (`name` or `namespace/name`). Something written as a path (absolute,
    `./`, `../`, `~`, or more than one `/`) must be an existing directory."""
    path = Path(text).expanduser()
    looks_like_path = text.startswith(("/", ".", "~")) or text.count("/") > 1
    if path.is_dir():
        return str(path)
    if looks_like_path:
        raise argparse.ArgumentTypeError(f"no model directory at {text}")
    return text
