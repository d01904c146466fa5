"""Routed experts in float8 (issue 35: "experts: the grouped GEMM in FP8") through the real entry point.

One process (one spawn): a Mixtral-style tiny MoE at train.precision=fp8, each recipe, against bf16 from
the same initialisation: 5 steps' losses within 2e-2 relative and not equal; every expert GEMM ran in
float8 (``_scaled_mm`` calls counted: the dense linears' and the experts'). Delayed scaling's per-expert
amax histories are checkpointed: stop at 3 and resume to 5 equals the uninterrupted run bit for bit.

Expert parallelism (a second spawn, 2 ranks): ep=2 (dp=2, one micro-batch of 2 sequences per rank) against
one process with the same 4 sequences in one micro-batch, only the routed experts in float8 (the dense
layers kept bf16, whose per-tensor scales would see a rank's half of the batch). An expert's rows after
dispatch are then the same tokens as the one process's (in another order), so its float8 operands of the
first forward (layer 0's gate/up GEMM: each expert's cast weight, its token block, their scales) equal the
one process's bit for bit, rows compared as a set; the 5 steps' losses track within 2e-2. The same spawn
trains cp=2, tp=2 with sequence parallelism (whole experts: an expert's rows split over tp's sequence
chunks) and tp=2 etp=2 (each expert's ffn split), tracking one process within 2e-2. Delayed scaling under
selective and full recompute equals the run without recompute bit for bit (the first forward's scales
replayed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

BASE = {"model": "tiny-llama", "model.arch": "mixtral", "model.num_experts": 8, "model.num_experts_per_tok": 2,
        "model.mlp_kind": "moe", "model.moe_ffn_hidden_size": 32, "model.router_aux_loss_coef": 0.02,
        "model.vocab_size": 256, "train.seq_length": 32, "train.steps": 5, "train.global_batch_size": 4,
        "train.micro_batch_size": 2, "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 1,
        "logging.progress": False}
RECIPES = ("tensorwise", "rowwise", "delayed")
TOLERANCE = 2e-2  # relative, per step's loss (as tests/distributed/test_fp8_training.py)
EXPERTS_ONLY = {"train.precision": "fp8", "train.fp8.keep_bf16": "[embedding.*,lm_head,*.router,layers.*.attn.*]"}
RUNS = {  # name -> (world, overrides)
    "bf16": (1, {"train.precision": "bf16"}),
    **{r: (1, {"train.precision": "fp8", "train.fp8.recipe": r}) for r in RECIPES},
    "delayed_half": (1, {"train.precision": "fp8", "train.fp8.recipe": "delayed", "train.stop_at": 3}),
    "delayed_resumed": (1, {"train.precision": "fp8", "train.fp8.recipe": "delayed",
                            "checkpoint.load": "{root}/delayed_half/checkpoints"}),
    "experts_ref": (1, {**EXPERTS_ONLY, "train.micro_batch_size": 4}),
    "experts_ref_mb2": (1, EXPERTS_ONLY),
    "delayed_selective": (1, {"train.precision": "fp8", "train.fp8.recipe": "delayed",
                              "parallel.recompute": "selective"}),
    "delayed_full": (1, {"train.precision": "fp8", "train.fp8.recipe": "delayed", "parallel.recompute": "full"}),
    "delayed_4_layers": (1, {"train.precision": "fp8", "train.fp8.recipe": "delayed", "model.num_layers": 4}),
    "experts_ep2": (2, {**EXPERTS_ONLY, "parallel.dp": 2, "parallel.ep": 2}),
    "experts_ep2_delayed": (2, {**EXPERTS_ONLY, "parallel.dp": 2, "parallel.ep": 2, "train.fp8.recipe": "delayed"}),
    # against experts_ref_mb2 (the same micro-batches): an expert's rows split over cp, over tp's sequence
    # chunks (whole experts under SP), and its ffn split over etp
    "experts_cp2": (2, {**EXPERTS_ONLY, "parallel.cp": 2}),
    "experts_cp2_delayed": (2, {**EXPERTS_ONLY, "parallel.cp": 2, "train.fp8.recipe": "delayed"}),
    "experts_tp2_sp": (2, {**EXPERTS_ONLY, "parallel.tp": 2, "parallel.etp": 1, "parallel.sequence_parallel": True}),
    "experts_etp2": (2, {**EXPERTS_ONLY, "parallel.tp": 2, "parallel.etp": 2, "parallel.sequence_parallel": True,
                         "train.fp8.recipe": "rowwise"}),
    # delayed expert histories checkpointed at tp=2 etp=2 (each tp rank holds the same, reduced ones)
    **{name: (2, {"train.precision": "fp8", "train.fp8.recipe": "delayed", "parallel.tp": 2, "parallel.etp": 2,
                  "parallel.sequence_parallel": True, **kw})
       for name, kw in (("etp2_delayed", {}), ("etp2_delayed_half", {"train.stop_at": 3}),
                        ("etp2_delayed_resumed", {"checkpoint.load": "{root}/etp2_delayed_half/checkpoints"}))},
    # a pipeline: each stage's experts whole, the zero-bubble V's split backward, delayed scaling replayed
    **{name: (2, {"train.precision": "fp8", "train.fp8.recipe": "delayed", "model.num_layers": 4, "parallel.pp": 2,
                  "parallel.vpp": 2, "parallel.schedule": "zb-v", **kw})
       for name, kw in (("delayed_pp2_zbv", {}), ("delayed_pp2_zbv_full", {"parallel.recompute": "full"}))},
}


def _worker(world: int, data: str, root: str) -> dict:
    import mpformer.layers.fp8_expert_gemm as fp8x
    from mpformer.layers.moe import Experts

    real_mm, real_rows, real_forward = torch._scaled_mm, fp8x.mm_rows, Experts.forward
    calls, seen, local, shards = [0], [], [], []

    def counted(*args, **kw):
        calls[0] += 1
        return real_mm(*args, **kw)

    def rows(a8, sa, b8, sb, g, method, out_dtype):
        if not seen:  # a run's first expert GEMM: layer 0's gate/up forward of its first micro-batch
            seen.append((list(local[0]), a8.clone(), sa.clone(), b8.clone(), sb.clone(), g.counts))
        return real_rows(a8, sa, b8, sb, g, method, out_dtype)

    def forward(self, x_mh, counts):
        if not local:  # the groups each projection's amaxes span: tokens, n (up under etp), k (down under etp)
            shards.append([([c.size for c in sh.tokens], sh.n.size if sh.n else 1, sh.k.size if sh.k else 1)
                           for sh in self.fp8_shards])
        local.append(self.local)
        return real_forward(self, x_mh, counts)

    torch._scaled_mm, fp8x.mm_rows, Experts.forward = counted, rows, forward
    out = {}
    try:
        for name, (w, kw) in RUNS.items():
            if w != world:
                continue
            calls[0], seen[:], local[:], shards[:] = 0, [], [], []
            kw = {k: (v.format(root=root) if isinstance(v, str) else v) for k, v in kw.items()}
            out[name] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw))
            out[name]["calls"], out[name]["shards"] = calls[0], shards[0] if shards else None
            out[name]["operands"] = _per_expert(*seen[0]) if seen else {}
    finally:
        torch._scaled_mm, fp8x.mm_rows, Experts.forward = real_mm, real_rows, real_forward
    return out


def _per_expert(experts, a8, sa, b8, sb, counts) -> dict:
    """Global expert id -> (weight bytes, weight scale, its token rows' bytes sorted, their scale)."""
    out, at = {}, 0
    for i, (e, c) in enumerate(zip(experts, counts, strict=True)):
        block = a8[at:at + c].view(torch.uint8)
        rows = sorted(bytes(r.tolist()) for r in block)
        scale_a = sa[i] if sb.dim() == 1 else sa[at:at + c]
        out[e] = (b8[i].view(torch.uint8).clone(), sb[i].clone(), rows, scale_a.unique().clone())
        at += c
    return out


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root, res = str(tmp_path_factory.mktemp("fp8_experts")), {}
    for world in (1, 2):
        ranks = run_distributed(_worker, world, args=(world, tiny_data, root), timeout=600)
        res.update(ranks[0])
        for name, r in ranks[1].items() if world == 2 else ():
            res[name]["operands"].update(r["operands"])
    return res


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_experts_track_bf16(results, recipe):
    got, want = results[recipe]["losses"], results["bf16"]["losses"]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOLERANCE * abs(w), (recipe, got, want)
    assert got != want
    # per micro-batch and layer (2 x 2 x 5 steps): 4 dense linears x 3 GEMMs, and the experts' 2 projections
    # x 3 GEMMs, one _scaled_mm per expert with tokens (8 experts: at most 8, at least 1 each)
    n = results[recipe]["calls"] - 2 * 2 * 5 * 4 * 3
    assert 2 * 2 * 5 * 2 * 3 <= n <= 2 * 2 * 5 * 2 * 3 * 8, results[recipe]["calls"]
    assert results["bf16"]["calls"] == 0


def test_experts_amaxes_span_the_ranks_that_split_them(results):
    """The model wires each layout's groups into its experts (the numerics of each: test_fp8_operands.py):
    cp's ranks (ep = 1), tp's under SP with whole experts, etp's as the up projection's N and the down's K."""
    one = [([], 1, 1), ([], 1, 1)]
    assert results["experts_ref_mb2"]["shards"] == results["experts_ep2"]["shards"] == one
    assert results["experts_cp2"]["shards"] == results["experts_tp2_sp"]["shards"] == [([2], 1, 1), ([2], 1, 1)]
    assert results["experts_etp2"]["shards"] == [([], 2, 1), ([], 1, 2)]


@pytest.mark.parametrize("run", ["delayed_selective", "delayed_full", "delayed_pp2_zbv_full"])
def test_delayed_experts_under_recompute_equal_the_plain_run(results, run):
    """Recomputed experts (selective: the experts alone; full: the block, also on a pp=2 ZB-V pipeline)
    replay the first forward's scales: the losses equal the same layout's run without recompute bit for bit
    (one machine, the same ops); the pipeline tracks one process within the layout tolerance."""
    plain = run.removesuffix("_full").removesuffix("_selective")
    assert results[run]["losses"] == results[plain]["losses"]
    if "pp2" in run:
        for g, w in zip(results[run]["losses"], results["delayed_4_layers"]["losses"], strict=True):
            assert abs(g - w) <= TOLERANCE * abs(w)


@pytest.mark.parametrize("run", ["delayed", "etp2_delayed"])
def test_delayed_expert_histories_resume_exactly(results, run):
    assert results[f"{run}_resumed"]["steps"] == [4, 5]
    assert results[f"{run}_resumed"]["losses"] == results[run]["losses"][3:]


@pytest.mark.parametrize("run", ["experts_ep2", "experts_ep2_delayed", "experts_cp2", "experts_cp2_delayed",
                                 "experts_tp2_sp", "experts_etp2"])
def test_expert_parallel_fp8_tracks_one_process(results, run):
    """Each layout's 5 losses track one process's (the operands themselves: test_fp8_operands.py's experts)."""
    got, want = results[run]["losses"], results["experts_ref" if "ep2" in run else "experts_ref_mb2"]["losses"]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOLERANCE * abs(w), (run, got, want)


@pytest.mark.parametrize("run", ["experts_ep2", "experts_ep2_delayed"])
def test_expert_parallel_first_float8_operands_equal_one_process(results, run):
    """Each expert's first-step float8 weight and token block (and scales) at ep=2 (its rank's) equal the
    one process's bit for bit (the delayed recipe's first use is scaled from its own amax)."""
    got, want = results[run]["operands"], results["experts_ref"]["operands"]
    assert sorted(got) == sorted(want) == list(range(8))
    assert sum(len(want[e][2]) for e in range(8)) >= 4 * 32 * 2  # every routed row (and its padding) compared
    for e in range(8):
        w8, sw, rows, sx = got[e]
        rw8, rsw, rrows, rsx = want[e]
        assert torch.equal(w8, rw8) and torch.equal(sw, rsw), e
        assert rows == rrows and torch.equal(sx, rsx), (e, len(rows), len(rrows))
