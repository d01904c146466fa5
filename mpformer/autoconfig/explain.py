"""Why the search chose its plan: the chosen plan's predicted time, term by term, against the
runner-up and against the plan a person would pick first (``autoconfig.explain=true``).

    baseline   tp   the largest divisor of a node's devices the model's heads, kv heads and ffn allow
                    (validate()'s tp rules): tensor parallelism stays on NVLink
               pp   one stage per node (layers balanced by compute when they do not split evenly, as the
                    search does); with more nodes than layers, the largest divisor of the node count that
                    leaves every stage a layer (a stage per group of whole nodes)
               dp   the rest; cp=1; sequence parallelism with tp > 1; micro-batch 1; ZeRO-1 with dp > 1
                    (Megatron's distributed optimizer); 1F1B; the least recompute that fits
    terms      every seconds term of ``Breakdown.to_dict()`` (keys ending ``_s``; ``iteration_s`` is the
               total), so terms the cost model adds appear here without a change. The terms in
               ``NOT_PARTS`` are shown but are not summands of the total; whatever the summands do not
               account for (the bubble clamped at zero) is shown as "not itemized", so a comparison's
               rows always add up to its difference in iteration time.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mpformer.autoconfig.candidates import Candidate, SearchResult
from mpformer.autoconfig.cluster import Cluster
from mpformer.autoconfig.memory import Workload, plan_memory
from mpformer.autoconfig.search import evaluate_plan, search
from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.layout import ParallelLayout, valid_tp_values, validate
from mpformer.core.model_config import ModelConfig, divisors

TOTAL = "iteration_s"
RESIDUAL = "not_itemized_s"  # the part of the difference no summand accounts for
# Seconds terms that are not summands of iteration_s: p2p_s is one stage-to-stage transfer, whose
# cost the pipeline bubble already contains.
# ep_hidden_s: the experts' exchanges DualPipeV's overlapped pairs run beside compute, which cost no time.
NOT_PARTS = {"p2p_s": "the time of one stage-to-stage transfer, already inside the pipeline bubble",
             "ep_hidden_s": "expert exchanges run beside compute in DualPipeV's overlapped pairs, costing no time"}
NAMES = {"compute_s": "compute", "tp_comm_s": "tensor-parallel communication",
         "cp_comm_s": "context-parallel communication", "ep_comm_s": "expert token exchanges",
         "ep_hidden_s": "expert token exchanges hidden in overlapped pairs", "pp_bubble_s": "pipeline bubble",
         "p2p_s": "pipeline send/receive", "dp_comm_exposed_s": "exposed data-parallel communication",
         "optimizer_s": "optimizer step", RESIDUAL: "not itemized"}
# The plan fields that move each term, named in the summary when they differ (at most two a term).
DRIVERS = {"compute_s": ("recompute", "micro_batch_size", "tp"),
           "tp_comm_s": ("tp", "sequence_parallel", "recompute"),
           "cp_comm_s": ("cp", "cp_kind", "cp_ulysses"),
           "ep_comm_s": ("ep", "schedule", "ep_dispatcher"),  # schedule: DualPipeV's pairs hide them
           "pp_bubble_s": ("pp", "vpp", "schedule", "microbatches", "offload"),  # offload: its exposed copies
           "p2p_s": ("pp", "sequence_parallel"),
           "dp_comm_exposed_s": ("dp", "zero"),
           "optimizer_s": ("zero", "dp")}
RECOMPUTE_ORDER = ("none", "selective", "full")  # cheapest first: the baseline takes the first that fits


def term_name(key: str) -> str:
    """A term's words: known terms by name, new ones from their key (``foo_bar_s`` -> ``foo bar``)."""
    return NAMES.get(key, key.removesuffix("_s").replace("_", " "))


@dataclass
class Baseline:
    """The plan a person picks first, or why there is none (``candidate`` None); ``why``: one line."""

    candidate: Candidate | None
    why: str


