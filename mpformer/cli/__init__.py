"""Console entry points. Each CLI turns user mistakes (ConfigError) into one line and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

from mpformer.errors import ConfigError

F = TypeVar("F", bound=Callable[..., int | None])

EXIT_USER_ERROR = 2


def user_errors_to_exit(fn: F) -> F:
    """Run a CLI main; a ConfigError prints ``error: <message>`` on stderr and exits 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            msg = " ".join(str(e).split())  # always exactly one line
            print(f"error: {msg}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]
