"""METP's MLP and attention on 2 and 4 gloo ranks compute what one rank computes, and hold the
intermediate bytes the memory model says, fewer than megatron-core's TP with sequence parallelism.

The reference is the whole computation on one rank in plain torch (the full weights, megatron-core's
QKV layout written out here): each rank's output and input gradient are its rows of the reference's,
and its weight gradients are its shard of the reference's (every shard checked on its owner). A
``TransformerLayer`` of ``metp_layer_spec`` is held against megatron-core's own local ViT layer on
one rank with the same weights (the norms' and row biases' gradients summed over the group, as
``finalize_model_grads`` sums parameters marked ``sequence_parallel``). The memory check counts,
on CPU, the storages the forward allocates (``support.tensor_accounting``)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from optimus_mllm.config import TransformerSpec
from optimus_mllm.costing.metp_memory import (
    metp_attention_forward_bound,
    metp_mlp_forward_peak,
    paper_attention_peak,
    paper_attention_ratio,
    paper_mlp_peak,
)
from optimus_mllm.costing.tp_memory import LayerBytes, layer_bytes
from optimus_mllm.runtime.layer_ops import (
    all_gather,
    build_layer,
    reduce_scatter,
    vision_layer_spec,
)
from optimus_mllm.runtime.llm import causal_mask, unfused_settings
from optimus_mllm.runtime.metp import HeadLayout, metp_attention, metp_layer_spec, metp_mlp

from support.distributed_utils import run_distributed
from support.megatron_ranks import group_of_this_rank, megatron_state
from support.tensor_accounting import LiveBytes, held_bytes

TOL = 1e-5
STEPS, LR = 3, 0.05  # a layer's training steps against its one-rank twin
SEQ, BATCH, HIDDEN, FFN = 16, 2, 16, 32
# (heads, query groups, head dim): multi-head and grouped-query attention
HEADS = {"mha": (4, 4, 4), "gqa": (8, 4, 2)}


def _weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _leaves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone().requires_grad_(True) for name, t in tensors.items()}


# how each weight is split over the ranks (megatron-core's column/row-parallel dims)
SPLIT = {"w1": 0, "b1": 0, "w2": 1, "w_qkv": 0, "b_qkv": 0, "w_proj": 1}


def _shards(full: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    p, rank = group.size(), group.rank()
    return _leaves({n: t.chunk(p, dim=SPLIT[n])[rank] for n, t in full.items()})


def _errors(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, float]:
    """Largest difference of each gradient (this rank's shard) and of the rows."""
    p, rank = group.size(), group.rank()
    errors = {}
    for name, value in got.items():
        want = expected[name]
        if name in SPLIT:
            want = want.chunk(p, dim=SPLIT[name])[rank]
        elif name in ("output", "input grad"):
            want = want.chunk(p, dim=0)[rank]
        errors[name] = (value - want).abs().max().item()
    return errors


def _mlp_case(group: dist.ProcessGroup) -> dict[str, float]:
    full = _weights({"w1": (FFN, HIDDEN), "b1": (FFN,), "w2": (HIDDEN, FFN)}, seed=1)
    x, grad = _weights({"x": (SEQ, BATCH, HIDDEN), "g": (SEQ, BATCH, HIDDEN)}, seed=2).values()

    ref, leaf = _leaves(full), x.clone().requires_grad_(True)
    out = F.linear(F.gelu(F.linear(leaf, ref["w1"], ref["b1"])), ref["w2"])
    out.backward(grad)
    expected = {"output": out.detach(), "input grad": leaf.grad}
    expected |= {name: t.grad for name, t in ref.items()}

    mine = _shards(full, group)
    leaf = x.chunk(group.size())[group.rank()].clone().requires_grad_(True)
    out = metp_mlp(leaf, mine["w1"], mine["b1"], mine["w2"], group, F.gelu)
    out.backward(grad.chunk(group.size())[group.rank()])
    got = {"output": out.detach(), "input grad": leaf.grad}
    got |= {name: t.grad for name, t in mine.items()}
    return _errors(got, expected, group)


def _reference_attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, groups: int, dim: int, causal: bool
) -> torch.Tensor:
    """One rank's attention; the QKV output per query group is [its queries, key, value]."""
    s, b, _ = x.shape
    r = heads // groups
    qkv = F.linear(x, w["w_qkv"], w["b_qkv"]).view(s, b, groups, (r + 2) * dim)
    q, k, v = qkv.split([r * dim, dim, dim], dim=-1)
    q = q.reshape(s, b, heads, dim).permute(1, 2, 0, 3)  # [b, heads, s, d]
    k = k.permute(1, 2, 0, 3).repeat_interleave(r, dim=1)
    v = v.permute(1, 2, 0, 3).repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, heads * dim)
    return F.linear(context, w["w_proj"])


