"""ZeRO stages 0, 1, 2, 3 on gloo ranks against a single-process torch.optim.AdamW (the oracle), fp32.

The oracle is written here from torch parts only: the same initial weights (mpformer's Transformer
with the run's seed), the same global batches, torch.optim.AdamW with the same hyper-parameters
and weight-decay groups, torch.nn.utils.clip_grad_norm_, the same LR schedule. Tolerance over 10
steps with clipping active: 1e-6 relative on losses, 5e-6 on pre-clipping gradient norms; the only
differences allowed are the order of floating-point sums (dp reductions, per-micro-batch reductions,
sharded norms) and AdamW's fused vs. foreach kernels. (AdamW's scale-free step turns rounding-level
gradient differences into weight differences that grow step by step, and the norm, a sum of squares
over every element, shows them first: measured up to 8e-7 at zero=0 and 1.2e-6 with ZeRO-2's
per-micro-batch reductions by step 10, 2.7e-7 with another draw of the same initial distribution. A
missed or doubled reduction, a wrong divisor or a misplaced shard moves the norm by 1e-3 or more.)

ZeRO-3 runs twice over: with this model's layers as whole units (the default: a layer under
train.zero3_unit_numel) and split into a unit per part (``SPLIT``: the attention's norm and qkv, its
output projection, the MLP's norm and up, its down projection; no prefetch budget for the layout with
tp and full recompute, a reduction budget of nothing: every unit's buffer waits for the one before).

Also: bytes moved per step by the dp collectives (2 Psi ring-adjusted for stages 0-2, 3 Psi less the
embedding's backward gather for 3, and again all but a recomputed split layer's last unit under full
recompute; bf16 ZeRO-3 reduce-scatters in bf16), ZeRO-3 gathering at most the units of two regions
at any time (the one in use and the next in use order; the embedding and the head freed like every
layer), model-state bytes per rank against docs/formulas.md's ZeRO table (fp32 and bf16), tp=2 x dp=2
with zero=2 and zero=3 (+ full recompute), pp=2 x dp=2 with zero=1, checkpoints resumed across dp
sizes and stages (bf16 zero=1 and zero=3 bit-identically), bf16 weights with fp32 masters against the
fp32 oracle, fp16 dynamic loss scaling, a ZeRO-3 checkpoint of whole-layer units resumed into split
units, and the initial weights of ZeRO-3 (dp=2, tp=2 x dp=2, bf16
masters) and pp=2 x dp=2 bit for bit the oracle's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpformer.parallel.spawn import run_distributed
from mpformer.testing.train import assemble, initial_weights, overrides, train

RTOL = 1e-6
NORM_RTOL = 5e-6  # see the module docstring
STEPS = 10
BASE = {"model": "tiny-llama", "train.seq_length": 32, "train.steps": STEPS, "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 2,
        "optim.clip_grad": 0.3, "logging.progress": False}
EVAL = {"eval.interval": 5, "eval.micro_batch_size": 1}  # eval.tokens (6 rows: uneven over 4 ranks) added below
SGD = {"optim.name": "sgd", "optim.momentum": 0.9, "optim.lr": 0.05}
SPLIT = {"train.zero3_unit_numel": 0, "train.zero3_reduce_numel": 0}  # a ZeRO-3 unit per part of a layer
RUNS = {  # name: (world, overrides)
    "z0": (4, {"parallel.zero": 0}),
    "z1": (4, {"parallel.zero": 1}),
    "z2": (4, {"parallel.zero": 2}),
    "z2_tp2": (4, {"parallel.zero": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}),
    "z1_pp2": (4, {"parallel.zero": 1, "parallel.pp": 2, "train.micro_batch_size": 1}),
    "z3": (4, {"parallel.zero": 3}),
    "z3_tp2_recompute": (4, {"parallel.zero": 3, "parallel.tp": 2, "parallel.recompute": "full"}),
    "z3_split": (4, {"parallel.zero": 3, **SPLIT}),
    "z3_split_recompute": (4, {"parallel.zero": 3, "parallel.recompute": "full", **SPLIT}),
    "z3_split_tp2_sp_recompute": (4, {"parallel.zero": 3, "parallel.tp": 2, "parallel.sequence_parallel": True,
                                      "parallel.recompute": "full", "train.zero3_prefetch_numel": 0, **SPLIT}),
    "z3_split_accum_eval": (4, {"parallel.zero": 3, "train.micro_batch_size": 1, **SPLIT, **EVAL}),
    "bf16_z3_split": (4, {"parallel.zero": 3, "train.precision": "bf16", **SPLIT}),
    "gpt2_z3_split": (4, {"model": "tiny-gpt2", "parallel.zero": 3, "parallel.recompute": "selective", **SPLIT}),
    "z2_stop": (4, {"parallel.zero": 2, "train.stop_at": 5}),
    "z3_stop": (4, {"parallel.zero": 3, "train.stop_at": 5}),
    "bf16_z1": (4, {"parallel.zero": 1, "train.precision": "bf16"}),
    "bf16_z3": (4, {"parallel.zero": 3, "train.precision": "bf16"}),
    "bf16_z1_stop": (4, {"parallel.zero": 1, "train.precision": "bf16", "train.stop_at": 5}),
    "bf16_z3_stop": (4, {"parallel.zero": 3, "train.precision": "bf16", "train.stop_at": 5}),
    "fp16_z2": (4, {"parallel.zero": 2, "train.precision": "fp16", "train.initial_loss_scale": 2.0**22}),
    "z1_accum": (4, {"parallel.zero": 1, "train.micro_batch_size": 1, **EVAL}),
    "z2_accum": (4, {"parallel.zero": 2, "train.micro_batch_size": 1}),
    "z3_accum_eval": (4, {"parallel.zero": 3, "train.micro_batch_size": 1, **EVAL}),
    "bf16_pp2_eval": (4, {"parallel.zero": 1, "parallel.pp": 2, "train.precision": "bf16", **EVAL}),
    "gpt2_z0": (4, {"model": "tiny-gpt2", "parallel.zero": 0}),
    "gpt2_pp2_z1_zb": (4, {"model": "tiny-gpt2", "parallel.zero": 1, "parallel.pp": 2, "parallel.schedule": "zb-h1",
                           "train.micro_batch_size": 1}),
    "sgd_z0": (4, {"parallel.zero": 0, **SGD}),
    "sgd_z1": (4, {"parallel.zero": 1, **SGD}),
    "sgd_z1_stop": (4, {"parallel.zero": 1, "train.stop_at": 5, **SGD}),
    "sgd_z1_resume": (4, {"parallel.zero": 1, **SGD}),
    "z1_dp2_resume": (2, {"parallel.zero": 1, "train.micro_batch_size": 4}),
    "z0_dp1_resume": (1, {"parallel.zero": 0, "train.micro_batch_size": 8}),
    "z0_dp1_resume_z3": (1, {"parallel.zero": 0, "train.micro_batch_size": 8}),
    "z3_split_dp2_resume": (2, {"parallel.zero": 3, "train.micro_batch_size": 4, **SPLIT}),
    "bf16_z1_resume": (4, {"parallel.zero": 1, "train.precision": "bf16"}),
    "bf16_z3_resume": (4, {"parallel.zero": 3, "train.precision": "bf16"}),
    "z0_reduce_bf16": (4, {"parallel.zero": 0, "parallel.grad_reduce_dtype": "bf16"}),
    "z2_reduce_bf16": (4, {"parallel.zero": 2, "parallel.grad_reduce_dtype": "bf16"}),
}
# The weights each layout starts from, as its trainer built them (meta device, the engine drawing only
# what each rank keeps), assembled from every rank: bit for bit the single-device model's.
INIT = {"init_z3_dp2": (2, {"parallel.zero": 3, "train.micro_batch_size": 4}),
        "init_z3_tp2_dp2": (4, {"parallel.zero": 3, "parallel.tp": 2}),
        "init_bf16_z3": (4, {"parallel.zero": 3, "train.precision": "bf16"}),
        "init_z1_pp2_dp2": (4, {"parallel.zero": 1, "parallel.pp": 2, "train.micro_batch_size": 1})}
RESUME_FROM = {"z1_dp2_resume": "z2_stop", "z0_dp1_resume": "z2_stop", "z0_dp1_resume_z3": "z3_stop",
               "z3_split_dp2_resume": "z3_stop",
               "bf16_z1_resume": "bf16_z1_stop", "bf16_z3_resume": "bf16_z3_stop", "sgd_z1_resume": "sgd_z1_stop"}


def _watch_gathers() -> list[tuple[frozenset[int], tuple[tuple[int, ...], ...]]]:
    """After every ZeRO-3 gather: the units gathered or arriving, and the regions that read them."""
    from mpformer.optim.gather import UnitGather

    seen, gather = [], UnitGather.gather

    def watched(self, k: int, async_op: bool = False) -> None:
        gather(self, k, async_op)
        live = frozenset(i for i in range(len(self.units)) if self.gathered[i] or self.gathering[i] is not None)
        seen.append((live, tuple(r.units for r in self.regions)))

    UnitGather.gather = watched
    return seen


def _within_two_regions(seen: list) -> bool:
    """Every gather left only the units of two regions (in use and the next in use order) gathered."""
    return bool(seen) and all(any(live <= set(a) | set(b) for a in regions for b in regions) for live, regions in seen)


def _worker(world: int, data: str, root: str) -> dict:
    out = {}
    seen = _watch_gathers()
    for name, (w, kw) in RUNS.items():
        if w != world:
            continue
        if name in RESUME_FROM:
            kw = {**kw, "checkpoint.load": str(Path(root) / RESUME_FROM[name] / "checkpoints")}
        if "eval.interval" in kw:
            kw = {**kw, "eval.tokens": str(Path(root) / "eval.npy")}
        seen.clear()
        out[name] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw))
        out[name]["gathers_within_two_regions"] = _within_two_regions(seen)
    for name, (w, kw) in INIT.items():
        if w == world:
            out[name] = initial_weights(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / name, **kw))
    return out


def _oracle(data: str) -> dict:
    """10 steps of single-process training with torch's AdamW and clip_grad_norm_."""
    from mpformer.cli.compose import compose_config
    from mpformer.data.sampler import build_train_dataset, get_batch
    from mpformer.models.transformer import Transformer
    from mpformer.optim.builder import param_groups
    from mpformer.optim.lr import LRSchedule

    cfg = compose_config(overrides({**BASE, "data.paths": f"[{data}]"}, Path("unused"))).cfg
    t, o = cfg.train, cfg.optim
    model = Transformer(cfg.model, seed=t.seed)
    initial = {k: v.detach().clone() for k, v in model.canonical_tensors().items()}
    dataset = build_train_dataset([data], None, t.seq_length, t.seed)
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay)
    sched = LRSchedule(lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, decay_steps=t.steps, decay=o.decay)
    losses, norms = [], []
    for step in range(STEPS):
        batch = get_batch(dataset, list(range(step * t.global_batch_size, (step + 1) * t.global_batch_size)))
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)))
        sched.apply(opt, step)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "initial": initial,
            "psi": sum(p.numel() for p in model.parameters()), "embedding": model.embed.weight.numel(),
            "layers": len(model.layers), "layer": sum(p.numel() for p in model.layers[0].parameters()),
            "mlp": sum(p.numel() for m in (model.layers[0].mlp_norm, model.layers[0].mlp) for p in m.parameters())}


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    import numpy as np

    root = tmp_path_factory.mktemp("zero")
    np.save(root / "eval.npy", np.random.default_rng(0).integers(1, 256, size=(6, 33)).astype(np.int64))
    res = {"root": root, "oracle": _oracle(tiny_data)}
    for world in (4, 2, 1):
        ranks = run_distributed(_worker, world, args=(world, tiny_data, str(root)), timeout=400)
        res.update(ranks[0])
        res.update({n: assemble([r[n] for r in ranks]) for n, (w, _) in INIT.items() if w == world})
    return res