def baseline_plan(model: ModelConfig, cluster: Cluster, workload: Workload, *, device: str = "cuda") -> Baseline:
    """Largest tp within a node, pp across nodes, dp the rest (module docstring), timed as the search times."""
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    tps = [t for t in divisors(per_node) if t in valid_tp_values(model)]
    tp = tps[-1]  # 1 always qualifies
    layers = model.num_layers
    pp = max(p for p in divisors(nodes) if p <= layers)  # a stage per node, or per group of nodes
    part = "uniform" if layers % pp == 0 else "balanced"  # as the search splits uneven layers
    pp_why = "one stage per node" if pp == nodes else \
        f"the largest divisor of {nodes} nodes that leaves every stage a layer (of {layers})"
    if part == "balanced":
        pp_why += f", {layers} layers split by compute (pp_partition=balanced: they do not divide evenly)"
    dp = cluster.world_size // (tp * pp)
    why = (f"tp={tp}: the largest of {format_choices(divisors(per_node))} (devices per node) that "
           f"{model.num_attention_heads} heads / {model.kv_heads} kv heads allow; pp={pp}: {pp_why}; dp={dp}: the "
           f"rest; cp=1, mbs=1, 1f1b, zero={1 if dp > 1 else 0}" + (", sequence parallel" if tp > 1 else ""))
    w = replace(workload, micro_batch_size=1)
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, sequence_parallel=tp > 1, zero=1 if dp > 1 else 0,
                            schedule="1f1b", pp_partition=part)
    try:
        validate(layout, model, cluster.world_size, global_batch_size=w.global_batch_size, micro_batch_size=1,
                 seq_length=w.seq_length)
    except ConfigError as e:
        return Baseline(None, f"none valid (tp={tp} pp={pp} dp={dp}): {e}")
    need = 0.0
    for rec in RECOMPUTE_ORDER:
        need = max(s.total for s in plan_memory(model, replace(layout, recompute=rec), w, device=device))
        if need <= cluster.usable_bytes:
            c = evaluate_plan(model, replace(layout, recompute=rec), w, cluster, device)
            return Baseline(c, f"{why}, recompute={rec}: the least that fits")
    return Baseline(None, f"none fits: tp={tp} pp={pp} dp={dp} needs {need / 1e9:.1f} GB per device even "
                          f"with full recompute ({cluster.usable_bytes / 1e9:.3g} GB usable on {cluster.name})")


def _values(c: Candidate) -> dict[str, Any]:
    """The plan's fields, its stage partition and its micro-batch count (what a term's drivers name)."""
    return c.plan() | {"pp_partition": c.layout.pp_partition, "microbatches": c.time.to_dict().get("microbatches")}


@dataclass
class Row:
    term: str  # a Breakdown key (seconds), or RESIDUAL
    chosen: float
    other: float

    @property
    def difference(self) -> float:
        return self.other - self.chosen


@dataclass
class Comparison:
    label: str
    other: Candidate | None
    note: str = ""  # what the other plan is and why (the baseline's rationale), or why there is none
    rows: list[Row] = field(default_factory=list)  # seconds terms, largest |difference| first
    layout: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # field -> (chosen, other), differing only
    summary: str = ""


@dataclass
class Explanation:
    chosen: Candidate
    comparisons: list[Comparison]

    def text(self, width: int = 120) -> str:
        """The comparisons as the CLI prints them: a table each, then its layout and its summary."""
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=width, color_system=None, highlight=False, soft_wrap=True)
        for c in self.comparisons:
            if c.other is None:
                console.print(f"{c.label}: {c.note}")
                continue
            console.print(_table(self.chosen, c))
            # the other plan's value first, as in the summary sentence
            fields_ = ", ".join(f"{k}={_show(b)} vs {_show(a)}" for k, (a, b) in c.layout.items())
            console.print(f"{c.label} layout against the chosen: {fields_ or 'the same'}")
            if c.note:
                console.print(f"{c.label}: {c.note}")
            console.print(c.summary)
        return buf.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """For plan.json's "explain": per comparison the other plan, its summary, every term with its
        difference (other - chosen; % of the chosen iteration time), the layout fields that differ."""
        t = self.chosen.time.iteration_s
        out = []
        for c in self.comparisons:
            d: dict[str, Any] = {"label": c.label, "note": c.note, "plan": None if c.other is None else c.other.plan()}
            if c.other is not None:
                va, vb = _values(self.chosen), _values(c.other)
                d |= {"summary": c.summary,
                      "layout_differences": {k: _pair(a, b) for k, (a, b) in c.layout.items()},
                      "terms": [{"term": r.term, "chosen": r.chosen, "other": r.other, "difference": r.difference,
                                 "percent_of_chosen": 100 * r.difference / t, "summand": r.term not in NOT_PARTS}
                                for r in c.rows],
                      "iteration_time_s": _pair(t, c.other.time.iteration_s),
                      "memory_gb_per_device": _pair(self.chosen.memory_bytes / 1e9, c.other.memory_bytes / 1e9),
                      "memory_rehearsed_gb_per_device": _pair(*(None if x.rehearsed is None else
                                                                x.rehearsed["peak_bytes"] / 1e9
                                                                for x in (self.chosen, c.other))),
                      "microbatches": _pair(va["microbatches"], vb["microbatches"])}
            out.append(d)
        return {"chosen": self.chosen.plan(), "comparisons": out}


