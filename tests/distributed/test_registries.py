"""A new MLP kind and a new mesh dimension through the registries alone, trained end to end.

The MLP is a test-only variant (squared ReLU, Primer's: down(relu(up(x))^2)), registered in
core/layer_spec.py with its description; the mesh dimension "xp" (size 1, after cp) in
core/topology.py, with a view "data_xp" folded over dp, cp and xp. Nothing else in mpformer knows of
any of them. Oracles: the memory model's parameter count (read from the kind's description) equals
what the model built; the tp=2 + SP run, split by the kind's own tp plan, gives the one-process
run's losses and gradient norms (fp32, within 1e-5 relative: the two sum the same products in another
order); the process groups carry the new dimension, and the rank math places it where it was
registered. A second variant names "data_xp" as its gradients' view (``grad_view``): at dp=2 under
ZeRO 0-3 its MLP weights reduce and shard over that view's own group (its bytes are in the ledger
under the view's tag) and the run gives the one-view run's losses and norms (within 1e-6 relative:
the norm is summed per view, then added).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpformer.core.layer_spec import MLP_KINDS, MLPKind, Projection, register_mlp, resolve
from mpformer.core.topology import MESH_DIMS, MeshDim, MeshView, registered
from mpformer.parallel.spawn import run_distributed
from mpformer.parallel.tensor_parallel import Part
from mpformer.testing.train import overrides, train

RTOL = 1e-5  # fp32, the same sums in another order (tp splits the MLP's and attention's GEMMs)
VIEW_RTOL = 1e-6  # fp32: only the gradient norm's sum is grouped differently (per view, then added)
ZERO_STAGES = (0, 1, 2, 3)
BASE = {"model": "tiny-llama", "model.num_layers": 2, "model.vocab_size": 256, "model.mlp_kind": "relu2",
        "train.seq_length": 32, "train.steps": 3, "train.global_batch_size": 4, "train.micro_batch_size": 2,
        "train.device": "cpu", "optim.lr": 3e-3, "optim.warmup_steps": 1, "logging.progress": False}


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2): one up projection (column-parallel under tp), one down (row-parallel)."""

    def __init__(self, cfg, *, tp=None, store=None, linear, device=None, dtype=None) -> None:
        super().__init__()
        from mpformer.layers.parallel import fused_shards, param_shards

        self._fused, self._param = fused_shards, param_shards
        self.ffn, kw = cfg.ffn_size, {"store": store, "device": device, "dtype": dtype}
        if tp is None:
            self.up = resolve(linear.plain)(cfg.hidden_size, self.ffn, bias=False, **kw)
            self.down = resolve(linear.plain)(self.ffn, cfg.hidden_size, bias=False, **kw)
        else:
            self.up = resolve(linear.column)(cfg.hidden_size, [Part("up", self.ffn)], tp, bias=False, **kw)
            self.down = resolve(linear.row)(self.ffn, cfg.hidden_size, tp, bias=False, **kw)

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x_sbh)).square())

    def parts(self) -> list[tuple[str, list[nn.Module]]]:
        return [("mlp_in", [self.up]), ("mlp_out", [self.down])]

    def canonical_shards(self, prefix: str) -> dict:
        out = self._fused(self.up, {"up": f"{prefix}.up"}, (self.ffn,))
        out.update(self._param(f"{prefix}.down", self.down))
        return out


class ReluSquaredOnView(ReluSquaredMLP):
    """The same MLP, its gradients reduced (and ZeRO-sharded) over the "data_xp" view."""

    grad_view = "data_xp"


