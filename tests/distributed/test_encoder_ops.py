"""Encoder ops: their chains are the cost model's stage chains, and running them op by op (any split
into prefixes, microbatches interleaved) gives the outputs and gradients of ordinary autograd
through the whole stage: TP1 in this process, TP2 on two gloo ranks with and without sequence
parallelism, where the TP2 stage also matches an unsharded copy of itself."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from optimus_mllm.config import OptimusConfig, config_from_dict
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.encoder_ops import MicrobatchRun, StageOps, build_stage_ops
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.encoder_costs import build_encoder_work

from support.distributed_utils import run_distributed
from support.paths import CONFIGS

SEED = 1234
MICRO_BATCH = 2
TOL = 1e-5
RANK_TIMEOUT_S = 120.0  # hard limit; both ranks take about 10 s on 2 shared cores

FROZEN_ENCODER = {  # a second, frozen encoder with a linear projector
    "name": "vit_small",
    "num_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "ffn_hidden_size": 32,
    "seq_length": 8,
    "patch_size": 2,
    "in_channels": 3,
    "frozen": True,
    "projector": {"type": "linear"},
}
GATED_GQA = {  # gated MLP, grouped-query attention, head dim != hidden / heads, RMSNorm, no biases
    "gated_linear_unit": True,
    "num_query_groups": 2,
    "kv_channels": 16,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
}
DROPOUT = {"hidden_dropout": 0.2, "attention_dropout": 0.3}
CASES = {
    "tiny": {},
    "tiny-selective": {"recompute": "selective"},
    "dual-frozen": {"dual": True},
    "dual-frozen-full": {"dual": True, "recompute": "full"},
    "gated-gqa": {"encoder": GATED_GQA},
    # ln_pre: under sequence parallelism on a rank's own tokens
    "clip": {"encoder": {"model_subtype": "clip"}},
    # a recomputed layer draws the forward's masks; under TP they are cut from the unsharded stage's
    "dropout-full": {"encoder": DROPOUT, "recompute": "full"},
    # megatron-core's affine projector: column-parallel, its output gathered
    "affine-relu": {"encoder": {"activation": "relu", "projector": {"type": "affine"}}},
}


def _config(
    sequence_parallel: bool = False,
    recompute: str = "none",
    dual: bool = False,
    encoder: dict[str, Any] | None = None,
) -> OptimusConfig:
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["training"].update(
        sequence_parallel=sequence_parallel, recompute=recompute, micro_batch_size=MICRO_BATCH
    )
    raw["model"]["encoders"][0].update(encoder or {})
    if dual:
        raw["model"]["encoders"].append(copy.deepcopy(FROZEN_ENCODER))
    return config_from_dict(raw)


# ---------------------------------------------------------------------------------------------
# Running a stage: whole-module autograd, ops one microbatch, ops of two microbatches


def _inputs(config: OptimusConfig, stage: int, seed: int) -> dict[str, torch.Tensor]:
    """Stage inputs, unsharded: patches on stage 0, hidden states [seq, batch, hidden] elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    return {
        enc.name: torch.randn(
            (MICRO_BATCH, enc.seq_length, enc.in_channels * enc.patch_size**2)
            if stage == 0
            else (enc.seq_length, MICRO_BATCH, enc.hidden_size),
            generator=gen,
        )
        for enc in config.encoders
    }


