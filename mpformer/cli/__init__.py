"""Console entry points. Each CLI turns user mistakes (ConfigError) into one line and exit code 2."""

from __future__ import annotations

import functools
import os
import sys
import time
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
            # Under torchrun every rank finds the same mistake: rank 0 alone says it, in one line. The
            # others wait a moment before failing, or torchrun could stop rank 0 before it has spoken.
            if os.environ.get("RANK", "0") == "0":
                msg = " ".join(str(e).split())
                print(f"error: {msg}", file=sys.stderr, flush=True)
            else:
                time.sleep(3.0)
            sys.exit(EXIT_USER_ERROR)

    return wrapper  # type: ignore[return-value]