def _attention_case(group: dist.ProcessGroup, kind: str, causal: bool) -> dict[str, float]:
    heads, groups, dim = HEADS[kind]
    qkv = (heads + 2 * groups) * dim
    full = _weights(
        {"w_qkv": (qkv, HIDDEN), "b_qkv": (qkv,), "w_proj": (HIDDEN, heads * dim)}, seed=3
    )
    x, grad = _weights({"x": (SEQ, BATCH, HIDDEN), "g": (SEQ, BATCH, HIDDEN)}, seed=4).values()

    ref, leaf = _leaves(full), x.clone().requires_grad_(True)
    out = _reference_attention(leaf, ref, heads, groups, dim, causal)
    out.backward(grad)
    expected = {"output": out.detach(), "input grad": leaf.grad}
    expected |= {name: t.grad for name, t in ref.items()}

    p = group.size()
    layout = HeadLayout(groups // p, heads // groups, dim, causal, 1.0 / math.sqrt(dim))
    mine = _shards(full, group)
    leaf = x.chunk(p)[group.rank()].clone().requires_grad_(True)
    out = metp_attention(leaf, mine["w_qkv"], mine["b_qkv"], mine["w_proj"], group, layout)
    out.backward(grad.chunk(p)[group.rank()])
    got = {"output": out.detach(), "input grad": leaf.grad}
    got |= {name: t.grad for name, t in mine.items()}
    return _errors(got, expected, group)


# the memory cases: a longer sequence, float32
MEM = {"b": 1, "s": 128, "h": 16, "ffn": 64, "heads": 4, "dim": 4}


def _tp_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron-LM's TP+SP FFN: all-gather the tokens, column- then row-parallel, reduce-scatter."""
    whole = all_gather(x, group)
    return reduce_scatter(F.linear(F.gelu(F.linear(whole, w["w1"], w["b1"])), w["w2"]), group)


def _tp_attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """Megatron-LM's TP+SP attention (no FlashAttention): all-gather, this rank's heads over the
    whole sequence, reduce-scatter."""
    p = group.size()
    whole = all_gather(x, group)
    heads = MEM["heads"] // p
    return reduce_scatter(_reference_attention(whole, w, heads, heads, MEM["dim"], False), group)


def _memory_cases(group: dist.ProcessGroup) -> dict[str, dict[str, int]]:
    """Peak bytes each forward allocates on this rank (weights requiring gradients: training)."""
    b, s, h, ffn, heads, dim = MEM.values()
    p = group.size()
    qkv = 3 * heads * dim
    x = _weights({"x": (s, b, h)}, seed=5)["x"].chunk(p)[group.rank()].clone()
    mlp = _shards(_weights({"w1": (ffn, h), "b1": (ffn,), "w2": (h, ffn)}, seed=6), group)
    full = {"w_qkv": (qkv, h), "b_qkv": (qkv,), "w_proj": (h, heads * dim)}
    attention = _shards(_weights(full, seed=7), group)
    layout = HeadLayout(heads // p, 1, dim, False, 1.0 / math.sqrt(dim))
    runs = {
        "mlp": (
            lambda: metp_mlp(x, mlp["w1"], mlp["b1"], mlp["w2"], group, F.gelu),
            lambda: _tp_mlp(x, mlp, group),
        ),
        "attention": (
            lambda: metp_attention(
                x, attention["w_qkv"], attention["b_qkv"], attention["w_proj"], group, layout
            ),
            lambda: _tp_attention(x, attention, group),
        ),
    }
    measured = {}
    for name, (metp, tp) in runs.items():
        peaks = {}
        for mode, run in (("metp", metp), ("tp", tp)):
            with LiveBytes() as live:
                out = run()
            peaks[mode] = live.peak
            del out
        measured[name] = peaks
    return measured


def _layer_config(tp: int, gated: bool) -> TransformerConfig:
    heads, groups, dim = HEADS["gqa"]
    return TransformerConfig(
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        ffn_hidden_size=FFN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **unfused_settings(),
    )


def _tp_shard(name: str, whole: torch.Tensor, param: torch.Tensor, gated: bool) -> torch.Tensor:
    """The rank's TP shard of a one-rank parameter or gradient (a gated fc1's: [gate_r; up_r])."""
    group = dist.group.WORLD
    p, rank = group.size(), group.rank()
    if not getattr(param, "tensor_model_parallel", False):
        return whole
    if gated and name.startswith("mlp.linear_fc1."):
        return torch.cat([half.chunk(p)[rank] for half in whole.chunk(2)])
    return whole.chunk(p, dim=param.partition_dim)[rank]


def _layer_case(
    group: dist.ProcessGroup, alone: dist.ProcessGroup, causal: bool, gated: bool
) -> dict:
    """A TransformerLayer of ``metp_layer_spec`` on the group against megatron-core's local ViT
    layer (its SelfAttention, DotProductAttention and MLP) on one rank, holding the same weights,
    for ``STEPS`` SGD steps: the first step's gradients and every step's loss."""
    mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
    spec = vision_layer_spec()
    attention = spec.submodules.self_attention
    attention = type(attention)(
        module=attention.module,
        params={**attention.params, "attn_mask_type": mask_type},
        submodules=attention.submodules,
    )
    spec = type(spec)(
        module=spec.module,
        submodules=type(spec.submodules)(**{**vars(spec.submodules), "self_attention": attention}),
    )
    reference = build_layer(spec, _layer_config(1, gated), alone, 0)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():  # nonzero biases and norms, the same on every rank
        for param in reference.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    config = _layer_config(group.size(), gated)
    layer = build_layer(metp_layer_spec(group, mask_type), config, group, 0)
    full = dict(reference.named_parameters())
    p, rank = group.size(), group.rank()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(_tp_shard(name, full[name], param, gated))

    x, grad = _weights({"x": (SEQ, BATCH, HIDDEN), "g": (SEQ, BATCH, HIDDEN)}, seed=9).values()
    mask = causal_mask(SEQ) if causal else None
    errors: dict[str, float] = {}
    for step in range(STEPS):  # then SGD on both: the losses stay the same
        leaf = x.clone().requires_grad_(True)
        out, _ = reference(leaf, attention_mask=mask)
        loss = (out * grad).sum()
        loss.backward()
        expected = {"output": out.detach(), "input grad": leaf.grad}

        leaf = x.chunk(p)[rank].clone().requires_grad_(True)
        out, _ = layer(leaf, attention_mask=None)
        mine = (out * grad.chunk(p)[rank]).sum()
        mine.backward()
        total = mine.detach().clone()
        dist.all_reduce(total, group=group)
        errors[f"loss of step {step}"] = abs(total.item() - loss.item())
        if step == 0:
            errors |= _errors({"output": out.detach(), "input grad": leaf.grad}, expected, group)
        for name, param in layer.named_parameters():
            want = _tp_shard(name, full[name].grad, param, gated)
            if getattr(param, "sequence_parallel", False):  # what finalize_model_grads sums
                dist.all_reduce(param.grad, group=group)
            if step == 0:
                errors[name] = (param.grad - want).abs().max().item()
        with torch.no_grad():
            for module in (reference, layer):
                for param in module.parameters():
                    param.sub_(LR * param.grad)
                    param.grad = None
    return errors


def _layer_held(group: dist.ProcessGroup) -> LayerBytes:
    """What a ``metp_layer_spec`` layer holds on this rank (``held_bytes``)."""
    layer = build_layer(
        metp_layer_spec(group, AttnMaskType.causal), _layer_config(group.size(), False), group, 0
    )
    return held_bytes(layer, torch.randn(SEQ // group.size(), BATCH, HIDDEN), None)


def _rank() -> dict[str, Any]:
    warnings.simplefilter("ignore")
    group = dist.group.WORLD
    memory = _memory_cases(group)
    torch.set_default_dtype(torch.float64)  # the 1e-5 is the algorithm's, not float32's
    errors = {"mlp": _mlp_case(group)}
    for kind in HEADS:
        for causal in (False, True):
            errors[f"attention {kind} {'causal' if causal else 'bidirectional'}"] = _attention_case(
                group, kind, causal
            )
    alone = group_of_this_rank()
    with megatron_state():
        for causal, gated in ((False, False), (True, False), (True, True)):
            name = f"layer {'causal' if causal else 'bidirectional'}{' gated' * gated}"
            errors[name] = _layer_case(group, alone, causal, gated)
        held = _layer_held(group)
    return {"errors": errors, "memory": memory, "layer": held}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_metp_equals_one_rank_and_saves_memory(world: int) -> None:
    b, s, h, ffn, heads, dim = MEM.values()
    mlp_model = 4 * metp_mlp_forward_peak(b * s // world, h, ffn, world, bias=True)
    bound = 4 * metp_attention_forward_bound(b, s, h, heads, heads, dim, world, bias=True)
    paper_mlp = paper_mlp_peak(b, s, h, ffn, world)
    paper_scores = paper_attention_peak(b, s, h, heads, world, k=1)  # no FlashAttention here
    for rank, result in enumerate(run_distributed(_rank, world, timeout=120.0)):
        for case, errors in result["errors"].items():
            assert max(errors.values()) <= TOL, (rank, case, errors)
        mlp, attention = result["memory"]["mlp"], result["memory"]["attention"]
        print(
            f"p={world} rank {rank}: MLP peak bytes METP {mlp['metp']} (model {mlp_model}) "
            f"TP {mlp['tp']} ratio {mlp['metp'] / mlp['tp']:.3f}; attention METP "
            f"{attention['metp']} (bound {bound}) TP {attention['tp']} ratio "
            f"{attention['metp'] / attention['tp']:.3f}; paper's ratios: MLP "
            f"{paper_mlp['metp'] / paper_mlp['tp']:.3f}, attention without FlashAttention "
            f"{paper_scores['metp'] / paper_scores['tp']:.3f}, with it (Eq. 10) "
            f"{paper_attention_ratio(world):.3f}"
        )
        assert mlp["metp"] == mlp_model
        # the bound adds every buffer that may be alive at the scores tile; it is within 15 %
        assert 0.85 * bound <= attention["metp"] <= bound
        assert mlp["metp"] < mlp["tp"] and attention["metp"] < attention["tp"]
        # the memory model's layer figure (tp_memory, what the planner prunes with) is what the
        # layer holds: every rank the same
        heads, groups, dim = HEADS["gqa"]
        spec = TransformerSpec(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=dim,
            ffn_hidden_size=FFN,
            seq_length=SEQ,
        )
        assert result["layer"] == layer_bytes(spec, "metp", world, BATCH, 8), result["layer"]
