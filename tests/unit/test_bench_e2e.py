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
        (["--rounds", "0"], "--rounds 0: give at least 1"),
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


def test_rounds_keep_each_rows_medians_its_range_and_the_placement_planned_most(bench):
    def rounds(*rows):
        return [
            [
                bench.Row("pp2", mode, predicted, measured, planned, f"r{i}.json")
                for mode, predicted, measured, planned in round_rows
            ]
            for i, round_rows in enumerate(rows)
        ]

    combined = bench.combine_rounds(
        rounds(
            [("megatron-lm", 2.0, 3.0, False), ("optimus", 1.5, 2.0, True)],
            [("megatron-lm", 2.2, 2.5, True), ("optimus", 1.7, None, False)],
            [("megatron-lm", 2.1, 2.8, False), ("optimus", 1.6, 2.4, True)],
        )
    )
    got = [(r.mode, r.predicted_s, r.measured_s, r.measured_range_s, r.planned) for r in combined]
    # optimus's second round failed: its median and range are of the two it measured
    assert got == [
        ("megatron-lm", 2.1, 2.8, (2.5, 3.0), False),
        ("optimus", 1.6, 2.2, (2.0, 2.4), True),
    ]
    assert combined[0].predicted_from == "3 profiles, one a round"
    assert "2.500-3.000" in bench.format_table(combined)
    # a tie between the planned placements goes to the earliest round's
    tied = bench.combine_rounds(
        rounds(
            [("megatron-lm", 2.0, 3.0, True), ("optimus", 1.5, 2.0, False)],
            [("megatron-lm", 2.0, 3.0, False), ("optimus", 1.5, 2.0, True)],
        )
    )
    assert [r.planned for r in tied] == [True, False]
    one = rounds([("optimus", 1.5, 2.0, True)])
    assert bench.combine_rounds(one) == one[0]


def test_a_failed_run_is_said_in_its_own_error_line(bench):
    stderr = "W1129 torchrun warning\noptimus-train: error: --baseline balanced: no\nTraceback\n"
    assert (
        bench.error_line("optimus-train", stderr) == "optimus-train: error: --baseline balanced: no"
    )
    assert bench.error_line("optimus-train", "a\nlast line\n\n") == "last line"
    assert bench.error_line("optimus-profile", "") == "optimus-profile failed with no output"


# Megatron-LM's own pretrain_vlm.py: the flags of a config, and what its log says

LLAVA = CONFIGS / "cpu" / "pp2_v1_llava.yaml"

# pretrain_vlm.py's log (configs/cpu/pp2_v1_llava.yaml, 4 iterations, with the flag), shortened
SCRIPT_OUTPUT = """\
optimus: --optimus-schedule auto: encoder plan DP2 PP1 TP1, warm-up [1, 0], 1.8500 s per \
iteration predicted
 [2026-11-29 10:00:01] iteration        1/       4 | consumed samples:            8 | elapsed \
time per iteration (ms): 9000.5 | learning rate: 1.000000E-04 | global batch size:     8 | lm \
loss: 6.970000E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
 [2026-11-29 10:00:04] iteration        2/       4 | consumed samples:           16 | elapsed \
time per iteration (ms): 3000.0 | learning rate: 7.5E-05 | global batch size:     8 | lm loss: \
6.960000E+00 | loss scale: 1.0 | grad norm: 1.100 | number of skipped iterations:   0 |
 [2026-11-29 10:00:06] iteration        3/       4 | consumed samples:           24 | elapsed \
time per iteration (ms): 2000.0 | learning rate: 5.0E-05 | global batch size:     8 | lm loss: \
6.950000E+00 | loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 |
 [2026-11-29 10:00:09] iteration        4/       4 | consumed samples:           32 | elapsed \
time per iteration (ms): 2500.0 | learning rate: 2.5E-05 | global batch size:     8 | lm loss: \
6.940000E+00 | loss scale: 1.0 | grad norm: 0.900 | number of skipped iterations:   0 |
"""
FALLBACK = (
    "optimus: --optimus-schedule auto: Megatron-LM's placement (the vision model in the first "
    "pipeline stage, 2.1000 s per iteration predicted) is no slower than every Optimus schedule "
    "(best 2.1500 s) within the step noise of 3.0%; training as Megatron-LM does"
)


