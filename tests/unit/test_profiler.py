"""optimus-profile: the kernels it measures are the ones the scheduler looks up, its torch ops do
the cost model's FLOPs, and its profile changes the cost model. GPU runs are skipped without a
GPU."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel, KernelWork, load_comm_fits, load_profile
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.baselines import megatron_lm_balanced_baseline, megatron_lm_baseline
from optimus_mllm.scheduler.bubble_scheduler import best_schedule
from optimus_mllm.scheduler.step_host import fit_config
from optimus_mllm.tools.profiler import (
    check_flops,
    kernel_callable,
    kernel_op,
    median_us,
    profile_entries,
    profile_kernels,
    wallclock_timer,
    write_profile,
)

from support.paths import CONFIGS, REPO

CONFIG_FILES = [CONFIGS / "tiny.yaml", CONFIGS / "paper" / "fig5_8gpu.yaml"]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class RecordingCostModel(CostModel):
    """Remembers the key of every compute and communication kernel the scheduler asks about."""

    def __init__(self, config):
        super().__init__(config.cluster, config.cost_model)
        self.compute_keys: set[tuple] = set()
        self.comm_keys: set[tuple] = set()

    def compute_us(self, work: KernelWork, module: str, tp: int) -> float:
        self.compute_keys.add((module, work.name, work.phase, tp))
        return super().compute_us(work, module, tp)

    def comm_us(
        self, work: KernelWork, bandwidth_gbps: float, module: str = "", tp: int = 0
    ) -> float:
        self.comm_keys.add((module, work.name, work.phase, tp))
        return super().comm_us(work, bandwidth_gbps, module, tp)


def scheduler_lookups(config) -> RecordingCostModel:
    """Run Optimus and both Megatron-LM baselines, as bench_scheduler does, recording the
    lookups."""
    planned = plan(config)
    cost = RecordingCostModel(config)
    best_schedule(config, planned, cost)
    best_schedule(config, planned, cost, fine=False)
    megatron_lm_baseline(config, planned.llm_plan, cost)
    if len(config.encoders) == 1:
        megatron_lm_balanced_baseline(config, planned.llm_plan, cost)
    return cost


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_entries_are_exactly_the_compute_kernels_the_scheduler_looks_up(path):
    config = load_config(path)
    lookups = scheduler_lookups(config)
    keys = [e.key for e in profile_entries(config)]
    assert len(keys) == len(set(keys))
    assert set(keys) == lookups.compute_keys
    assert not set(keys) & lookups.comm_keys  # communication stays with the bandwidth model


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_gemm_callables_do_the_cost_models_flops(path):
    """torch's FLOP counter over each GEMM callable, forward, backward and recompute; the paper
    config runs on meta tensors (shapes only, no memory). CPU SDPA kernels are not counted by torch,
    so the attention core's shape is held to the cost model by the profiler's own check_flops."""
    config = load_config(path)
    device = "cpu" if path.stem == "tiny" else "meta"
    checked = 0
    for entry in profile_entries(config):
        if entry.work.kind != "gemm":
            continue
        fn = kernel_callable(
            kernel_op(config, entry),
            entry.work.phase,
            entry.work.name.startswith("recompute_"),
            device,
            torch.float32,
        )
        with FlopCounterMode(display=False) as counter:
            fn()
        assert counter.get_total_flops() == entry.work.flops, entry.key
        checked += 1
    assert checked >= 10


def test_gemm_shapes_match_the_cost_model_flops():
    config = load_config(CONFIG_FILES[1])
    by_key = {e.key: e for e in profile_entries(config)}
    for key in [
        ("llm", "qkv", "fwd", 2),
        ("llm", "fc1", "bwd", 2),
        ("vit", "fc2", "fwd", 1),
        ("vit", "projector_fc1", "fwd", 2),
        ("llm", "output_layer", "fwd", 2),
    ]:
        entry = by_key[key]
        op = kernel_op(config, entry)
        m, k, n = op.dims
        assert 2 * m * k * n * (2 if key[2] == "bwd" else 1) == entry.work.flops, key
    llm, enc = config.llm, config.encoders[0]
    assert kernel_op(config, by_key[("llm", "qkv", "fwd", 2)]).dims == (
        llm.seq_length,
        llm.hidden_size,
        3 * llm.hidden_size // 2,
    )
    assert kernel_op(config, by_key[("vit", "fc1", "fwd", 1)]).dims == (
        enc.seq_length,
        enc.hidden_size,
        enc.ffn_hidden_size,
    )


def test_median_us_warms_up_then_takes_the_median():
    calls = []
    times = iter([5.0, 1.0, 9.0])
    assert (
        median_us(
            lambda: calls.append(1), warmup=2, repeats=3, timer=lambda fn: (fn(), next(times))[1]
        )
        == 5.0
    )
    assert len(calls) == 5


def test_cpu_profile_loads_and_changes_the_cost_model(tmp_path):
    config = load_config(CONFIG_FILES[0])
    profile = profile_kernels(
        config, warmup=1, repeats=2, device="cpu", dtype=torch.float32, timer=wallclock_timer
    )
    assert {(k["module"], k["kernel"], k["phase"], k["tp"]) for k in profile["kernels"]} == {
        e.key for e in profile_entries(config)
    }
    assert all(k["time_us"] > 0 for k in profile["kernels"])
    out = tmp_path / "profile.json"
    write_profile(profile, out)
    table = load_profile(out)
    assert len(table) == len(profile["kernels"])
    planned = plan(config)
    roofline = best_schedule(config, planned, CostModel(config.cluster, config.cost_model))
    measured = best_schedule(config, planned, CostModel(config.cluster, config.cost_model, table))
    assert measured.llm_alone_us != roofline.llm_alone_us
    # a measured kernel's key is what the cost model hits: its time comes back unchanged
    entry = profile_entries(config)[0]
    assert (
        CostModel(config.cluster, config.cost_model, table).compute_us(
            entry.work, entry.module, entry.tp
        )
        == table[entry.key]
    )


def _cli(
    *args: str, cwd, threads: int | None = None, world: int = 1
) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), **_env()}
    if world > 1:  # what torchrun tells rank 0 of a job of ``world`` ranks
        env.update(WORLD_SIZE=str(world), RANK="0")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run(
        [sys.executable, "-m", "optimus_mllm.cli.profile", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``nproc`` ranks of optimus-profile as torchrun starts them (its variables, one thread a
    rank), forked from the test session's fork server (``train_utils.ranks``): rank 0's exit
    status and stderr, and every rank's stdout."""
    from support.train_utils import ranks

    done = ranks(
        nproc, *args, program=("-m", "optimus_mllm.cli.profile"), environment=_torchrun_env()
    )
    failed = next((d for d in done if d.returncode != 0), done[0])
    stdout = "".join(d.stdout for d in done)
    return subprocess.CompletedProcess(failed.args, failed.returncode, stdout, failed.stderr)


