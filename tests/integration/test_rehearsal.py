"""The CUDA path, rehearsed (rehearsal/): every attention kind at 8k tokens in bf16, fp16 and fp32 runs
fused kernels only, forms no [s, s] tensor and reads the host only at the step's reporting boundary;
the seeded defects are caught; the CLI's bad input fails in one line.

A rehearsal runs pretraining's own build and steps on meta tensors as a GPU would run them (the
target named CUDA, a fake process group of the full world), so these are the GPU's code paths, run
here. Oracles: torch's fused-op names (what a GPU's profiler lists), the shapes of the tensors each op
returns, and the ops that need a device value on the host (parallel/host_syncs.py).
"""

from __future__ import annotations

import pytest

from mpformer.testing.cli import run_cli
from mpformer.testing.rehearsal import rehearse_many

pytestmark = pytest.mark.slow

SEQ = 8192
MODEL = ["model=tiny-mistral", "model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=512", "model.vocab_size=512",
         f"model.max_position_embeddings={SEQ}", "model.sliding_window=null", f"train.seq_length={SEQ}",
         "train.global_batch_size=2", "train.micro_batch_size=1"]
KINDS = {  # attention kind -> (overrides, world size, ranks)
    "causal": ([], 1, [0]),
    "documents": (["data.document_mask=true", "data.eos_token_id=0"], 1, [0]),
    "window": (["model.sliding_window=3000"], 1, [0]),
    "dropout": (["model.attention_dropout=0.1"], 1, [0]),
    "window+dropout+documents": (["model.sliding_window=3000", "model.attention_dropout=0.1",
                                  "data.document_mask=true", "data.eos_token_id=0"], 1, [0]),
    "token slices": (["parallel.pp=2", "parallel.pp_token_slices=2", "parallel.schedule=1f1b"], 2, [0, 1]),
    "token slices+dropout": (["parallel.pp=2", "parallel.pp_token_slices=2", "model.attention_dropout=0.1"], 2, [1]),
    "cp ring": (["parallel.cp=2", "parallel.cp_kind=ring"], 2, [1]),
    "cp all-gather": (["parallel.cp=2", "parallel.cp_kind=allgather", "model.sliding_window=3000"], 2, [1]),
    "cp ulysses": (["parallel.cp=2", "parallel.cp_kind=ulysses"], 2, [0]),
    "cp hybrid": (["parallel.cp=4", "parallel.cp_kind=hybrid", "parallel.cp_ulysses=2", "data.document_mask=true",
                   "data.eos_token_id=0"], 4, [3]),
}
PRECISIONS = ("bf16", "fp16", "fp32")


@pytest.fixture(scope="module")
def kinds() -> dict[tuple[str, str], list[dict]]:
    cases, keys = [], []
    for precision in PRECISIONS:
        for name, (extra, world, ranks) in KINDS.items():
            for rank in ranks:
                cases.append(([*MODEL, f"train.precision={precision}", f"parallel.dp={world // _non_dp(extra)}",
                               *extra], world, rank, None))
                keys.append((precision, name))
    out: dict[tuple[str, str], list[dict]] = {}
    for key, report in zip(keys, rehearse_many(cases)):
        out.setdefault(key, []).append(report)
    return out


def _non_dp(extra: list[str]) -> int:
    n = 1
    for o in extra:
        key, value = o.split("=")
        if key in ("parallel.pp", "parallel.cp", "parallel.tp"):
            n *= int(value)
    return n


