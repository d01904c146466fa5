"""ZeRO-3 with train.precision=fp8 (issue 35 parts 2-3): float8 layers' weights gathered in float8.

Oracle: one-process fp8 of the same global batch (ZeRO-0, the weights whole, each cast by
layers/fp8_linear.py itself). At dp=2 ZeRO-3 every rank gathers its units (optim/fp8_gather.py):

- the first step's forward GEMMs read float8 weights and scales equal to one process's bit for bit
  (every recipe; tensorwise and delayed gather them in float8 with amaxes all-reduced over the shards,
  rowwise gathers bf16 and casts as one process), and each input-gradient GEMM reads the very bytes
  its forward did (the unit freed after forward and gathered again in backward);
- 10 steps of losses track one process within 2e-2 relative (the suite's bound for bf16 layouts),
  with whole-layer units, a unit per part (a norm and a projection: two buckets), full recompute
  (tensorwise: bit for bit the run without recompute, its recomputed forward reusing the scales) and
  two micro-batches a rank (delayed: a weight's amax recorded once per micro-batch's forward);
- the ledger's bytes are the formula: float8 weights 1 byte an element, the rest bf16's 2, gathered in
  forward and again in backward but the embedding; one all-reduce of 4 bytes a float8 weight per
  forward gather; gradients reduce-scattered in bf16;
- a gathered float8 unit holds 1 byte per element and no bf16 buffer;
- a checkpoint saved at dp=2 ZeRO-3 fp8 (delayed: masters, optimizer and amax histories) resumes to
  the uninterrupted run's losses exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import overrides, train

STEPS = 10
BASE = {"model": "tiny-llama", "model.ffn_hidden_size": 128, "model.num_layers": 4, "model.vocab_size": 256,
        "train.seq_length": 32, "train.steps": STEPS, "train.global_batch_size": 4, "train.micro_batch_size": 2,
        "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 1, "logging.progress": False,
        "train.precision": "fp8"}
RECIPES = ("tensorwise", "rowwise", "delayed")
TOLERANCE = 2e-2
LINEARS = 4 * 4  # qkv, o, up, down per layer: every float8 GEMM's weight
SPLIT = {"train.zero3_unit_numel": 0, "train.zero3_reduce_numel": 0}
RUNS = {  # dp=2 ZeRO-3
    "tensorwise": {}, "rowwise": {"train.fp8.recipe": "rowwise"}, "delayed": {"train.fp8.recipe": "delayed"},
    "tensorwise_split": SPLIT,
    "delayed_accum": {"train.fp8.recipe": "delayed", "train.micro_batch_size": 1},  # 2 micro-batches a rank
    "tensorwise_recompute": {"parallel.recompute": "full"},
    "delayed_stop": {"train.fp8.recipe": "delayed", "train.stop_at": 5},
    "delayed_resume": {"train.fp8.recipe": "delayed"},
}


def _capture(limit: int) -> tuple[list, object]:
    """The first ``limit`` _scaled_mm calls' (a, b, scale_a, scale_b), cloned."""
    calls, real = [], torch._scaled_mm

    def capture(a, b, scale_a=None, scale_b=None, **kw):
        if len(calls) < limit:
            calls.append(tuple(t.clone() for t in (a, b, scale_a, scale_b)))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    torch._scaled_mm = capture
    return calls, real


def _watch_float8_units() -> list[tuple[int, int, int, int]]:
    """At every float8 gather: (float8 buffer bytes, bf16 buffer bytes, elements, float8 units gathered)."""
    from mpformer.optim.gather import UnitGather

    seen, gather = [], UnitGather.gather

    def watched(self, k: int, async_op: bool = False) -> None:
        gather(self, k, async_op)
        f = self.fp8[k]
        if f is not None:
            u = self.units[k]
            seen.append((f.gathered_bytes(), u.param_buf.untyped_storage().nbytes(), u.layout.size,
                         sum(x is not None for x in self.fp8)))

    UnitGather.gather = watched
    return seen


def _weights(calls: list) -> list[torch.Tensor]:
    """The forward GEMMs' float8 weights [N, K] as bytes, and their scales (b = W^T, column-major)."""
    return [(c[1].t().contiguous().view(torch.uint8), c[3]) for c in calls[:LINEARS]]


