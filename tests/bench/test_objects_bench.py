"""The one-budget benchmark on a small run: its figures are consistent, and the knobs are checked."""

import pytest

from kvtier.bench.objects import KINDS, ObjectsBenchConfig, format_table, make_events, run


def test_a_small_run_reports_every_policy_and_kind():
    cfg = ObjectsBenchConfig(requests=300, budgets=(0.1,), grid=4)
    (res,) = run(cfg)
    assert set(res.saved_s) == {"cost", "lru", "best_partition", "footprint_partition", "phase_partitions",
                                "clairvoyant"}
    assert res.saved_s["phase_partitions"] >= res.saved_s["best_partition"]  # re-tuned per phase
    for policy, by_kind in res.saved_by_kind.items():
        assert set(by_kind) == set(KINDS)
        assert 0 < res.saved_s[policy] <= res.possible_s
        assert res.saved_s[policy] == pytest.approx(sum(by_kind.values()))
    assert sum(res.best_partition) == pytest.approx(1.0)
    assert res.ratio_vs_partition > 0
    assert "cost / partition" in format_table([res]) and "clairvoyant" in format_table([res])


def test_the_mix_shifts_by_phase():
    steady = make_events(ObjectsBenchConfig(requests=600, phases=((1, 1),)))
    shifting = make_events(ObjectsBenchConfig(requests=600, phases=((0, 0), (1, 1))))
    first_half = shifting[: len(shifting) // 3]
    assert all(ev.kind == 0 for ev in first_half)  # no images, no indexes in the first phase
    assert any(ev.kind != 0 for ev in steady[: len(steady) // 3])


@pytest.mark.parametrize("bad", [{"budgets": (0.0,)}, {"image_share": 2.0}, {"grid": 2},
                                 {"phases": ((1,),)}, {"requests": 0}])
def test_bad_configs_are_refused(bad):
    with pytest.raises(ValueError):
        ObjectsBenchConfig(**bad)


def test_the_cli_prints_the_table_and_json():
    import json

    from click.testing import CliRunner

    from kvtier.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["bench", "objects", "--requests", "200", "--budgets", "0.1", "--steady"])
    assert res.exit_code == 0, res.output
    assert "cost / partition" in res.output and "steady mix" in res.output
    res = runner.invoke(main, ["bench", "objects", "--requests", "200", "--budgets", "0.1", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)
    assert {"budget_slots", "saved_s", "ratio_vs_partition", "best_partition"} <= set(row)
    res = runner.invoke(main, ["bench", "objects", "--budgets", "2"])
    assert res.exit_code != 0 and "budgets" in res.output