def _torchrun_env() -> dict[str, str]:
    return {**_env(), "OMP_NUM_THREADS": "1"}  # torchrun's default for more than one rank


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="profiles the CPU; a CUDA GPU is visible")
def test_cli_on_cpu_times_the_kernels_at_one_thread_and_says_communication_was_not_measured(
    tmp_path,
):
    out = tmp_path / "profile.json"
    proc = _cli(
        "--config",
        str(CONFIG_FILES[0]),
        "--out",
        str(out),
        "--warmup",
        "0",
        "--repeats",
        "1",
        cwd=tmp_path,
        threads=1,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert (data["device_kind"], data["threads"], data["dtype"]) == ("cpu", 1, "float32")
    assert data["megatron_core"] and data["torch"] == torch.__version__
    assert "communication" not in data and "run of one rank" in data["not_measured"]
    # each module's layers, as the runtime builds them, timed beside one layer's kernels: a
    # pipeline chunk's worth of the LLM's, all of the encoder's
    config = load_config(CONFIG_FILES[0])
    llm_plan = plan(config).llm_plan
    host = {(h["module"], h["phase"]): h for h in data["layer_host"]}
    assert set(host) == {("llm", "fwd"), ("llm", "bwd"), ("vit", "fwd"), ("vit", "bwd")}
    for (module, _), h in host.items():
        assert h["layers"] == (
            config.llm.num_layers // (llm_plan.pp * llm_plan.vp)
            if module == "llm"
            else config.encoders[0].num_layers
        )
        assert h["layer_us"] > 0 and h["kernels_us"] > 0
        assert h["host_us"] == pytest.approx(max(0.0, h["layer_us"] - h["kernels_us"]))
    assert data["optimizer_us_per_param"] > 0  # the runtime's optimizer over the LLM's chunk
    assert set(load_profile(out)) == {e.key for e in profile_entries(config)}
    assert load_comm_fits(out) == {}


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.is_available(), reason="profiles CPU ranks; a CUDA GPU is visible")
def test_cli_under_torchrun_fits_the_jobs_collectives_on_its_own_groups(tmp_path):
    # tiny is DP1 PP2 TP2: the TP group's collectives and the pipeline's send/receive
    out = tmp_path / "profile.json"
    proc = _torchrun(
        4,
        "--config",
        str(CONFIG_FILES[0]),
        "--out",
        str(out),
        "--warmup",
        "1",
        "--repeats",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["world_size"] == 4
    fits = load_comm_fits(out)
    assert set(fits) == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2), ("p2p", 2)}
    assert all(f.us(1e6) > 0 for f in fits.values())
    assert "all_reduce over 2 ranks (tp)" in proc.stdout
    assert "p2p over 2 ranks (pp)" in proc.stdout
    # the TP group's all-reduce now costs what was measured, not NVLink's bandwidth
    config = load_config(CONFIG_FILES[0], [f"cost_model.profile={out}"])
    work = KernelWork("tp_ar_mlp", "fwd", "comm", bytes=1e6, collective="all_reduce", group_size=2)
    cost = CostModel.from_config(config)
    assert cost.comm_us(work, 100.0) == fits[("all_reduce", 2)].us(1e6)
    # real steps of Megatron-LM's placement at half the microbatches, which the profile's host
    # work per LLM op predicts (unless its kernels alone predict more)
    llm_plan = plan(config).llm_plan
    fit = fit_config(config, llm_plan)
    step_host = data["step_host"]
    assert step_host["microbatches"] == fit.num_microbatches_total // llm_plan.dp == 4
    assert cost.microbatch_host_us == step_host["microbatch_host_us"] >= 0
    predicted = megatron_lm_baseline(fit, llm_plan, cost).iteration_us
    if cost.microbatch_host_us > 0:
        assert predicted == pytest.approx(step_host["measured_step_us"], rel=0.01)
    else:
        assert predicted >= step_host["measured_step_us"]
    assert "Megatron-LM's placement at 4 microbatches: measured" in proc.stdout