def _priced(kind: str, precision: str) -> str:
    """The kernel the cost model prices for this case (autoconfig/kernels.py: the runtime's own choice)."""
    from mpformer.autoconfig.kernels import attention_kernel
    from mpformer.cli.compose import compose_config
    from mpformer.training.preflight import preflight_rehearsal

    extra, world, _ = KINDS[kind]
    args = [*MODEL, f"train.precision={precision}", f"parallel.dp={world // _non_dp(extra)}", *extra]
    spec = preflight_rehearsal(compose_config(args), world)
    return attention_kernel(spec.cfg.model, spec.layout, SEQ, "mpformer", True, False, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_attention_kind_runs_fused_kernels_without_squares_or_syncs(kinds, kind, precision):
    fused = {"bf16": "flash", "fp16": "flash", "fp32": "efficient"}[precision]
    for r in kinds[precision, kind]:
        used = set(r["attention_kernels"])
        assert used and used <= {"flash", "efficient"}, (kind, precision, r["attention_kernels"])
        if "window" not in kind:  # a window's edges are masked tiles: the efficient kernel
            assert fused in used, (kind, precision, r["attention_kernels"])
        assert _priced(kind, precision) in used, (kind, precision, r["attention_kernels"])  # the cost model's
        assert not r["square_tensors"], r["square_tensors"][:3]
        inside = [s for s in r["host_syncs"] if not s.get("boundary")]
        assert not inside, inside
        # the step check's one read; fp16 also reads its overflow flag
        assert len(r["host_syncs"]) == r["steps"] * (2 if precision == "fp16" else 1), r["host_syncs"]
        assert r["peak_bytes"] > 0 and r["flops"] > 0


def test_seeded_defects_are_caught():
    """The three mistakes the rehearsal exists for, each planted in a run that is otherwise clean."""
    base = [*MODEL, "parallel.dp=1"]
    gqa, item, mask = rehearse_many([([*base, "train.precision=fp32"], 1, 0, "sdpa_gqa_fp32"),
                                     ([*base, "train.precision=bf16"], 1, 0, "item_in_forward"),
                                     ([*base, "train.precision=bf16"], 1, 0, "dense_mask")])
    assert gqa["attention_kernels"].get("math", 0) > 0, gqa["attention_kernels"]
    assert any(s["shape"][-2:] == [SEQ, SEQ] for s in gqa["square_tensors"]), gqa["square_tensors"][:2]
    inside = [s for s in item["host_syncs"] if not s.get("boundary")]
    # one in each layer's forward (two layers, two micro-batches), each naming the planted line
    assert len(inside) == 2 * 2 and all("mpformer/testing/rehearsal.py" in s["line"] for s in inside), inside
    assert any(s["shape"] == [SEQ, SEQ] for s in mask["square_tensors"]), mask["square_tensors"]


@pytest.mark.parametrize("args, expected", [
    (["rehearse.device=h100-40gb"], "rehearse.device='h100-40gb' is unknown; valid: a100-40gb, a100-80gb, "
                                    "h100-80gb, h100-96gb, h200-141gb"),
    (["parallel.dp=2", "rehearse.ranks=[0,2]"], "rehearse.ranks has 2, outside the world of 2 ranks; valid: 0..1"),
    (["parallel.dp=1", "parallel.tp=3"], "parallel.tp=3"),
    (["parallel.tp=2"], "a rehearsal needs its world size: give parallel.dp=N"),
])
def test_bad_input_fails_in_one_line(args, expected):
    r = run_cli(["tools/rehearse.py", "model=tiny-llama", *args], timeout=60)
    assert r.returncode != 0
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and expected in lines[0], r.stderr


def test_a_stage_holds_no_more_with_more_micro_batches():
    """1F1B's last stage keeps one micro-batch in flight whatever the step's count: its peak is the same
    at 2 and 16 micro-batches, within one [s, b, h] tensor. (Every sent input gradient kept to the step's
    end once grew it by one such tensor a micro-batch: 512 of them on a 1T model's stage.)"""
    base = [*MODEL, "train.precision=bf16", "parallel.pp=2", "parallel.dp=1", "train.seq_length=4096"]
    few, many = rehearse_many([([*base, "train.global_batch_size=2"], 2, 1, None),
                               ([*base, "train.global_batch_size=16"], 2, 1, None)])
    one = 4096 * 256 * 2  # an [s, b, h] bf16 tensor: the 14 more micro-batches would add 14 of them
    assert abs(many["peak_bytes"] - few["peak_bytes"]) < one, (few["peak_by_kind"], many["peak_by_kind"])


def test_offloaded_activations_leave_the_rehearsed_device():
    """Activation offload on the CUDA path: rank 0 of a 1F1B pp=2 pipeline holds two micro-batches'
    activations without it and about one layer's with it. (The offload told tensors apart by their
    address, which is 0 for every meta tensor: each looked like a parameter's and stayed on the device,
    and a rehearsed Llama 3 8B zb-h2 rank showed 139 GB where it holds 92.)"""
    base = [*MODEL, "model.num_layers=4", "train.precision=bf16", "parallel.pp=2", "parallel.dp=1",
            "train.seq_length=4096", "train.global_batch_size=8", "parallel.schedule=1f1b"]
    kept, moved = rehearse_many([([*base, "parallel.offload=none"], 2, 0, None),
                                 ([*base, "parallel.offload=all"], 2, 0, None)])
    assert kept["peak_by_kind"]["activations"] > 0.5 * kept["peak_bytes"], kept["peak_by_kind"]
    assert moved["peak_bytes"] < 0.7 * kept["peak_bytes"], (kept["peak_by_kind"], moved["peak_by_kind"])


@pytest.mark.parametrize("extra", [
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1",
     "parallel.recompute=full"],
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.vpp=2",
     "parallel.schedule=interleaved", "parallel.dp=2", "parallel.zero=0", "parallel.recompute=selective",
     "model.num_layers=4", "train.global_batch_size=8"],
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.dp=1", "parallel.cp=2",
     "parallel.zero=1", "parallel.recompute=full", "parallel.recompute_layers=1", "model.num_layers=4"],
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=2", "parallel.cp=2", "parallel.zero=3",
     "parallel.recompute=selective", "model.tie_embeddings=true", "model.num_layers=2",
     "train.global_batch_size=4"],
    # fp8: sequence parallelism's float8 gathers (rowwise: with the rows' scales, bf16 in backward) and
    # ZeRO-3's float8 weight gathers with their amaxes
    ["train.precision=fp8", "train.fp8.recipe=rowwise", "parallel.tp=2", "parallel.sequence_parallel=true",
     "parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.recompute=full"],
    ["train.precision=fp8", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=4", "parallel.zero=3",
     "parallel.recompute=selective", "model.num_layers=2", "train.global_batch_size=8"],
], ids=["tp-sp pp dp zero1 full", "tp-sp interleaved dp zero0", "tp-sp pp cp zero1 full-1", "tp-sp cp dp zero3 tied",
        "fp8 rowwise tp-sp pp dp zero1 full", "fp8 tp-sp dp zero3"])
