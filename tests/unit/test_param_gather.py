"""ZeRO-1/2's overlapped parameter all-gather: every parameter a forward reads is waited for first.

A real gather on one machine finishes long before the next forward reads the buffer, so a missing
wait would pass every parity test by luck. Here the gather is a stand-in whose copy happens only
when it is waited for, and the rest of each buffer holds NaN until then: a forward that reads any
parameter before waiting for it gives NaN instead of the reference output.
"""

from __future__ import annotations

import pytest
import torch

from mpformer.core.model_config import ModelConfig
from mpformer.models import Transformer
from mpformer.optim.engine import GradEngine, Reduction
from mpformer.parallel.comm import CommLedger


class _Deferred:
    def __init__(self, out: torch.Tensor, value: torch.Tensor) -> None:
        self.out, self.value = out, value

    def wait(self) -> bool:
        self.out.copy_(self.value)
        return True


class _FakeComm:
    """Rank 0 of 2: a gather's result (the buffer as it was, ``truth``) lands only at wait()."""

    def __init__(self) -> None:
        self.group, self.ledger, self.tag, self.size, self.rank = None, CommLedger(), "dp.", 2, 0
        self.truth: dict[int, torch.Tensor] = {}
        self.waited: list[int] = []

    def all_gather_into(self, out, src, async_op=False):
        work = _Deferred(out, self.truth[out.data_ptr()])
        return work if async_op else work.wait()


CONFIGS = {
    "llama": ModelConfig(arch="llama", num_layers=3, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, vocab_size=64),
    "gpt2-tied": ModelConfig(arch="gpt2", num_layers=3, hidden_size=32, num_attention_heads=4, activation="gelu_tanh",
                             vocab_size=64, max_position_embeddings=16, tie_embeddings=True, attention_bias=True,
                             mlp_bias=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bucket_mb", [0.002, 25.0])  # buckets that split blocks, and one bucket for all
def test_every_parameter_is_waited_for_before_the_forward_reads_it(name, bucket_mb):
    model = Transformer(CONFIGS[name], seed=1)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens[:, :-1])
    comm = _FakeComm()
    engine = GradEngine(model, Reduction(comm), stage=1, groups=[{"params": list(model.parameters())}],
                        make_optimizer=lambda g: torch.optim.SGD(g, lr=0.0), bucket_mb=bucket_mb,
                        overlap_param_gather=True)
    assert len(engine.buckets) > (1 if bucket_mb < 1 else 0)
    for b in engine.buckets:  # what the gather will deliver; until then, NaN outside this rank's shard
        comm.truth[b.param_buf.data_ptr()] = b.param_buf.clone()
        lo, hi = b.layout.shard_range(0)
        b.param_buf[:lo] = float("nan")
        b.param_buf[hi:] = float("nan")
    engine.param_gather.launch()
    if bucket_mb < 1:  # one bucket holds the embedding too: waited at once; split ones stay in flight
        assert engine.param_gather.pending, "the blocks' gathers are still in flight after the step"
    with torch.no_grad():
        got = model(tokens[:, :-1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not engine.param_gather.pending
