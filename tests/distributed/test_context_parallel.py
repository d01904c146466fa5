"""Context parallelism on gloo ranks against attention and training on one process, fp32.

Oracles: torch's SDPA over the whole sequence with an explicit mask (causal, sliding window,
document ids) for the attention of every cp kind; the single-process Transformer with the same
seed for whole-model losses and gradients; a single-process pretraining run for 3 AdamW steps.
Tolerances: outputs and gradients within 1e-5 of the largest element of the reference tensor
(elements whose true value is about 0 would make a per-element relative test compare rounding
noise); losses and grad norms 1e-5 relative. bf16 runs track their own fp32 runs to 2e-2 relative
(bf16 keeps 8 bits of mantissa: 2^-8 = 4e-3 per rounding, a few roundings per layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mpformer.core.model_config import ModelConfig
from mpformer.core.model_options import ModelOptions
from mpformer.core.sequence import load_balance
from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

RTOL = 1e-5
BF16_RTOL = 2e-2
KINDS = {2: [("ring", 1), ("allgather", 1), ("ulysses", 1)],
         4: [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)]}
MODELS = {
    "llama": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  ffn_hidden_size=176, vocab_size=97),
    "gpt2": dict(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, activation="gelu_tanh",
                 vocab_size=97, max_position_embeddings=64, tie_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": dict(arch="mistral", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=1,
                    ffn_hidden_size=176, vocab_size=97, sliding_window=6),
}


def _close(got: torch.Tensor, want: torch.Tensor, what) -> float:
    err = (got - want).abs().max().item()
    assert err <= RTOL * want.abs().max().item() + 1e-9, (what, err, want.abs().max().item())
    return err


def _reference_attention(q, k, v, docs, window):
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    mask = mask[None, None] if docs is None else mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _attention_parity(cp: int) -> int:
    """Every kind at this cp, GQA and MQA, causal / sliding window / document masks, ring with and
    without overlap: outputs and q, k, v gradients equal full attention's at this rank's positions."""
    import dataclasses

    from mpformer.context_parallel.context import SeqShard, attention, document_ids
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.sequence import positions
    from mpformer.models.parallelize import cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    b, s, d, checked = 2, 8 * cp, 8, 0
    gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
    tokens = torch.randint(0, 4, (b, s), generator=gen)
    docs_all = document_ids(tokens, 0)
    for kind, u in KINDS[cp]:
        layout = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=u)
        ctx = cp_context(layout, ProcessGroups.build(layout, Device("cpu")))
        variants = [ctx] + ([dataclasses.replace(ctx, overlap=False)] if kind == "ring" else [])
        segs = ctx.segments(s)
        index = torch.tensor(positions(segs))
        for heads, kv in ((4, 2), (4, 1)):
            for docs, window in ((None, None), (docs_all, None), (docs_all, 5)):
                q, k, v = (torch.randn(b, n, s, d, generator=gen, requires_grad=True) for n in (heads, kv, kv))
                g = torch.randn(b, heads, s, d, generator=gen)
                ref = _reference_attention(q, k, v, docs, window)
                ref_grads = torch.autograd.grad(ref, (q, k, v), g)
                for c in variants:
                    local = [t.detach()[:, :, index].requires_grad_() for t in (q, k, v)]
                    out = attention(*local, c, SeqShard(s, segs, index, docs), window, d ** -0.5)
                    what = (kind, cp, heads, kv, docs is not None, window, c.overlap)
                    _close(out, ref.detach()[:, :, index], what)
                    grads = torch.autograd.grad(out, local, g[:, :, index])
                    for name, got, want in zip("qkv", grads, ref_grads):
                        _close(got, want[:, :, index], (*what, "d" + name))
                    checked += 1
    return checked


MEMORY_S = 8192  # any [s, s] tensor of one byte an element is 64 MiB; the bound is a quarter of that


def _attention_memory(cp: int) -> dict:
    """The storage meter around every kind's forward and backward at s = 8192, documents and a sliding
    window on: the most bytes live at once on this rank (no [s, s] or [s/cp, s] mask or scores)."""
    from mpformer.context_parallel.context import SeqShard, attention, document_ids
    from mpformer.core.layout import ParallelLayout
    from mpformer.core.sequence import positions
    from mpformer.models.parallelize import cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups
    from mpformer.parallel.memory_meter import StorageMeter

    s, gen = MEMORY_S, torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (1, s), generator=gen)
    tokens[0, ::1500] = 0
    docs = document_ids(tokens, 0)
    peaks = {}
    for kind, u in KINDS[cp]:
        layout = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=u)
        ctx = cp_context(layout, ProcessGroups.build(layout, Device("cpu")))
        segs = ctx.segments(s)
        index = torch.tensor(positions(segs))
        for masks, window in (("causal", None), ("docs+window", 3000)):
            q, k, v = (torch.randn(1, n, s // cp, 8, generator=gen, requires_grad=True) for n in (4, 2, 2))
            seq = SeqShard(s, segs, index, docs if masks != "causal" else None)
            with StorageMeter() as meter:
                out = attention(q, k, v, ctx, seq, window, 8 ** -0.5)
                out.backward(torch.ones_like(out))
            peaks[(kind, masks)] = meter.peak
    return peaks


def _model_parity(cp: int) -> int:
    """The whole model at each kind: every cp rank's loss share sums to the single-process loss, and
    its gradients, summed over cp, equal the single-process gradients (Llama, GPT-2 with learned
    positions and tied embeddings, Mistral's sliding window; with and without document masks). The
    reference's head is unfused; the cp model's is fused (chunks of 3 tokens), and at the first kind
    unfused too. Some labels are -100, all of one row's first 8 positions: under the zigzag split a
    rank holds few or none of them, and its share still counts every rank's labelled tokens."""
    import torch.distributed as dist

    from mpformer.core.layout import ParallelLayout
    from mpformer.models import Transformer
    from mpformer.models.parallelize import build_model, cp_context
    from mpformer.parallel.device import Device
    from mpformer.parallel.groups import ProcessGroups

    checked = 0
    tokens = torch.randint(0, 97, (2, 8 * cp + 1), generator=torch.Generator().manual_seed(1))
    tokens[:, ::5] = 0  # EOS every few tokens: several documents per row
    labels = tokens[:, 1:].clone()
    labels[0, :8] = -100
    for kind, u in KINDS[cp]:
        layout = ParallelLayout(dp=1, cp=cp, cp_kind=kind, cp_ulysses=u)
        groups = ProcessGroups.build(layout, Device("cpu"))
        ctx = cp_context(layout, groups)
        heads = (True, False) if kind == KINDS[cp][0][0] else (True,)
        for arch, eos, fused in ((a, e, f) for a in MODELS for e in (None, 0) for f in heads):
            cfg = ModelConfig(**MODELS[arch])
            model = build_model(cfg, ModelOptions(document_eos=eos, fused_cross_entropy=fused, cross_entropy_chunk=3),
                                tp=None, cp=ctx, device=torch.device("cpu"), seed=5)
            ref = Transformer(cfg, ModelOptions(document_eos=eos, fused_cross_entropy=False), seed=5)
            loss, ref_loss = model(tokens[:, :-1], labels), ref(tokens[:, :-1], labels)
            loss.backward()
            ref_loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=groups.cp)
            torch.testing.assert_close(total, ref_loss.detach(), rtol=RTOL, atol=0)
            for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
                grad = p.grad.clone()
                dist.all_reduce(grad, group=groups.cp)
                _close(grad, rp.grad, (kind, arch, eos, fused, name))
            checked += fused  # the count the test expects: one per (kind, arch, mask)
    return checked