def _close(got, want, rtol: float = RTOL):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=0)


@pytest.mark.parametrize("run", ["z0", "z1", "z2", "z3", "z2_tp2", "z3_tp2_recompute", "z1_pp2", "z1_accum",
                                 "z2_accum", "z3_accum_eval", "z3_split", "z3_split_recompute",
                                 "z3_split_tp2_sp_recompute", "z3_split_accum_eval"])
def test_matches_single_process_adamw(results, run):
    got, want = results[run], results["oracle"]
    assert max(want["grad_norms"]) > BASE["optim.clip_grad"], "clipping must be active"
    _close(got["losses"], want["losses"])
    _close(got["grad_norms"], want["grad_norms"], NORM_RTOL)
    clip = BASE["optim.clip_grad"]
    _close(got["grad_norms_clipped"], [min(n, clip) if n < clip else n * clip / (n + 1e-6)
                                       for n in want["grad_norms"]], NORM_RTOL)


@pytest.mark.parametrize("run", sorted(INIT))
def test_every_layout_starts_from_the_single_device_weights(results, run):
    """ZeRO-3 at dp=2 and tp=2 x dp=2 (each rank drew only its shard), bf16 ZeRO-3's fp32 masters, and
    pp=2 x dp=2: every canonical tensor, gathered from the ranks, equals the oracle's initial one exactly."""
    got, want = results[run], results["oracle"]["initial"]
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), (run, name)


