"""benchmarks/bench_e2e.py's pure parts: the median step after warm-up from optimus-train's step
lines, the rows and their JSON, and the refusals. Nothing here launches torchrun: the benchmark
itself is the measurement."""

from __future__ import annotations

import json

import pytest

from optimus_mllm.scheduler.placements import PlacementPrediction

from support.paths import CONFIGS, load_script

# optimus-train's output (configs/cpu/pp2_v1_heavy_vit.yaml, 5 steps), with the lines it prints
# besides the steps
TRAIN_OUTPUT = """\
schedule: Optimus, encoder DP2 PP1 TP1
step 1/5 | loss 6.9958 | grad norm 1.8059 | lr 1.000e-04 | 5999.5 ms | 341 tokens/s | x 6.2%
step 2/5 | loss 6.9825 | grad norm 1.1735 | lr 7.500e-05 | 3283.3 ms | 624 tokens/s | x 6.2%
step 3/5 | loss 6.9783 | grad norm 0.9465 | lr 5.000e-05 | 2100.0 ms | 626 tokens/s | x 6.2%
step 4/5 | loss 6.9861 | grad norm 0.9890 | lr 2.500e-05 | 1900.0 ms | 1038 tokens/s | x 6.2%
step 5/5 | loss 6.9700 | grad norm 0.9000 | lr 1.000e-05 | 2500.0 ms | 1038 tokens/s | x 6.2%
done: 5 steps | mean step 3156.6 ms | final loss 6.9700
"""


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_e2e")


def test_the_median_leaves_out_the_warm_up_steps_and_keeps_the_last_loss(bench):
    measured = bench.parse_steps(TRAIN_OUTPUT)
    assert measured == bench.Measured(step_s=2.1, loss=6.97, steps=5)
    assert bench.parse_steps(TRAIN_OUTPUT, warmup=5) is None
    assert bench.parse_steps("") is None


def test_rows_table_and_json(bench, tmp_path, capsys):
    predictions = [
        PlacementPrediction("megatron-lm", 0.004, False),
        PlacementPrediction("balanced", None, False, "the balanced baseline splits ..."),
        PlacementPrediction("optimus", 0.003, True),
    ]
    measured = {
        "megatron-lm": bench.Measured(2.5, 6.97, 5),
        "optimus": "optimus-train: error: something",
    }
    rows = bench.build_rows("pp2", predictions, measured, bench.NO_PROFILE)
    assert [(r.mode, r.measured_s, r.planned) for r in rows] == [
        ("megatron-lm", 2.5, False),
        ("balanced", None, False),
        ("optimus", None, True),
    ]
    assert rows[1].problem.startswith("the balanced baseline") and rows[2].problem
    out = tmp_path / "rows.json"
    bench.write_json(rows, str(out))
    table = json.loads(out.read_text())
    assert [r["mode"] for r in table] == ["megatron-lm", "balanced", "optimus"]
    for row in table:
        assert {"config", "mode", "predicted_s", "measured_s", "planned"} <= set(row)
    assert [r["planned"] for r in table] == [False, False, True]
    text = bench.format_table(rows) + bench.format_speedups(rows)
    assert (
        "pp2: Optimus's speed-up (baseline step / Optimus step) against megatron-lm: measured -, "
        "predicted 1.333x"
    ) in text
    assert "the planner runs optimus; predicted from the cost model's constants" in text
    assert "pp2 balanced: not measured: the balanced baseline" in text


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--steps", "2"], "--steps 2: give at least 3"),
        (["--nproc", "100000"], "--nproc 100000: more ranks than this machine's"),
        (["--nproc", "4"], "has cluster.num_gpus=2; give --nproc 2"),
        (["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
        (["--profile", "no/such.json"], "--profile no/such.json: no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(bench, flags, said, capsys, monkeypatch):
    monkeypatch.setattr(bench, "available_cores", lambda: 8)
    given = {"--config": str(CONFIGS / "cpu" / "dp2.yaml"), "--nproc": "2", "--steps": "5"}
    given.update(zip(flags[::2], flags[1::2]))
    argv = [part for flag, value in given.items() for part in (flag, value)]
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and said in err


def test_a_failed_run_is_said_in_its_own_error_line(bench):
    stderr = "W1129 torchrun warning\noptimus-train: error: --baseline balanced: no\nTraceback\n"
    assert (
        bench.error_line("optimus-train", stderr) == "optimus-train: error: --baseline balanced: no"
    )
    assert bench.error_line("optimus-train", "a\nlast line\n\n") == "last line"
    assert bench.error_line("optimus-profile", "") == "optimus-profile failed with no output"