BASE = {"model": "tiny-llama", "model.vocab_size": 256, "train.seq_length": 32, "train.steps": 3,
        "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.device": "cpu", "optim.lr": 3e-3,
        "optim.warmup_steps": 1, "optim.clip_grad": 0.5, "logging.progress": False}
DOCS = {"data.document_mask": True, "data.eos_token_id": 0, "train.seq_length": 64}
TEN = {"train.steps": 10}
BF16 = {"train.precision": "bf16", **TEN}


def _cp(n: int, kind: str = "ring", **kw) -> dict:
    return {"parallel.cp": n, "parallel.cp_kind": kind, **({"parallel.cp_ulysses": 2} if kind == "hybrid" else {}),
            **kw}


RUNS = {  # name -> (world size, phase, overrides); phase 2 resumes checkpoints written in phase 1
    "ref": (1, 1, {}),
    "ref_gpt2": (1, 1, {"model": "tiny-gpt2"}),
    "ref_docs": (1, 1, DOCS),
    **{f"cp2_{k}": (2, 1, _cp(2, k)) for k in ("ring", "allgather", "ulysses")},
    **{f"cp2_{k}_docs": (2, 1, _cp(2, k, **DOCS)) for k in ("ring", "allgather", "ulysses")},
    "cp2_gpt2": (2, 1, _cp(2, "allgather", model="tiny-gpt2")),
    "cp2_stop2": (2, 1, _cp(2, "ring", **{"train.stop_at": 2})),
    "fp32_tp2_sp": (2, 1, {"parallel.tp": 2, "parallel.sequence_parallel": True, **TEN}),
    "bf16_tp2_sp": (2, 1, {"parallel.tp": 2, "parallel.sequence_parallel": True, **BF16}),
    "fp32_cp2": (2, 1, {**_cp(2), **TEN}),
    "bf16_cp2": (2, 1, {**_cp(2), **BF16}),
    # the CPU's speed choices (conftest.py makes the GPU's path the default): fp32 attention cores, W^T copies
    "bf16_cp2_cpu": (2, 1, {**_cp(2), **BF16, "train.cpu_attention": "fp32", "train.cpu_dgrad": "transposed"}),
    "fp32_cp2_allgather": (2, 1, {**_cp(2, "allgather"), **TEN}),
    "bf16_cp2_allgather": (2, 1, {**_cp(2, "allgather"), **BF16}),
    "fp32_pp2": (2, 1, {"parallel.pp": 2, **TEN}),
    "bf16_pp2": (2, 1, {"parallel.pp": 2, **BF16}),
    **{f"cp4_{k}": (4, 1, _cp(4, k)) for k in ("ring", "allgather", "ulysses", "hybrid")},
    "cp4_hybrid_docs": (4, 1, _cp(4, "hybrid", **DOCS)),
    "tp2_cp2_sp": (4, 1, _cp(2, "ring", **{"parallel.tp": 2, "parallel.sequence_parallel": True})),
    "tp2_cp2_sp_gpt2": (4, 1, _cp(2, "ulysses", **{"parallel.tp": 2, "parallel.sequence_parallel": True,
                                                   "model": "tiny-gpt2"})),
    "pp2_cp2_1f1b": (4, 1, _cp(2, "ring", **{"parallel.pp": 2, "parallel.schedule": "1f1b"})),
    "pp2_cp2_zbh1": (4, 1, _cp(2, "allgather", **{"parallel.pp": 2, "parallel.schedule": "zb-h1"})),
    "pp2_cp2_gpt2": (4, 1, _cp(2, "ring", **{"parallel.pp": 2, "model": "tiny-gpt2"})),  # tied embeddings
    **{f"dp2_cp2_zero{z}": (4, 1, _cp(2, kind, **{"parallel.dp": 2, "parallel.zero": z}))
       for z, kind in ((0, "allgather"), (1, "ring"), (2, "ring"), (3, "ulysses"))},
    "cp4_from_cp2": (4, 2, _cp(4, "allgather", **{"checkpoint.load": "{root}/cp2_stop2/checkpoints"})),
    "cp1_from_cp2": (1, 2, {"checkpoint.load": "{root}/cp2_stop2/checkpoints"}),
}