def register_test_kinds() -> None:
    """The one place the new MLPs are described (idempotent: spawned ranks import this module afresh)."""
    for name, module in (("relu2", ReluSquaredMLP), ("relu2_xp", ReluSquaredOnView)):
        if name in MLP_KINDS:
            continue
        register_mlp(MLPKind(
            name, module,
            part_sizes=lambda m, tp: [[m.hidden_size * (m.ffn_size // tp)], [(m.ffn_size // tp) * m.hidden_size]],
            projections=lambda m, tp: [Projection("up", m.hidden_size, m.ffn_size // tp),
                                       Projection("down", m.ffn_size // tp, m.hidden_size)],
            saved=lambda m, tp: 2 * (m.ffn_size // tp), tp_plan=(("up", "column"), ("down", "row")),
            out_projections=("down",)))


XP = MeshDim("xp", "nothing yet (a test dimension of size 1)", lambda layout: 1)
DATA_XP = MeshView("data_xp", ("dp", "cp", "xp"), "dpx.", partial=("cp",))


def _worker(world: int, data: str, root: str) -> dict:
    import torch.distributed as dist

    from mpformer.autoconfig.memory import layer_params_per_rank
    from mpformer.cli.compose import compose_config
    from mpformer.core.layout import ParallelLayout
    from mpformer.models.parallelize import build_model
    from mpformer.parallel.device import resolve_device
    from mpformer.parallel.groups import ProcessGroups

    register_test_kinds()
    out: dict = {}
    with registered(XP, after="cp", views=(DATA_XP,)):
        layout = ParallelLayout(tp=world, dp=1, sequence_parallel=world > 1)
        groups = ProcessGroups.build(layout, resolve_device("cpu"))
        out["mesh"] = groups.mesh.mesh_dim_names
        out["coords"] = groups.coords
        out["xp_group"] = sorted(dist.get_process_group_ranks(groups.group("xp")))
        cfg = compose_config(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / "cfg")).cfg
        tp = groups.tp_context() if world > 1 else None
        model = build_model(cfg.model, tp=tp, device=torch.device("cpu"), seed=1)
        per_layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
        out["layer_params"] = (per_layer, layer_params_per_rank(cfg.model, world))
        out["num_params"] = (sum(p.numel() for p in model.parameters()), cfg.model.num_params())
        kw = {"parallel.tp": world, "parallel.sequence_parallel": world > 1}
        out["run"] = train(overrides({**BASE, "data.paths": f"[{data}]"}, Path(root) / f"tp{world}", **kw))
        if world == 2:  # the second view, at dp=2 under each ZeRO stage, against the one-view run
            for zero in ZERO_STAGES:
                for kind in ("relu2", "relu2_xp"):
                    kw = {"parallel.dp": 2, "parallel.zero": zero, "model.mlp_kind": kind}
                    run_dir = Path(root) / f"dp2_z{zero}_{kind}"
                    out[(zero, kind)] = train(overrides({**BASE, "data.paths": f"[{data}]"}, run_dir, **kw))
    out["dims_after"] = [d.name for d in MESH_DIMS]
    return out


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict[int, list[dict]]:
    root = str(tmp_path_factory.mktemp("registries"))
    return {w: run_distributed(_worker, w, args=(w, tiny_data, root), timeout=600) for w in (1, 2)}


def test_the_new_dimension_is_in_the_mesh_where_it_was_registered(runs):
    for per_rank in runs.values():
        for rank, got in enumerate(per_rank):
            assert got["mesh"] == ("pp", "dp", "xp", "cp", "tp")  # slowest first: xp right after cp
            assert got["coords"] == {"tp": rank, "cp": 0, "xp": 0, "dp": 0, "pp": 0}
            assert got["xp_group"] == [rank]
            assert got["dims_after"] == ["tp", "cp", "dp", "pp"]  # unregistered on the way out


def test_the_models_read_the_new_kind_from_its_description(runs):
    for per_rank in runs.values():
        for got in per_rank:
            built, described = got["layer_params"]
            assert built == described > 0
    built, described = runs[1][0]["num_params"]  # one process holds the whole model
    assert built == described


def test_the_new_kind_trains_and_tensor_parallelism_splits_it_exactly(runs):
    one, two = runs[1][0]["run"], runs[2][0]["run"]
    assert len(one["losses"]) == 3 and all(math.isfinite(x) for x in one["losses"])
    assert one["losses"][-1] < one["losses"][0]
    for a, b in zip(one["losses"] + one["grad_norms"], two["losses"] + two["grad_norms"]):
        assert b == pytest.approx(a, rel=RTOL)


def test_a_kind_or_dimension_that_is_not_registered_fails_in_one_line():
    from mpformer.core.errors import ConfigError
    from mpformer.core.model_config import ModelConfig
    from mpformer.core.topology import Topology, register_dim

    with pytest.raises(ConfigError, match=r"model.mlp_kind='nope' is not a registered kind; valid: .*dense"):
        ModelConfig(mlp_kind="nope").validate()
    with pytest.raises(ValueError, match="unknown dims"):
        Topology(xp=1)
    with pytest.raises(ValueError, match="exists already"):
        register_dim(MeshDim("tp", "", lambda layout: 1), after="cp")


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_a_parameter_reduces_and_shards_over_the_view_its_module_names(runs, zero):
    one_view, two_views = runs[2][0][(zero, "relu2")], runs[2][0][(zero, "relu2_xp")]
    for a, b in zip(one_view["losses"] + one_view["grad_norms"], two_views["losses"] + two_views["grad_norms"]):
        assert b == pytest.approx(a, rel=VIEW_RTOL)
    on_view = {k: v for k, v in two_views["comm_by_kind"][0].items() if k.startswith("dpx.")}
    assert on_view and all(v > 0 for v in on_view.values()), two_views["comm_by_kind"][0]
    assert not any(k.startswith("dpx.") for k in one_view["comm_by_kind"][0])
