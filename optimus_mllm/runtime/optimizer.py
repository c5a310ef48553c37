"""megatron-core's training stack under both runtimes: DDP, the (distributed) optimizer, the LR
schedule.

Every LLM chunk and the encoder stage are wrapped in megatron-core's ``DistributedDataParallel``
(contiguous fp32 gradient buffers, ``param.main_grad``), and one megatron-core optimizer steps them:
``get_megatron_optimizer`` (AdamW or SGD; fp32 main parameters for bf16/fp16 models; dynamic loss
scaling for fp16; the distributed optimizer, ZeRO-1, with ``training.distributed_optimizer``), one
``ChainedOptimizer`` over the LLM's and the encoder's parts so that the gradient norm and its
clipping span both, and, for fp16, one loss scale (``OneLossScaleOptimizer``). The LR follows
megatron-core's ``OptimizerParamScheduler``, one step per iteration.

Data-parallel collectives are Megatron-LM's defaults (no ``--overlap-grad-reduce`` /
``--overlap-param-gather``): the gradients are reduce-scattered (all-reduced without the distributed
optimizer) after the pipeline schedule, in ``finalize_model_grads``, and the updated parameters are
all-gathered at the end of the optimizer step, i.e. before the next step's first computation. These
are the windows the LLM timeline models (``scheduler.llm_costs.dp_comm_us``).

The encoder (Optimus mode) runs under its own plan, so its DDP and optimizer get its own groups
(``encoder_process_groups``). Its data-parallel group holds DP_enc = m * DP_llm copies of a stage,
whose gradients are averaged over DP_llm (``megatron_patches.ddp.average_over``): the m pipelines
of one LLM replica share that replica's microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import (
    ChainedOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_patches.ddp import average_over
from megatron_patches.optimizer import use_gloo_group
from optimus_mllm.config import OptimusConfig
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.process_groups import EncoderProcessGroups


def ddp_config(config: OptimusConfig) -> DistributedDataParallelConfig:
    """Megatron-LM's DDP defaults, gradients accumulated and reduced in fp32."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=config.training.distributed_optimizer,
    )


def wrap_ddp(
    config: OptimusConfig,
    tconfig: TransformerConfig,
    module: torch.nn.Module,
    pg_collection: ProcessGroupCollection | None = None,
    replicas: int | None = None,
) -> DistributedDataParallel:
    """``module`` under megatron-core's DDP; ``pg_collection`` None means megatron's (the LLM's)
    groups.
    ``replicas``: average the gradients over that many replicas instead of the DP group's size."""
    ddp = DistributedDataParallel(tconfig, ddp_config(config), module, pg_collection=pg_collection)
    if replicas is not None:
        average_over(ddp, replicas)
    return ddp


def encoder_process_groups(groups: EncoderProcessGroups) -> ProcessGroupCollection:
    """The encoder plan's groups in megatron-core's form, for its DDP and optimizer.

    The distributed optimizer's gradient statistics are reduced over megatron's intra-instance group
    (every rank), the same group object as the LLM's, so the chained optimizer computes one norm.
    """
    return ProcessGroupCollection(
        tp=groups.tp_group,
        pp=groups.pp_group,
        mp=groups.mp_group,
        dp=groups.dp_group,
        dp_cp=groups.dp_group,
        expt_dp=groups.dp_group,
        ep=None,
        tp_ep_pp=None,
        intra_dist_opt=parallel_state.get_intra_distributed_optimizer_instance_group(),
    )


def optimizer_config(config: OptimusConfig) -> OptimizerConfig:
    """Megatron's optimizer settings from ``training`` (the names are megatron-core's)."""
    t = config.training
    return OptimizerConfig(
        optimizer=t.optimizer,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        sgd_momentum=t.sgd_momentum,
        clip_grad=t.clip_grad,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=DTYPES[t.precision],
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=t.distributed_optimizer,
    )


def build_optimizer(
    config: OptimusConfig,
    llm: Sequence[DistributedDataParallel],
    encoder: DistributedDataParallel | None,
    encoder_groups: ProcessGroupCollection | None,
    encoder_dp_gloo: dist.ProcessGroup | None = None,
) -> OneLossScaleOptimizer:
    """One optimizer over the LLM chunks and the encoder stage.

    ``encoder_groups`` None: the encoder shares the LLM's groups (the Megatron-style baseline, where
    it sits in the first pipeline stage) and joins the LLM's optimizer. Otherwise it gets its own,
    on every rank, even where its stage has nothing to train (a frozen encoder): megatron-core then
    builds a stub that still takes part in the gradient-norm reduction. ``encoder_dp_gloo``: the
    encoder's data-parallel group over gloo, which its part gathers its checkpoint state over.
    """
    opt_config = optimizer_config(config)
    if encoder_groups is None:
        models = [*llm, *([encoder] if encoder is not None else [])]
        return OneLossScaleOptimizer(optimizer_parts(get_megatron_optimizer(opt_config, models)))
    return chain_encoder_optimizer(
        get_megatron_optimizer(opt_config, list(llm)),
        encoder,
        opt_config,
        encoder_groups,
        encoder_dp_gloo,
    )


