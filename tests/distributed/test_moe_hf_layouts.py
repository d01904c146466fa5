"""Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE against transformers at every expert-parallel layout, fp32.

Issue 34's parity rule: each tiny random HF model (from its transformers config class, no hub: hidden 64,
4 heads, 2 kv heads, 8 experts top-2, random weights and norm gains) is saved, converted with
``mpformer-convert hf-to-mpformer`` and loaded by every layout below from the one checkpoint; on the
same 4 x 32 tokens (128 routed tokens a layer) each layout's ranks run the forward and compare their
part of the result with HF's:

    logits: max |diff| <= 1e-5 * max |HF logit|          (each rank's rows and positions against the same
                                                          slice of HF's, the maximum over the ranks)
    loss:   |diff| <= 1e-5 * |HF loss|                   (the training loss path: fused, vocab-parallel
                                                          under tp, shares summed over cp, mean over dp)
    top-k:  every sparse layer's k experts per token equal to HF's, in order; HF's from its router
            logits (output_router_logits=True): topk(softmax(logits)), as its routers pick them

Layouts (ep carved from dp x cp; one spawn per world size runs every layout and family): ep=1 (one
process: the test's own), dp=2 x ep=2, cp=2 x ep=2 (ring and Ulysses), dp=4 x ep=4 (all-to-all and
all-gather dispatchers), tp=2 x dp=2 x ep=2 with etp 1 and 2 (sequence parallelism on; etp 1 also
without it; OLMoE's q/k norm over the whole projection is split over tp there), pp=2 x dp=2 x ep=2.
Which ranks hold what: rows split over dp, positions over cp (the load-balanced chunks,
``SeqShard.index``), and under sequence parallelism with etp=1 each tp rank routes its chunk of its
positions; with etp=tp every tp rank routes them all.

Observed (CPU, fp32): max |logit diff| / max |HF logit| 0 at ep=1, dp x ep and pp (the same kernels
on the same rows), 5e-7 under cp ring and tp; the file runs in ~80 s on 2 shared cores (imports dominate
each rank's start).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from mpformer.parallel.spawn import run_distributed

VOCAB, SEQ, BATCH = 123, 32, 4
TOL = 1e-5
KW = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=64, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2)
# transformers config class and its arguments; imported in the test process only (the ranks re-import this
# module, and transformers would add seconds to each rank's start)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=8, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         decoder_sparse_step=2, norm_topk_prob=True, head_dim=32)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, tie_word_embeddings=True)),
}
LAYOUTS = {  # name -> (world size, ParallelLayout fields); world 1 runs in the test process
    "ep1": (1, {}),
    "dp2_ep2": (2, dict(dp=2, ep=2)),
    "cp2_ep2": (2, dict(cp=2, ep=2)),
    "cp2_ep2_ulysses": (2, dict(cp=2, ep=2, cp_kind="ulysses")),
    "dp4_ep4": (4, dict(dp=4, ep=4)),
    "dp4_ep4_allgather": (4, dict(dp=4, ep=4, ep_dispatcher="allgather")),
    "tp2_dp2_ep2_etp1": (4, dict(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True)),
    "tp2_dp2_ep2_etp1_nosp": (4, dict(tp=2, dp=2, ep=2, etp=1)),
    "tp2_dp2_ep2_etp2": (4, dict(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True)),
    "pp2_dp2_ep2": (4, dict(pp=2, dp=2, ep=2)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


# ---- in the ranks ---------------------------------------------------------------------------------
def _forward(model, groups, tokens_bs: torch.Tensor):  # groups: None on one process
    """This rank's logits ``[b, s_l, v]`` and loss (None off the last stage), the sequence it held, and
    every router's (layer, experts_tk) in forward order. The stage's own path, as the pipeline runs it:
    embed, layers, head; the hidden state goes to the next stage by a plain send (forward only)."""
    import torch.distributed as dist

    from mpformer.layers.moe import moe_layers

    picks: list = []
    hooks = [m.router.register_forward_hook(lambda _m, _i, out, i=m.layer: picks.append((i, out[1].clone())))
             for m in moe_layers(model)]
    labels = torch.cat([tokens_bs[:, 1:], torch.full((tokens_bs.shape[0], 1), -100)], dim=1)  # ours: no shift
    pp, stage = (groups.size("pp"), groups.coords["pp"]) if groups is not None else (1, 0)
    with torch.no_grad():
        seq = model.sequence(tokens_bs)
        if model.has_embedding:
            x = model.embed_tokens(tokens_bs, seq)
        else:
            x = torch.empty(SEQ, tokens_bs.shape[0], model.cfg.hidden_size)
            dist.recv(x, dist.get_global_rank(groups.pp, stage - 1))
        x = model.run_layers(x, range(len(model.layers)), seq)
        if stage < pp - 1:
            dist.send(x.contiguous(), dist.get_global_rank(groups.pp, stage + 1))
            logits = loss = None
        else:
            logits, loss = model.head_output(x, None, seq), model.head_output(x, labels, seq)
    for h in hooks:
        h.remove()
    return logits, loss, seq, picks


def _check_layout(layout_kw: dict, ckpts: dict[str, str], tokens: torch.Tensor, refs: dict) -> dict:
    """Every family at one layout: this rank's errors against its slice of HF's results (one process
    without a process group: the plain Transformer, as a one-device user builds it)."""
    from mpformer.checkpoint.io import load_checkpoint
    from mpformer.checkpoint.manifest import read_manifest
    from mpformer.core.layout import ParallelLayout, validate
    from mpformer.core.model_config import ModelConfig
    from mpformer.models.parallelize import build_rank
    from mpformer.models.transformer import Transformer
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out, groups = {}, None
    for name, ckpt in ckpts.items():
        cfg = ModelConfig.from_dict(read_manifest(Path(ckpt))["model"])
        layout = validate(ParallelLayout(**layout_kw), cfg, world, seq_length=SEQ)
        if world == 1:
            model, coords = Transformer(cfg), {"dp": 0, "tp": 0, "pp": 0, "cp": 0}
        else:
            groups = groups or ProcessGroups.build(layout, Device("cpu"))  # one set of groups per layout
            model, coords = build_rank(cfg, layout, groups, seq_length=SEQ, seed=0).model, dict(groups.coords)
        load_checkpoint(Path(ckpt), model.eval())
        rows = torch.arange(BATCH).chunk(layout.dp)[coords["dp"]]
        logits, loss, seq, picks = _forward(model, groups, tokens[rows])
        ref = refs[name]
        pos = seq.index if seq.index is not None else torch.arange(SEQ)
        res = {"coords": coords, "dp": layout.dp, "logit_err": None, "loss": None, "layers": [], "mismatch": 0}
        if logits is not None:
            want = ref["logits"][rows][:, pos]
            res["logit_err"] = (logits - want).abs().max().item()
            res["loss"] = loss.item()
        sp_chunks = layout.tp > 1 and layout.sequence_parallel and (layout.etp or layout.tp) == 1
        for layer, got in picks:
            want = ref["experts"][layer][rows][:, pos].transpose(0, 1)  # [s_l, b, k], ours are s-major
            if sp_chunks:
                want = want.chunk(layout.tp)[coords["tp"]]
            want = want.reshape(-1, want.shape[-1])
            assert got.shape == want.shape, (name, layer, got.shape, want.shape)
            res["layers"].append(layer)
            res["mismatch"] += int((got != want).any(-1).sum())
        out[name] = res
    return out


def _worker(world: int, ckpts: dict[str, str], tokens: torch.Tensor, refs: dict) -> dict:
    out = {}
    for lname, (w, kw) in LAYOUTS.items():
        if w == world:
            t0 = time.perf_counter()
            out[lname] = _check_layout(kw, ckpts, tokens, refs)
            out[lname]["seconds"] = time.perf_counter() - t0
    return out


# ---- in the test process ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Each family's HF model, converted; HF's logits, loss and per-layer top-k on the tokens; then every
    layout's per-rank results (world 1 here, each larger world in one spawn)."""
    import transformers as T

    from mpformer.cli.convert import main as convert

    root = tmp_path_factory.mktemp("moe_hf_layouts")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    ckpts, refs = {}, {}
    for i, (name, (config_class, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        hf = T.AutoModelForCausalLM.from_config(getattr(T, config_class)(**KW, **extra)).eval()
        _randomize(hf, seed=200 + i)
        hf.save_pretrained(root / f"hf_{name}")
        assert convert(["hf-to-mpformer", "--hf", str(root / f"hf_{name}"), "--out", str(root / name)]) == 0
        with torch.no_grad():
            o = hf(tokens, output_router_logits=True)
            loss = hf(tokens, labels=tokens, output_router_logits=False).loss  # the cross entropy alone
        k = hf.config.num_experts_per_tok
        sparse = [j for j, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        assert len(sparse) == len(o.router_logits)
        experts = {j: torch.topk(lg.float().softmax(-1), k, dim=-1).indices.view(BATCH, SEQ, k)
                   for j, lg in zip(sparse, o.router_logits)}
        for e in experts.values():  # the tokens spread over the experts, and every ep=4 rank gets some
            assert len(e.unique()) >= 6 and len((e // 2).unique()) == 4, (name, e.unique())
        refs[name] = {"logits": o.logits.float(), "loss": loss.item(), "experts": experts, "sparse": sparse}
        ckpts[name] = str(root / name)
    results, timings = {}, {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        t0 = time.perf_counter()
        if world == 1:
            per_rank = [_worker(1, ckpts, tokens, refs)]
        else:
            per_rank = run_distributed(_worker, world, args=(world, ckpts, tokens, refs), timeout=240)
        timings[world] = round(time.perf_counter() - t0, 1)
        for lname in per_rank[0]:
            results[lname] = [r[lname] for r in per_rank]
    seconds = {k: round(v[0].pop("seconds"), 1) for k, v in results.items()}
    print(f"\nseconds by world size (spawn included): {timings}; by layout (rank 0): {seconds}")
    worst = {lname: max(r[f]["logit_err"] / refs[f]["logits"].abs().max().item()
                        for r in ranks for f in FAMILIES if r[f]["logit_err"] is not None)
             for lname, ranks in results.items()}
    print("max |logit diff| / max |HF logit| by layout: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return {"refs": refs, "results": results}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_hf(reference, layout, family):
    ref = reference["refs"][family]
    ranks = [r[family] for r in reference["results"][layout]]
    scale = ref["logits"].abs().max().item()
    errs = [r["logit_err"] for r in ranks if r["logit_err"] is not None]
    assert errs and max(errs) <= TOL * scale, (max(errs) / scale, errs)
    # the loss: tp ranks agree (take tp rank 0), cp ranks' shares add up, dp ranks' means average
    shares = [r["loss"] for r in ranks if r["loss"] is not None and r["coords"]["tp"] == 0]
    loss = sum(shares) / ranks[0]["dp"]
    assert abs(loss - ref["loss"]) <= TOL * abs(ref["loss"]), (loss, ref["loss"])
    assert sum(r["mismatch"] for r in ranks) == 0, [r["mismatch"] for r in ranks]
    # every sparse layer was routed on some rank (a stage holds its own layers)
    assert sorted({j for r in ranks for j in r["layers"]}) == ref["sparse"]