def test_resume_across_dp_sizes_and_stages(results):
    """zero=2 dp=4 stopped at step 5, resumed at zero=1 dp=2 and zero=0 dp=1, and zero=3 dp=4 (whole-layer
    units) resumed at zero=0 dp=1 and at zero=3 dp=2 with a unit per part: steps 6-10 as uninterrupted;
    bf16 zero=1 and zero=3 resumed bit-identically (fp32 masters: at zero=3 the only copy of the weights a
    rank keeps)."""
    want = results["oracle"]["losses"]
    assert results["z2_stop"]["losses"] == results["z2"]["losses"][:5]
    for run in ("z1_dp2_resume", "z0_dp1_resume", "z0_dp1_resume_z3", "z3_split_dp2_resume"):
        _close(results[run]["losses"], want[5:])
    for run in ("bf16_z1", "bf16_z3"):
        assert results[f"{run}_stop"]["losses"] + results[f"{run}_resume"]["losses"] == results[run]["losses"]


@pytest.mark.parametrize("run", ["bf16_z1", "bf16_z3", "bf16_z3_split"])
def test_bf16_weights_with_fp32_masters_track_fp32(results, run):
    """bf16 parameters and activations, fp32 main gradients and masters: within 2e-3 relative of the
    fp32 oracle over 10 steps (measured: about 1e-4; bf16's unit roundoff is 3.9e-3)."""
    torch.testing.assert_close(torch.tensor(results[run]["losses"]), torch.tensor(results["oracle"]["losses"]),
                               rtol=2e-3, atol=0)