def _worker(world: int, phase: int, data: str, root: str) -> dict:
    out: dict = {}
    if world > 1 and phase == 1:
        out[("attention", world)] = _attention_parity(world)
        out[("memory", world)] = _attention_memory(world)
        out[("model", world)] = _model_parity(world)
    for name, (w, ph, kw) in RUNS.items():
        if (w, ph) == (world, phase):
            kw = {k: (v.format(root=root) if isinstance(v, str) else v) for k, v in kw.items()}
            out[name] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw))
    return out


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp"))
    res = {"root": root}
    for world, phase in ((1, 1), (2, 1), (4, 1), (1, 2), (4, 2)):
        res.update(run_distributed(_worker, world, args=(world, phase, tiny_data, root), timeout=600)[0])
    return res


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_of_every_kind_equals_full_attention(results, cp):
    # kinds x 2 head layouts x 3 masks, ring twice (with and without overlap)
    assert results[("attention", cp)] == (len(KINDS[cp]) + 1) * 2 * 3


@pytest.mark.parametrize("cp", [2, 4])
def test_no_kind_forms_a_square_mask_or_scores(results, cp):
    peaks = results[("memory", cp)]
    assert len(peaks) == 2 * len(KINDS[cp])
    for what, peak in peaks.items():
        assert peak < MEMORY_S ** 2 // 4, (what, f"{peak / 2**20:.1f} MiB live at the peak")


