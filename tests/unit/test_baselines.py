"""Megatron-LM baselines (paper §5.1, Appendix B): the layer-partition DP and both simulated
baselines."""

from __future__ import annotations

import itertools
import random
import signal
from pathlib import Path

import pytest

from optimus_mllm.cli.plan import main as plan_main
from optimus_mllm.config import config_from_dict, load_config
from optimus_mllm.costing.cost_model import CostModel, KernelWork
from optimus_mllm.costing.memory_model import GIB
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.planner.planner import llm_memory
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.baselines import (
    balanced_partition,
    baseline_placements,
    max_virtual_stage_us,
    megatron_lm_balanced_baseline,
    megatron_lm_baseline,
    runnable_baselines,
)
from optimus_mllm.scheduler.llm_costs import build_llm_timeline, llm_op_work

from support.paths import CONFIGS

PAPER = sorted(p.stem for p in (CONFIGS / "paper").glob("*.yaml"))
SINGLE_ENCODER = [name for name in PAPER if not name.startswith("dualenc")]


def _setup(name: str, overrides: tuple[str, ...] = ()):
    config = load_config(CONFIGS / "paper" / f"{name}.yaml", overrides)
    return config, plan(config).llm_plan, CostModel.from_config(config)


def _slowest(times: list[float], ranges: list[tuple[int, int]]) -> float:
    return max(sum(times[lo:hi]) for lo, hi in ranges)


def _brute_force(times: list[float], stages: int) -> float:
    n = len(times)
    return min(
        _slowest(times, list(zip((0, *cuts), (*cuts, n))))
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )


