"""Data pipeline: indexed mmap datasets, GPT samples, blending and the deterministic sampler.

Only the light, torch/numpy-only parts are re-exported here, so that the trainer importing
``mpformer.data`` does not pull in ``transformers`` or ``datasets``. Tokenizers, preprocessing
and the demo corpus live in ``mpformer.data.tokenizer``, ``.preprocess`` and ``.demo_corpus``.
"""

from mpformer.data.blend import BlendedDataset
from mpformer.data.gpt_dataset import GPTDataset, permute
from mpformer.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype, check_data_prefix
from mpformer.data.sampler import build_train_dataset, get_batch, micro_batch_sample_indices, num_micro_batches

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "best_dtype",
    "build_train_dataset",
    "check_data_prefix",
    "get_batch",
    "micro_batch_sample_indices",
    "num_micro_batches",
    "permute",
]
