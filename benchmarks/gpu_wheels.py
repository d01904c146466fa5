"""The pinned closure of the packages benchmarks/gpu_check.sh needs beyond torch, as installed here.

    python benchmarks/gpu_wheels.py PACKAGE ... > requirements.txt      (make gpu-wheels runs it)

Every distribution the named packages require (recursively, extras and environment markers honoured
for this interpreter), at the version installed in this environment (the one the tests ran with),
less torch and everything torch itself requires: a GPU machine brings its own CUDA torch, and a clean
venv gets torch first. One ``name==version`` a line.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement


def _closure(names: list[str]) -> dict[str, str]:
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
    return out


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: gpu_wheels.py PACKAGE ...")
    torch_side = _closure(["torch"])
    for name, version in sorted(_closure(argv).items()):
        if name not in torch_side:
            print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
