"""Expert layers under tensor (and sequence) parallelism against the single-device model, fp32.

Oracle: the plain Transformer with the same seed on the same tokens. For each tp size, sequence
parallelism on or off and expert tensor parallelism etp in {1, tp}: the loss within 1e-5 relative,
every router's top-k choices identical, and every gradient block (router losses included: aux and z
coefficients set, the router-loss factor 1) within 1e-5 of the largest element of the reference
gradient, after the tp sums the gradient specs name. The same for an OLMoE-like model (q/k RMSNorm over
the whole projection, whose statistics are all-reduced over tp) with one kv head, so that at tp=2 the k
projection and its norm gain are replicated on both ranks.
"""

from __future__ import annotations

import torch

from mpformer.core.model_config import ModelConfig
from mpformer.parallel.spawn import run_distributed

RTOL = 1e-5
MOE = dict(arch="qwen2_moe", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
           moe_ffn_hidden_size=32, num_experts=8, num_experts_per_tok=2, mlp_kind="moe", vocab_size=96,
           attention_bias=True, shared_expert_ffn_size=64, shared_expert_gate=True, mlp_only_layers=[1],
           router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
OLMOE = dict(arch="olmoe", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=1, ffn_hidden_size=32,
             moe_ffn_hidden_size=32, num_experts=8, num_experts_per_tok=2, mlp_kind="moe", vocab_size=96,
             qk_norm="projection", norm_topk_prob=False, tie_embeddings=True, router_aux_loss_coef=0.1)


def _block(full: torch.Tensor, offsets, shape) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, shape)):
        full = full.narrow(dim, off, n)
    return full


def _choices(model) -> list:
    """Record every router's top-k choices of the next forward."""
    from mpformer.layers.moe import moe_layers

    seen: list = []
    for m in moe_layers(model):
        m.router.register_forward_hook(lambda _m, _i, out: seen.append(out[1].detach().clone()))
    return seen


def _tp_parity(tp: int, sp: bool, etp: int, model: dict) -> dict:
    from mpformer.checkpoint.io import views_like
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.model_options import ModelOptions
    from mpformer.models import Transformer
    from mpformer.models.parallelize import build_model, grad_specs
    from mpformer.parallel.device import Device
    from mpformer.parallel.expert_parallel import EPContext
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.tensor_parallel import kv_replicas, sync_tp_grads

    cfg = ModelConfig(**model)
    groups = ProcessGroups.build(ParallelLayout(dp=1, tp=tp, sequence_parallel=sp), Device("cpu"))
    options = ModelOptions(fused_cross_entropy=False)
    model = build_model(cfg, options, tp=groups.tp_context(kv_replicas(tp, cfg.kv_heads)), device=torch.device("cpu"),
                        seed=5, ep=EPContext(etp=etp))
    ref = Transformer(cfg, options, seed=5)
    model.train()
    ref.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    got_choices, want_choices = _choices(model), _choices(ref)
    loss, ref_loss = model(tokens[:, :-1], tokens[:, 1:]), ref(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    loss.backward()
    ref_loss.backward()
    if sp and etp == 1:  # each tp rank routed its own chunk: compare against the rows of that chunk
        want_choices = [w.view(16, 2, -1).chunk(tp)[model.tp.rank].reshape(-1, w.shape[-1]) for w in want_choices]
    assert len(got_choices) == len(want_choices) == sum(k == "moe" for k in cfg.layer_kinds())
    for g, w in zip(got_choices, want_choices):
        assert torch.equal(g, w), (tp, sp, etp)
    sync_tp_grads(grad_specs(model))
    shards = model.canonical_shards()
    grads = views_like({k: s.local for k, s in shards.items()}, list(model.parameters()), lambda p: p.grad)
    ref_grads = views_like(ref.canonical_tensors(), list(ref.parameters()), lambda p: p.grad)
    for name, sh in shards.items():
        expect = _block(ref_grads[name], sh.offsets, sh.local.shape)
        err = (grads[name] - expect).abs().max().item() if expect.numel() else 0.0
        assert err <= RTOL * ref_grads[name].abs().max().item() + 1e-9, (tp, sp, etp, name, err)
    return {"loss": loss.item()}


def _worker(world: int) -> dict:
    out = {}
    for sp in (False, True):
        for etp in (1, world):
            out[("qwen2_moe", world, sp, etp)] = _tp_parity(world, sp, etp, MOE)
        out[("olmoe", world, sp, 1)] = _tp_parity(world, sp, 1, OLMOE)
    return out


def test_expert_layers_under_tensor_parallelism_match_one_process():
    for world in (2,):
        res = run_distributed(_worker, world, args=(world,), timeout=120)
        assert len(res[0]) == 6
