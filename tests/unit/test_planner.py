"""Model planner: LLM plan choice, encoder plan enumeration, placement, partitions, CLI output."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest

from optimus_mllm.cli.plan import main
from optimus_mllm.config import load_config
from optimus_mllm.planner import (
    ParallelPlan,
    encoder_stage_gpus,
    microbatch_partitions,
    plan,
    symmetry_groups,
)
from optimus_mllm.planner.planner import choose_virtual_stages

from support.paths import CONFIGS, balanced_wins

PAPER = sorted(p.stem for p in (CONFIGS / "paper").glob("*.yaml"))
# benchmarks/bench_e2e.py's 2-rank CPU configs
CPU = sorted(f"cpu/{p.stem}" for p in (CONFIGS / "cpu").glob("*.yaml"))


def test_figure5_example_includes_the_papers_encoder_plan():
    result = plan(load_config(CONFIGS / "paper" / "fig5_8gpu.yaml"))
    assert result.llm_plan == ParallelPlan(dp=1, pp=4, tp=2, vp=2)
    plans = {c.plan for c in result.candidates}
    assert ParallelPlan(dp=2, pp=2, tp=2) in plans
    fig5 = next(c for c in result.candidates if c.plan == ParallelPlan(dp=2, pp=2, tp=2))
    assert fig5.m == 2


@pytest.mark.parametrize("name", PAPER + ["tiny"] + CPU)
def test_every_listed_plan_obeys_divisibility(name):
    config = load_config(CONFIGS / ("paper" if name in PAPER else "") / f"{name}.yaml")
    result = plan(config)
    llm, n = result.llm_plan, config.cluster.num_gpus
    assert llm.world_size == n
    assert config.llm.num_layers % (llm.pp * llm.vp) == 0
    assert config.num_microbatches_total % llm.dp == 0
    for c in result.candidates + tuple(p for p in result.pruned):
        enc = c.plan
        assert llm.pp % enc.pp == 0 and llm.tp % enc.tp == 0
        assert enc.world_size == n
        assert enc.dp % llm.dp == 0
    for c in result.candidates:
        assert c.m == c.plan.dp // llm.dp
        assert all(e.num_attention_heads % c.plan.tp == 0 for e in config.encoders)
        assert c.memory.total <= result.gpu_memory_bytes
        for part in c.partitions.partitions:
            assert len(part) == c.m and sum(part) == result.num_microbatches
            assert min(part) >= 1 and max(part) <= c.max_microbatches_per_pipeline
    # every divisor pair is either kept or pruned, exactly once
    seen = Counter((c.plan.pp, c.plan.tp) for c in result.candidates + result.pruned)
    fixed = config.parallel.encoder
    expected = (
        {(fixed.pp, fixed.tp)}
        if fixed
        else {
            (p, t)
            for p in range(1, llm.pp + 1)
            for t in range(1, llm.tp + 1)
            if llm.pp % p == 0 and llm.tp % t == 0
        }
    )
    assert set(seen) == expected and max(seen.values()) == 1


def test_figure5_placement():
    layout = encoder_stage_gpus(ParallelPlan(1, 4, 2), ParallelPlan(2, 2, 2))
    assert layout == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@pytest.mark.parametrize("pp_enc, tp_enc", [(1, 1), (1, 4), (2, 2), (4, 8), (8, 1)])
def test_every_gpu_holds_exactly_one_encoder_stage(pp_enc, tp_enc):
    llm = ParallelPlan(1, 8, 8)
    enc = ParallelPlan(64 // (pp_enc * tp_enc), pp_enc, tp_enc)
    layout = encoder_stage_gpus(llm, enc)
    gpus = [g for pipeline in layout for stage in pipeline for g in stage]
    assert sorted(gpus) == list(range(64))
    for pipeline in layout:  # stage e+1 sits on the next LLM stage
        llm_stages = [stage[0] // llm.tp for stage in pipeline]
        assert llm_stages == list(range(llm_stages[0], llm_stages[0] + pp_enc))


def test_paper_partition_example():
    """Paper §4.1: 8 microbatches over 2 encoder pipelines on different LLM stages: [1,7] ...
    [7,1]."""
    result = microbatch_partitions(8, [1, 1], 8, cap=100)
    assert sorted(result.partitions) == [(i, 8 - i) for i in range(1, 8)]
    assert result.num_compositions == 7 and not result.truncated


@pytest.mark.parametrize("n, groups", [(8, [2]), (9, [2, 2]), (10, [3, 1]), (7, [1, 1, 1])])
def test_symmetry_reduction_is_exact(n, groups):
    """Uncapped, the kept partitions' orbits under in-group permutations are all compositions, once
    each."""
    result = microbatch_partitions(n, groups, n, cap=10**6)
    m = sum(groups)
    all_compositions = {c for c in itertools.product(range(1, n + 1), repeat=m) if sum(c) == n}
    assert len(all_compositions) == result.num_compositions == math.comb(n - 1, m - 1)

    def canonical(part):
        out, i = [], 0
        for size in groups:
            out += sorted(part[i : i + size], reverse=True)
            i += size
        return tuple(out)

    assert len(set(result.partitions)) == len(result.partitions)
    assert {canonical(c) for c in all_compositions} == set(result.partitions)


def test_partition_cap_keeps_even_split_first_and_says_so():
    result = microbatch_partitions(16, [1] * 8, 16, cap=10)
    assert result.truncated and len(result.partitions) == 10
    assert result.partitions[0] == (2,) * 8
    spreads = [max(p) - min(p) for p in result.partitions]
    assert spreads == sorted(spreads)


def test_memory_bound_limits_partition_parts():
    result = microbatch_partitions(8, [1, 1], 5, cap=100)
    assert sorted(result.partitions) == [(3, 5), (4, 4), (5, 3)]
    assert microbatch_partitions(8, [1, 1], 3, cap=100).partitions == ()


def test_planner_chooses_llm_plan_by_megatron_guidance():
    config = load_config(CONFIGS / "paper" / "appc_vit3b_gpt11b_8gpu.yaml")
    result = plan(config)
    chosen = result.llm_plan
    assert result.llm_plan_origin == "planner"
    assert chosen.tp <= config.cluster.gpus_per_node
    assert result.candidates, "the chosen LLM plan must leave room for an encoder plan"
    for (
        rejected
    ) in result.llm_rejected:  # everything tried first was smaller or equal and did not fit
        assert rejected.plan.tp * rejected.plan.pp <= chosen.tp * chosen.pp
        assert rejected.reason


def test_no_llm_plan_fits_is_a_one_line_error(capsys):
    path = str(CONFIGS / "paper" / "appc_vit3b_gpt11b_8gpu.yaml")
    assert main(["--config", path, "--override", "cluster.gpu_memory_gib=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no LLM plan fits 8 GPUs of 4 GiB" in err


def test_virtual_stage_choice():
    config = load_config(CONFIGS / "paper" / "model_d.yaml")
    assert choose_virtual_stages(config, 8, 16) == 12  # 12 layers per stage, one per chunk
    capped = load_config(CONFIGS / "paper" / "model_d.yaml", ["planner.max_virtual_stages=5"])
    assert choose_virtual_stages(capped, 8, 16) == 4
    # interleaving needs a multiple of PP microbatches
    assert choose_virtual_stages(config, 8, 12) == 1


def test_symmetry_groups_follow_tp_slots():
    assert symmetry_groups(ParallelPlan(1, 4, 2), ParallelPlan(2, 2, 2)) == [1, 1]
    assert symmetry_groups(ParallelPlan(1, 4, 2), ParallelPlan(4, 2, 1)) == [2, 2]


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert (
        main(["--config", str(CONFIGS / "paper" / "strong_3072.yaml"), "--json", str(out_json)])
        == 0
    )
    out = capsys.readouterr().out
    assert "LLM plan (config): DP48 PP8 TP8 V12, 16 microbatches per LLM pipeline" in out
    assert "ranked by simulated iteration time (bubble scheduler)" in out
    assert "pruned encoder plans" in out and "chosen: LLM DP48 PP8 TP8 V12 | encoder" in out
    data = json.loads(out_json.read_text())
    assert data["llm_plan"] == {"dp": 48, "pp": 8, "tp": 8, "vp": 12}
    expected = plan(load_config(CONFIGS / "paper" / "strong_3072.yaml"))
    assert sorted(map(str, (p["plan"] for p in data["encoder_plans"]))) == sorted(
        str(c.plan.as_dict()) for c in expected.candidates
    )
    assert data["chosen"]["encoder_plan"] == data["encoder_plans"][0]["plan"]
    assert data["encoder_plans"][0]["status"] == "scheduled"
    first = data["encoder_plans"][0]
    assert set(first["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    assert all("reason" in p for p in data["pruned"])
    assert data["faster_baseline"] is None


def test_cli_names_a_baseline_that_beats_every_schedule(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert main(["--config", str(balanced_wins(tmp_path)), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "chosen: LLM DP1 PP2 TP1 V2 | encoder" in out  # Optimus's fastest schedule, still shown
    # the placements' lines (test_placements) follow
    assert (
        "but the Megatron-LM balanced baseline is faster: iteration 0.0011 s; "
        "optimus-train runs it (--baseline balanced) unless given this schedule (--schedule)\n"
    ) in out
    data = json.loads(out_json.read_text())
    assert data["faster_baseline"]["runtime"] == "balanced"
    assert data["faster_baseline"]["iteration_us"] < data["chosen"]["iteration_us"]


def test_cli_writes_artifact_trace_and_png(tmp_path, capsys):
    # matplotlib is in .[dev]: a missing one fails here rather than skipping the PNG
    out = {name: tmp_path / name for name in ("schedule.json", "trace.json", "timeline.png")}
    assert (
        main(
            [
                "--config",
                str(CONFIGS / "tiny.yaml"),
                "--artifact",
                str(out["schedule.json"]),
                "--trace",
                str(out["trace.json"]),
                "--png",
                str(out["timeline.png"]),
            ]
        )
        == 0
    )
    assert "chosen: LLM DP1 PP2 TP2 V2 | encoder" in capsys.readouterr().out
    assert json.loads(out["schedule.json"].read_text())["format"] == "optimus-schedule"
    assert json.loads(out["trace.json"].read_text())["traceEvents"]
    assert out["timeline.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_output_into_missing_directory_is_a_clear_error(tmp_path, capsys):
    assert (
        main(
            ["--config", str(CONFIGS / "tiny.yaml"), "--artifact", str(tmp_path / "no" / "a.json")]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err


def test_a_long_sequence_encoder_no_1d_plan_fits_gets_metp_plans(capsys):
    """Issue 37's planning half: 8192 patch tokens per image prune every 1D encoder plan for
    memory; under parallel.encoder.tp_mode: metp the planner keeps METP plans, and optimus-plan
    prints the mode."""
    path = CONFIGS / "metp_long_vision.yaml"
    one_d = plan(load_config(path, ["parallel.encoder.tp_mode=1d"]))
    assert one_d.candidates == ()
    assert all(p.reason.startswith("out of memory") for p in one_d.pruned), one_d.pruned
    metp = plan(load_config(path))
    assert metp.candidates
    assert {c.plan.tp_mode for c in metp.candidates} == {"metp"}
    # each kept METP plan's TP degree was pruned under 1D for memory
    tried = {(p.plan.pp, p.plan.tp) for p in one_d.pruned}
    assert {(c.plan.pp, c.plan.tp) for c in metp.candidates} <= tried
    assert {p.reason for p in metp.pruned} == {
        "encoder 'vit': tp_mode=metp needs a TP degree of at least 2 (its ring), got tp=1"
    }
    assert main(["--config", str(path)]) == 0
    assert "chosen: LLM DP1 PP4 TP2 V8 | encoder DP4 PP1 TP2 metp |" in capsys.readouterr().out
    # the LLM plan search prices each LLM plan with an encoder in the config's mode too: with a
    # 1D encoder none fits
    chosen = plan(load_config(path, ["parallel.llm=null"]))
    assert chosen.llm_plan_origin == "planner" and chosen.candidates


def test_the_encoder_tp_mode_keeps_the_degrees_it_can_take():
    """2d on an LLM TP of 4: only TP_enc = 4 (a 2 x 2 grid) is a square; its plans carry the mode,
    a fixed encoder plan too."""
    path = CONFIGS / "tiny.yaml"
    llm = "parallel.llm={dp: 1, pp: 1, tp: 4}"
    result = plan(load_config(path, [llm, "parallel.encoder={tp_mode: 2d}"]))
    assert [c.plan for c in result.candidates] == [ParallelPlan(1, 1, 4, 1, "2d")]
    assert all("square TP degree" in p.reason for p in result.pruned)
    fixed = plan(load_config(path, [llm, "parallel.encoder={pp: 1, tp: 4, tp_mode: 2d}"]))
    assert [c.plan for c in fixed.candidates] == [ParallelPlan(1, 1, 4, 1, "2d")]
    llm_metp = plan(load_config(path, ["parallel.llm={dp: 1, pp: 1, tp: 4, tp_mode: metp}"]))
    assert llm_metp.llm_plan == ParallelPlan(1, 1, 4, 1, "metp")
