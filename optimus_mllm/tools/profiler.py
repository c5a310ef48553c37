"""Measure the kernels the scheduler costs, on one GPU, into a profile the cost model loads.

The entries are exactly the compute kernels the bubble scheduler and the Megatron-LM baselines ask
the cost model for under the config's plans: the LLM's layer, embedding and output layer at the
LLM's TP, and every encoder's layer, patch embedding and projector at each candidate encoder TP and
at the LLM's TP (where the baselines run the encoder). They are found by running the scheduler's own
costing functions against a recording cost model, so kernel names cannot drift from what it looks
up.

Each kernel is rebuilt in torch at its TP shard shape (GEMMs as ``F.linear`` with the sharded dims,
the attention core with torch SDPA, norms and activations: the kernel set the runtime runs,
``cost_model.KERNEL_SET``, recorded in the profile) and timed after warm-up as the median of
repeats; a backward kernel is timed as ``torch.autograd.grad`` through a retained forward graph, so
only the backward runs. Communication kernels (TP all-gather / reduce-scatter / all-reduce, P2P, DP)
need several GPUs and are not measured: the cost model keeps its bandwidth model for them, as for
any key missing from a profile.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from optimus_mllm.config import OptimusConfig, TransformerSpec, encoder_tp_problem
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import (
    KERNEL_SET,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CostModel,
    KernelWork,
    MeasuredKernel,
    Phase,
)
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import ParallelPlan, PlannerResult, plan
from optimus_mllm.scheduler.encoder_costs import build_encoder_work
from optimus_mllm.scheduler.llm_costs import LLM, llm_op_work

Key = tuple[str, str, str, int]  # (module, kernel, phase, tp), as CostModel looks a profile up
Timer = Callable[[Callable[[], object]], float]  # runs the callable once, returns microseconds
RECOMPUTE = "recompute_"  # a forward kernel re-run inside the backward (cost_model.layer_kernels)
NOT_MEASURED = (
    "communication: not measured by a run of one rank (run optimus-profile under torchrun with the "
    "config's world size to measure it); the cost model uses its bandwidth model for it"
)


# --------------------------------------------------------------------------------------------
# Which kernels


@dataclass(frozen=True)
class ProfileEntry:
    """One compute kernel the scheduler costs: the cost model's work for it, where and at which
    TP."""

    module: str
    tp: int
    work: KernelWork

    @property
    def key(self) -> Key:
        return (self.module, self.work.name, self.work.phase, self.tp)


class _RecordingCostModel(CostModel):
    """The roofline cost model, remembering every compute kernel it is asked for."""

    def __init__(self, config: OptimusConfig):
        super().__init__(config.cluster, config.cost_model)
        self.entries: dict[Key, ProfileEntry] = {}

    def compute_us(self, work: KernelWork, module: str, tp: int) -> float:
        entry = ProfileEntry(module, tp, work)
        self.entries.setdefault(entry.key, entry)
        return super().compute_us(work, module, tp)


def profile_entries(
    config: OptimusConfig, planned: PlannerResult | None = None
) -> list[ProfileEntry]:
    """The compute kernels the scheduler and the baselines look up for ``config``, in costing
    order."""
    planned = planned or plan(config)
    recorder = _RecordingCostModel(config)
    llm_op_work(config, planned.llm_plan, recorder)
    for enc_plan in _encoder_plans(config, planned):
        build_encoder_work(config, planned.llm_plan, enc_plan, recorder)
    return list(recorder.entries.values())


def _encoder_plans(config: OptimusConfig, planned: PlannerResult) -> list[ParallelPlan]:
    """One encoder plan per TP the encoders run at: encoder kernels depend on TP only, not on PP/DP.

    The Megatron-LM baselines run the encoders in the first LLM stage at the LLM's TP, as one stage.
    """
    llm_plan = planned.llm_plan
    by_tp = {c.plan.tp: c.plan for c in planned.candidates}
    if llm_plan.tp not in by_tp and not any(
        encoder_tp_problem(
            e, config.llm.hidden_size, config.training.sequence_parallel, llm_plan.tp
        )
        for e in config.encoders
    ):
        by_tp[llm_plan.tp] = ParallelPlan(llm_plan.dp, 1, llm_plan.tp)
    return [by_tp[tp] for tp in sorted(by_tp)]


# --------------------------------------------------------------------------------------------
# Kernels as torch ops


@dataclass(frozen=True)
class KernelOp:
    """A kernel's forward at its TP shard shape.

    ``kind`` and ``dims``: ``linear`` (tokens, in, out), ``attention`` (batch, heads, kv_heads, seq,
    head_dim), ``norm`` (tokens, hidden), ``act`` (tokens, ffn), ``embedding`` (tokens, vocab,
    hidden).
    """

    kind: str
    dims: tuple[int, ...]
    bias: bool = False
    # linear: its activation fused after the GEMM (the projector's fc1), GELU or, with ``silu``,
    # SiLU; gated as ``act`` is
    fused_act: bool = False
    gated: bool = False  # act (or a fused_act linear): act(gate) * up over a 2*ffn-wide input
    silu: bool = False  # act (or a fused_act linear): SiLU instead of GELU (--swiglu)
    rms: bool = False  # norm: RMSNorm instead of LayerNorm
    causal: bool = False  # attention

    def flops(self, backward: bool) -> float:
        """Matmul FLOPs of the GEMM or attention core, as the cost model counts them (0 for the
        rest); a backward does the dgrad and the wgrad GEMMs, twice the forward."""
        if self.kind == "linear":
            m, k, n = self.dims
            fwd = 2.0 * m * k * n
        elif self.kind == "attention":
            b, h, _, s, d = self.dims
            fwd = 4.0 * b * h * s * s * d  # QK^T and PV, the causal mask not discounted
        else:
            return 0.0
        return 2 * fwd if backward else fwd


def kernel_op(config: OptimusConfig, entry: ProfileEntry) -> KernelOp:
    """The torch op of ``entry``'s kernel; the shapes mirror ``cost_model._forward_kernels`` and the
    encoder/LLM head kernels in ``scheduler``, and :func:`check_flops` holds them to the same
    FLOPs."""
    name = entry.work.name.removeprefix(RECOMPUTE)
    t, mbs = entry.tp, config.training.micro_batch_size
    if entry.module == LLM:
        spec: TransformerSpec = config.llm
        llm = config.llm
        tokens = llm.seq_length * mbs
        if name == "embedding":
            return KernelOp("embedding", (tokens, llm.vocab_size // t, llm.hidden_size))
        if name == "output_layer":
            return KernelOp("linear", (tokens, llm.hidden_size, llm.vocab_size // t))
    else:
        enc = next((e for e in config.encoders if e.name == entry.module), None)
        if enc is None:
            raise OptimusError(
                f"profiler: the scheduler costs module '{entry.module}', which is neither the "
                "LLM nor an encoder of the config"
            )
        spec = enc
        h_enc, h_llm = enc.hidden_size, config.llm.hidden_size
        if name == "patch_embed":  # the class token is no GEMM row (scheduler/encoder_costs.py)
            sp = config.training.sequence_parallel and t > 1
            local = enc.layer_tokens // t * mbs if sp else enc.seq_length * mbs
            return KernelOp(
                "linear",
                (local, enc.in_channels * enc.patch_size**2, h_enc),
                bias=enc.model_subtype != "clip",
            )
        # the projector's spatial merge
        merged, h_in = (
            enc.image_tokens * mbs,
            enc.projector_input_size,
        )
        projector = enc.projector
        ffn = projector.mlp_ffn_hidden_size(h_llm) // t
        if name == "projector_fc1":
            if projector.type == "mlp":  # column-parallel, its activation fused (runtime/vit.py)
                gated = projector.gated_linear_unit
                return KernelOp(
                    "linear",
                    (merged, h_in, 2 * ffn if gated else ffn),
                    bias=projector.add_bias_linear,
                    fused_act=True,
                    gated=gated,
                    silu=projector.activation == "silu",
                )
            if projector.type == "affine":  # column-parallel, its bias before the gather
                return KernelOp(
                    "linear", (merged, h_in, h_llm // t), bias=projector.add_bias_linear
                )
            # row-parallel, bias after the reduce
            return KernelOp("linear", (merged, h_in // t, h_llm))
        if name == "projector_fc2":
            return KernelOp("linear", (merged, ffn, h_llm))
    return layer_op(
        spec, name, t, mbs, config.training.sequence_parallel, causal=entry.module == LLM
    )


def layer_op(
    spec: TransformerSpec, name: str, t: int, mbs: int, sequence_parallel: bool, causal: bool
) -> KernelOp:
    """A transformer layer's kernel on one TP rank (Megatron's column/row-parallel split)."""
    n, h, d = spec.layer_tokens * mbs, spec.hidden_size, spec.head_dim
    heads, groups, ffn = (
        spec.num_attention_heads // t,
        spec.query_groups // t,
        spec.ffn_hidden_size // t,
    )
    fc1_out = 2 * ffn if spec.gated_linear_unit else ffn
    local = n // t if sequence_parallel and t > 1 else n  # norms run on the sequence-parallel shard
    ops = {
        "ln_attn": KernelOp("norm", (local, h), rms=spec.normalization == "RMSNorm"),
        "ln_mlp": KernelOp("norm", (local, h), rms=spec.normalization == "RMSNorm"),
        "qkv": KernelOp("linear", (n, h, (heads + 2 * groups) * d), bias=spec.add_bias_linear),
        "attn_core": KernelOp(
            "attention", (mbs, heads, groups, spec.layer_tokens, d), causal=causal
        ),
        # row-parallel GEMMs: their bias is added after the TP reduction, outside the kernel
        "attn_proj": KernelOp("linear", (n, heads * d, h)),
        "fc1": KernelOp("linear", (n, h, fc1_out), bias=spec.add_bias_linear),
        "act": KernelOp(
            "act", (n, ffn), gated=spec.gated_linear_unit, silu=spec.activation == "silu"
        ),
        "fc2": KernelOp("linear", (n, ffn, h)),
    }
    if name not in ops:
        raise OptimusError(
            f"profiler: no torch op for kernel '{name}'; teach optimus_mllm/tools/profiler.py its "
            "shape"
        )
    return ops[name]


def check_flops(entry: ProfileEntry, op: KernelOp) -> None:
    """Refuse to measure a GEMM or attention shape whose FLOPs differ from the cost model's
    kernel."""
    if entry.work.kind not in ("gemm", "attention"):
        return
    backward = entry.work.phase == "bwd" and not entry.work.name.startswith(RECOMPUTE)
    if op.flops(backward) != entry.work.flops:
        raise OptimusError(
            f"profiler: {entry.key} would measure {op.flops(backward):.4g} FLOPs, the cost model "
            f"counts {entry.work.flops:.4g}; the profiler's shapes are out of date"
        )


def _forward(
    op: KernelOp, device: str, dtype: torch.dtype
) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    """The op as a function of its inputs, with random inputs that require grad where it has
    gradients."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).mul_(0.02).requires_grad_()

    if op.kind == "linear":
        m, k, n = op.dims
        inputs = [rand(m, k), rand(n, k)] + ([rand(n)] if op.bias else [])
        if op.fused_act:
            act = _activation(op)
            return lambda x, w, *b: act(F.linear(x, w, *b)), inputs
        return F.linear, inputs
    if op.kind == "norm":
        n, h = op.dims
        if op.rms:
            return lambda x, w: F.rms_norm(x, (h,), w), [rand(n, h), rand(h)]
        return lambda x, w, b: F.layer_norm(x, (h,), w, b), [rand(n, h), rand(h), rand(h)]
    if op.kind == "act":
        n, ffn = op.dims
        return _activation(op), [rand(n, 2 * ffn if op.gated else ffn)]
    if op.kind == "embedding":
        tokens, vocab, h = op.dims
        ids = torch.randint(0, vocab, (tokens,), device=device)
        return lambda table: F.embedding(ids, table), [rand(vocab, h)]
    if op.kind == "attention":
        return _attention(op, device, dtype, rand)
    raise OptimusError(f"profiler: unknown op kind '{op.kind}'")


