"""Argument types shared by the command line's subcommands (`demo`, `doctor`, `serve`): a wrong value is one
line from argparse (`usage: ...` and `error: ...`, exit status 2), never a traceback from deeper down."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return _whole_number(text, 0)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def memory_budget(text: str) -> int | str:
    """Bytes (an int >= 1) or a share of free memory (`"90%"`: more than 0, at most 100 percent)."""
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
        if not 0 < share <= 100:
            raise argparse.ArgumentTypeError(f"a share of free memory is more than 0% and at most 100%, got {text}")
        return text
    return positive_int(text)


def existing_file(text: str) -> Path:
    """A path to an existing file."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file at {text}")
    return path


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