def test_every_collective_moves_what_its_formula_says(extra):
    """The ledger's bytes per collective on the first and the last stage equal rehearsal/volumes.py's
    formulas from the model's shape and the layout (exact: integers in float64)."""
    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.report import with_formulas
    from mpformer.training.preflight import preflight_rehearsal

    precision = [] if any(a.startswith("train.precision=") for a in extra) else ["train.precision=bf16"]
    args = [*MODEL, *precision, "train.seq_length=4096", *extra]
    spec = preflight_rehearsal(compose_config(args), 8)
    L = spec.layout
    first, last = L.topology.rank(pp=0, dp=0, cp=0, tp=0), L.topology.rank(pp=L.pp - 1, dp=L.dp - 1, cp=L.cp - 1,
                                                                          tp=L.tp - 1)
    for rep in rehearse_many([(args, 8, first, None), (args, 8, last, None)]):
        with_formulas(spec.cfg, spec.layout, rep)
        f = rep["comm_formula_bytes"]
        moved = {k for k, v in rep["comm_bytes"].items() if v and k != "check.all_reduce"}
        assert {k for k, v in f.items() if v} <= moved <= {k for k in f if k != "cp"} | {k for k in moved if
                                                                                    k.startswith("cp.")}
        assert rep["comm_formula_error"] == pytest.approx(0, abs=1e-12), (rep["comm_bytes"], f)


GPT3_BLOCK = ["model=gpt2", "model.activation=gelu_tanh", "model.attention_bias=true", "model.mlp_bias=true",
              "model.hidden_size=1024", "model.num_attention_heads=16", "model.ffn_hidden_size=4096",
              "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "model.max_position_embeddings=2048",
              "train.seq_length=2048", "train.precision=bf16", "parallel.tp=8", "parallel.dp=1",
              "train.global_batch_size=1", "train.micro_batch_size=1"]