def _activation(op: KernelOp) -> Callable[[torch.Tensor], torch.Tensor]:
    """GELU or SiLU, gated as megatron-core's GLU (and runtime/layer_ops.py): act(gate) * up."""
    act = F.silu if op.silu else F.gelu
    if not op.gated:
        return act

    def glu(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return glu


def _attention(
    op: KernelOp, device: str, dtype: torch.dtype, rand: Callable[..., torch.Tensor]
) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor]]:
    b, heads, groups, s, d = op.dims
    # SDPA: grouped K/V expanded to every head beforehand, as runtime/layer_ops.py does
    return (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=op.causal),
        [rand(b, heads, s, d), rand(b, heads, s, d), rand(b, heads, s, d)],
    )


def kernel_callable(
    op: KernelOp, phase: Phase, recompute: bool, device: str, dtype: torch.dtype
) -> Callable[[], object]:
    """A no-argument callable that runs the kernel once: the forward, or (``bwd``) the gradients of
    every input through a forward graph built once and retained; a recompute runs the forward."""
    fn, inputs = _forward(op, device, dtype)
    if phase == "fwd" or recompute:
        return lambda: fn(*inputs)
    out = fn(*inputs)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


# --------------------------------------------------------------------------------------------
# Timing


def cuda_timer(fn: Callable[[], object]) -> float:
    """GPU time of one call between two CUDA events, in microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def wallclock_timer(fn: Callable[[], object]) -> float:
    """Host time of one call, in microseconds: a CPU kernel runs synchronously, so this is its
    time."""
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e6


def timings_us(fn: Callable[[], object], warmup: int, repeats: int, timer: Timer) -> list[float]:
    """``repeats`` timed calls after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise OptimusError(
            f"profiler: needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}"
        )
    for _ in range(warmup):
        fn()
    return [timer(fn) for _ in range(repeats)]


