"""benchmarks/bench_dynamic.py on a small setting: the JSON's shape, and per-iteration scheduling
never slower than the static schedule for the maximum on any iteration."""

from __future__ import annotations

import json

from support.paths import load_script


def test_bench_dynamic_rows_and_per_iteration_never_slower_than_static_max(tmp_path, capsys):
    bench = load_script("bench_dynamic")
    rows, times, why = bench.bench("fig5_8gpu", iterations=4, seed=1)
    out = tmp_path / "rows.json"
    bench.write_json(rows, str(out))
    table = json.loads(out.read_text())
    assert [(r["config"], r["policy"]) for r in table] == [
        ("fig5_8gpu", policy) for policy in bench.POLICIES
    ]
    for row in table:
        assert set(row) == {"config", "policy", "mean_iteration_s", "scheduler_share"}
        assert row["mean_iteration_s"] is None or row["mean_iteration_s"] > 0
        assert 0 <= row["scheduler_share"] < 10
    bench.print_table(rows)
    assert "per-iteration" in capsys.readouterr().out

    per_iteration, static_max = times["per-iteration"], times["static-max"]
    assert len(per_iteration) == len(static_max) == 4
    assert all(p <= s for p, s in zip(per_iteration, static_max))
    # the iterations differ, and so do their own schedules
    assert len(set(per_iteration)) > 1
    assert why == ""  # re-scheduling can gain here: no reason printed


def test_bench_dynamic_says_why_per_iteration_ties_static_max_at_1536():
    """At strong_1536 the schedule for the maximum is the LLM plus the encoder's DP collectives,
    whatever the images: the bench says so under its table instead of leaving a bare tie."""
    bench = load_script("bench_dynamic")
    rows, times, why = bench.bench("strong_1536", iterations=2, seed=1)
    assert times["per-iteration"] == times["static-max"]
    assert why.startswith("strong_1536: per-iteration = static-max: the schedule for the maximum")
    assert "the LLM alone (" in why and "gradient reduce-scatter (" in why
