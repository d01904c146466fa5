"""User-facing errors, and the decorator that turns them into one line and exit code 2.

A ConfigError is a mistake in what the user asked for (a key, a value, a path, a file). Entry points
(CLIs, and library mains such as the profile and the demo corpus) catch it and print its message as
one line, without a traceback, before any process group exists. Assertions are kept for internal
invariants only.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int | None])

EXIT_USER_ERROR = 2
EXIT_HALTED = 3  # the run stopped itself: a non-finite step under train.on_nan=halt, nothing to roll back to


class ConfigError(ValueError):
    """A bad key, value, layout, path or file; the message names it and the valid alternatives."""


class RunHalted(RuntimeError):
    """Training stopped on purpose (every rank agrees why); the message says why and how to go on."""


def format_choices(values: object) -> str:
    """Render a list of valid values compactly: '1, 2, 4'."""
    return ", ".join(str(v) for v in values)  # type: ignore[attr-defined]


def user_errors_to_exit(fn: F) -> F:
    """Run a main; a ConfigError prints ``error: <message>`` on stderr and exits 2, a RunHalted exits 3,
    both without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ConfigError, RunHalted) as e:
            # Under torchrun every rank finds the same mistake: rank 0 alone says it, in one line. The
            # others wait a moment before failing, or torchrun could stop rank 0 before it has spoken.
            if os.environ.get("RANK", "0") == "0":
                msg = " ".join(str(e).split())
                print(f"error: {msg}", file=sys.stderr, flush=True)
            else:
                time.sleep(3.0)
            sys.exit(EXIT_HALTED if isinstance(e, RunHalted) else EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")


def check_output_file(path: str, what: str, suffixes: tuple[str, ...] | None = None) -> None:
    """An output file a CLI will write: not a directory, in a directory that exists (or can be made
    under one that does), with one of ``suffixes``; a ConfigError naming ``what`` otherwise. Checked
    before the work, so a long run does not end in a traceback about its last write."""
    from pathlib import Path

    p = Path(path)
    if suffixes is not None and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{what}={path}: unsupported file type {p.suffix or '(none)'}; valid: "
                          f"{format_choices(suffixes)}")
    if p.is_dir():
        raise ConfigError(f"{what}={path} is a directory; give a file path")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what}={path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{what}={path}: {parent} is not writable")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its mistakes said as every other user error is: ``error: <prog>: <what>; ...``, one
    line on stderr, exit 2 (argparse's own prints the usage first, over several lines)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        msg = " ".join(message.split())
        print(f"error: {self.prog}: {msg}; see {self.prog} --help", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
