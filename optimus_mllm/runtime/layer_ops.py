"""A megatron-core ``TransformerLayer`` as kernel-level steps, from the layer's own submodules.

``layer_steps`` walks a layer built from a ``ModuleSpec`` (input norm, ``SelfAttention``'s
``linear_qkv`` / ``core_attention`` / ``linear_proj``, pre-MLP norm, ``MLP``'s ``linear_fc1`` /
activation / ``linear_fc2``) and returns the chain the cost model schedules
(``cost_model.layer_kernels``: ``ln_attn, qkv, attn_core, attn_proj, ln_mlp, fc1, act, fc2`` and the
TP collectives), each step applying that submodule's own weights, norm module, softmax scale, mask
type and activation. The layer's ``forward`` is never called: its TP collectives are steps of their
own, so that each can be placed and hooked. A layer this cannot reproduce exactly
(transformer-engine modules, QK norms, MoE, cross-attention, other masks) is refused in one line
naming the submodule.

TP collectives (explicit adjoints, so a backward collective is an op of its own):
- without sequence parallelism a half-layer's input is copied into the TP region (its adjoint, the
  all-reduce of the partial input gradient, runs right after the qkv/fc1 backward) and its output is
  all-reduced (``tp_ar_*``, adjoint the identity);
- with sequence parallelism (TP > 1) the residual stream holds 1/TP of the tokens: all-gather before
  qkv/fc1 (adjoint reduce-scatter), reduce-scatter after linear_proj/fc2 (adjoint all-gather). The
  layer is built with megatron-core's ``sequence_parallel`` off (the steps, not its forward, gather
  and scatter), and the parameters applied to a rank's own tokens are marked by the caller.

A layer of ``metp.metp_layer_spec`` (tp_mode metp) is four ops, ``ln_attn, metp_attn, ln_mlp,
metp_mlp``: METP's attention and MLP interleave their broadcasts and ring hops with their GEMMs
inside one autograd function each, so each runs whole, and the scheduler's chain for the mode is
the same four (``cost_model.runtime_layer_ops``). A layer of ``layers_2d.get_2d_layer_spec``
(tp_mode 2d) is 1D's compute ops on its rank's grid block, each linear's SUMMA broadcasts and
reduces inside its op, and the chain for 2d likewise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import init_method_normal
from torch import nn
from torch.distributed import ProcessGroup

from optimus_mllm.config import TransformerSpec
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.dropout import dropout, site_seed
from optimus_mllm.runtime.dtypes import ACTIVATIONS
from optimus_mllm.runtime.encoder_ops import Step
from optimus_mllm.runtime.llm import SdpaCoreAttention, unfused_settings
from optimus_mllm.runtime.metp import MetpMLP, MetpSelfAttention
from optimus_mllm.runtime.tp_modes.layers_2d import LayerNorm2D, Linear2D

Tensor = torch.Tensor

# torch 2.13 renames the single-tensor collectives; older releases have only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# the masks a layer applies with no mask tensor passed, as megatron-core's local attention does
_BIDIRECTIONAL, _CAUSAL = AttnMaskType.no_mask, AttnMaskType.causal


# ---------------------------------------------------------------------------------------------
# The encoder's layers as megatron-core builds them


def vision_layer_spec() -> ModuleSpec:
    """megatron-core's local ViT layer with bidirectional attention.

    ``get_vit_layer_with_local_spec`` asks for a causal mask in megatron-core 0.16 (for none in the
    current Megatron-LM source, as its transformer-engine twin does) and keeps the norms under their
    module names; this takes no mask, as a ViT attends, and saves the norms under the fused names
    megatron-core's GPT local spec and LLaVA's transformer-engine ViT use
    (``self_attention.linear_qkv.layer_norm_weight``), so checkpoints match Megatron-LM's."""
    spec = get_vit_layer_with_local_spec()
    attention = spec.submodules.self_attention
    attention = replace(attention, params={**attention.params, "attn_mask_type": _BIDIRECTIONAL})
    keys = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    return replace(
        spec,
        submodules=replace(
            spec.submodules, self_attention=attention, sharded_state_dict_keys_map=keys
        ),
    )