def test_megatron_s_elapsed_time_per_iteration_is_read_after_warm_up(bench):
    assert bench.compare.elapsed_ms(SCRIPT_OUTPUT) == {1: 9000.5, 2: 3000.0, 3: 2000.0, 4: 2500.0}
    assert bench.parse_script(SCRIPT_OUTPUT) == bench.Measured(step_s=2.25, loss=6.94, steps=4)
    assert bench.parse_script(SCRIPT_OUTPUT, warmup=3) == bench.Measured(2.5, 6.94, 4)
    assert bench.parse_script(SCRIPT_OUTPUT, warmup=4) is None
    assert bench.parse_script("") is None


def test_the_flag_s_prediction_is_the_iteration_it_says_it_runs(bench):
    said = bench.FLAG_LINE.search(SCRIPT_OUTPUT)[0]
    assert bench.flag_predicted_s(said) == 1.85
    assert bench.flag_predicted_s(FALLBACK) == 2.1  # Megatron-LM's placement, which it runs
    assert bench.flag_predicted_s(None) is None


def _read_back(bench, flags):
    """The config the flag reads off pretrain_vlm.py's command line, as Megatron-LM passes it."""
    return bench.flags_config(flags, 2)


def test_a_config_pretrain_vlm_can_build_is_its_flags_job(bench):
    from dataclasses import replace

    from optimus_mllm.config import load_config

    config = load_config(LLAVA)
    flags = bench.script_flags(config)
    assert not isinstance(flags, str), flags
    assert flags[: len(bench.compare.CPU_VLM_ARGS)] == bench.compare.CPU_VLM_ARGS
    built = _read_back(bench, flags)
    # the ViT, its projector and the LLM as the YAML has them; the null tokenizer's
    # end-of-document token makes Megatron's vocabulary one more than --vocab-size
    assert built.encoders == config.encoders
    assert replace(built.llm, vocab_size=built.llm.vocab_size + 1) == config.llm
    assert built.parallel.llm == config.parallel.llm
    assert built.cluster == config.cluster
    same = ("global_batch_size", "micro_batch_size", "precision", "distributed_optimizer")
    same += ("sequence_parallel", "recompute", "optimizer", "lr", "min_lr", "seed")
    for field in same:
        assert getattr(built.training, field) == getattr(config.training, field), field
    # the picture: 64 x 64 pixels in 4 x 4 patches, 64 text tokens beside the 256 image tokens
    given = dict(zip(flags, flags[1:]))
    assert (given["--img-h"], given["--img-w"], given["--patch-dim"]) == ("64", "64", "4")
    assert (given["--seq-length"], given["--dataloader-seq-length"]) == ("64", "64")
    assert "--disable-vision-class-token" in flags and "--swiglu" not in flags


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "model.encoders.0.projector.spatial_merge=2",
            "projector: mlp with spatial_merge 2; pretrain_vlm.py's projector is an MLP merging "
            "no patches",
        ),
        ("parallel.llm.vp=2", "parallel.llm.vp 2: pretrain_vlm.py cannot run interleaved"),
        (
            "model.encoders.0.class_token=false model.encoders.0.drop_class_token=false",
            "builds CLIP (model_subtype clip) with its class token",
        ),
        (
            "model.encoders.0.normalization=RMSNorm",
            "normalization RMSNorm is not model.llm's LayerNorm",
        ),
        (
            "model.encoders.0.num_attention_heads=2",
            "num_attention_heads 2 is not model.llm's 4: pretrain_vlm.py's ViT is a copy",
        ),
        ("model.encoders.0.projector.ffn_hidden_size=192", "projector is the LLM's MLP"),
        ("model.llm.vocab_size=1000", "vocab_size 1000: Megatron-LM pads its vocabulary"),
        ("model.encoders.0.name=vision", "name vision: the flag names its ViT vit"),
        ("data.max_images_per_microbatch=2", "data: pretrain_vlm.py trains on Megatron's mock"),
        ("cluster.gpus_per_node=1", "build another job: cluster.gpus_per_node=1, this job has 2"),
    ],
)
def test_a_config_the_flags_would_build_otherwise_is_refused_in_one_line(bench, override, said):
    from optimus_mllm.config import load_config

    why = bench.script_flags(load_config(LLAVA, override.split()))
    assert isinstance(why, str) and "\n" not in why and said in why, why