def test_fp16_dynamic_loss_scaling_skips_and_backs_off(tiny_data, results):
    """fp16 starting at 2^22: the first steps overflow in backward and are skipped (no update, the
    scale halves each time, both in metrics.jsonl), then training proceeds with a finite loss."""
    rows = [json.loads(x) for x in (results["root"] / "fp16_z2" / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in rows]
    skipped = [r["skipped_steps"] for r in rows]
    assert skipped[0] == 1 and skipped[-1] < len(rows), skipped
    was_skipped = [s > prev for prev, s in zip([0, *skipped], skipped)]
    for a, b, skip in zip(scales, scales[1:], was_skipped):
        assert b == (a / 2 if skip else a)  # halved after a skipped step, kept otherwise (window 1000)
    for r, skip in zip(rows, was_skipped):
        assert (r["grad_norm"] != r["grad_norm"]) == skip  # nan exactly on skipped steps: no norm, no step
    assert rows[-1]["loss"] == pytest.approx(results["oracle"]["losses"][-1], rel=0.05)
    assert rows[0]["loss"] == pytest.approx(results["oracle"]["losses"][0], rel=1e-3)  # same weights, fp16


@pytest.mark.parametrize("zero", [0, 1, 2, 3, "3_split"])
def test_dp_traffic_is_two_psi_or_three(results, zero):
    """Per step (one micro-batch per rank here): all-reduce (stage 0) or reduce-scatter + all-gather
    (1, 2) of Psi fp32 elements, 2 Psi ring-adjusted by (n-1)/n; stage 3 gathers in forward and again
    in backward, except the embedding, whose backward reads no weights (optim/gather.py): 3 Psi - E.
    Buckets are padded to a multiple of dp (< dp elements each: within 1e-4)."""
    psi, n, embed = results["oracle"]["psi"], 4, results["oracle"]["embedding"]
    gathered = 2 * psi - embed if str(zero).startswith("3") else psi  # elements all-gathered per step
    want = (psi + gathered if zero else 2 * psi) * (n - 1) / n * 4
    for by_kind in results[f"z{zero}"]["comm_by_kind"]:
        dp = {k: v for k, v in by_kind.items() if k.startswith("dp.")}
        assert by_kind["check.all_reduce"] == 2 * (n - 1) / n * 12  # the step check: norm, loss, SIGTERM: 3 fp32
        assert set(dp) == ({"dp.all_reduce"} if zero == 0 else {"dp.reduce_scatter", "dp.all_gather"})
        assert sum(dp.values()) == pytest.approx(want, rel=1e-4)
        if zero:
            assert dp["dp.all_gather"] == pytest.approx(gathered / psi * dp["dp.reduce_scatter"], rel=1e-4)


@pytest.mark.parametrize("run", ["z3", "bf16_z3", "z3_tp2_recompute", "z3_accum_eval", "z3_split",
                                 "z3_split_recompute", "z3_split_tp2_sp_recompute", "z3_split_accum_eval",
                                 "gpt2_z3_split"])
def test_zero3_gathers_at_most_two_regions(results, run):
    """ZeRO-3 (optim/gather.py): after every gather only the units of the region in use and of the next
    in use order are gathered: the embedding and the head are freed like every layer (also under full
    recompute, whose forward inside a layer's backward gathers the layer's units one by one, with
    gradient accumulation and with validation between steps)."""
    assert results[run]["gathers_within_two_regions"]


def test_split_units_match_whole_layers(results):
    """A unit per part (each reduced and gathered on its own, weight gradients formed in the unit's buffer,
    every buffer waiting for the one before) against whole-layer units: the same sums in another order
    (within the oracle's tolerance); bf16 within bf16's; GPT-2's tied head with selective recompute as
    replicated ZeRO-0 (1e-5, as the pipeline's tied copy)."""
    _close(results["z3_split"]["losses"], results["z3"]["losses"])
    _close(results["bf16_z3_split"]["losses"], results["bf16_z3"]["losses"], 2e-3)
    torch.testing.assert_close(torch.tensor(results["gpt2_z3_split"]["losses"]),
                               torch.tensor(results["gpt2_z0"]["losses"]), rtol=1e-5, atol=0)


def test_full_recompute_regathers_a_split_layer_but_its_last_two_units(results):
    """Per micro-batch a split layer under full recompute is gathered in forward, in its recomputed
    forward and in its backward, except its last unit (the down projection), which stays from the
    recompute to its backward, and the one before it (the MLP's norm and up projection), kept from its
    recomputed forward as the next in use order (it fits the prefetch budget): 2 Psi - E + L (layer -
    MLP) elements all-gathered; Psi reduce-scattered."""
    o = results["oracle"]
    psi, n, embed = o["psi"], 4, o["embedding"]
    gathered = 2 * psi - embed + o["layers"] * (o["layer"] - o["mlp"])
    for by_kind in results["z3_split_recompute"]["comm_by_kind"]:
        assert by_kind["dp.all_gather"] == pytest.approx(gathered * (n - 1) / n * 4, rel=1e-4)
        assert by_kind["dp.reduce_scatter"] == pytest.approx(psi * (n - 1) / n * 4, rel=1e-4)


def test_zero3_reduces_16bit_gradients_in_their_dtype(results):
    """bf16 parameters at stage 3: each unit's gradients are reduce-scattered in bf16 (half of fp32's
    bytes, as FSDP and DeepSpeed do), and so are the gathers; accumulation stays in the fp32 shards
    (the bf16 run tracks the fp32 oracle: test_bf16_weights_with_fp32_masters_track_fp32)."""
    for fp32, bf16 in zip(results["z3"]["comm_by_kind"], results["bf16_z3"]["comm_by_kind"]):
        for kind in ("dp.reduce_scatter", "dp.all_gather"):
            assert bf16[kind] == pytest.approx(fp32[kind] / 2, rel=1e-6), kind


@pytest.mark.parametrize("zero", [0, 2])
def test_gradients_reduced_in_bf16_halve_the_traffic_and_track_fp32(results, zero):
    """parallel.grad_reduce_dtype=bf16 (Megatron's --grad-reduce-in-bf16): the gradient collective
    moves half fp32's bytes (stage 2's parameter all-gather is unchanged) and accumulation stays fp32.
    Each reduced gradient element is off by about bf16's unit roundoff (3.9e-3) relative, which AdamW's
    elementwise normalisation passes on as a 3.9e-3 relative change of each step, far below a loss
    change of 2e-3 relative over 10 steps (the bound the bf16-parameter runs use above)."""
    ref, got = results[f"z{zero}"], results[f"z{zero}_reduce_bf16"]
    kind = "dp.all_reduce" if zero == 0 else "dp.reduce_scatter"
    for a, b in zip(ref["comm_by_kind"], got["comm_by_kind"]):
        assert b[kind] == pytest.approx(a[kind] / 2, rel=1e-6)
        assert b.get("dp.all_gather", 0) == a.get("dp.all_gather", 0)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(results["oracle"]["losses"]),
                               rtol=2e-3, atol=0)
    assert got["losses"] != ref["losses"], "the bf16 reduction must actually round"