def test_balanced_partition_matches_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        # small integers give ties, floats heterogeneous layers
        times = [
            float(rng.randint(1, 4)) if rng.random() < 0.5 else rng.uniform(0.1, 10)
            for _ in range(n)
        ]
        ranges = balanced_partition(times, stages)
        assert len(ranges) == stages
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(lo < hi for lo, hi in ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert _slowest(times, ranges) == pytest.approx(_brute_force(times, stages), rel=1e-12)


def test_balanced_partition_needs_a_layer_per_stage():
    with pytest.raises(ValueError):
        balanced_partition([1.0, 2.0], 3)


class _Faster(CostModel):
    """The same cost model with every kernel, collectives included, ``factor`` times faster."""

    def __init__(self, base: CostModel, factor: float):
        super().__init__(base.cluster, base.params, base.profile)
        self.factor = factor

    def compute_us(self, work: KernelWork, module: str, tp: int) -> float:
        return super().compute_us(work, module, tp) / self.factor

    def comm_us(self, work: KernelWork, bandwidth_gbps: float, module: str = "", tp: int = 0):
        return super().comm_us(work, bandwidth_gbps, module, tp) / self.factor


def _balanced_setup(seed: int) -> tuple[dict, int]:
    """A small single-encoder job with more layers than virtual stages (so that splits tie), as a
    config mapping, and the V to balance it at."""
    rng = random.Random(seed)
    pp, vp, tp, dp = (
        rng.choice([2, 4]),
        rng.choice([1, 2, 3, 4]),
        rng.choice([1, 2]),
        rng.choice([1, 2]),
    )
    heads, enc_heads = 4 * rng.choice([1, 2]), rng.choice([4, 8])
    encoder = {
        "name": "vit",
        "num_layers": rng.randint(2, 12),
        "hidden_size": 16 * enc_heads,
        "num_attention_heads": enc_heads,
        "ffn_hidden_size": 64 * enc_heads,
        "seq_length": rng.choice([64, 256, 512]),
        "patch_size": 4,
    }
    llm = {
        "num_layers": pp * rng.randint(vp, 3 * vp),
        "hidden_size": 32 * heads,
        "num_attention_heads": heads,
        "ffn_hidden_size": 128 * heads,
        "seq_length": 1024,
        "vocab_size": 1024,
    }
    raw = {
        "name": f"balanced{seed}",
        "cluster": {
            "num_gpus": tp * pp * dp,
            "gpus_per_node": max(4, tp),
            "gpu_memory_gib": 80,
            "inter_node_bandwidth_gbps": rng.choice([5.0, 50.0]),
        },
        "model": {"encoders": [encoder], "llm": llm},
        "training": {
            "global_batch_size": pp * rng.choice([1, 2, 4]) * dp,
            "micro_batch_size": 1,
            "recompute": rng.choice(["none", "selective", "full"]),
        },
        "parallel": {"llm": {"dp": dp, "pp": pp, "tp": tp, "vp": 1}},
    }
    return raw, vp


def test_balanced_is_never_slower_with_faster_kernels():
    """Every kernel up to 5 % faster never makes the balanced baseline slower: its split used to
    tie on the last bit of float sums, so that the same job, a little faster, could be split into
    virtual stages that load one pipeline rank more."""
    slower = []
    for seed in range(40):
        raw, vp = _balanced_setup(seed)
        config = config_from_dict(raw)
        llm = config.parallel.llm
        llm_plan = ParallelPlan(llm.dp, llm.pp, llm.tp, vp)
        cost = CostModel.from_config(config)
        before = megatron_lm_balanced_baseline(config, llm_plan, cost).iteration_us
        rng = random.Random(seed)
        for factor in (rng.uniform(1, 1.05), rng.uniform(1, 1.05)):
            after = megatron_lm_balanced_baseline(config, llm_plan, _Faster(cost, factor))
            if after.iteration_us > before * (1 + 1e-12):
                slower.append(
                    f"seed {seed} x{factor:.4f}: {before:.1f} -> {after.iteration_us:.1f}"
                )
    assert not slower, slower


def test_balanced_at_1536_gpus_is_no_slower_with_faster_memory():
    """strong_1536 at V12 under the paper calibration: memory efficiency 0.7 -> 0.8 (every kernel
    as fast or faster) took balanced from 10.847 to 11.350 s, the 2-layer virtual stages piling up
    on some pipeline ranks."""
    times = []
    for efficiency in (0.7, 0.8):
        config, llm_plan, cost = _setup(
            "strong_1536",
            ("cost_model.calibration=paper", f"cost_model.memory_efficiency={efficiency}"),
        )
        result = megatron_lm_balanced_baseline(config, llm_plan, cost, vp=12)
        times.append(result.iteration_us)
        # 96 virtual stages over 144 layers: every pipeline rank within one LLM layer of another
        per_rank = [
            sum(
                result.timeline.work[(s, c, p)].duration_us
                for c in range(12)
                for p in ("fwd", "bwd")
            )
            for s in range(llm_plan.pp)
        ]
        assert max(per_rank) - min(per_rank) < 25_600  # an LLM layer is 21-26 ms there
    assert times[1] <= times[0]


@pytest.mark.parametrize("name", PAPER)
def test_megatron_lm_is_never_faster_than_the_llm_alone(name):
    config, llm_plan, cost = _setup(name)
    alone = build_llm_timeline(config, llm_plan, cost)
    result = megatron_lm_baseline(config, llm_plan, cost)
    assert result.name == "Megatron-LM"
    assert result.iteration_us == result.timeline.iteration_us >= alone.iteration_us
    # the encoder parameters join the first stage's DP collectives only
    assert result.timeline.dp_all_gather_us[1:] == alone.dp_all_gather_us[1:]
    assert result.timeline.dp_all_gather_us[0] >= alone.dp_all_gather_us[0]


@pytest.mark.parametrize("name", ["model_a", "dualenc_22b_5b"])
def test_megatron_lm_runs_encoders_in_the_first_stages_pre_process(name):
    config, llm_plan, cost = _setup(name)
    work = megatron_lm_baseline(config, llm_plan, cost).timeline.work
    llm = llm_op_work(config, llm_plan, cost)
    fwd = [k.name for k in work[(0, 0, "fwd")].kernels]
    bwd = [k.name for k in work[(0, 0, "bwd")].kernels]
    for enc in config.encoders:
        assert fwd.count(f"{enc.name}.qkv") == enc.num_layers == bwd.count(f"{enc.name}.qkv")
        assert f"{enc.name}.patch_embed" in fwd and f"{enc.name}.projector_fc1" in fwd
    assert fwd[0] == f"{config.encoders[0].name}.patch_embed"  # encoders before the LLM's embedding
    assert fwd[-len(llm[(0, 0, "fwd")].kernels) :] == [k.name for k in llm[(0, 0, "fwd")].kernels]
    assert bwd[: len(llm[(0, 0, "bwd")].kernels)] == [k.name for k in llm[(0, 0, "bwd")].kernels]
    assert all(work[key] == op for key, op in llm.items() if key[:2] != (0, 0))


def test_frozen_encoder_runs_only_its_projector_backward():
    config, llm_plan, cost = _setup("model_a", ("model.encoders.0.frozen=true",))
    bwd = [
        k.name
        for k in megatron_lm_baseline(config, llm_plan, cost).timeline.work[(0, 0, "bwd")].kernels
    ]
    assert "vit.projector_fc1" in bwd and "vit.qkv" not in bwd and "vit.patch_embed" not in bwd


@pytest.mark.parametrize("name", SINGLE_ENCODER)
def test_balanced_slowest_virtual_stage_is_no_slower_than_megatron_lms(name):
    config, llm_plan, cost = _setup(name)
    plain = megatron_lm_baseline(config, llm_plan, cost)
    balanced = megatron_lm_balanced_baseline(config, llm_plan, cost)
    assert balanced.name == "Megatron-LM balanced"
    assert balanced.timeline.vp == llm_plan.vp
    assert max_virtual_stage_us(balanced.timeline) <= max_virtual_stage_us(plain.timeline) * (
        1 + 1e-12
    )
    ranges = balanced.layer_ranges
    assert len(ranges) == llm_plan.pp * llm_plan.vp
    assert ranges[-1][1] == config.encoders[0].num_layers + config.llm.num_layers


def test_balanced_accepts_the_papers_virtual_stages():
    config, llm_plan, cost = _setup("model_d")
    result = megatron_lm_balanced_baseline(config, llm_plan, cost, vp=12)
    assert result.timeline.vp == 12 and len(result.layer_ranges) == 96


def test_balanced_needs_a_layer_per_virtual_stage():
    config, llm_plan, cost = _setup("model_a")  # 48 + 80 layers
    with pytest.raises(OptimusError, match="at most 128"):
        megatron_lm_balanced_baseline(config, llm_plan, cost, vp=40)


def test_balanced_rejects_several_encoders_but_megatron_lm_runs_them():
    config, llm_plan, cost = _setup("dualenc_22b_5b")
    with pytest.raises(OptimusError, match="single encoder only"):
        megatron_lm_balanced_baseline(config, llm_plan, cost)
    assert megatron_lm_baseline(config, llm_plan, cost).iteration_us > 0


def _plan_error(config: Path, overrides: tuple[str, ...], capsys, *extra: str) -> str:
    """optimus-plan's one-line refusal (exit 2) of ``config`` with ``overrides``."""
    argv = ["--config", str(config), *extra]
    for override in overrides:
        argv += ["--override", override]
    assert plan_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("optimus-plan: error: ")
    return err


@pytest.mark.parametrize(
    "config, override, needs",
    [
        # every placement is out of memory, the baselines included: they were recommended before
        ("tiny.yaml", "cluster.gpu_memory_gib=1e-300", "the Megatron-LM balanced baseline, needs"),
        ("tiny.yaml", "model.encoders.0.patch_size=100000", "encoder plan DP2 PP1 TP2, needs 5364"),
        ("tiny.yaml", "model.llm.kv_channels=100000", "needs 1.546 GiB"),
        # perturbed paper configs whose LLM alone is larger than the GPU
        ("paper/fig5_8gpu.yaml", "model.llm.seq_length=16384", "needs 120.9 GiB"),
        ("paper/dualenc_11b_5b.yaml", "model.llm.seq_length=8192", "needs 105.1 GiB"),
    ],
)
def test_nothing_fitting_is_one_line_naming_the_smallest_shortfall(config, override, needs, capsys):
    err = _plan_error(CONFIGS / config, (override,), capsys)
    assert "cluster.gpu_memory_gib: nothing fits in" in err and needs in err
    assert "GiB short" in err and "baseline is faster" not in err


def test_nothing_fitting_with_trace_names_the_pruned_plans(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    err = _plan_error(
        CONFIGS / "tiny.yaml",
        ("model.encoders.0.patch_size=100000",),
        capsys,
        "--trace",
        str(trace),
    )
    assert "out of memory (GiB): DP4 PP1 TP1 8941, DP2 PP1 TP2 5364, " in err
    assert "Megatron-LM balanced 7153" in err and not trace.exists()


def test_an_infinite_kernel_time_names_the_efficiency(capsys):
    err = _plan_error(CONFIGS / "tiny.yaml", ("cost_model.gemm_efficiency=1e-320",), capsys)
    assert "cost_model.gemm_efficiency:" in err and "infinite time" in err
    assert "inf s" not in err


def test_baselines_out_of_memory_are_not_runnable():
    config, llm_plan, cost = _setup("fig5_8gpu")
    placements = baseline_placements(config, llm_plan, cost)
    assert [b.runtime for b in placements] == ["megatron-lm", "balanced"]
    assert runnable_baselines(config, llm_plan, cost) == placements
    # the Megatron-LM baseline holds the LLM's fullest rank plus every encoder
    plain = placements[0]
    assert plain.memory.total > llm_memory(config, llm_plan).total
    smaller = min(b.memory.total for b in placements) / GIB
    tight, _, _ = _setup("fig5_8gpu", (f"cluster.gpu_memory_gib={smaller * 0.999}",))
    assert runnable_baselines(tight, llm_plan, cost) == []
    roomy, _, _ = _setup("fig5_8gpu", (f"cluster.gpu_memory_gib={smaller * 1.001}",))
    assert len(runnable_baselines(roomy, llm_plan, cost)) == 1


def test_huge_finite_times_do_not_stall_the_search(capsys):
    """peak_tflops 1e-298 gives iterations of 1e298 s: the bisection for the earliest feasible t0
    (to 0.01 us) used to loop forever once 0.01 us fell below the times' float spacing. (At 1e-300
    the tiny encoder's kernels, which fill a fraction of one wave, take some 1e304 s, and sums of
    them come close to the largest float.)"""

    def expire(signum, frame):
        raise TimeoutError("the scheduler did not finish")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    try:
        code = plan_main(
            ["--config", str(CONFIGS / "tiny.yaml"), "--override", "cluster.peak_tflops=1e-298"]
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 0 and "chosen: LLM" in capsys.readouterr().out