def test_the_other_cpu_configs_say_why_pretrain_vlm_cannot_run_them(bench):
    from optimus_mllm.config import load_config

    for name in ("dp2", "pp2_v1_heavy_vit", "tp2"):  # a ViT narrower than the LLM
        why = bench.script_flags(load_config(CONFIGS / "cpu" / f"{name}.yaml"))
        assert "pretrain_vlm.py's ViT is a copy of the LLM's layers" in why, (name, why)
    for name in ("pp2_v2_heavy_vit", "pp2_v2_light_vit"):
        why = bench.script_flags(load_config(CONFIGS / "cpu" / f"{name}.yaml"))
        assert "cannot run interleaved" in why, (name, why)


def test_the_script_rows_and_the_flag_s_speed_up(bench):
    said = bench.FLAG_LINE.search(SCRIPT_OUTPUT)[0]
    rows = [
        bench.Row("llava", "megatron-lm", 2.4, 3.0, False, "p.json"),
        bench.Row("llava", "balanced", 2.2, 2.8, False, "p.json"),
        bench.Row("llava", "optimus", 1.9, 2.5, True, "p.json"),
        bench.Row("llava", bench.SCRIPT, 2.4, 3.2, False, "p.json", loss=6.94, steps=4),
        bench.Row(
            "llava", bench.SCRIPT_WITH_FLAG, 1.85, 2.56, False, "p.json", 6.94, 4, None, said
        ),
    ]
    text = bench.format_table(rows) + bench.format_speedups(rows)
    assert "llava                megatron-lm-script+optimus       1.8500      2.5600" in text
    assert (
        "llava: pretrain_vlm.py's speed-up from --optimus-schedule auto (iteration without / "
        "with): measured 1.250x, predicted 1.297x; the flag ran an Optimus schedule"
    ) in text
    fell_back = [*rows[:4], bench.replace(rows[4], said=FALLBACK, predicted_s=2.1)]
    assert "the flag ran Megatron-LM's placement" in bench.format_speedups(fell_back)


def test_a_megatron_lm_dir_without_pretrain_vlm_is_one_line(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "available_cores", lambda: 8)
    with pytest.raises(SystemExit) as exited:
        bench.main(["--config", str(LLAVA), "--nproc", "2", "--steps", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"MEGATRON_LM_DIR {tmp_path}: no pretrain_vlm.py" in err[0], err


@pytest.mark.distributed  # energon's preparation of the shards starts worker processes
def test_a_config_whose_images_vary_trains_on_a_sample_dataset_drawn_from_its_histogram(
    bench, tmp_path
):
    """configs/cpu/pp2_v2_varying_images.yaml names no dataset: the bench makes a webdataset whose
    samples carry 0-4 images each, 64 px (the ViT's 256 tokens in 4 px patches), and every run of
    the config reads it; a config with a dataset, or images that do not vary, gets none."""
    import io
    import tarfile
    from collections import Counter

    from PIL import Image

    path = str(CONFIGS / "cpu" / "pp2_v2_varying_images.yaml")
    override = bench.sample_data(path, tmp_path)
    data = tmp_path / "pp2_v2_varying_images.data"
    assert override == [f"data.path={data}"]
    assert (data / ".nv-meta").is_dir()
    images: Counter[str] = Counter()
    sizes = set()
    for shard in sorted(data.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                images[key] += 0
                if ext.endswith("png"):
                    images[key] += 1
                    sizes.add(Image.open(io.BytesIO(tar.extractfile(member).read())).size)
    assert len(images) == bench.SAMPLE_DATA_SAMPLES
    assert set(images.values()) == set(range(5))  # every count of the histogram, no other
    assert sizes == {(64, 64)}
    assert bench.sample_data(str(CONFIGS / "cpu" / "pp2_v2_heavy_vit.yaml"), tmp_path) == []


def test_a_histogram_the_sample_dataset_cannot_draw_is_refused_in_one_line(bench, tmp_path):
    from optimus_mllm.errors import OptimusError

    raw = (CONFIGS / "cpu" / "pp2_v2_varying_images.yaml").read_text()
    skewed = tmp_path / "skewed.yaml"
    skewed.write_text(raw.replace("{0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2}", "{0: 0.5, 4: 0.5}"))
    with pytest.raises(
        OptimusError, match=r"^data\.images_per_sample: .* not \{0: 0\.5, 4: 0\.5\}"
    ):
        bench.sample_data(str(skewed), tmp_path)
    assert not list(tmp_path.glob("*.data"))
