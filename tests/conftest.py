"""Shared fixtures: a small random-token dataset; hub access off, wandb off unless a test asks.

16-bit runs take the path a GPU takes (parallel/kernel_choice.py): attention in the run's dtype and
input gradients dY @ W, whatever this CPU's probe would choose, so that the bf16 tests exercise the
GPU's numerics on every CPU kind; the CPU's own speed choices are tested where a test asks for them
(train.cpu_attention / train.cpu_dgrad, or these variables set by the test).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MPFORMER_CPU_ATTENTION", "native")
os.environ.setdefault("MPFORMER_CPU_DGRAD", "nn")


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