def vision_transformer_config(
    spec: TransformerSpec, tp: int, params_dtype: torch.dtype, init_std: float
) -> TransformerConfig:
    """megatron-core's config for an encoder's layers on a TP group of ``tp`` ranks.

    Sequence parallelism stays off: the steps do the gathers and scatters. Every matrix starts as
    normal(0, ``init_std``), the output layers unscaled."""
    init = init_method_normal(init_std)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        activation_func=ACTIVATIONS[spec.activation],
        normalization=spec.normalization,
        layernorm_epsilon=1e-5,
        add_bias_linear=spec.add_bias_linear,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
        tensor_model_parallel_size=tp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        init_method_std=init_std,
        init_method=init,
        output_layer_init_method=init,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        **unfused_settings(),
    )


def build_layer(
    spec: ModuleSpec, config: TransformerConfig, group: ProcessGroup, layer_index: int
) -> nn.Module:
    """One layer of ``spec`` on the TP group ``group`` (not megatron-core's ``parallel_state``: the
    encoder
    has its own plan); ``layer_index`` is global, so its ``layer_number`` is the whole model's."""
    groups = ProcessGroupCollection(tp=group, cp=None, pp=None)
    return build_module(spec, config=config, layer_number=layer_index + 1, pg_collection=groups)


# ---------------------------------------------------------------------------------------------
# Collectives over the layer's TP group (dim 0 is the sequence)


def all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.clone()  # x may still be saved for another op's backward
    dist.all_reduce(out, group=group)
    return out


def all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def collective(
    forward: Callable[[Tensor], Tensor],
    adjoint: Callable[[Tensor], Tensor],
    fwd_kernel: str | None,
    bwd_kernel: str | None,
    tokenwise: bool = False,
) -> Step:
    return Step(
        forward=lambda x: (forward(x),),
        adjoint=lambda g: (adjoint(g),),
        fwd_kernel=fwd_kernel,
        bwd_kernel=bwd_kernel,
        tokenwise=tokenwise,
    )


def _identity(x: Tensor) -> Tensor:
    return x


def tp_entry(group: ProcessGroup, sequence_parallel: bool, half: str) -> Step:
    """Into a column-parallel GEMM: gather the tokens (SP), or copy (backward: all-reduce)."""
    if sequence_parallel:
        return collective(
            lambda x: all_gather(x, group),
            lambda g: reduce_scatter(g, group),
            f"tp_ag_{half}",
            f"tp_rs_{half}",
        )
    return collective(
        _identity, lambda g: all_reduce(g, group), None, f"tp_ar_{half}", tokenwise=True
    )


def tp_exit(group: ProcessGroup, sequence_parallel: bool, half: str) -> Step:
    """Out of a row-parallel GEMM: reduce-scatter (SP) or all-reduce the partial sums."""
    if sequence_parallel:
        return collective(
            lambda x: reduce_scatter(x, group),
            lambda g: all_gather(g, group),
            f"tp_rs_{half}",
            f"tp_ag_{half}",
        )
    return collective(
        lambda x: all_reduce(x, group), _identity, f"tp_ar_{half}", None, tokenwise=True
    )


# ---------------------------------------------------------------------------------------------
# Compute steps


def compute(
    kernel: str, fn: Callable[[Tensor], Tensor], *params: Tensor | None, tokenwise: bool = False
) -> Step:
    return Step(
        forward=lambda x: (fn(x),),
        fwd_kernel=kernel,
        bwd_kernel=kernel,
        trainable=wants_grad(*params),
        tokenwise=tokenwise,
    )


def linear(kernel: str, module: nn.Module, with_bias: bool = True, tokenwise: bool = True) -> Step:
    """A GEMM with ``module``'s weight (and bias): pieces of its tokens take their gradients
    directly."""
    weight, bias = module.weight, module.bias if with_bias else None
    return Step(
        forward=lambda x: (F.linear(x, weight, bias),),
        fwd_kernel=kernel,
        bwd_kernel=kernel,
        trainable=wants_grad(weight, bias),
        tokenwise=tokenwise,
        linear=(weight, bias),
    )


