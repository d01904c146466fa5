"""Shared fixtures: a small random-token dataset and helpers to run the CLIs as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """An indexed dataset of 60 random documents (vocab 256, EOS 0): the prefix, for data.paths."""
    from mpformer.data.indexed import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("data") / "tiny_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(60):
        doc = rng.integers(1, 256, size=int(rng.integers(20, 200)))
        # A little structure (repeated bigrams) so that the loss can fall.
        doc[1::2] = (doc[0::2][: len(doc[1::2])] * 7 + 3) % 255 + 1
        builder.add_document(np.append(doc, 0))
    builder.finalize()
    return str(prefix)


def run_cli(args: list[str], *, timeout: float = 120, torchrun: int | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a repository script as a subprocess (optionally under torchrun with N CPU ranks)."""
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd + args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)
