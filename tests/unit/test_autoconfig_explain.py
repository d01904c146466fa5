"""autoconfig.explain: the baseline plan's rules, the comparison's arithmetic, the CLI end to end
(in process) and a bad value in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mpformer.autoconfig.candidates import Candidate
from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import Breakdown
from mpformer.autoconfig.explain import (
    NOT_PARTS,
    RESIDUAL,
    TOTAL,
    Explanation,
    baseline_plan,
    explain,
    explain_choice,
    term_name,
)
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.autoconfig.search import search
from mpformer.cli.autoconfig import main
from mpformer.cli.compose import compose_config
from mpformer.core.errors import ConfigError
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig

README = ["model=llama3-8b", "cluster=dgx-h100", "autoconfig.nodes=4", "train.global_batch_size=512",
          "train.seq_length=4096", "train.precision=bf16"]


def _model(name: str) -> ModelConfig:
    return compose_config([f"model={name}"]).cfg.model


@pytest.fixture(scope="module")
def readme_explanation() -> tuple[Explanation, list[Candidate]]:
    """The README example's search and its explanation (about half a second)."""
    model, cluster, w = _model("llama3-8b"), load_cluster("dgx-h100", 4), Workload(512, 1, 4096, "bf16")
    top = search(model, cluster, w, top_k=2).top
    return explain_choice(top, model, cluster, w), top


def test_baseline_llama3_8b_on_four_h100_nodes():
    b = baseline_plan(_model("llama3-8b"), load_cluster("dgx-h100", 4), Workload(512, 1, 4096, "bf16"))
    assert b.candidate is not None, b.why
    p = b.candidate.plan()
    assert (p["tp"], p["pp"], p["dp"], p["cp"], p["vpp"]) == (8, 4, 1, 1, 1)
    assert p["sequence_parallel"] and p["zero"] == 0 and p["micro_batch_size"] == 1 and p["schedule"] == "1f1b"
    assert p["recompute"] == "none" and b.candidate.layout.pp_partition == "uniform"
    assert "pp=4: one stage per node" in b.why and "recompute=none: the least that fits" in b.why
    assert b.candidate.time.iteration_s > 0 and b.candidate.memory_bytes <= load_cluster("dgx-h100").usable_bytes


def test_baseline_tp_follows_heads_and_kv_heads():
    """12 heads on 8-GPU nodes: tp=4 (8 does not divide 12); 24 heads but 6 kv heads: tp=2 (kv heads
    must be split or replicated whole: 6 is neither divisible by 4 or 8 nor a divisor of them)."""
    b = baseline_plan(_model("gpt2"), load_cluster("dgx-h100", 1), Workload(64, 1, 1024, "bf16"))
    p = b.candidate.plan()
    assert (p["tp"], p["pp"], p["dp"], p["zero"], p["sequence_parallel"]) == (4, 1, 2, 1, True), b.why
    gqa = ModelConfig(num_layers=8, hidden_size=1536, num_attention_heads=24, num_kv_heads=6, ffn_hidden_size=4096)
    b = baseline_plan(gqa, load_cluster("dgx-h100", 2), Workload(64, 1, 1024, "bf16"))
    p = b.candidate.plan()
    assert (p["tp"], p["pp"], p["dp"], p["zero"]) == (2, 2, 4, 1), b.why
    assert "24 heads / 6 kv heads" in b.why


def test_baseline_pipeline_over_nodes_when_layers_do_not_divide():
    """3 nodes, 32 layers: a stage per node, layers balanced by compute; more nodes than layers: the
    largest divisor of the node count that leaves every stage a layer."""
    b = baseline_plan(_model("llama3-8b"), load_cluster("dgx-h100", 3), Workload(512, 1, 4096, "bf16"))
    assert (b.candidate.plan()["pp"], b.candidate.layout.pp_partition) == (3, "balanced"), b.why
    tiny = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    b = baseline_plan(tiny, load_cluster("dgx-h100", 4), Workload(64, 1, 128, "bf16"))
    p = b.candidate.plan()
    assert (p["tp"], p["pp"], p["dp"]) == (4, 2, 4) and "largest divisor of 4 nodes" in b.why