@pytest.mark.distributed
def test_cli_as_a_job_of_another_world_size_is_refused_in_one_line(tmp_path):
    out = tmp_path / "profile.json"
    proc = _cli("--config", str(CONFIG_FILES[0]), "--out", str(out), cwd=tmp_path, world=3)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "optimus-profile: error: a job of 3 ranks cannot measure config tiny's communication: "
        "run it with torchrun --nproc-per-node 4 (the config's cluster.num_gpus), or as one "
        "process to time its kernels only"
    ]
    assert not out.exists()


@needs_gpu
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_cli_measures_on_gpu(tmp_path, path):
    out = tmp_path / "profile.json"
    proc = _cli(
        "--config", str(path), "--out", str(out), "--warmup", "2", "--repeats", "5", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "roofline us" in proc.stdout and "not measured" in proc.stdout
    config = load_config(path)
    table = load_profile(out)
    assert set(table) == {e.key for e in profile_entries(config)}
    assert all(us > 0 for us in table.values())
    data = json.loads(out.read_text())
    assert data["device"] == torch.cuda.get_device_name(0)


def test_a_shape_out_of_step_with_the_cost_model_is_refused():
    config = load_config(CONFIG_FILES[0])
    entry = next(e for e in profile_entries(config) if e.work.name == "fc1")
    drifted = dataclasses.replace(
        entry, work=dataclasses.replace(entry.work, flops=entry.work.flops * 2)
    )
    with pytest.raises(OptimusError, match="out of date"):
        check_flops(drifted, kernel_op(config, drifted))
    unknown = dataclasses.replace(entry, work=dataclasses.replace(entry.work, name="fc3"))
    with pytest.raises(OptimusError, match="no torch op for kernel 'fc3'"):
        kernel_op(config, unknown)
