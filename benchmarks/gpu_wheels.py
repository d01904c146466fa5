"""The pinned closure of the packages benchmarks/gpu_check.sh needs beyond torch, as installed here.

    python benchmarks/gpu_wheels.py PACKAGE ... > requirements.txt      (make gpu-wheels runs it)

Every distribution the named packages require (recursively, extras and environment markers honoured
for this interpreter), at the version installed in this environment (the one the tests ran with),
less torch and everything torch itself requires: a GPU machine brings its own CUDA torch, and a clean
venv gets torch first. One ``name==version`` a line. A requirement only another CPython of
``PYTHONS`` needs (pytest's exceptiongroup and tomli below 3.11) is not installed here: it follows as
written, with its marker, so that a GPU image on that Python installs it and this one skips it.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

PYTHONS = ("3.10", "3.11", "3.12", "3.13")  # the CPythons make gpu-wheels fetches wheels for


def _elsewhere(req: Requirement) -> bool:
    """Whether another of PYTHONS (not this interpreter) needs ``req``."""
    return req.marker is not None and any(req.marker.evaluate({"extra": "", "python_version": v,
                                                               "python_full_version": f"{v}.0"}) for v in PYTHONS)


def _closure(names: list[str], elsewhere: dict[str, str] | None = None) -> dict[str, str]:
    """name -> installed version of ``names`` and what they require here; ``elsewhere`` collects
    name -> requirement string of those only another Python needs."""
    out: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in out:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_wheels.py: {name} is not installed here (make venv first)") from None
        out[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
            elif elsewhere is not None and _elsewhere(req):
                elsewhere.setdefault(re.sub(r"[-_.]+", "-", req.name).lower(), str(req))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: gpu_wheels.py PACKAGE ...")
    torch_side, elsewhere = _closure(["torch"]), {}
    here = _closure(argv, elsewhere)
    for name, version in sorted(here.items()):
        if name not in torch_side:
            print(f"{name}=={version}")
    for name, req in sorted(elsewhere.items()):
        if name not in here and name not in torch_side:
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