def test_baseline_recompute_is_the_least_that_fits():
    model, cluster, w = _model("llama3-8b"), load_cluster("dgx-h100", 1), Workload(8, 1, 98304, "bf16")
    b = baseline_plan(model, cluster, w)
    assert b.candidate is not None and b.candidate.layout.recompute == "full", b.why
    for cheaper in ("none", "selective"):  # neither cheaper mode fits, so full is the least
        need = max(s.total for s in plan_memory(model, replace(b.candidate.layout, recompute=cheaper), w))
        assert need > cluster.memory_bytes


def test_baseline_says_why_there_is_none():
    b = baseline_plan(_model("llama2-7b"), load_cluster("local-cpu"), Workload(4, 1, 4096, "bf16"), device="cpu")
    assert b.candidate is None and b.why.startswith("none fits: tp=") and "GB per device even with full" in b.why
    b = baseline_plan(_model("gpt2"), load_cluster("dgx-h100", 1), Workload(3, 1, 1024, "bf16"))
    assert b.candidate is None and "none valid (tp=4 pp=1 dp=2)" in b.why and "global_batch_size=3" in b.why
    chosen = Candidate(ParallelLayout(dp=1), 1, 1e9, Breakdown(compute_s=1.0, iteration_s=1.0))
    text = explain(chosen, [("baseline", None)], notes={"baseline": b.why}).text()
    assert text.strip() == f"baseline: {b.why}"  # one line, no table


def test_a_baseline_that_is_the_chosen_plan_is_said_in_a_line():
    model, cluster, w = _model("gpt2"), load_cluster("dgx-h100", 1), Workload(64, 1, 1024, "bf16")
    base = baseline_plan(model, cluster, w).candidate
    e = explain_choice([base], model, cluster, w)
    assert [(c.label, c.other) for c in e.comparisons] == [("runner-up", None), ("baseline", None)]
    assert e.text().splitlines() == ["runner-up: none: the search found a single feasible plan",
                                     f"baseline: the chosen plan itself ({baseline_plan(model, cluster, w).why})"]


def test_differences_sum_to_the_iteration_difference(readme_explanation):
    e, top = readme_explanation
    assert [c.label for c in e.comparisons] == ["runner-up", "baseline"]
    t = e.chosen.time.iteration_s
    for c in e.comparisons:
        assert c.other is not None, c.note
        diff = c.other.time.iteration_s - t
        summed = sum(r.difference for r in c.rows if r.term not in NOT_PARTS)
        assert summed == pytest.approx(diff, rel=1e-9, abs=1e-12)
        # every seconds term of the breakdown is a row, and the summands alone account for the total
        keys = {k for k in e.chosen.time.to_dict() if k.endswith("_s") and k != TOTAL}
        assert keys == {r.term for r in c.rows} - {RESIDUAL}
        assert RESIDUAL not in {r.term for r in c.rows}
        assert [abs(r.difference) for r in c.rows] == sorted((abs(r.difference) for r in c.rows), reverse=True)
        assert c.summary.startswith(f"the {c.label} is {100 * diff / t:.1f}% slower than the chosen plan")
    runner, base = e.comparisons
    assert runner.other is top[1]
    assert base.layout["tp"] == (e.chosen.layout.tp, 8) and base.other.layout.pp == 4
    for c in e.comparisons:  # the largest difference is named first
        assert c.summary.split(": ", 1)[1].startswith(f"{c.rows[0].difference:+.3g} s {term_name(c.rows[0].term)}")
    d = json.loads(json.dumps(e.to_dict()))  # plain JSON
    assert d["chosen"] == e.chosen.plan() and d["comparisons"][1]["plan"]["tp"] == 8
    row = d["comparisons"][1]["terms"][0]
    assert row["percent_of_chosen"] == pytest.approx(100 * row["difference"] / t)