def wants_grad(*params: Tensor | None) -> bool:
    return any(p is not None and p.requires_grad for p in params)


def _norm_step(norm: nn.Module, kernel: str, tokenwise: bool) -> Step:
    """Normalise, and keep the input as the residual of the half-layer."""
    return Step(
        forward=lambda h: (norm(h), h),
        fwd_kernel=kernel,
        bwd_kernel=kernel,
        writes=("hidden", "residual"),
        trainable=wants_grad(*norm.parameters()),
        tokenwise=tokenwise,
    )


def _residual_add_step(
    bias: Tensor | None,
    p: float,
    site: str,
    group: ProcessGroup,
    sequence_parallel: bool,
    tokenwise: bool,
) -> Step:
    """The row-parallel bias, hidden dropout and the residual, after the reduction (megatron-core's
    bias-dropout-add): no kernel of its own. Under sequence parallelism ``x`` holds this rank's
    tokens, otherwise all of them, the same on every TP rank."""
    parts, part = (group.size(), group.rank()) if sequence_parallel else (1, 0)

    def forward(seed: int, x: Tensor, residual: Tensor) -> tuple[Tensor]:
        x = x if bias is None else x + bias
        x = dropout(x, p, site_seed(seed, site), (x.shape[0] * parts, *x.shape[1:]), 0, parts, part)
        return (x + residual,)

    return Step(
        forward=forward,
        fwd_kernel=None,
        bwd_kernel=None,
        reads=("hidden", "residual"),
        trainable=wants_grad(bias),
        seeded=True,
        tokenwise=tokenwise,
    )


# ---------------------------------------------------------------------------------------------
# The layer


def layer_steps(
    layer: nn.Module, group: ProcessGroup, sequence_parallel: bool, site: str
) -> tuple[Step, ...]:
    """The steps of a megatron-core ``TransformerLayer`` on TP group ``group``.

    Args:
        layer: built with TP size ``group.size()`` from a local-spec ``ModuleSpec``, or from
            ``metp_layer_spec`` (then on this rank's tokens, whatever ``sequence_parallel``).
        group: the layer's TP group.
        sequence_parallel: the residual stream holds this rank's 1/TP of the tokens.
        site: ``encoder:global layer``, which names the layer's dropout masks.

    Raises:
        OptimusError: a submodule these steps cannot reproduce, named.
    """
    check_decomposable(layer, site)
    if isinstance(layer.self_attention, MetpSelfAttention):
        return _metp_layer_steps(layer, group, site)
    if isinstance(layer.self_attention.linear_qkv, Linear2D):
        return _summa_layer_steps(layer, site)
    attention, mlp, config = layer.self_attention, layer.mlp, layer.config
    qkv, proj, fc1, fc2 = (
        attention.linear_qkv,
        attention.linear_proj,
        mlp.linear_fc1,
        mlp.linear_fc2,
    )
    core = attention.core_attention
    causal = core.attn_mask_type == _CAUSAL
    heads, groups = (
        attention.num_attention_heads_per_partition,
        attention.num_query_groups_per_partition,
    )
    head_dim, scale = attention.hidden_size_per_attention_head, core.softmax_scale
    p_attn = config.attention_dropout

    def attend(seed: int, x: Tensor, rows: slice = slice(None)) -> tuple[Tensor]:
        return (
            _attention(
                x,
                heads,
                groups,
                head_dim,
                scale,
                causal,
                p_attn,
                group,
                site_seed(seed, f"{site}:attn_core"),
                rows,
            ),
        )

    # pieces of tokens (encoder_ops), not with dropout: its masks are drawn whole (``encoder_costs``
    # splits the same layers)
    pieces = p_attn == 0.0 and layer.hidden_dropout == 0.0
    query_rows = (lambda seed, rows, x: attend(seed, x, rows)) if pieces else None

    def activation(x: Tensor) -> Tensor:
        if config.gated_linear_unit:  # megatron-core's MLP: [gate; up] per rank
            gate, up = x.chunk(2, dim=-1)
            return config.activation_func(gate) * up
        return config.activation_func(x)

    attention_steps = [
        linear("qkv", qkv, tokenwise=pieces),
        Step(
            forward=attend,
            fwd_kernel="attn_core",
            bwd_kernel="attn_core",
            seeded=True,
            query_rows=query_rows,
        ),
        # its bias: after the reduction
        linear("attn_proj", proj, with_bias=False, tokenwise=pieces),
    ]
    mlp_steps = [
        linear("fc1", fc1, tokenwise=pieces),
        compute("act", activation, tokenwise=pieces),
        linear("fc2", fc2, with_bias=False, tokenwise=pieces),
    ]
    if group.size() > 1:
        sp = sequence_parallel
        attention_steps = [
            tp_entry(group, sp, "attn"),
            *attention_steps,
            tp_exit(group, sp, "attn"),
        ]
        mlp_steps = [tp_entry(group, sp, "mlp"), *mlp_steps, tp_exit(group, sp, "mlp")]
    p = layer.hidden_dropout
    return (
        _norm_step(layer.input_layernorm, "ln_attn", pieces),
        *attention_steps,
        _residual_add_step(proj.bias, p, f"{site}:attn", group, sequence_parallel, pieces),
        _norm_step(layer.pre_mlp_layernorm, "ln_mlp", pieces),
        *mlp_steps,
        _residual_add_step(fc2.bias, p, f"{site}:mlp", group, sequence_parallel, pieces),
    )


