"""The profile's multi-process part on 2 gloo ranks, one round: what calibration.py is built from.

The full profile (``python -m mpformer.autoconfig.profile``, under a minute) is too slow for the
suite; its multi-process run is checked here on the smallest host: the reference model alone and by
both ranks at once, trained one step in each reference layout of 2 ranks (a 2-stage 1F1B pipeline
and a tensor-parallel pair with sequence parallelism), the collectives, and context parallelism's
attention of each measured kind; then the cost model takes its calibration from the result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from mpformer.autoconfig.cluster import load_cluster
from mpformer.autoconfig.cost import calibration
from mpformer.autoconfig.cp_cost import measured_on_host
from mpformer.autoconfig.memory import Workload
from mpformer.autoconfig.profile import summarise
from mpformer.autoconfig.profile_ranks import CP_SEQS, REFERENCE, REFERENCE_SEQ, profile_shared, reference_layouts
from mpformer.core.layout import ParallelLayout
from mpformer.core.model_config import ModelConfig


def test_shared_run_measures_sharing_layouts_collectives_and_cp_attention():
    shared = profile_shared(ranks=(2,), rounds=1, sizes=[4096, 65536])
    seconds = asdict(shared.seconds)
    assert set(seconds) == {"build", "rounds", "collectives", "cp_attention"} and min(seconds.values()) > 0
    assert shared.reference.seconds > 0 and len(shared.reference.seconds_alone_runs) == 1
    assert set(shared.loaded) == {"2"} and 0.3 < shared.loaded["2"].slowdown < 5
    assert set(shared.layouts) == set(reference_layouts(2)) == {"pp2", "dp1 tp2"}
    for row in shared.layouts.values():
        assert row.world == 2 and row.microbatches == 4
        # A layout's step over the busy step of the same micro-batches: near 1 (a pipeline's bubbles,
        # tensor parallelism's waits make it longer), far from it only if the two measured different work.
        assert row.seconds > 0 and row.relative > 0 and 0.5 < row.relative_to_busy < 4
        # The ledger's tensor-parallel waits: within the step, none without tensor parallelism.
        tp = row.layout.get("tp", 1) > 1
        assert (0 < row.tp_waits_relative_to_busy < row.relative_to_busy) if tp else \
            row.tp_waits_relative_to_busy == 0
    assert {(c.op, c.ranks) for c in shared.collectives} == {(op, 2) for op in ("all_reduce", "all_gather",
                                                                                "reduce_scatter")}
    # Every measured cp kind at degree 2, at both sequence lengths: slower than the fused kernel's share.
    assert set(shared.cp_attention) == {"ring/2", "allgather/2", "ulysses/2"}
    for fit in shared.cp_attention.values():
        assert [r.seq for r in fit.rows] == list(CP_SEQS)
        assert all(r.seconds > 0 and r.fused_s > 0 for r in fit.rows)
    # The cost model reads the profile as profile.py writes it: the results' fields are its JSON keys.
    measured = asdict(shared)
    fits = summarise([{"dtype": "fp32", "m": 8, "n": 8, "k": 8, "flops_per_s": 1e10}],
                     measured["collectives"])["fits"]
    ref = {"model": REFERENCE, "seq_length": REFERENCE_SEQ, "micro_batch_size": 1, "precision": "fp32",
           **measured["reference"], "split_backward_ratio": 1.0}
    host = replace(load_cluster("local-cpu"), devices_per_node=2,
                   measured={"reference": ref, "loaded": measured["loaded"], "layouts": measured["layouts"],
                             "fits": fits, "cp_attention": measured["cp_attention"]})
    cal = calibration(host)
    assert set(cal.pipeline) == {2} and set(cal.tp) == {2}
    assert math.isfinite(cal.compute) and cal.compute > 0
    m, w = ModelConfig(**REFERENCE), Workload(4, 1, REFERENCE_SEQ, "fp32")
    assert measured_on_host(m, ParallelLayout(dp=1, cp=2), w, host) is not None