def _dp2(data: str, root: str) -> dict:
    out: dict = {}
    seen = _watch_float8_units()
    base = {**BASE, "data.paths": f"[{data}]"}
    for name, kw in RUNS.items():
        if name == "delayed_resume":
            kw = {**kw, "checkpoint.load": str(Path(root) / "delayed_stop" / "checkpoints")}
        seen.clear()
        # one micro-batch a rank: forward, then per linear in reverse dgrad (b = W [N, K]) before wgrad, and
        # under full recompute each layer's forward again (a: x in e4m3, where dgrad's and wgrad's is dY)
        calls, real = _capture((4 if "recompute" in name else 3) * LINEARS)
        try:
            out[name] = train(overrides(base, Path(root) / name, **{"parallel.dp": 2, "parallel.zero": 3, **kw}))
        finally:
            torch._scaled_mm = real
        out[name]["weights"], out[name]["units"] = _weights(calls), list(seen)
        if kw.get("train.fp8.recipe") == "rowwise":  # its dY is e4m3 too, and its backward re-casts W
            continue
        back = [c for c in calls[LINEARS:] if c[0].dtype != torch.float8_e4m3fn]  # dY: e5m2
        out[name]["dgrad_weights"] = [back[2 * j][1].contiguous().view(torch.uint8) for j in range(LINEARS)][::-1]
        again = _weights([c for c in calls[LINEARS:] if c[0].dtype == torch.float8_e4m3fn])  # layers in reverse
        out[name]["recomputed_weights"] = [w for i in reversed(range(LINEARS // 4)) for w in again[4 * i:4 * i + 4]]
    return out


def _one(data: str, root: str) -> dict:
    out = {}
    for r in RECIPES:
        calls, real = _capture(LINEARS)
        try:
            out[r] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / f"one_{r}",
                                     **{"train.fp8.recipe": r}))
        finally:
            torch._scaled_mm = real
        out[r]["weights"] = _weights(calls)
    from mpformer.cli.compose import compose_config
    from mpformer.core.fp8_config import Fp8Options
    from mpformer.core.model_options import ModelOptions
    from mpformer.models.transformer import Transformer

    cfg = compose_config(overrides(BASE, Path(root) / "x")).cfg.model
    model = Transformer(cfg, ModelOptions(fp8=Fp8Options()), seed=None, device="meta")
    out["psi"] = sum(p.numel() for p in model.parameters())
    out["embedding"] = model.embed.weight.numel()
    out["float8"] = sum(m.weight.numel() for m in model.modules() if getattr(m, "fp8", None) is not None)
    out["float8_layers"] = len(model.fp8_layers)
    return out


def _tp2_dp2(data: str, root: str) -> dict:
    """tp=2 (sequence parallel) x dp=2 ZeRO-3, tensorwise: the first step's forward weights and 3 losses."""
    import torch.distributed as dist

    calls, real = _capture(LINEARS)
    try:
        out = train(overrides({**BASE, "data.paths": f"[{data}]", "train.steps": TP_STEPS}, Path(root) / "tp2", **{
            "parallel.dp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.zero": 3}))
    finally:
        torch._scaled_mm = real
    return {"losses": out["losses"], "weights": _weights(calls), "rank": dist.get_rank()}


TP_STEPS = 3
# this model's float8 linears per layer: (name, tp split, the fused parts' rows): q 64, k and v 32 each
TP_LAYERS = (("qkv", "rows", (64, 32, 32)), ("o", "cols", None), ("up", "rows", (128, 128)), ("down", "cols", None))


def _tp_block(w8: torch.Tensor, split: str, parts: tuple[int, ...] | None, t: int) -> torch.Tensor:
    """Tensor-parallel rank ``t``'s block of one process's float8 weight [N, K] (a column-parallel fused
    projection holds its rows of each part, back to back)."""
    if split == "cols":
        k = w8.shape[1] // 2
        return w8[:, t * k:(t + 1) * k]
    blocks, at = [], 0
    for n in parts:
        blocks.append(w8[at + t * n // 2:at + (t + 1) * n // 2])
        at += n
    return torch.cat(blocks)


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_zero3")
    ranks = run_distributed(_dp2, 2, args=(tiny_data, str(root)), timeout=600)
    one = run_distributed(_one, 1, args=(tiny_data, str(root)), timeout=600)[0]
    tp = run_distributed(_tp2_dp2, 4, args=(tiny_data, str(root)), timeout=600)
    return {"ranks": ranks, "one": one, "tp": tp}


def test_tp2_dp2_float8_weights_are_one_process_slices(results):
    """tp=2 x dp=2 ZeRO-3: a weight's amax spans dp's shards and tp's blocks, so each rank's forward GEMM
    reads its tensor-parallel block of one process's float8 weight bit for bit, with its scale; 3 losses
    track one process."""
    want = results["one"]["tensorwise"]["weights"]
    for res in results["tp"]:
        t = res["rank"] % 2  # tp is the inner dimension of the mesh (dp x tp)
        for i, ((g8, gs), (w8, ws)) in enumerate(zip(res["weights"], want, strict=True)):
            _, split, parts = TP_LAYERS[i % 4]
            ref = _tp_block(w8.view(torch.float8_e4m3fn), split, parts, t).contiguous().view(torch.uint8)
            assert torch.equal(gs, ws) and torch.equal(g8, ref), (res["rank"], i)
        for g, w in zip(res["losses"], results["one"]["tensorwise"]["losses"][:TP_STEPS], strict=True):
            assert abs(g - w) <= TOLERANCE * abs(w)


@pytest.mark.parametrize("run", ["tensorwise", "rowwise", "delayed", "tensorwise_split", "tensorwise_recompute",
                                 "delayed_accum"])
def test_losses_track_one_process(results, run):
    recipe = run.split("_")[0]
    got, want = results["ranks"][0][run]["losses"], results["one"][recipe]["losses"]
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert abs(g - w) <= TOLERANCE * abs(w), (run, got, want)


@pytest.mark.parametrize("run", ["tensorwise", "rowwise", "delayed", "tensorwise_split", "tensorwise_recompute",
                                 "delayed_accum"])
def test_first_step_float8_weights_are_one_process_casts(results, run):
    """Forward GEMMs' float8 weight and scale = one process's bit for bit on each rank; the dgrad GEMMs
    (not rowwise: it re-casts W along N) read the bytes the forward read."""
    want = results["one"][run.split("_")[0]]["weights"]
    assert len(want) == LINEARS
    for rank, res in enumerate(results["ranks"]):
        got = res[run]["weights"]
        for i, ((g8, gs), (w8, ws)) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g8, w8) and torch.equal(gs, ws), (run, rank, i)
        if not run.startswith("rowwise"):
            for i, (d8, (g8, _)) in enumerate(zip(res[run]["dgrad_weights"], got, strict=True)):
                assert torch.equal(d8, g8), (run, rank, i)


def test_recompute_regathers_the_same_bytes(results):
    """Full recompute's forward inside backward gathers the units again with the forward's scales: its
    GEMMs read the forward's float8 weights and scales, and the losses are the run's without recompute
    bit for bit."""
    for res in results["ranks"]:
        r = res["tensorwise_recompute"]
        assert len(r["recomputed_weights"]) == LINEARS
        for (a8, a), (b8, b) in zip(r["recomputed_weights"], r["weights"], strict=True):
            assert torch.equal(a8, b8) and torch.equal(a, b)
        assert r["losses"] == res["tensorwise"]["losses"]


@pytest.mark.parametrize("run", ["tensorwise", "delayed", "tensorwise_split"])
def test_ledger_is_the_formula(results, run):
    """Per step (one micro-batch a rank), bytes a rank sends, ring (n-1)/n with n = 2: float8 weights
    F elements at 1 byte, the other Psi - F at 2, gathered in forward and again in backward less the
    embedding E (its backward reads no weight); 4 bytes a float8 weight's amax, all-reduced once per forward
    gather (2 (n-1)/n); gradients reduce-scattered in bf16 (2 Psi). No padding: every bucket is even."""
    one = results["one"]
    psi, f8, emb, w = one["psi"], one["float8"], one["embedding"], one["float8_layers"]
    ring = 1 / 2
    gathered = 2 * (f8 * 1 + (psi - f8) * 2) - emb * 2
    for by_kind in results["ranks"][0][run]["comm_by_kind"]:
        assert by_kind["dp.all_gather"] == round(gathered * ring), by_kind
        assert by_kind["dp.fp8.all_reduce"] == round(2 * ring * 4 * w), by_kind
        assert by_kind["dp.reduce_scatter"] == round(psi * 2 * ring), by_kind
    rowwise = results["ranks"][0]["rowwise"]["comm_by_kind"][0]  # bf16 gathers, no amax all-reduce
    assert rowwise["dp.all_gather"] == round((4 * psi - 2 * emb) * ring) and "dp.fp8.all_reduce" not in rowwise


def test_float8_units_hold_one_byte_an_element(results):
    """Every float8 gather: the unit's buffer holds 1 byte per element, its bf16 buffer nothing."""
    for run in ("tensorwise", "delayed", "tensorwise_split", "tensorwise_recompute"):
        units = results["ranks"][0][run]["units"]
        assert units, run
        for fp8_bytes, bf16_bytes, numel, _ in units:
            assert (fp8_bytes, bf16_bytes) == (numel, 0), (run, fp8_bytes, bf16_bytes, numel)
        assert units[0][3] == (4 if run != "tensorwise_split" else LINEARS)  # layers, or a unit per projection


def test_checkpoint_resumes_exactly(results):
    r = results["ranks"][0]
    assert r["delayed_stop"]["losses"] == r["delayed"]["losses"][:5]
    assert r["delayed_resume"]["steps"] == list(range(6, STEPS + 1))
    assert r["delayed_resume"]["losses"] == r["delayed"]["losses"][5:]