def _output_grads(
    config: OptimusConfig, stage: int, num_stages: int, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    last = stage == num_stages - 1
    return {
        enc.name: torch.randn(
            enc.seq_length,
            MICRO_BATCH,
            config.llm.hidden_size if last else enc.hidden_size,
            generator=gen,
        )
        for enc in config.encoders
    }


def _own_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x.chunk(group.size(), dim=0)[group.rank()]


def _local(tensors: dict[str, torch.Tensor | None], model: EncoderStage, sharded: bool) -> dict:
    """A rank's part of unsharded stage inputs/outputs: its tokens under sequence parallelism."""

    def part(name: str, x: torch.Tensor | None) -> torch.Tensor | None:
        split = x is not None and sharded and model.encoders[name].sequence_parallel
        return _own_tokens(x, model.tp_group) if split else x

    return {name: part(name, x) for name, x in tensors.items()}


def _autograd(
    model: EncoderStage,
    inputs: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    needs_input_grad: frozenset[str],
    seed: int,
) -> tuple[dict, dict]:
    leaves = {
        name: x.clone().requires_grad_(name in needs_input_grad) for name, x in inputs.items()
    }
    outputs = model(leaves, seed)
    roots = [(out, grads[name]) for name, out in outputs.items() if out.requires_grad]
    torch.autograd.backward([out for out, _ in roots], [g for _, g in roots])
    return (
        {name: out.detach() for name, out in outputs.items()},
        {name: leaf.grad for name, leaf in leaves.items()},
    )


def _advance(
    run: MicrobatchRun,
    grads: dict[str, torch.Tensor],
    cut: dict[int, float] | None = None,
    rng: random.Random | None = None,
    runs: dict[int, range] | None = None,
) -> None:
    """One op, or with ``cut`` (how far each run's split op has got) one piece of a splittable op:
    up to a
    random point, often one that gives a piece no whole row; with ``runs`` (a backward op -> the
    run of ops declared to it), a declared run's ops at once."""
    if run.forward_done and not run.output_grad_set:
        run.set_output_grad(grads)
        return
    forward = not run.forward_done
    k = run.next_forward if forward else run.next_backward
    if not forward and runs and len(runs.get(k, ())) > 1:
        run.run_backward_range(runs[k])
        return
    execute = run.run_forward if forward else run.run_backward
    op = (run.ops.fwd if forward else run.ops.bwd)[k]
    if cut is None or not op.splittable:
        execute(k)
        return
    lo = cut.pop(id(run), 0.0)
    hi = rng.choice([1.0, 1.0, lo + (1.0 - lo) * rng.random(), lo + (1.0 - lo) * 1e-3])
    execute(k, (lo, hi))
    if hi < 1.0:
        cut[id(run)] = hi


def _random_runs(ops: StageOps, rng: random.Random) -> list[range]:
    """Consecutive backward ops in runs of random lengths, as hook points might gather them."""
    runs: list[range] = []
    while not runs or runs[-1].stop < len(ops.bwd):
        start = runs[-1].stop if runs else 0
        size = rng.choice([1, 2, 3, 5, len(ops.bwd)])
        runs.append(range(start, min(start + size, len(ops.bwd))))
    return runs


def _run_ops(
    ops: StageOps,
    inputs: list[dict],
    grads: list[dict],
    rng: random.Random | None,
    split: bool = False,
    joined: bool = False,
) -> list[MicrobatchRun]:
    """Microbatches one after the other (``rng`` None), or interleaved op by op in a random order;
    ``split``: splittable ops in random pieces of their tokens, other microbatches' ops between
    them; ``joined``: each microbatch's backward ops in random runs, declared to it and run at once
    (the executor's batches at one hook point)."""
    runs = [_random_runs(ops, rng) if joined else [] for _ in inputs]
    mbs = [MicrobatchRun(ops, x, SEED + i, r) for i, (x, r) in enumerate(zip(inputs, runs))]
    by_op = [{k: run for run in r for k in run} for r in runs]
    if rng is None:
        for mb, g in zip(mbs, grads):
            while not mb.backward_done:
                _advance(mb, g)
        return mbs
    cut: dict[int, float] | None = {} if split else None
    while not all(mb.backward_done for mb in mbs):
        i = rng.choice([i for i, mb in enumerate(mbs) if not mb.backward_done])
        _advance(mbs[i], grads[i], cut, rng, by_op[i])
    return mbs


def _param_grads(model: EncoderStage) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
    }