@pytest.mark.parametrize("run", ["z0", "z1", "z2", "z3", "bf16_z1", "bf16_z3"])
def test_model_state_bytes_match_the_zero_table(results, run):
    """fp32 weights are their own masters: w = g = 4, m = 0, k = 8 (Adam's m and v); bf16: w = 2,
    fp32 main gradients g = 4, fp32 masters m = 4 (Megatron's 6 + 12/N_d at stage 1); bf16 at stage 3
    keeps no 16-bit shard (w = 0: its gathers cast the masters, optim/gather.py), 16 Psi / N_d as FSDP.
    Within 1%, not counting the per-tensor step counters; bucket padding is < dp elements per bucket."""
    from mpformer.optim.memory import zero_formula_bytes

    psi = results["oracle"]["psi"]
    report = json.loads((results["root"] / run / "memory.json").read_text())
    zero, bf16 = report["zero"], run.startswith("bf16")
    w = (0 if zero == 3 else 2) if bf16 else 4
    want = zero_formula_bytes(zero, psi, 4, w=w, g=4, m=4 if bf16 else 0, k=8)
    assert len(report["per_rank"]) == 4
    for mem in report["per_rank"]:
        assert abs(mem["total"] - mem["optimizer_scalars"] - want) <= 0.01 * want, (mem, want)
        assert (mem["master_weights"] > 0) == bf16