def chain_encoder_optimizer(
    llm: MegatronOptimizer,
    encoder: DistributedDataParallel | None,
    opt_config: OptimizerConfig,
    encoder_groups: ProcessGroupCollection,
    encoder_dp_gloo: dist.ProcessGroup | None,
    build: Callable[..., MegatronOptimizer] = get_megatron_optimizer,
    **build_kwargs: Any,
) -> OneLossScaleOptimizer:
    """The LLM's optimizer chained with one over the encoder stage under its own plan's groups
    (``build``, megatron-core's ``get_megatron_optimizer`` or the job's wrapper of it, with
    ``build_kwargs``): one gradient norm, one clip and one loss scale over both."""
    parts = optimizer_parts(llm)
    if encoder is not None:
        encoder_parts = optimizer_parts(
            build(
                opt_config,
                [encoder],
                use_gloo_process_groups=False,
                pg_collection=encoder_groups,
                **build_kwargs,
            )
        )
        for part in encoder_parts:
            use_gloo_group(part, encoder_dp_gloo)
        parts += encoder_parts
    return OneLossScaleOptimizer(parts)


class OneLossScaleOptimizer(ChainedOptimizer):
    """A ``ChainedOptimizer`` whose parts share one loss scale, updated once per step from all of
    them.

    megatron-core's ``ChainedOptimizer`` scales the loss by its first part's scale, while every part
    unscales its gradients by, and updates, a scale of its own. After a step where only the LLM's
    gradients overflow, the LLM's scale backs off and the encoder's does not: from then on the
    encoder's gradients are unscaled by a scale the loss was never multiplied by. Here the first
    part's scaler is the one scale; the parts read it and only report their overflow.
    """

    def __init__(self, parts: list[MegatronOptimizer]):
        super().__init__(parts)
        self.loss_scaler: MegatronGradScaler | None = (
            getattr(parts[0], "grad_scaler", None) if parts else None
        )
        if self.loss_scaler is not None:
            for part in parts:
                part.grad_scaler = _PartOfLossScale(self.loss_scaler)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        found_inf = super().prepare_grads()
        if self.loss_scaler is None:
            return found_inf
        # every rank skips or steps together, whatever groups the parts checked their overflow over
        flag = torch.tensor([float(found_inf)], device=self.loss_scaler.scale.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found_inf = bool(flag.item() > 0)
        self.loss_scaler.update(found_inf)
        return found_inf


class _PartOfLossScale(MegatronGradScaler):
    """A part's view of its ``OneLossScaleOptimizer``'s scale: read it, leave updating it to the
    owner."""

    # no super().__init__: the scale tensor is the owner's
    def __init__(self, owner: MegatronGradScaler):
        self.owner = owner

    @property
    def scale(self) -> torch.Tensor:
        return self.owner.scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self.owner.inv_scale

    def update(self, found_inf: bool) -> None:
        pass  # the owner's update follows every part's check (OneLossScaleOptimizer.prepare_grads)

    def state_dict(self) -> dict[str, Any]:
        return self.owner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.owner.load_state_dict(state_dict)


def optimizer_parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """A megatron-core optimizer's parts: a ``ChainedOptimizer``'s, or itself."""
    return (
        list(optimizer.chained_optimizers)
        if isinstance(optimizer, ChainedOptimizer)
        else [optimizer]
    )


def build_opt_param_scheduler(
    config: OptimusConfig, optimizer: MegatronOptimizer
) -> OptimizerParamScheduler:
    """Megatron's LR (warm-up from 0, then constant / linear / cosine decay to ``min_lr``) and
    constant weight decay, counted in iterations; on resuming, its settings are the checkpoint's or
    this run's as ``training.use_checkpoint_opt_param_scheduler`` / ``override_opt_param_scheduler``
    say (``checkpoint.lr_schedule_change`` refuses a difference when neither is set)."""
    t = config.training
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=t.decay_iters,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.decay_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler,
    )