def _metp_layer_steps(layer: nn.Module, group: ProcessGroup, site: str) -> tuple[Step, ...]:
    """A ``metp_layer_spec`` layer: its attention and its MLP one op each (``runtime/metp``'s
    autograd functions, which interleave their broadcasts and ring hops with their GEMMs;
    ``cost_model.METP_OPS``), on this rank's 1/p of the tokens, never cut into pieces."""

    def half(kernel: str, module: nn.Module) -> Step:
        return Step(
            forward=lambda x: (module(x)[0],),  # (output, bias): the bias after the residual
            fwd_kernel=kernel,
            bwd_kernel=kernel,
            trainable=wants_grad(*module.parameters()),
        )

    attention, mlp, p = layer.self_attention, layer.mlp, layer.hidden_dropout
    return (
        _norm_step(layer.input_layernorm, "ln_attn", False),
        half("metp_attn", attention),
        _residual_add_step(attention.linear_proj.bias, p, f"{site}:attn", group, True, False),
        _norm_step(layer.pre_mlp_layernorm, "ln_mlp", False),
        half("metp_mlp", mlp),
        _residual_add_step(mlp.linear_fc2.bias, p, f"{site}:mlp", group, True, False),
    )


def _summa_layer_steps(layer: nn.Module, site: str) -> tuple[Step, ...]:
    """A ``get_2d_layer_spec`` layer on its rank's ``[s, b/q, h/q]`` block: its norms, linears,
    core attention (the row's heads of the rank's samples) and activation one op each, each linear's
    SUMMA broadcasts and reduces inside its op (``tp_modes.summa.SummaLinear``), its bias (hosted on
    grid row 0) added in it; never cut into pieces.

    Every step is differentiated on every rank of the grid when any of the layer's parameters wants
    a gradient (rows other than 0 hold no norm weights, but their backward joins the reduce to row
    0), so all ranks run the same ops."""
    attention, mlp, config = layer.self_attention, layer.mlp, layer.config
    if config.hidden_dropout or config.attention_dropout:
        raise OptimusError(
            f"{site}: 2D layers run without dropout here; set hidden_dropout and attention_dropout "
            "to 0"
        )
    trainable = wants_grad(*layer.parameters())
    core = attention.core_attention
    heads, groups = (
        attention.num_attention_heads_per_partition,
        attention.num_query_groups_per_partition,
    )
    head_dim, scale = attention.hidden_size_per_attention_head, core.softmax_scale
    causal = core.attn_mask_type == _CAUSAL

    def step(kernel: str | None, fn: Callable[..., tuple[Tensor, ...]], **kw: Any) -> Step:
        return Step(forward=fn, fwd_kernel=kernel, bwd_kernel=kernel, trainable=trainable, **kw)

    def linear2d(kernel: str, module: nn.Module) -> Step:
        def forward(x: Tensor) -> tuple[Tensor]:
            out, bias = module(x)
            return (out if bias is None else out + bias,)

        return step(kernel, forward)

    def norm(kernel: str, module: nn.Module) -> Step:
        return step(kernel, lambda h: (module(h), h), writes=("hidden", "residual"))

    def attend(x: Tensor) -> tuple[Tensor]:
        return (_attention(x, heads, groups, head_dim, scale, causal, 0.0, None, 0),)

    def add(x: Tensor, residual: Tensor) -> tuple[Tensor]:
        return (x + residual,)

    return (
        norm("ln_attn", layer.input_layernorm),
        linear2d("qkv", attention.linear_qkv),
        step("attn_core", attend),
        linear2d("attn_proj", attention.linear_proj),
        step(None, add, reads=("hidden", "residual")),
        norm("ln_mlp", layer.pre_mlp_layernorm),
        linear2d("fc1", mlp.linear_fc1),
        step("act", lambda x: (config.activation_func(x),)),
        linear2d("fc2", mlp.linear_fc2),
        step(None, add, reads=("hidden", "residual")),
    )


