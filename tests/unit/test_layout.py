"""The one validator: every rule gives one line naming the key and the valid values."""

import pytest

from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout, valid_pp_values, valid_tp_values, validate
from mpformer.core.model_config import ModelConfig

LLAMA = ModelConfig(arch="llama", num_layers=4, hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                    ffn_hidden_size=192, vocab_size=100)


def _err(layout, world=1, model=LLAMA, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        validate(layout, model, world, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_resolves_dp_from_world():
    assert validate(ParallelLayout(), LLAMA, 4).dp == 4
    assert validate(ParallelLayout(dp=2), LLAMA, 2).dp == 2


def test_world_size_mismatch_lists_the_valid_dp():
    msg = _err(ParallelLayout(dp=2), world=1)
    assert "world size is 1" in msg and "parallel.dp=1" in msg


def test_heads_not_divisible_by_tp_lists_valid_tp():
    msg = _err(ParallelLayout(tp=3), world=3)
    assert "parallel.tp=3" in msg and "num_attention_heads=8" in msg
    assert "valid tp for this model: 1, 2, 4, 8" in msg
    assert valid_tp_values(LLAMA) == [1, 2, 4, 8]


def test_kv_heads_must_divide_or_be_replicable():
    m = ModelConfig(arch="llama", num_layers=2, hidden_size=96, num_attention_heads=12, num_kv_heads=4,
                    ffn_hidden_size=96 * 4, vocab_size=100)
    # tp=6 divides 12 heads but neither divides 4 kv heads nor is a multiple of it.
    msg = _err(ParallelLayout(tp=6), world=6, model=m)
    assert "num_kv_heads=4" in msg
    assert 6 not in valid_tp_values(m) and 12 in valid_tp_values(m)


def test_ffn_not_divisible_by_tp():
    m = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=8,
                    ffn_hidden_size=100, vocab_size=100)
    msg = _err(ParallelLayout(tp=8), world=8, model=m)
    assert "ffn_hidden_size=100" in msg and "valid tp for this model: 1, 2, 4" in msg


def test_sequence_parallel_needs_seq_divisible_by_tp():
    msg = _err(ParallelLayout(tp=2, sequence_parallel=True), world=2, seq_length=33)
    assert "seq_length=33" in msg and "multiples of 2" in msg


def test_layers_not_splittable_into_pp():
    msg = _err(ParallelLayout(pp=3), world=3)
    assert "num_layers=4" in msg and "valid pp: 1, 2, 4" in msg
    assert "exceeds num_layers" in _err(ParallelLayout(pp=8), world=8)
    assert valid_pp_values(LLAMA, vpp=2) == [1, 2]


def test_malformed_pp_split():
    msg = _err(ParallelLayout(pp=2, pp_split=(3, 2)), world=2)
    assert "pp_split=[3, 2]" in msg and "summing to num_layers=4" in msg and "e.g. [2, 2]" in msg
    assert "2 positive" in _err(ParallelLayout(pp=2, pp_split=(4,)), world=2)
    assert "positive" in _err(ParallelLayout(pp=2, pp_split=(4, 0)), world=2)
    assert validate(ParallelLayout(pp=2, pp_split=(3, 1)), LLAMA, 2).pp_split == (3, 1)
    msg = _err(ParallelLayout(pp=2, pp_split=(3, 1), pp_partition="balanced"), world=2)
    assert "both choose the stages" in msg


def test_pipeline_layouts():
    """pp > layers, vpp not dividing a stage's layers, interleaved without vpp, too few micro-batches."""
    assert "parallel.pp=8 exceeds num_layers=4" in _err(ParallelLayout(pp=8), world=8)
    msg = _err(ParallelLayout(pp=2, vpp=4, schedule="interleaved"), world=2)
    assert "pp*vpp=8" in msg and "vpp in 2 at pp=2" in msg
    msg = _err(ParallelLayout(pp=2, schedule="interleaved"), world=2)
    assert "needs parallel.vpp > 1" in msg and "vpp in 2" in msg
    msg = _err(ParallelLayout(pp=4, schedule="zb-h2"), world=4, global_batch_size=4, micro_batch_size=1)
    assert "zb-h2" in msg and "4 micro-batches" in msg and "microbatches >=" in msg
    msg = _err(ParallelLayout(pp=2, vpp=2, schedule="interleaved"), world=2, global_batch_size=3,
               micro_batch_size=1)
    assert "divisible by pp=2" in msg
    assert validate(ParallelLayout(pp=2, schedule="zb-h1"), LLAMA, 2, global_batch_size=4,
                    micro_batch_size=1).pp == 2


def test_balanced_partition_accepts_uneven_layer_counts():
    msg = _err(ParallelLayout(pp=3), world=3)
    assert "pp_partition=balanced" in msg
    assert validate(ParallelLayout(pp=3, pp_partition="balanced"), LLAMA, 3).pp == 3
    assert "valid: uniform, balanced" in _err(ParallelLayout(pp_partition="even"))


def test_global_batch_not_divisible():
    msg = _err(ParallelLayout(), world=2, global_batch_size=10, micro_batch_size=3)
    assert "global_batch_size=10" in msg and "multiples of 6" in msg and "micro_batch_size in 1, 5" in msg


def test_enum_values():
    assert "valid: gpipe, 1f1b" in _err(ParallelLayout(schedule="zb"))
    assert "valid: none, selective, full" in _err(ParallelLayout(recompute="some"))
    assert "valid: 0, 1, 2, 3" in _err(ParallelLayout(zero=4))
    assert "needs parallel.tp > 1" in _err(ParallelLayout(sequence_parallel=True))


def test_context_parallelism_is_implemented_for_every_kind():
    for kind, extra in (("ring", {}), ("allgather", {}), ("ulysses", {}), ("hybrid", {"cp_ulysses": 2})):
        L = validate(ParallelLayout(cp=4, cp_kind=kind, **extra), LLAMA, 8, seq_length=64)
        assert (L.cp, L.cp_kind, L.dp) == (4, kind, 2)


def test_context_parallel_bad_input_names_the_valid_values():
    # Every kind shares the zigzag split into 2*cp chunks.
    msg = _err(ParallelLayout(cp=4, cp_kind="allgather"), world=4, seq_length=36)
    assert "train.seq_length=36" in msg and "2*cp = 8" in msg and "valid: multiples of 8" in msg
    msg = _err(ParallelLayout(cp=2, tp=2, sequence_parallel=True), world=4, seq_length=12)
    assert "valid: multiples of 8" in msg
    # Ulysses scatters this tp rank's heads: 8 heads / tp 2 = 4, which cp=8 does not divide.
    msg = _err(ParallelLayout(cp=8, tp=2, cp_kind="ulysses"), world=16, seq_length=64)
    assert "parallel.cp=8 with cp_kind=ulysses" in msg and "valid Ulysses degrees: 2, 4" in msg
    msg = _err(ParallelLayout(cp=6, cp_kind="hybrid", cp_ulysses=3), world=6, seq_length=72)
    assert "parallel.cp_ulysses=3 with cp_kind=hybrid does not divide the 8" in msg
    msg = _err(ParallelLayout(cp=4, cp_kind="hybrid", cp_ulysses=3), world=4)
    assert "parallel.cp_ulysses=3 at cp=4" in msg and "valid: 2" in msg
    assert "valid: none at this cp" in _err(ParallelLayout(cp=2, cp_kind="hybrid", cp_ulysses=2), world=2)
    assert "applies only to cp_kind=hybrid" in _err(ParallelLayout(cp=4, cp_ulysses=2), world=4)
    assert "valid: ring, allgather, ulysses, hybrid" in _err(ParallelLayout(cp=2, cp_kind="p2p"), world=2)
    assert "recompute_layers=-1 must be an integer >= 0" in _err(ParallelLayout(recompute_layers=-1))
    for msg in (_err(ParallelLayout(cp=4, cp_kind="allgather"), world=4, seq_length=36),
                _err(ParallelLayout(cp=2, cp_kind="p2p"), world=2)):
        assert "\n" not in msg


def test_recompute_is_implemented():
    assert validate(ParallelLayout(recompute="full"), LLAMA, 1).recompute == "full"


def test_zero_stage_two_does_not_run_under_a_pipeline():
    msg = _err(ParallelLayout(pp=2, zero=2), world=4)
    assert "parallel.zero=2 cannot run with parallel.pp=2" in msg and "zero=0 or 1" in msg
    assert validate(ParallelLayout(pp=2, zero=1), LLAMA, 4).dp == 2
