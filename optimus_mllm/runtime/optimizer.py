"""megatron-core's training stack under both runtimes: DDP, the (distributed) optimizer, the LR schedule.

Every LLM chunk and the encoder stage are wrapped in megatron-core's ``DistributedDataParallel``
(contiguous fp32 gradient buffers, ``param.main_grad``), and one megatron-core optimizer steps them:
``get_megatron_optimizer`` (AdamW or SGD; fp32 main parameters for bf16/fp16 models; dynamic loss
scaling for fp16; the distributed optimizer, ZeRO-1, with ``training.distributed_optimizer``), one
``ChainedOptimizer`` over the LLM's and the encoder's parts so that the gradient norm and its
clipping span both. The LR follows megatron-core's ``OptimizerParamScheduler``, one step per iteration.

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

from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_patches.ddp import average_over
from optimus_mllm.config import OptimusConfig
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.process_groups import EncoderProcessGroups


def ddp_config(config: OptimusConfig) -> DistributedDataParallelConfig:
    """Megatron-LM's DDP defaults, gradients accumulated and reduced in fp32."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=config.training.distributed_optimizer)


def wrap_ddp(config: OptimusConfig, tconfig: TransformerConfig, module: torch.nn.Module,
             pg_collection: ProcessGroupCollection | None = None,
             replicas: int | None = None) -> DistributedDataParallel:
    """``module`` under megatron-core's DDP; ``pg_collection`` None means megatron's (the LLM's) groups.
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
        tp=groups.tp_group, pp=groups.pp_group, mp=groups.mp_group, dp=groups.dp_group, dp_cp=groups.dp_group,
        expt_dp=groups.dp_group, ep=None, tp_ep_pp=None,
        intra_dist_opt=parallel_state.get_intra_distributed_optimizer_instance_group())


def optimizer_config(config: OptimusConfig) -> OptimizerConfig:
    """Megatron's optimizer settings from ``training`` (the names are megatron-core's)."""
    t = config.training
    return OptimizerConfig(
        optimizer=t.optimizer, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, sgd_momentum=t.sgd_momentum,
        clip_grad=t.clip_grad, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        params_dtype=DTYPES[t.precision], loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale, loss_scale_window=t.loss_scale_window, hysteresis=t.hysteresis,
        use_distributed_optimizer=t.distributed_optimizer)


def build_optimizer(config: OptimusConfig, llm: Sequence[DistributedDataParallel],
                    encoder: DistributedDataParallel | None,
                    encoder_groups: ProcessGroupCollection | None) -> ChainedOptimizer:
    """One optimizer over the LLM chunks and the encoder stage.

    ``encoder_groups`` None: the encoder shares the LLM's groups (the Megatron-style baseline, where
    it sits in the first pipeline stage) and joins the LLM's optimizer. Otherwise it gets its own,
    on every rank, even where its stage has nothing to train (a frozen encoder): megatron-core then
    builds a stub that still takes part in the gradient-norm reduction.
    """
    opt_config = optimizer_config(config)
    if encoder_groups is None:
        return _chained(get_megatron_optimizer(opt_config, [*llm, *([encoder] if encoder else [])]))
    parts = [*_chained(get_megatron_optimizer(opt_config, list(llm))).chained_optimizers]
    if encoder is not None:
        parts += _chained(get_megatron_optimizer(opt_config, [encoder], use_gloo_process_groups=False,
                                                 pg_collection=encoder_groups)).chained_optimizers
    return ChainedOptimizer(parts)


def _chained(optimizer: MegatronOptimizer) -> ChainedOptimizer:
    return optimizer if isinstance(optimizer, ChainedOptimizer) else ChainedOptimizer([optimizer])


def build_scheduler(config: OptimusConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron's LR (warm-up from 0, then constant / linear / cosine decay to ``min_lr``) and constant
    weight decay, counted in iterations."""
    t = config.training
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=t.decay_iters, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
        end_wd=t.weight_decay, wd_incr_steps=t.decay_iters, wd_incr_style="constant")
