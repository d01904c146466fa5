"""The schedule table (tools/schedule.py --table): every simulated bubble and peak equals the published
formula wherever one exists (docs/formulas.md, Narayanan et al. 2021, Qi et al. 2024, the
DualPipe README, TeraPipe for token slices), at several depths, micro-batch counts and cost ratios."""

from __future__ import annotations

import pytest

from mpformer.cli.schedule import main
from mpformer.pipeline.compare import schedule_table


@pytest.mark.parametrize("pp,m,f,b,w", [(4, 16, 1, 1, 1), (6, 24, 1, 1, 1), (3, 12, 1, 1, 1), (8, 32, 1, 1, 1),
                                        (4, 8, 1.0, 1.5, 0.5)])
def test_every_simulated_row_equals_its_published_formula(pp, m, f, b, w):
    rows = {r["schedule"]: r for r in schedule_table(pp, m, f, b, w)}
    assert set(rows) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev",
                         "1f1b, 2 token slices", "1f1b, 4 token slices"}
    for name, r in rows.items():
        if r["bubble_published"] is not None:
            got = r["bubble_back_to_back"] if name == "zb-h2" else r["bubble"]  # ZB-H2's figure is across steps
            if name != "dualpipev" or f == b == w:  # DualPipe's formula is stated at equal passes
                assert got == pytest.approx(r["bubble_published"], abs=1e-9), name
        if r["peak_published"] is not None:
            assert r["peak_stages"] == pytest.approx(r["peak_published"]), name
        assert r["params"] == 1.0
    assert rows["zb-v"]["bubble"] <= rows["zb-h1"]["bubble"] + 1e-12  # Qi et al.: ZB-V at most ZB-H1's
    assert rows["zb-v"]["peak_stages"] == rows["1f1b"]["peak_stages"]
    for k in (2, 4):  # token slices: TeraPipe's bubble above; k - 1 more slices than 1F1B's p - 1 warmup
        assert rows[f"1f1b, {k} token slices"]["peak_stages"] == pytest.approx((pp - 1 + k) / k)
        assert rows[f"1f1b, {k} token slices"]["bubble"] < rows["1f1b"]["bubble"]


def test_the_table_command(capsys):
    assert main(["--table", "--pp", "4", "--microbatches", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("p = 4, m = 16, T_F = T_B = T_W") and "| dualpipev | 2 | 0.059 |" in out
    with pytest.raises(SystemExit) as e:
        main(["--table", "--pp", "4"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --table needs --pp P --microbatches M"