@pytest.mark.parametrize(("extra", "per_sbh", "stats"), [
    (["parallel.sequence_parallel=true", "parallel.recompute=selective"], 34 / 8, 2 * 8 / 8),
    (["parallel.sequence_parallel=false", "parallel.recompute=selective"], 10 + 24 / 8, 2 * 8),
    (["parallel.sequence_parallel=true", "parallel.recompute=full"], 2 / 8, 0),
], ids=["sp selective: 34/t", "selective: 10+24/t", "sp full: 2/t"])
def test_a_gpt_layer_keeps_what_korthikanti_counts(extra, per_sbh, stats):
    """Korthikanti et al.'s Table 2 (GPT block: LayerNorm, GeLU, dropout 0.1, bf16, t = 8) against what one
    rehearsed layer keeps for backward: the activations at the peak of 4 layers less those of 2, halved.
    Equal to the byte, less the LayerNorms' fp32 mean and 1/std rows the paper leaves out (8 bytes a row).
    (Autocast's fp32 LayerNorm kept fp32 inputs, CPU and meta dropout kept 16-bit masks, and the qkv and MLP
    inputs were kept gathered under sequence parallelism: 8.5 s b h at SP + selective, twice the paper's.)"""
    s, b, h = 2048, 1, 1024
    two, four = rehearse_many([([*GPT3_BLOCK, f"model.num_layers={n}", *extra], 8, 0, None) for n in (2, 4)])
    per_layer = (four["peak_by_kind"]["activations"] - two["peak_by_kind"]["activations"]) / 2
    assert per_layer == per_sbh * s * b * h + stats * s * b, (per_layer / (s * b * h), per_sbh)


def test_unequal_chunks_are_counted_by_their_own_layers():
    """Interleaved pp=2 vpp=2 with chunks of 1 and 2 layers on rank 0 and of 2 and 1 on rank 1: the
    memory model within 3% of each rehearsed peak. (Every unit in flight counted as the walked chunk's
    layers was 19% over on rank 0 and 28% under on rank 1; 13% and 35% on Llama 3 405B's balanced split.)"""
    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.report import predicted
    from mpformer.training.preflight import preflight_rehearsal

    args = [*MODEL, "model.num_layers=6", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
            "model.num_attention_heads=8", "train.precision=bf16", "parallel.pp=2", "parallel.vpp=2",
            "parallel.dp=1", "parallel.schedule=interleaved", "parallel.pp_split=[1,2,2,1]",
            "train.seq_length=4096", "train.global_batch_size=8"]
    spec = preflight_rehearsal(compose_config(args), 2)
    for rep in rehearse_many([(args, 2, 0, None), (args, 2, 1, None)]):
        model = predicted(spec.cfg, spec.layout, rep["coords"]["pp"])["predicted_peak_bytes"]
        assert model == pytest.approx(rep["peak_bytes"], rel=0.03), (rep["rank"], model, rep["peak_by_kind"])


def test_fp8_rehearses_within_the_memory_model():
    """train.precision=fp8 (issue 35) at gpu_check.sh's 1B Llama size (two of its 16 layers: a rehearsal's
    cost is its ops), each recipe: ``_scaled_mm`` runs on meta CUDA tensors with fused attention only, no
    [s, s] tensor and no host read in the step, and the memory model (its float8 inputs, weight copies and
    casts: autoconfig/fp8_terms.py) within 5% of the rehearsed peak, as for bf16."""
    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.report import predicted
    from mpformer.training.preflight import preflight_rehearsal

    base = ["model=llama-1b", "model.num_layers=2", "train.seq_length=2048", "train.micro_batch_size=4",
            "train.global_batch_size=8", "parallel.dp=1", "train.precision=fp8"]
    cases = [[*base, f"train.fp8.recipe={r}"] for r in ("tensorwise", "rowwise", "delayed")]
    for args, rep in zip(cases, rehearse_many([(a, 1, 0, None) for a in cases]), strict=True):
        spec = preflight_rehearsal(compose_config(args), 1)
        model = predicted(spec.cfg, spec.layout, 0)["predicted_peak_bytes"]
        assert model == pytest.approx(rep["peak_bytes"], rel=0.05), (args[-1], model, rep["peak_by_kind"])
        assert set(rep["attention_kernels"]) == {"flash"} and not rep["square_tensors"], args[-1]
        assert not [x for x in rep["host_syncs"] if not x.get("boundary")], (args[-1], rep["host_syncs"])


# ---- mixture of experts -----------------------------------------------------------------------------------
# Mixtral 8x7B's widths (HF mistralai/Mixtral-8x7B-v0.1 config.json), two of its 32 layers: a rehearsal's cost
# is its op count, not its tensors' sizes (meta), so the shapes are the real model's
MIXTRAL = ["model=mixtral-tiny", "model.num_layers=2", "model.hidden_size=4096", "model.num_attention_heads=32",
           "model.num_kv_heads=8", "model.ffn_hidden_size=14336", "model.moe_ffn_hidden_size=14336",
           "model.vocab_size=32000", "model.max_position_embeddings=4096", "train.seq_length=4096",
           "train.precision=bf16", "train.global_batch_size=16", "train.micro_batch_size=1"]