def test_new_terms_and_a_residual_appear_without_code_changes():
    """Terms the cost model adds (any ``*_s`` key, here through ``extra``) are rows and can lead the
    summary; what the summands miss is a "not itemized" row."""
    def cand(pp: int, bubble: float, new: float, total: float) -> Candidate:
        b = Breakdown(compute_s=1.0, pp_bubble_s=bubble, iteration_s=total, extra={"microbatches": 8,
                                                                                    "fancy_overlap_s": new})
        return Candidate(ParallelLayout(dp=8 // pp, pp=pp), 1, 10e9, b)

    chosen, other = cand(2, 0.1, 0.0, 1.1), cand(4, 0.3, 0.5, 1.9)  # 0.8 s slower; 0.2 + 0.5 itemized
    e = explain(chosen, [("runner-up", other)])
    c = e.comparisons[0]
    assert [r.term for r in c.rows[:3]] == ["fancy_overlap_s", "pp_bubble_s", RESIDUAL]
    assert sum(r.difference for r in c.rows if r.term not in NOT_PARTS) == pytest.approx(0.8)
    assert c.summary == ("the runner-up is 72.7% slower than the chosen plan (1.9 s vs 1.1 s): +0.5 s fancy overlap, "
                         "+0.2 s pipeline bubble (pp=4 vs 2), +0.1 s not itemized")
    assert c.layout == {"dp": (4, 2), "pp": (2, 4)}
    text = e.text()
    assert "fancy overlap" in text and "runner-up layout against the chosen: dp=2 vs 4, pp=4 vs 2" in text


def test_cli_explain_prints_the_comparison_and_writes_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*README, "autoconfig.explain=true", "autoconfig.top_k=1", f"autoconfig.output={out}",
                 "autoconfig.rehearse=false"]) == 0  # rehearsed: tests/integration/test_autoconfig_cli.py
    text = capsys.readouterr().out
    table_end = text.index("chosen plan vs runner-up")
    assert text.index("rejected ") < table_end < text.index("chosen plan vs baseline") < text.index("pretrain with:")
    assert "the runner-up is " in text and "the baseline is " in text and "tensor-parallel communication" in text
    assert "runner-up: the best other plan of a search that ranks two (autoconfig.top_k=1 ranks one)" in text
    d = json.loads(out.read_text())
    assert len(d["top"]) == 1 and d["explain"]["chosen"] == d["plan"]
    labels = [c["label"] for c in d["explain"]["comparisons"]]
    assert labels == ["runner-up", "baseline"] and d["explain"]["comparisons"][1]["plan"]["tp"] == 8
    assert all(c["terms"] and c["summary"] for c in d["explain"]["comparisons"])


def test_cli_without_explain_writes_no_explanation(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["model=tiny-llama", "cluster=dgx-h100", "train.global_batch_size=64", "train.seq_length=128",
                 f"autoconfig.output={out}", "autoconfig.rehearse=false"]) == 0
    assert "chosen plan vs" not in capsys.readouterr().out and "explain" not in json.loads(out.read_text())


def test_cli_bad_explain_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main([*README, "autoconfig.explain=maybe"])
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert err == ["error: autoconfig.explain: Value 'maybe' is not a valid bool (type str); valid: true, false"]


def test_a_plan_that_does_not_fit_when_rehearsed_is_dropped(monkeypatch, capsys):
    """autoconfig.rehearse: a plan whose rehearsed peak exceeds the usable memory leaves the table; when
    none is left, one line says so (the rehearsals themselves: tests/integration/test_autoconfig_cli.py)."""
    import mpformer.cli.rehearse as rehearse_cli
    from mpformer.cli.autoconfig import _rehearse

    cluster = load_cluster("dgx-h100", 4)
    model, w = _model("llama3-8b"), Workload(512, 1, 4096, "bf16")
    res = search(model, cluster, w, top_k=2)
    first, second = res.top
    peaks = [cluster.usable_bytes + 1, cluster.usable_bytes - 1]
    monkeypatch.setattr(rehearse_cli, "rehearse_plans", lambda args, plans, device: [
        {"rank": 0, "peak_bytes": p, "peak_where": "pp.B mb0 c0"} for p in peaks])
    dropped = _rehearse(res, cluster, README, None)
    assert res.top == [second] and second.rehearsed["peak_bytes"] == peaks[1] and first.rehearsed is not None
    assert len(dropped) == 1 and dropped[0]["plan"] == first.plan()
    assert "dropped parallel.dp=" in capsys.readouterr().out
    assert _rehearse(res, cluster, README, False) == [] and res.top == [second]  # off: nothing run
    peaks[:] = [cluster.usable_bytes + 1]
    with pytest.raises(ConfigError, match="no plan of the top 1 fits when rehearsed on h100-80gb"):
        _rehearse(res, cluster, README, True)
    with pytest.raises(ConfigError, match=r"autoconfig\.rehearse=true needs a GPU the rehearsal knows"):
        _rehearse(res, load_cluster("local-cpu"), README, True)
