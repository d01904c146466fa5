"""The fused, chunked LM head + cross entropy (layers/fused_cross_entropy.py) on one process.

Oracle: F.cross_entropy(ignore_index=-100) on the full logits F.linear(x, W), and torch's autograd
through it. Tolerances: fp32 rtol 1e-5 (atol 1e-7: gradient entries near 0 are rounding noise);
bf16 autocast: fused and unfused alike within 2e-2 of the largest element of the fp32 reference
(bf16 keeps 8 mantissa bits, 4e-3 per rounding; the two paths round in different places, and
AVX2 and AMX kernels round differently, so the bf16 paths are not compared with each other bit
for bit). The vocabulary-parallel case (tp=2, padded vocabulary) is in
tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpformer.core.config import Config, TrainConfig, check_training_config
from mpformer.core.errors import ConfigError
from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.layers.fused_cross_entropy import DEFAULT_CHUNK, fused_linear_cross_entropy
from mpformer.layers.linear import WeightGradStore, linear
from mpformer.models import Transformer

FP32 = {"rtol": 1e-5, "atol": 1e-7}
BF16_RTOL = 2e-2
N, H, V = 37, 24, 53


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.5)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    return x, w, labels


def _reference(x, w, labels):
    """fp32 loss and (dX, dW) through F.cross_entropy on the full logits."""
    loss = F.cross_entropy(F.linear(x.detach().double(), w.detach().double()).float(), labels, ignore_index=-100)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, wr), labels, ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(ref.detach(), loss, **FP32)
    return ref.detach(), xr.grad, wr.grad


def _mean(x, w, labels, **kw):
    return fused_linear_cross_entropy(x, w, labels, **kw) / (labels != -100).sum()


@pytest.mark.parametrize("chunk", [1, 5, 16, N, 4 * N])  # token count 37: 5 and 16 leave remainders
def test_fp32_loss_and_gradients_equal_cross_entropy_of_full_logits(chunk):
    x, w, labels = _inputs()
    ref, ref_dx, ref_dw = _reference(x, w, labels)
    loss = _mean(x, w, labels, chunk=chunk)
    assert loss.dtype == torch.float32 and loss.shape == ()
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref, **FP32)
    torch.testing.assert_close(x.grad, ref_dx, **FP32)
    torch.testing.assert_close(w.grad, ref_dw, **FP32)
    assert torch.all(x.grad[labels == -100] == 0), "ignored tokens get no gradient"


def test_gradients_accumulate_and_scale_by_grad_output():
    """A weight that already holds a gradient (a tied embedding's lookup) accumulates into it; backward
    scales by grad_output (a loss scale, a 1/micro-batches factor)."""
    x, w, labels = _inputs()
    _, ref_dx, ref_dw = _reference(x, w, labels)
    w.grad = torch.ones_like(w)
    (3.0 * _mean(x, w, labels, chunk=8)).backward()
    torch.testing.assert_close(w.grad, 1.0 + 3.0 * ref_dw, **FP32)
    torch.testing.assert_close(x.grad, 3.0 * ref_dx, **FP32)


def test_padding_rows_never_reach_the_loss():
    """Rows from ``valid`` on (tp vocabulary padding) are ignored, whatever they hold, and get gradient 0."""
    x, w, labels = _inputs()
    ref, ref_dx, ref_dw = _reference(x, w, labels)
    padded = torch.nn.Parameter(torch.cat([w.detach(), torch.full((3, H), 50.0)]))
    loss = _mean(x, padded, labels, chunk=10, valid=V)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref, **FP32)
    torch.testing.assert_close(x.grad, ref_dx, **FP32)
    torch.testing.assert_close(padded.grad[:V], ref_dw, **FP32)
    assert torch.all(padded.grad[V:] == 0)


@pytest.mark.parametrize("chunk", [7, 4 * N])
def test_bf16_autocast_fused_and_unfused_both_track_fp32(chunk):
    x, w, labels = _inputs()
    ref, ref_dx, ref_dw = _reference(x, w, labels)
    got = {}
    for name in ("fused", "unfused"):
        xa, wa = x.detach().clone().requires_grad_(), torch.nn.Parameter(w.detach().clone())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "fused":
                loss = _mean(xa, wa, labels, chunk=chunk)
            else:
                loss = F.cross_entropy(linear(xa, wa).float(), labels, ignore_index=-100)
        loss.backward()
        assert loss.dtype == xa.grad.dtype == wa.grad.dtype == torch.float32
        got[name] = (loss.detach(), xa.grad, wa.grad)
    for name, (loss, dx, dw) in got.items():
        for what, a, b in (("loss", loss, ref), ("dx", dx, ref_dx), ("dw", dw, ref_dw)):
            err = (a - b).abs().max().item()
            assert err <= BF16_RTOL * b.abs().max().item(), (name, what, err)


@pytest.mark.parametrize("bf16", [False, True])
def test_store_capture_defers_the_weight_gradient(bf16):
    """With a WeightGradStore the head's dW is recomputed from the saved log-sum-exp: queued while the
    store captures (BI leaves weight.grad alone, BW adds it), returned directly outside a capture."""
    x, w, labels = _inputs()
    _, ref_dx, ref_dw = _reference(x, w, labels)
    tol = {"rtol": BF16_RTOL, "atol": BF16_RTOL * ref_dw.abs().max().item()} if bf16 else FP32
    store = WeightGradStore()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        losses = [_mean(x, w, labels, chunk=8, store=store) for _ in range(2)]
    with store.capture("mb0"):
        losses[0].backward()
    assert w.grad is None, "BI must not produce the weight gradient"
    torch.testing.assert_close(x.grad, ref_dx, **tol)
    store.run("mb0")
    torch.testing.assert_close(w.grad, ref_dw, **tol)
    losses[1].backward()  # no capture: a plain backward, accumulating
    torch.testing.assert_close(w.grad, 2 * ref_dw, **tol)
    assert w.grad.dtype == torch.float32 and not store.pending


def test_no_grad_gives_the_loss_without_a_graph():
    x, w, labels = _inputs()
    ref, _, _ = _reference(x, w, labels)
    with torch.no_grad():
        loss = _mean(x, w, labels, chunk=6)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref, **FP32)


def test_second_backward_is_refused_and_bad_chunks_are_errors():
    x, w, labels = _inputs()
    loss = _mean(x, w, labels, chunk=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    with pytest.raises(ValueError, match="chunk"):
        fused_linear_cross_entropy(x, w, labels, chunk=0)
    with pytest.raises(ValueError, match="cross_entropy_chunk"):
        Transformer(ModelConfig(arch="llama", num_layers=1, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                                ffn_hidden_size=48, vocab_size=50), ModelOptions(cross_entropy_chunk=0))
    assert TrainConfig().cross_entropy_chunk == DEFAULT_CHUNK and TrainConfig().fused_cross_entropy
    cfg = Config()
    cfg.train.cross_entropy_chunk = 0
    with pytest.raises(ConfigError, match=r"train\.cross_entropy_chunk"):
        check_training_config(cfg)


MODELS = {
    "llama": ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=48, vocab_size=101),
    "gpt2-tied": ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4,
                             activation="gelu_tanh", vocab_size=101, max_position_embeddings=32, tie_embeddings=True,
                             attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_model_loss_and_every_gradient_equal_the_unfused_head(arch):
    """The Transformer's head, fused (a chunk that leaves a remainder) against the unfused path; the
    tied embedding's gradient sums the lookup's and the head's. Without labels both give the logits."""
    tokens = torch.randint(0, 101, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = tokens[:, 1:].clone()
    labels[1, 2:6] = -100
    runs = {}
    for fused in (True, False):
        m = Transformer(MODELS[arch], ModelOptions(fused_cross_entropy=fused, cross_entropy_chunk=7), seed=3)
        loss = m(tokens[:, :-1], labels)
        loss.backward()
        runs[fused] = (loss.detach(), dict(m.named_parameters()), m(tokens[:, :-1]))
    torch.testing.assert_close(runs[True][0], runs[False][0], **FP32)
    assert torch.equal(runs[True][2], runs[False][2])
    for name, p in runs[True][1].items():
        ref = runs[False][1][name].grad
        err = (p.grad - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item() + 1e-9, (name, err)


def test_no_host_sync_in_forward_or_backward():
    """Ignored labels are masked arithmetically: no op that would wait for a GPU (a boolean index is
    a nonzero), in fp32 and bf16, whole and chunked, with ignored labels in every chunk."""
    from mpformer.parallel.host_syncs import HostSyncs

    for dtype, chunk in ((torch.float32, 8), (torch.bfloat16, DEFAULT_CHUNK)):
        x, w, labels = _inputs()
        with HostSyncs() as syncs, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = fused_linear_cross_entropy(x, w, labels, chunk=chunk)
            loss.backward()
        assert syncs.ops == [], syncs.ops
    with HostSyncs() as syncs:  # the oracle that it sees one: a boolean index
        x[labels != -100].sum()
    assert syncs.ops

