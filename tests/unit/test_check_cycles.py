"""tools/check_cycles.py: every import counts (module level, under TYPE_CHECKING, inside a function),
so a child that refers back to its parent fails `make lint`; the repository itself has no cycle."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_cycles.py"


@pytest.fixture(scope="module")
def checker():
    spec = importlib.util.spec_from_file_location("check_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


PARENT = "from pkg.child import Helper\n\nclass Parent:\n    pass\n"
TYPE_CHECKING_BACK = ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.parent import Parent\n\n"
                      "class Helper:\n    def __init__(self, p: 'Parent') -> None:\n        self.p = p\n")
LAZY_BACK = "class Helper:\n    def f(self):\n        from . import parent\n        return parent\n"


@pytest.mark.parametrize("child", [TYPE_CHECKING_BACK, LAZY_BACK], ids=["type_checking", "lazy_relative"])
def test_a_hidden_back_import_is_a_cycle(checker, tmp_path, capsys, child):
    pkg = _package(tmp_path, {"parent.py": PARENT, "child.py": child})
    assert checker.main([str(pkg)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["import cycle: pkg.child <-> pkg.parent"]


def test_cycles_in_subpackages_and_through_attribute_imports(checker, tmp_path):
    pkg = _package(tmp_path, {"a/__init__.py": "", "a/x.py": "import pkg.b.y\n",
                              "b/__init__.py": "", "b/y.py": "from pkg.c import z\n",
                              "c/__init__.py": "", "c/z.py": "from pkg.a.x import NAME\n",
                              "d.py": "from pkg.a import x\n"})
    graph = checker.import_graph(pkg)
    assert graph["pkg.a.x"] == {"pkg.b.y"} and graph["pkg.c.z"] == {"pkg.a.x"} and graph["pkg.d"] == {"pkg.a.x"}
    assert checker.cycles(graph) == [["pkg.a.x", "pkg.b.y", "pkg.c.z"]]


def test_a_one_way_graph_passes(checker, tmp_path):
    pkg = _package(tmp_path, {"parent.py": PARENT, "child.py": "import os\nfrom typing import Protocol\n"})
    assert checker.main([str(pkg)]) == 0


def test_the_repository_has_no_import_cycle():
    res = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