@pytest.mark.parametrize("cp", [2, 4])
def test_model_losses_and_gradients_equal_one_process(results, cp):
    assert results[("model", cp)] == len(KINDS[cp]) * len(MODELS) * 2


def _same(run: dict, ref: dict, start: int = 0) -> None:
    want = ref["losses"][start:]
    assert len(run["losses"]) == len(want)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"][start:]), rtol=RTOL,
                               atol=0)


@pytest.mark.parametrize("run,ref", [
    *((f"cp2_{k}", "ref") for k in ("ring", "allgather", "ulysses")),
    *((f"cp4_{k}", "ref") for k in ("ring", "allgather", "ulysses", "hybrid")),
    *((f"cp2_{k}_docs", "ref_docs") for k in ("ring", "allgather", "ulysses")),
    ("cp4_hybrid_docs", "ref_docs"), ("cp2_gpt2", "ref_gpt2"), ("tp2_cp2_sp", "ref"), ("tp2_cp2_sp_gpt2", "ref_gpt2"),
    ("pp2_cp2_1f1b", "ref"), ("pp2_cp2_zbh1", "ref"), ("pp2_cp2_gpt2", "ref_gpt2"),
    *((f"dp2_cp2_zero{z}", "ref") for z in range(4))])
def test_training_matches_one_process(results, run, ref):
    _same(results[run], results[ref])


@pytest.mark.parametrize("run,kinds", [
    ("cp2_ring", {"cp.send"}), ("cp2_allgather", {"cp.all_gather", "cp.reduce_scatter"}),
    ("cp2_ulysses", {"cp.all_to_all"}), ("cp4_hybrid", {"cp.ulysses.all_to_all", "cp.ring.send"})])
def test_each_kind_moves_what_it_should(results, run, kinds):
    """Every step's ledger holds the kind's own context-parallel traffic and no other."""
    for step in results[run]["comm_by_kind"]:
        assert {k for k in step if k.startswith("cp.") and step[k] > 0} == kinds, step


def test_document_masks_change_the_run(results):
    """The packed-document runs see EOS boundaries: their losses differ from plain causal attention's."""
    assert results["ref_docs"]["losses"] != results["ref"]["losses"]


@pytest.mark.parametrize("run", ["cp4_from_cp2", "cp1_from_cp2"])
def test_checkpoints_resume_under_another_cp(results, run):
    _same(results[run], results["ref"], start=2)


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2", "cp2_allgather", "pp2", "cp2_cpu"])
def test_bf16_tracks_fp32_under_model_parallelism(results, layout):
    fp32 = results[f"fp32_{layout.removesuffix('_cpu')}"]["losses"]
    bf16 = results[f"bf16_{layout}"]["losses"]
    assert len(bf16) == len(fp32) == 10
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=BF16_RTOL, atol=0)
    assert fp32[-1] < fp32[0]  # it trains: the comparison is not between two flat lines


def test_zigzag_balances_causal_attention_and_contiguous_does_not():
    for cp in (2, 4, 8):
        assert load_balance(64 * cp, cp, "zigzag") <= 1.05
    assert load_balance(256, 4, "contiguous") >= 1.5