def test_validation_runs_under_every_stage_and_pipeline(results):
    """6 eval rows over 4 dp ranks (uneven): ZeRO-3 gathers in every forward, so ranks must run the same
    number of passes; bf16 pipeline validation sends 16-bit activations."""
    want = results["z1_accum"]["val_losses"]
    assert len(want) == 2
    _close(results["z3_accum_eval"]["val_losses"], want)
    _close(results["z3_split_accum_eval"]["val_losses"], want)
    assert len(results["bf16_pp2_eval"]["val_losses"]) == 2


def test_tied_embeddings_pipeline_zero1_zero_bubble(results):
    """GPT-2 (tied) at pp=2 x dp=2, ZeRO-1, ZB-H1: deferred weight gradients reach the ZeRO buffers,
    and the two copies of the embedding save without overlapping chunks; as dp=4 at zero=0."""
    torch.testing.assert_close(torch.tensor(results["gpt2_pp2_z1_zb"]["losses"]),
                               torch.tensor(results["gpt2_z0"]["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(results["gpt2_pp2_z1_zb"]["grad_norms"]),
                               torch.tensor(results["gpt2_z0"]["grad_norms"]), rtol=1e-5, atol=0)


def test_sgd_with_momentum_shards_and_resumes(results):
    _close(results["sgd_z1"]["losses"], results["sgd_z0"]["losses"])
    assert results["sgd_z1_stop"]["losses"] + results["sgd_z1_resume"]["losses"] == results["sgd_z1"]["losses"]
