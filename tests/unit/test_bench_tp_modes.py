"""scripts/bench_tp_modes.py's figures on small cases: the bisection finds the longest sequence
that fits, METP's is at least 1D's, the gain is computed from the two lengths, and the ViT sweep
asks the planner (issue 37)."""

from __future__ import annotations

import json

import yaml

from support.paths import load_script

bench = load_script("bench_tp_modes")
GIB = 1024**3
BERT = bench.PAPER_MODELS[0]


def test_max_sequence_is_the_longest_that_fits():
    for mode in ("1d", "metp"):
        longest = bench.max_sequence(BERT, mode, 8, 4 * GIB)
        assert longest > 0 and longest % bench.SEQUENCE_GRANULE == 0
        assert bench.rank_bytes(BERT, mode, 8, longest) <= 4 * GIB
        assert bench.rank_bytes(BERT, mode, 8, longest + bench.SEQUENCE_GRANULE) > 4 * GIB
    # model states alone above the memory: nothing fits
    assert bench.max_sequence(bench.PAPER_MODELS[3], "1d", 2, 1 * GIB) == 0


def test_metp_reaches_longer_sequences_and_the_gain_is_their_ratio():
    (row,) = bench.sequence_rows(models=(BERT,), p=4, gpu_gib=4)
    assert row["max_seq_metp"] > row["max_seq_1d"] > 0
    assert row["gain"] == row["max_seq_metp"] / row["max_seq_1d"]
    assert row["max_seq_1d"] == bench.max_sequence(BERT, "1d", 4, 4 * GIB)


def test_metp_saves_activations_at_p_2_and_4():
    rows = bench.peak_rows(BERT, 4096)
    assert [r["p"] for r in rows] == [2, 4]
    assert all(0 < r["ratio"] < 1 for r in rows)
    assert [round(r["paper_eq10_ratio"], 3) for r in rows] == [0.583, 0.344]


def test_the_vit_sweep_asks_the_planner():
    raw = yaml.safe_load(bench.VIT_CONFIG.read_text())
    assert bench.encoder_status(raw, "1d", 16, 4) == "fits"
    # 4096 patch tokens: 1D's s x s scores prune every plan, METP's ring keeps one
    assert bench.encoder_status(raw, "1d", 64, 4) == "OOM"
    assert bench.encoder_status(raw, "metp", 64, 4) == "fits"
    assert bench.encoder_status(raw, "metp", 256, 4) == "no text room"
    assert bench.encoder_status(raw, "metp", 30, 4) == "no plan"  # 900 tokens: no 4 x 4 groups


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert bench.main(["--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert {"sequence", "memory", "peak", "vit", "grid"} <= figures.keys()
    assert "Longest sequence" in capsys.readouterr().out
    assert bench.main(["--json", str(tmp_path / "missing" / "tp.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_the_grid_modes_keep_more_sequences_than_1d_per_byte():
    rows = {r["mode"]: r for r in bench.grid_rows(batch=16)}
    per_sequence = {m: r["activation_bytes_per_sequence"] for m, r in rows.items()}
    assert per_sequence["2d"] < per_sequence["3d"] < per_sequence["1d"]
    assert rows["2d"]["sequences_vs_1d"] == per_sequence["1d"] / per_sequence["2d"]
    # 3D keeps its all-gathered weights whatever the batch; 1D keeps nothing that does not grow
    assert rows["3d"]["fixed_activation_bytes"] > 0 == rows["1d"]["fixed_activation_bytes"]