def _max_error(
    a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None], relative: bool = False
) -> float:
    """Largest absolute difference (``relative``: over the largest value of ``b``, at least 1);
    infinite where one side has a tensor and the other none."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            scale = max(1.0, y.abs().max().item()) if relative else 1.0
            worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def _shard(full: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of an unsharded parameter (or gradient), as megatron-core splits it."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    chunks = full.chunk(group.size() * param.partition_stride, dim=param.partition_dim)
    return torch.cat(chunks[group.rank() :: group.size()], dim=param.partition_dim)


def _stage_report(
    config: OptimusConfig,
    stage: int,
    num_stages: int,
    group: dist.ProcessGroup,
    solo: dist.ProcessGroup,
) -> dict[str, Any]:
    """Errors of every check on one stage, and its op chains. ``solo``: a one-rank group for the
    unsharded reference model (the same group as ``group`` on one rank)."""
    torch.manual_seed(SEED)
    full = EncoderStage(config, stage, num_stages, solo, init_std=0.2)
    with torch.no_grad():  # nonzero biases and norm parameters, identical on every rank
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = full
    if group is not solo:
        model = EncoderStage(config, stage, num_stages, group)
        fulls = dict(full.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_shard(fulls[name], p, group))
    ops = build_stage_ops(model.blocks(), config.training.recompute)
    sharded_in, sharded_out = stage > 0, stage < num_stages - 1
    xs = [_inputs(config, stage, SEED + i) for i in range(2)]
    gs = [_output_grads(config, stage, num_stages, SEED + 10 + i) for i in range(2)]
    local_x = [_local(x, model, sharded_in) for x in xs]
    local_g = [_local(g, model, sharded_out) for g in gs]
    errors = {}

    ref_out, ref_in_grad = _autograd(model, local_x[0], local_g[0], ops.input_grad_encoders, SEED)
    ref_grads = _param_grads(model)
    model.zero_grad(set_to_none=True)
    (run,) = _run_ops(ops, local_x[:1], local_g[:1], None)
    errors["ops output vs autograd"] = _max_error(run.output, ref_out)
    errors["ops parameter grads vs autograd"] = _max_error(_param_grads(model), ref_grads)
    errors["ops input grad vs autograd"] = _max_error(run.input_grad, ref_in_grad)

    if group is not solo:
        model.reduce_sequence_parallel_grads()
        full_out, full_in_grad = _autograd(full, xs[0], gs[0], ops.input_grad_encoders, SEED)
        fulls = dict(full.named_parameters())
        expected = {
            name: None if fulls[name].grad is None else _shard(fulls[name].grad, p, group)
            for name, p in model.named_parameters()
        }
        # sharded sums add in another order: compare relative to the values' size
        errors["TP output vs unsharded"] = _max_error(
            run.output, _local(full_out, model, sharded_out), True
        )
        errors["TP parameter grads vs unsharded"] = _max_error(_param_grads(model), expected, True)
        full_in_grad = _local(full_in_grad, model, sharded_in)
        errors["TP input grad vs unsharded"] = _max_error(run.input_grad, full_in_grad, True)

    model.zero_grad(set_to_none=True)
    one_by_one = _run_ops(ops, local_x, local_g, None)
    sequential = _param_grads(model)
    model.zero_grad(set_to_none=True)
    interleaved = _run_ops(ops, local_x, local_g, random.Random(SEED + stage))
    errors["interleaved parameter grads vs sequential"] = _max_error(
        _param_grads(model), sequential
    )
    errors["interleaved input grads vs sequential"] = max(
        _max_error(a.input_grad, b.input_grad) for a, b in zip(interleaved, one_by_one)
    )
    model.zero_grad(set_to_none=True)
    split = _run_ops(ops, local_x, local_g, random.Random(SEED + 7 * stage), split=True)
    # a GEMM's weight gradient sums its pieces' tokens in another order: relative to the values'
    # size
    errors["split parameter grads vs sequential"] = _max_error(
        _param_grads(model), sequential, True
    )
    errors["split outputs vs sequential"] = max(
        _max_error(a.output, b.output, True) for a, b in zip(split, one_by_one)
    )
    errors["split input grads vs sequential"] = max(
        _max_error(a.input_grad, b.input_grad, True) for a, b in zip(split, one_by_one)
    )
    # backward ops in declared runs: their forward joins each run's graph, one autograd call a run
    model.zero_grad(set_to_none=True)
    joined = _run_ops(ops, local_x, local_g, random.Random(SEED + 3 * stage), joined=True)
    errors["joined parameter grads vs sequential"] = _max_error(_param_grads(model), sequential)
    errors["joined input grads vs sequential"] = max(
        _max_error(a.input_grad, b.input_grad) for a, b in zip(joined, one_by_one)
    )
    # ... with forward ops in pieces, which cut the runs' graphs, and single ops' backward in pieces
    model.zero_grad(set_to_none=True)
    rng = random.Random(SEED + 5 * stage)
    joined_split = _run_ops(ops, local_x, local_g, rng, split=True, joined=True)
    errors["joined split parameter grads vs sequential"] = _max_error(
        _param_grads(model), sequential, True
    )
    errors["joined split input grads vs sequential"] = max(
        _max_error(a.input_grad, b.input_grad, True) for a, b in zip(joined_split, one_by_one)
    )
    return {
        "errors": errors,
        "fwd": ops.chain("fwd"),
        "bwd": ops.chain("bwd"),
        "split": [op.name for op in ops.fwd + ops.bwd if op.splittable],
    }


def _cost_chains(config: OptimusConfig, stage: int, num_stages: int, tp: int) -> dict[str, list]:
    llm = config.parallel.llm
    enc_plan = ParallelPlan(config.cluster.num_gpus // (num_stages * tp), num_stages, tp)
    work = build_encoder_work(
        config, ParallelPlan(llm.dp, llm.pp, llm.tp), enc_plan, CostModel.from_config(config)
    )
    return {
        phase: [
            (k.encoder, k.layer, k.name, k.splittable) for k in getattr(work, phase)[stage].kernels
        ]
        for phase in ("fwd", "bwd")
    }


def _assert_small(errors: dict[str, float], where: str) -> None:
    bad = {check: err for check, err in errors.items() if not err <= TOL}
    assert not bad, f"{where}: {bad}"


# ---------------------------------------------------------------------------------------------
# TP1, in this process


@pytest.fixture(scope="module")
def one_rank() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_tp1_chains_equal_the_cost_model(
    one_rank: dist.ProcessGroup, case: str, num_stages: int
) -> None:
    config = _config(**CASES[case])
    for stage in range(num_stages):
        ops = build_stage_ops(
            EncoderStage(config, stage, num_stages, one_rank).blocks(), config.training.recompute
        )
        expected = _cost_chains(config, stage, num_stages, tp=1)
        assert ops.chain("fwd") == expected["fwd"], f"stage {stage}"
        assert ops.chain("bwd") == expected["bwd"], f"stage {stage}"


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_tp1_ops_match_whole_stage_autograd(
    one_rank: dist.ProcessGroup, case: str, num_stages: int
) -> None:
    config = _config(**CASES[case])
    for stage in range(num_stages):
        _assert_small(
            _stage_report(config, stage, num_stages, one_rank, one_rank)["errors"], f"stage {stage}"
        )


def test_frozen_encoder_gets_no_gradients_but_its_projector_does(
    one_rank: dist.ProcessGroup,
) -> None:
    config = _config(dual=True)
    model = EncoderStage(config, 0, 1, one_rank)
    ops = build_stage_ops(model.blocks())
    run = MicrobatchRun(ops, _inputs(config, 0, SEED), SEED)
    for k in range(len(ops.fwd)):
        run.run_forward(k)
    run.set_output_grad(_output_grads(config, 0, 1, SEED))
    for k in range(len(ops.bwd)):
        run.run_backward(k)
    frozen = model.encoders["vit_small"]
    assert all(
        p.grad is None for name, p in frozen.named_parameters() if not name.startswith("projector.")
    )
    assert all(p.grad is not None for p in frozen.projector.parameters())
    assert [op.name for op in ops.bwd if op.encoder == "vit_small"] == ["projector_fc1"]


def test_ops_run_in_chain_order_only(one_rank: dist.ProcessGroup) -> None:
    config = _config()
    ops = build_stage_ops(EncoderStage(config, 0, 1, one_rank).blocks())
    run = MicrobatchRun(ops, _inputs(config, 0, SEED), SEED)
    with pytest.raises(ValueError, match="op 0 is next"):
        run.run_forward(1)
    run.run_forward(0)
    with pytest.raises(RuntimeError, match="before the forward finished"):
        _ = run.output
    with pytest.raises(RuntimeError, match="before set_output_grad"):
        run.run_backward(0)


# ---------------------------------------------------------------------------------------------
# TP2 on two gloo ranks

TP2_CASES = {
    f"{case}-{'sp' if sp else 'nosp'}": (case, sp) for case in CASES for sp in (False, True)
}


def _tp2_rank(cases: dict[str, tuple[str, bool]]) -> dict[str, list[dict[str, Any]]]:
    solo = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    group = dist.new_group([0, 1])
    reports = {}
    for case_id, (case, sp) in cases.items():
        config = _config(sequence_parallel=sp, **CASES[case])
        reports[case_id] = [_stage_report(config, stage, 2, group, solo) for stage in range(2)]
    return reports


@pytest.fixture(scope="module")
def tp2_reports() -> list[dict[str, list[dict[str, Any]]]]:
    return run_distributed(_tp2_rank, 2, TP2_CASES, timeout=RANK_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", TP2_CASES)
def test_tp2_ops_match_autograd_and_the_unsharded_stage(tp2_reports: list, case_id: str) -> None:
    for rank, reports in enumerate(tp2_reports):
        for stage, report in enumerate(reports[case_id]):
            _assert_small(report["errors"], f"rank {rank} stage {stage}")


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", TP2_CASES)
def test_tp2_chains_are_the_cost_models(tp2_reports: list, case_id: str) -> None:
    case, sp = TP2_CASES[case_id]
    config = _config(sequence_parallel=sp, **CASES[case])
    for stage, report in enumerate(tp2_reports[0][case_id]):
        cost = _cost_chains(config, stage, 2, tp=2)
        for phase in ("fwd", "bwd"):
            assert [tuple(k) for k in report[phase]] == cost[phase], f"stage {stage} {phase}"