MIXTRAL_LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=8", "parallel.etp=1",
                  "parallel.dp=8", "parallel.zero=1"]  # 16 GPUs: two nodes of 8, ep over the dp ranks
# Qwen3-30B-A3B's widths (HF Qwen/Qwen3-30B-A3B config.json: 128 experts, top 8, 768 wide), two of its 48
# layers, with DeepSeek-V3's sigmoid router and selection bias in place of its softmax
QWEN3 = ["model=qwen3-moe-tiny", "model.num_layers=2", "model.hidden_size=2048", "model.num_attention_heads=32",
         "model.num_kv_heads=4", "model.head_dim=128", "model.ffn_hidden_size=6144", "model.moe_ffn_hidden_size=768",
         "model.num_experts=128", "model.num_experts_per_tok=8", "model.vocab_size=151936",
         "model.max_position_embeddings=4096", "model.router_score=sigmoid", "model.router_bias=true",
         "train.seq_length=4096", "train.precision=bf16", "train.global_batch_size=16", "train.micro_batch_size=1"]
QWEN3_LAYOUT = ["parallel.ep=8", "parallel.dp=8", "parallel.zero=1"]
MOE_CASES = {  # name -> (overrides, world size)
    "mixtral ep8 tp2 alltoall": ([*MIXTRAL, *MIXTRAL_LAYOUT, "parallel.ep_dispatcher=alltoall"], 16),
    "mixtral ep8 tp2 allgather": ([*MIXTRAL, *MIXTRAL_LAYOUT, "parallel.ep_dispatcher=allgather"], 16),
    "qwen3 sigmoid ep8 alltoall": ([*QWEN3, *QWEN3_LAYOUT, "parallel.ep_dispatcher=alltoall"], 8),
}
# Float8 routed experts (issue 35) split every way at once: their ffn over etp = tp = 2, an expert's rows over
# the cp = 4 ranks outside its ep = 2 group (two per expert). Rowwise (e4m3 gradients) takes the grouped
# kernel, tensorwise (e5m2 gradients, which it cannot take) a _scaled_mm per expert.
MIXTRAL_FP8 = [*(a for a in MIXTRAL if not a.startswith("train.precision")), "train.precision=fp8",
               "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2", "parallel.cp=4", "parallel.ep=2",
               "parallel.dp=2", "parallel.zero=1", "parallel.ep_dispatcher=alltoall"]
FP8_MOE_CASES = {f"mixtral fp8 {r} ep2 cp4 etp2": ([*MIXTRAL_FP8, f"train.fp8.recipe={r}"], 16)
                 for r in ("rowwise", "tensorwise")}


