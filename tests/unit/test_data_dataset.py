"""GPT samples, the Feistel permutation, blending and the resumable micro-batch index math."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mpformer.core.errors import ConfigError
from mpformer.data.blend import BlendedDataset
from mpformer.data.gpt_dataset import GPTDataset, epoch_key, mix64, permute
from mpformer.data.indexed import IndexedDataset, IndexedDatasetBuilder
from mpformer.data.sampler import (
    build_train_dataset,
    get_batch,
    micro_batch_sample_indices,
    num_micro_batches,
)


def _indexed(tmp_path, name, doc_lengths, start=0) -> IndexedDataset:
    """Documents cut from the stream start, start+1, ...: token value == stream position + start."""
    stream = np.arange(start, start + sum(doc_lengths))
    with IndexedDatasetBuilder(tmp_path / name, np.int32) as b:
        b.add_documents(stream, doc_lengths)
        b.finalize()
    return IndexedDataset(tmp_path / name)


# ---- GPTDataset ---------------------------------------------------------------------------


def test_windows_cross_documents_with_one_token_overlap(tmp_path):
    ds = GPTDataset(_indexed(tmp_path, "w", [3, 5, 2, 13]), seq_length=4, seed=0)  # 23 tokens
    assert ds.samples_per_epoch == (23 - 1) // 4 == 5
    for k in range(5):
        np.testing.assert_array_equal(ds.window(k), np.arange(4 * k, 4 * k + 5))
    for i in range(12):
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (5,)
        np.testing.assert_array_equal(sample, ds.window(ds.window_index(i)))


def test_every_epoch_visits_every_window_in_a_new_order(tmp_path):
    ds = GPTDataset(_indexed(tmp_path, "e", [50, 51, 60]), seq_length=3, seed=7)
    n = ds.samples_per_epoch
    orders = [[ds.window_index(e * n + p) for p in range(n)] for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(n))
    assert orders[0] != orders[1] != orders[2]
    other_seed = GPTDataset(ds.indexed, seq_length=3, seed=8)
    assert [other_seed.window_index(p) for p in range(n)] != orders[0]
    again = GPTDataset(ds.indexed, seq_length=3, seed=7)
    assert [again.window_index(p) for p in range(n)] == orders[0]


def test_too_small_dataset_says_how_many_tokens(tmp_path):
    with pytest.raises(ConfigError, match=r"too small for seq_length 8: it has 8 tokens, one sample needs 9"):
        GPTDataset(_indexed(tmp_path, "s", [8]), seq_length=8, seed=0)
    assert GPTDataset(_indexed(tmp_path, "s9", [9]), seq_length=8, seed=0).samples_per_epoch == 1


def test_negative_index_is_an_error(tmp_path):
    ds = GPTDataset(_indexed(tmp_path, "n", [20]), seq_length=4, seed=0)
    with pytest.raises(IndexError):
        ds[-1]


# ---- permutation --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 16, 100, 257, 1000, 1023, 1025, 4099])
def test_permute_is_a_bijection(n):
    for key in (0, 12345):
        assert sorted(permute(i, n, key) for i in range(n)) == list(range(n))


def test_permute_depends_on_key_and_is_reproducible():
    n = 1000
    a = [permute(i, n, epoch_key(1, 0)) for i in range(n)]
    assert a == [permute(i, n, epoch_key(1, 0)) for i in range(n)]
    assert a != [permute(i, n, epoch_key(1, 1)) for i in range(n)]  # other epoch
    assert a != [permute(i, n, epoch_key(2, 0)) for i in range(n)]  # other seed
    assert sum(a[i] == i for i in range(n)) < 20  # a shuffle, not the identity
    assert mix64(-1) == mix64(2**64 - 1)  # seeds are taken mod 2**64, any sign


def test_permute_is_constant_memory_on_huge_domains():
    n = 3 * 10**12 + 7  # about what a multi-trillion-token corpus gives
    t0 = time.perf_counter()
    outs = {permute(i, n, 99) for i in range(0, n, n // 500)}
    assert time.perf_counter() - t0 < 1.0
    assert len(outs) == 501 and all(0 <= x < n for x in outs)


# ---- blending -----------------------------------------------------------------------------


class _Tagged:
    """Fake dataset: sample k of dataset d is the array [d, k]."""

    def __init__(self, d: int) -> None:
        self.d = d

    def __getitem__(self, k: int) -> np.ndarray:
        return np.array([self.d, k])


@pytest.mark.parametrize(
    "weights,block",
    [([0.3, 0.7], 10), ([1, 1, 2], 4), ([0.2, 0.3001, 0.4999], 10_000), ([1 / 3, 2 / 3], 3)],
)
def test_blend_proportions_and_sub_indices(weights, block):
    blend = BlendedDataset([_Tagged(d) for d in range(len(weights))], weights, seed=3)
    assert blend.block_size == block
    w = np.asarray(weights, float) / sum(weights)
    n_blocks = max(2, 30_000 // block)
    src = np.array([blend.source(i) for i in range(n_blocks * block)])
    for d in range(len(weights)):
        ks = src[src[:, 0] == d, 1]
        assert ks.tolist() == list(range(ks.size))  # each dataset read in order, no gaps or repeats
        assert ks.size == n_blocks * blend.counts[d] == n_blocks * round(w[d] * block)
        # every prefix stays within the documented bound
        n_d = np.cumsum(src[:, 0] == d)
        prefix = np.arange(1, src.shape[0] + 1)
        bound = 2 + prefix * abs(blend.counts[d] / block - w[d])
        assert (np.abs(n_d - w[d] * prefix) < bound).all()
    np.testing.assert_array_equal(blend[5], np.array(blend.source(5)))


def test_blend_seed_only_breaks_ties():
    patterns = {tuple(BlendedDataset([_Tagged(0), _Tagged(1)], [1, 1], seed=s).pattern.tolist()) for s in range(20)}
    assert patterns == {(0, 1), (1, 0)}


@pytest.mark.parametrize(
    "weights,match",
    [([1.0], "2 datasets"), ([1.0, -0.5], ">= 0"), ([0.0, 0.0], "sum to"), ([1.0, 1e-9], "below half a slot")],
)
def test_blend_rejects_bad_weights(weights, match):
    with pytest.raises(ConfigError, match=match):
        BlendedDataset([_Tagged(0), _Tagged(1)], weights, seed=0)


# ---- sampler ------------------------------------------------------------------------------


def test_build_train_dataset_single_and_blended(tmp_path):
    _indexed(tmp_path, "a", [40, 41])
    _indexed(tmp_path, "b", [30], start=10_000)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    single = build_train_dataset([a], None, seq_length=4, seed=5)
    assert isinstance(single, GPTDataset) and single.seed == 5
    blend = build_train_dataset([a, b], [0.25, 0.75], seq_length=4, seed=5)
    assert isinstance(blend, BlendedDataset)
    assert [d.seed for d in blend.datasets] == [mix64(5, 0), mix64(5, 1)]
    from_b = [blend[i] for i in range(8) if blend.source(i)[0] == 1]
    assert len(from_b) == 6 and all(s[0] >= 10_000 for s in from_b)
    by_size = build_train_dataset([a, b], None, seq_length=4, seed=5)  # weights = samples per epoch
    assert by_size.counts.tolist() == [20, 7]
    with pytest.raises(ConfigError, match="3 weights for 2 data paths"):
        build_train_dataset([a, b], [1, 2, 3], seq_length=4, seed=5)
    with pytest.raises(ConfigError, match="does not exist"):
        build_train_dataset([str(tmp_path / "nope")], None, seq_length=4, seed=5)


@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_micro_batches_cover_the_step_in_global_order_for_any_dp(mbs):
    gbs = 16
    for step in (0, 1, 7):
        expected = list(range(step * gbs, (step + 1) * gbs))
        for dp in (1, 2, 4):
            if gbs % (dp * mbs):
                continue
            got = []
            for rank in range(dp):
                for m in range(num_micro_batches(dp_size=dp, global_batch_size=gbs, micro_batch_size=mbs)):
                    got += micro_batch_sample_indices(
                        step, m, dp_rank=rank, dp_size=dp, global_batch_size=gbs, micro_batch_size=mbs
                    )
            assert got == expected, (step, dp, mbs)


def test_resume_with_other_dp_continues_at_next_sample():
    # 3 steps at dp=4 then resume at step 3 with dp=2: samples are consecutive, none repeated.
    seen = []
    for step, dp in [(0, 4), (1, 4), (2, 4), (3, 2), (4, 2)]:
        for r in range(dp):
            for m in range(8 // (dp * 2)):
                seen += micro_batch_sample_indices(
                    step, m, dp_rank=r, dp_size=dp, global_batch_size=8, micro_batch_size=2
                )
    assert seen == list(range(40))


def test_micro_batch_validation():
    with pytest.raises(ConfigError, match="not divisible by dp\\*micro_batch_size=4\\*3"):
        micro_batch_sample_indices(0, 0, dp_rank=0, dp_size=4, global_batch_size=16, micro_batch_size=3)
    with pytest.raises(ValueError, match="dp_rank 2 outside"):
        micro_batch_sample_indices(0, 0, dp_rank=2, dp_size=2, global_batch_size=16, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_step 4 outside"):
        micro_batch_sample_indices(0, 4, dp_rank=0, dp_size=2, global_batch_size=16, micro_batch_size=2)


def test_get_batch(tmp_path):
    ds = GPTDataset(_indexed(tmp_path, "g", [100]), seq_length=8, seed=0)
    batch = get_batch(ds, [0, 3, 11])
    assert batch.dtype == torch.long and batch.shape == (3, 9)
    torch.testing.assert_close(batch[1], torch.from_numpy(ds[3]))