def _attention(
    qkv: Tensor,
    heads: int,
    groups: int,
    head_dim: int,
    scale: float,
    causal: bool,
    p: float,
    group: ProcessGroup,
    seed: int,
    rows: slice = slice(None),
) -> Tensor:
    """Softmax attention over this rank's heads; QKV grouped per query group (megatron-core's
    layout, so TP shards split whole groups). With attention dropout the probabilities are
    materialised (as in megatron-core's local attention): their mask is cut from the one of all
    heads. ``rows``: the queries to attend for, each to every key (or under the causal mask, every
    key up to its own position), without dropout."""
    s, b, _ = qkv.shape
    per_group = heads // groups
    x = qkv.view(s, b, groups, per_group + 2, head_dim)
    q = x[rows, :, :, :per_group].reshape(-1, b, heads, head_dim)
    k, v = x[:, :, :, per_group], x[:, :, :, per_group + 1]
    q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [batch, heads, seq, head_dim]
    if per_group > 1:
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
    first, _, _ = rows.indices(s)
    # some queries: key j is visible to query first + i if j <= first + i
    if p == 0.0 and causal and q.shape[2] < s:
        visible = torch.ones(q.shape[2], s, dtype=torch.bool, device=qkv.device).tril(first)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    elif p == 0.0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(
                torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1), float("-inf")
            )
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        tp = group.size()
        probs = dropout(probs, p, seed, (b, heads * tp, s, s), 1, tp, group.rank())
        out = torch.matmul(probs, v)
    return out.permute(2, 0, 1, 3).reshape(-1, b, heads * head_dim)