def median_us(fn: Callable[[], object], warmup: int, repeats: int, timer: Timer) -> float:
    """Median of ``repeats`` timed calls after ``warmup`` untimed ones."""
    return statistics.median(timings_us(fn, warmup, repeats, timer))


def spread_us(times: list[float]) -> float:
    """Half the interquartile range: how far a typical run lands from the median."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / 2


# --------------------------------------------------------------------------------------------
# The profile


def profile_kernels(
    config: OptimusConfig,
    *,
    warmup: int = 5,
    repeats: int = 20,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    timer: Timer | None = None,
) -> dict[str, Any]:
    """Measure every compute kernel the scheduler costs for ``config``; a JSON-ready profile.

    ``timer`` defaults to CUDA events on a CUDA device and to the wall clock on CPU. Each
    entry keeps the cost model's FLOPs and bytes (the shape it was measured at) and its roofline.
    """
    if timer is None:
        timer = cuda_timer if torch.device(device).type == "cuda" else wallclock_timer
    roofline = CostModel(config.cluster, config.cost_model)
    kernels = []
    for entry in profile_entries(config):
        op = kernel_op(config, entry)
        check_flops(entry, op)
        fn = kernel_callable(
            op, entry.work.phase, entry.work.name.startswith(RECOMPUTE), device, dtype
        )
        times = timings_us(fn, warmup, repeats, timer)
        del fn  # free this kernel's tensors before the next one's
        module, kernel, phase, tp = entry.key
        kernels.append(
            {
                "module": module,
                "kernel": kernel,
                "phase": phase,
                "tp": tp,
                "time_us": statistics.median(times),
                "spread_us": spread_us(times),
                "roofline_us": roofline.compute_us(entry.work, module, tp),
                "flops": entry.work.flops,
                "bytes": entry.work.bytes,
                "op": op.kind,
                "dims": list(op.dims),
            }
        )
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "config": config.name,
        "device": device_name(device),
        "device_kind": torch.device(device).type,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "kernel_set": KERNEL_SET,
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core"),
        "warmup": warmup,
        "repeats": repeats,
        "statistic": "median",
        "not_measured": NOT_MEASURED,
        "kernels": kernels,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model as the kernel reports it."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_profile(profile: dict[str, Any], path: str | Path) -> None:
    """Write the profile as JSON, atomically (no half-written file on failure)."""
    atomic_write_text(path, json.dumps(profile, indent=2) + "\n")


def matching_profile(
    config: OptimusConfig, measured: list[MeasuredKernel]
) -> tuple[dict[Key, float], int]:
    """The measured times that fit ``config``'s kernels, for ``CostModel(profile=...)``, and how
    many compute kernels ``config`` costs in all.

    A profile is keyed by (module, kernel, phase, tp), which does not tell models apart, so an entry
    is used only where its recorded FLOPs and bytes equal those of ``config``'s kernel under that
    key.
    """
    needed = {e.key: e.work for e in profile_entries(config)}
    table = {}
    for m in measured:
        work = needed.get(m.key)
        if work is not None and (work.flops, work.bytes) == (m.flops, m.bytes):
            table[m.key] = m.time_us
    return table, len(needed)