def _pair(chosen: Any, other: Any) -> dict[str, Any]:
    return {"chosen": chosen, "other": other}


def explain(chosen: Candidate, others: list[tuple[str, Candidate | None]], *,
            notes: Mapping[str, str] | None = None) -> Explanation:
    """``chosen`` against each (label, plan) of ``others``; a plan of None is reported by its note only
    (``notes``: label -> one line, e.g. why there is no baseline)."""
    notes = notes or {}
    return Explanation(chosen, [_compare(chosen, label, other, notes.get(label, "")) for label, other in others])


def _compare(chosen: Candidate, label: str, other: Candidate | None, note: str) -> Comparison:
    if other is None:
        return Comparison(label, None, note or "none")
    a, b = chosen.time.to_dict(), other.time.to_dict()
    keys = [k for k in dict.fromkeys([*a, *b]) if k.endswith("_s") and k != TOTAL]
    rows = [Row(k, float(a.get(k, 0.0)), float(b.get(k, 0.0))) for k in keys]
    parts = sum(r.difference for r in rows if r.term not in NOT_PARTS)
    residual = (other.time.iteration_s - chosen.time.iteration_s) - parts
    if abs(residual) > 1e-9 * max(chosen.time.iteration_s, 1e-12):
        rows.append(Row(RESIDUAL, 0.0, residual))
    rows.sort(key=lambda r: -abs(r.difference))
    va, vb = _values(chosen), _values(other)
    layout = {k: (va[k], vb[k]) for k in va if k != "microbatches" and va[k] != vb[k]}
    return Comparison(label, other, note, rows, layout, _summary(label, chosen, other, rows, va, vb))


def _summary(label: str, chosen: Candidate, other: Candidate, rows: list[Row], va: dict, vb: dict) -> str:
    """One sentence: how much slower (or faster) the other plan is and the 2-3 terms behind it."""
    t0, t1 = chosen.time.iteration_s, other.time.iteration_s
    pct = 100 * (t1 - t0) / t0
    how = "as fast as" if abs(pct) < 0.05 else f"{abs(pct):.1f}% {'slower' if pct > 0 else 'faster'} than"
    head = f"the {label} is {how} the chosen plan ({t1:.3g} s vs {t0:.3g} s)"
    parts = [r for r in rows if r.term not in NOT_PARTS and abs(r.difference) >= 1e-6 * t0]
    if not parts:
        return head
    keep = [parts[0]] + [r for r in parts[1:3] if abs(r.difference) >= 0.1 * abs(parts[0].difference)]
    said = []
    for r in keep:
        drivers = [k for k in DRIVERS.get(r.term, ()) if va.get(k) != vb.get(k)][:2]
        why = f" ({', '.join(f'{k}={_show(vb[k])} vs {_show(va[k])}' for k in drivers)})" if drivers else ""
        said.append(f"{r.difference:+.3g} s {term_name(r.term)}{why}")
    return f"{head}: {', '.join(said)}"