@pytest.fixture(scope="module")
def moe() -> dict[str, dict]:
    from mpformer.cli.compose import compose_config
    from mpformer.rehearsal.report import with_formulas
    from mpformer.training.preflight import preflight_rehearsal

    cases = MOE_CASES | FP8_MOE_CASES
    reports = rehearse_many([(args, world, 0, None) for args, world in cases.values()])
    out = {}
    for (name, (args, world)), rep in zip(cases.items(), reports, strict=True):
        spec = preflight_rehearsal(compose_config(args), world)
        out[name] = with_formulas(spec.cfg, spec.layout, rep) | {"spec": spec}
    return out


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_runs_the_grouped_gemm_with_one_host_read_per_dispatch(moe, name):
    """The CUDA branch (layers/expert_gemm.py: torch._grouped_mm for aligned bf16, chosen by the device the
    kernel runs on, not the meta tensors'), each GEMM's FLOPs counted: forward up (2f wide) and down, and in
    backward each one's input and weight gradients, 18 M h f for M rows (uniform routing: the k T slots of
    the ep ranks' T tokens, ep El / E of them here). One host read per dispatch (the splits and the group
    sizes), in forward; none in backward; the step's boundary reads the check and the routers' sums.
    (Was: torch.bincount, which has no meta kernel and reads its max on a CUDA host; a second read for the
    splits, one for the dropped slots, one for the ids' range, one for nonzero; the loop's per-expert GEMMs.)"""
    r, spec = moe[name], moe[name]["spec"]
    m, L, t = spec.cfg.model, spec.layout, spec.cfg.train
    micro = t.global_batch_size // (L.dp * t.micro_batch_size)
    etp = L.etp if L.etp is not None else L.tp
    tokens = t.seq_length * t.micro_batch_size // (L.tp if L.sequence_parallel and etp == 1 else 1)
    rows = L.ep * tokens * m.num_experts_per_tok * (m.num_experts // L.ep) // m.num_experts
    f = m.expert_ffn_size // etp
    assert r["grouped_mm"] == {"calls": 6 * m.num_layers * micro,
                               "flops": 18 * rows * m.hidden_size * f * m.num_layers * micro}, r["grouped_mm"]
    inside = [s for s in r["host_syncs"] if not s.get("boundary")]
    assert len(inside) == m.num_layers * micro, inside
    assert all("mpformer/layers/moe_dispatch.py" in s["line"] and s["where"].endswith(".mlp forward")
               for s in inside), inside
    boundary = [s["line"].split(":")[0] for s in r["host_syncs"] if s.get("boundary")]
    assert boundary == ["mpformer/training/overlap.py", "mpformer/training/router_report.py"], boundary
    assert set(r["attention_kernels"]) == {"flash"} and not r["square_tensors"], r["attention_kernels"]


@pytest.mark.parametrize("name", list(FP8_MOE_CASES))
def test_float8_experts_run_their_cuda_kernels_with_one_host_read_per_dispatch(moe, name):
    """The float8 experts' CUDA branch (layers/fp8_expert_gemm.py): rowwise runs torch._scaled_grouped_mm,
    one call per GEMM (forward, dgrad, wgrad of the up and down projections); tensorwise, whose e5m2
    gradients the grouped kernel refuses, a _scaled_mm per expert and GEMM. The dense projections (qkv, o)
    add 3 _scaled_mm each. Host reads: the dispatch's one per layer and micro-batch, as in bf16."""
    r, spec = moe[name], moe[name]["spec"]
    m, L, t = spec.cfg.model, spec.layout, spec.cfg.train
    micro = t.global_batch_size // (L.dp * t.micro_batch_size)
    per = m.num_layers * micro  # layer forwards (and backwards) on this rank
    local = m.num_experts // L.ep
    if "rowwise" in name:
        assert r["scaled_mm"] == {"_scaled_mm": 6 * per, "_scaled_grouped_mm": 6 * per}, r["scaled_mm"]
    else:  # uniform routing gives every local expert rows
        assert r["scaled_mm"] == {"_scaled_mm": 6 * per + 6 * local * per, "_scaled_grouped_mm": 0}, r["scaled_mm"]
    assert r["grouped_mm"]["calls"] == 0
    inside = [s for s in r["host_syncs"] if not s.get("boundary")]
    assert len(inside) == per and all("mpformer/layers/moe_dispatch.py" in s["line"] for s in inside), inside
    assert set(r["attention_kernels"]) == {"flash"} and not r["square_tensors"], r["attention_kernels"]


@pytest.mark.parametrize("name", [*MOE_CASES, *FP8_MOE_CASES])
def test_moe_dispatch_moves_what_its_formula_says(moe, name):
    """The ep group's ledger against layers/moe_dispatch.py's dispatch_bytes (rehearsal/volumes.py), exact:
    the rehearsal routes uniformly (parallel/device.py host_ints), the formula's own assumption."""
    r = moe[name]
    ep = {k: v for k, v in r["comm_formula_bytes"].items() if k.startswith("ep.")}
    kind = r["spec"].layout.ep_dispatcher
    assert set(ep) == ({"ep.all_to_all"} if kind == "alltoall" else {"ep.all_gather", "ep.reduce_scatter"})
    assert {k: r["comm_bytes"].get(k) for k in ep} == ep, (r["comm_bytes"], ep)


@pytest.mark.parametrize("name", [*MOE_CASES, *FP8_MOE_CASES])
def test_moe_peak_is_the_memory_models(moe, name):
    r = moe[name]
    assert r["predicted_peak_bytes"] == pytest.approx(r["peak_bytes"], rel=0.05), (r["peak_by_kind"],
                                                                                   r["predicted_by_kind"])