def check_decomposable(layer: nn.Module, where: str) -> None:
    """Refuse, naming the submodule, a layer whose forward the steps would not reproduce exactly."""

    def refuse(name: str, module: object, what: str) -> OptimusError:
        kind = type(module).__name__
        return OptimusError(
            f"{where}: {name} is {kind}; Optimus splits only {what} (build the layer from "
            "megatron-core's local spec, e.g. get_vit_layer_with_local_spec)"
        )

    def exactly(name: str, module: object, *classes: type) -> None:
        if type(module) not in classes:
            raise refuse(name, module, " or ".join(c.__name__ for c in classes))

    exactly("the layer", layer, TransformerLayer)
    config = layer.config
    on_grid = isinstance(getattr(layer.self_attention, "linear_qkv", None), Linear2D)
    if on_grid:  # get_2d_layer_spec's
        _check_grid_layer(layer, where, exactly)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        norm = getattr(layer, name)
        if not on_grid and not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
            raise refuse(
                name,
                norm,
                "torch LayerNorm or RMSNorm (megatron-core's WrappedTorchNorm); a norm "
                "fused into the next linear is transformer-engine's",
            )
    if isinstance(layer.self_attention, MetpSelfAttention):  # metp_layer_spec's
        exactly("mlp", layer.mlp, MetpMLP)
    elif not on_grid:
        _check_tp_halves(layer, where, refuse, exactly)
    for name in ("pre_cross_attn_layernorm", "cross_attention"):
        exactly(name, getattr(layer, name), IdentityOp)
    exactly("cross_attn_bda", layer.cross_attn_bda, IdentityFuncOp)
    settings = {
        "apply_residual_connection_post_layernorm": False,
        "fp32_residual_connection": False,
        "apply_query_key_layer_scaling": False,
        "context_parallel_size": 1,
    }
    for field, wanted in settings.items():
        if getattr(config, field) != wanted:
            raise OptimusError(
                f"{where}: TransformerConfig.{field} is {getattr(config, field)}; Optimus splits "
                f"only layers with {field}={wanted}"
            )


def _refuse_a_mask_tensor(attention: nn.Module, where: str) -> None:
    """The layer steps compute the mask from its type: an attention given a mask tensor is not
    theirs to split."""
    mask = attention.core_attention.attn_mask_type
    if mask not in (_BIDIRECTIONAL, _CAUSAL):
        raise OptimusError(
            f"{where}: self_attention has attn_mask_type {mask.name}; Optimus splits only "
            "attention without a mask tensor (no_mask or causal)"
        )


def _check_grid_layer(layer: nn.Module, where: str, exactly: Callable[..., None]) -> None:
    """``get_2d_layer_spec``'s layer: megatron-core's attention and MLP on 2D linears, norms."""
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        exactly(name, getattr(layer, name), LayerNorm2D)
    exactly("self_attention", layer.self_attention, SelfAttention)
    attention = layer.self_attention
    for name in ("linear_qkv", "linear_proj"):
        exactly(f"self_attention.{name}", getattr(attention, name), Linear2D)
    exactly("self_attention.core_attention", attention.core_attention, DotProductAttention)
    _refuse_a_mask_tensor(attention, where)
    exactly("mlp", layer.mlp, MLP)
    for name in ("linear_fc1", "linear_fc2"):
        exactly(f"mlp.{name}", getattr(layer.mlp, name), Linear2D)


def _check_tp_halves(
    layer: nn.Module,
    where: str,
    refuse: Callable[[str, object, str], OptimusError],
    exactly: Callable[..., None],
) -> None:
    """megatron-core's own attention and MLP, as ``layer_steps`` splits them."""
    exactly("self_attention", layer.self_attention, SelfAttention)
    attention = layer.self_attention
    exactly("self_attention.linear_qkv", attention.linear_qkv, ColumnParallelLinear)
    # SdpaCoreAttention: the LLM's GPU core attention, the same math
    exactly(
        "self_attention.core_attention",
        attention.core_attention,
        DotProductAttention,
        SdpaCoreAttention,
    )
    exactly("self_attention.linear_proj", attention.linear_proj, RowParallelLinear)
    for name in ("q_layernorm", "k_layernorm"):
        norm = getattr(attention, name, None)
        if norm is not None and type(norm) is not IdentityOp:
            raise refuse(f"self_attention.{name}", norm, "layers without QK norms (--qk-layernorm)")
    _refuse_a_mask_tensor(attention, where)
    exactly("mlp", layer.mlp, MLP)
    exactly("mlp.linear_fc1", layer.mlp.linear_fc1, ColumnParallelLinear)
    exactly("mlp.linear_fc2", layer.mlp.linear_fc2, RowParallelLinear)
