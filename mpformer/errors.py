"""User-facing errors.

A ConfigError is a mistake in what the user asked for (a key, a value, a path, a file). Entry points
catch it and print its message as one line, without a traceback, before any process group exists.
Assertions are kept for internal invariants only.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad key, value, layout, path or file; the message names it and the valid alternatives."""


def format_choices(values: object) -> str:
    """Render a list of valid values compactly: '1, 2, 4'."""
    return ", ".join(str(v) for v in values)  # type: ignore[attr-defined]