def _table(chosen: Candidate, c: Comparison):
    from rich.table import Table

    assert c.other is not None
    t, t1 = chosen.time.iteration_s, c.other.time.iteration_s
    notes = [f"{term_name(r.term)}: {NOT_PARTS[r.term]}" for r in c.rows if r.term in NOT_PARTS]
    table = Table(title=f"chosen plan vs {c.label} (seconds per iteration unless named)",
                  caption="* not a summand of the total: " + "; ".join(notes) if notes else None)
    for col in ("term", "chosen", c.label, "difference", "% of chosen"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for i, r in enumerate(c.rows):
        resid = r.term == RESIDUAL
        table.add_row(term_name(r.term) + (" *" if r.term in NOT_PARTS else ""), "" if resid else _num(r.chosen),
                      "" if resid else _num(r.other), _diff(r.difference, t), f"{100 * r.difference / t:+.1f}%",
                      end_section=i == len(c.rows) - 1)
    table.add_row("iteration (total)", _num(t), _num(t1), _diff(t1 - t, t), f"{100 * (t1 - t) / t:+.1f}%")
    ma, mb = chosen.memory_bytes / 1e9, c.other.memory_bytes / 1e9
    table.add_row("memory (GB per device)", f"{ma:.1f}", f"{mb:.1f}", f"{mb - ma:+.1f}", "")
    if chosen.rehearsed and c.other.rehearsed:  # autoconfig.rehearse: the most loaded rank run on the GPU
        ra, rb = chosen.rehearsed["peak_bytes"] / 1e9, c.other.rehearsed["peak_bytes"] / 1e9
        table.add_row("memory rehearsed (GB)", f"{ra:.1f}", f"{rb:.1f}", f"{rb - ra:+.1f}", "")
    na, nb = _values(chosen)["microbatches"], _values(c.other)["microbatches"]
    if na is not None and nb is not None:
        table.add_row("micro-batches", str(na), str(nb), f"{nb - na:+d}", "")
    return table


def _num(x: float) -> str:
    return f"{x:.3g}"


def _diff(d: float, total: float) -> str:
    """A difference; rounding noise (below a millionth of the iteration) as 0."""
    return "0" if abs(d) < 1e-6 * total else f"{d:+.3g}"


def _show(v: Any) -> str:
    """A plan value as the command line writes it (true, not True)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def explain_choice(top: list[Candidate], model: ModelConfig, cluster: Cluster, workload: Workload, *,
                   device: str = "cuda", runner_up_note: str = "") -> Explanation:
    """The search's best plan (``top[0]``) against its runner-up (``top[1]``) and the baseline."""
    if not top:
        raise ValueError("explain_choice needs the search's ranked plans (top is empty)")
    chosen = top[0]
    base = baseline_plan(model, cluster, workload, device=device)
    notes = {"baseline": base.why, "runner-up": runner_up_note}
    if base.candidate is not None and _values(base.candidate) == _values(chosen):
        notes["baseline"], base = f"the chosen plan itself ({base.why})", Baseline(None, base.why)
    if len(top) < 2:
        notes["runner-up"] = "none: the search found a single feasible plan"
    return explain(chosen, [("runner-up", top[1] if len(top) > 1 else None), ("baseline", base.candidate)],
                   notes=notes)


def explain_search(res: SearchResult, model: ModelConfig, cluster: Cluster, workload: Workload, *,
                   fixed: Mapping[str, Any] | None = None, device: str = "cuda") -> Explanation:
    """``explain_choice`` of a search's result. With one ranked plan (autoconfig.top_k=1) the runner-up
    comes from a search that ranks two (the first is not widened: the plans it re-times, and so its
    choice, may depend on top_k)."""
    ranked, note = res.top, ""
    if len(ranked) == 1:
        chosen = ranked[0].plan()
        wider = search(model, cluster, workload, fixed=dict(fixed or {}), top_k=2, device=device).top
        ranked = [ranked[0], *[c for c in wider if c.plan() != chosen][:1]]
        note = "the best other plan of a search that ranks two (autoconfig.top_k=1 ranks one)"
    return explain_choice(ranked, model, cluster, workload, device=device, runner_up_note=note)

