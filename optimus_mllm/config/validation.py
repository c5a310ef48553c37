"""Validation: everything that a single field's type cannot say, each problem one ``ConfigError``
naming the field and a valid alternative; and the divisibility rules the planner shares."""

from __future__ import annotations

from optimus_mllm.config.schema import (
    MAX_GPUS,
    MAX_MICROBATCHES_PER_PIPELINE,
    MAX_MODEL_SIZES,
    EncoderConfig,
    EncoderPlanConfig,
    LLMPlanConfig,
    OptimusConfig,
    TPMode,
    TrainingConfig,
    TransformerSpec,
)
from optimus_mllm.errors import ConfigError


def validate(config: OptimusConfig) -> None:
    """Raise ConfigError on the first inconsistency, naming the field and a valid alternative."""
    c, t = config.cluster, config.training
    _positive(c.num_gpus, "cluster.num_gpus")
    _at_most(c.num_gpus, MAX_GPUS, "cluster.num_gpus")
    _positive(c.gpus_per_node, "cluster.gpus_per_node")
    for name in (
        "gpu_memory_gib",
        "peak_tflops",
        "hbm_bandwidth_gbps",
        "intra_node_bandwidth_gbps",
        "inter_node_bandwidth_gbps",
    ):
        _positive(getattr(c, name), f"cluster.{name}")
    if c.num_gpus > c.gpus_per_node and c.num_gpus % c.gpus_per_node:
        raise ConfigError(
            "cluster.num_gpus", f"{c.num_gpus} is not a multiple of gpus_per_node={c.gpus_per_node}"
        )

    names = [e.name for e in config.encoders]
    if len(set(names)) != len(names):
        raise ConfigError("model.encoders", f"encoder names must be unique, got {names}")
    for i, enc in enumerate(config.encoders):
        _validate_transformer(enc, f"model.encoders[{i}]")
        _positive(enc.patch_size, f"model.encoders[{i}].patch_size")
        _positive(enc.in_channels, f"model.encoders[{i}].in_channels")
        _validate_class_token(enc, f"model.encoders[{i}]")
        _validate_spatial_merge(enc, f"model.encoders[{i}].projector.spatial_merge")
        _validate_projector_mlp(enc, f"model.encoders[{i}].projector")
    _validate_transformer(config.llm, "model.llm")
    _positive(config.llm.vocab_size, "model.llm.vocab_size")
    _at_most(config.llm.vocab_size, 1 << 24, "model.llm.vocab_size")
    if config.image_tokens >= config.llm.seq_length:
        raise ConfigError(
            "model.llm.seq_length",
            f"{config.llm.seq_length} leaves no room for text after "
            f"{config.image_tokens} image tokens; use more than {config.image_tokens}",
        )

    _positive(t.global_batch_size, "training.global_batch_size")
    _positive(t.micro_batch_size, "training.micro_batch_size")
    _at_most(
        t.global_batch_size // t.micro_batch_size,
        MAX_MICROBATCHES_PER_PIPELINE * c.num_gpus,
        "training.global_batch_size",
        "microbatches (global_batch_size / micro_batch_size)",
    )
    _positive(t.train_iters, "training.train_iters")
    _validate_optimizer(t)
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            "training.global_batch_size",
            f"{t.global_batch_size} is not divisible by "
            f"micro_batch_size={t.micro_batch_size}; use a multiple of {t.micro_batch_size}",
        )

    _positive(config.planner.max_partitions, "planner.max_partitions")
    _positive(config.planner.max_virtual_stages, "planner.max_virtual_stages")
    cm = config.cost_model
    for name in (
        "gemm_efficiency",
        "attention_efficiency",
        "memory_efficiency",
        "network_efficiency",
        "nvlink_efficiency",
    ):
        value = getattr(cm, name)
        if value is not None and not 0 < value <= 1:
            raise ConfigError(f"cost_model.{name}", f"must be in (0, 1], got {value}")
    if cm.kernel_overhead_us < 0:
        raise ConfigError(
            "cost_model.kernel_overhead_us", f"must be >= 0, got {cm.kernel_overhead_us}"
        )

    _validate_workload(config)

    _validate_data(config)
    if config.parallel.llm is not None:
        validate_llm_plan(config, config.parallel.llm, "parallel.llm")
    encoder = config.parallel.encoder
    if encoder is not None and (encoder.pp is None) != (encoder.tp is None):
        given, missing = ("pp", "tp") if encoder.tp is None else ("tp", "pp")
        raise ConfigError(
            f"parallel.encoder.{missing}",
            f"a fixed encoder plan needs pp and tp together; give {missing} too, or drop "
            f"{given} to let the planner choose both",
        )
    if encoder is not None and encoder.fixed:
        if config.parallel.llm is None:
            raise ConfigError(
                "parallel.encoder", "a fixed encoder plan needs a fixed parallel.llm plan too"
            )
        validate_encoder_plan(config, encoder, config.parallel.llm, "parallel.encoder")


def _validate_workload(config: OptimusConfig) -> None:
    """The planned maximum and the workload distribution (``optimus_mllm/costing/workload.py``)."""
    d = config.data
    if d.max_images_per_microbatch is not None:
        _positive(d.max_images_per_microbatch, "data.max_images_per_microbatch")
        _at_most(d.max_images_per_microbatch, 1 << 12, "data.max_images_per_microbatch")
    if config.training.schedule_per_iteration and d.max_images_per_microbatch is None:
        most = d.max_images_per_sample * d.samples_per_sequence * config.training.micro_batch_size
        raise ConfigError(
            "data.max_images_per_microbatch",
            "is needed with training.schedule_per_iteration (its fallback is the schedule for it): "
            "state the most images per microbatch, e.g. "
            f"{most}",
        )
    if d.tokens_per_image is not None and d.images_per_sample is None:
        raise ConfigError(
            "data.tokens_per_image", "needs data.images_per_sample (the images it sizes); add it"
        )
    if d.images_per_sample is not None:
        _validate_histogram(d.images_per_sample, "data.images_per_sample", lowest=0)
        if d.max_images_per_microbatch is None:
            raise ConfigError(
                "data.max_images_per_microbatch",
                "is needed with data.images_per_sample: state the most images per microbatch "
                "memory is planned for, e.g. "
                f"{max(d.images_per_sample) * config.training.micro_batch_size}",
            )
    if d.tokens_per_image is not None:
        _validate_histogram(d.tokens_per_image, "data.tokens_per_image", lowest=1)
        if len(config.encoders) != 1:
            raise ConfigError(
                "data.tokens_per_image",
                f"sizes one encoder's images, the config has {len(config.encoders)}; leave it out",
            )
        enc = config.encoders[0]
        for tokens in d.tokens_per_image:
            if tokens > enc.seq_length or tokens % enc.merged_tokens:
                raise ConfigError(
                    f"data.tokens_per_image[{tokens}]",
                    f"must be at most the encoder's seq_length={enc.seq_length} (what memory is "
                    f"planned for) and a multiple of its projector merge {enc.merged_tokens}",
                )


def _validate_histogram(histogram: dict[int, float], path: str, lowest: int) -> None:
    if not histogram:
        raise ConfigError(path, "is empty; give value: weight pairs, e.g. {0: 0.2, 1: 0.8}")
    for value, weight in histogram.items():
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= 1 << 20:
            raise ConfigError(f"{path}[{value!r}]", f"keys must be integers >= {lowest}")
        if weight < 0:
            raise ConfigError(f"{path}[{value!r}]", f"weight must be >= 0, got {weight}")
    if abs(sum(histogram.values()) - 1.0) > 1e-6:
        raise ConfigError(path, f"weights sum to {sum(histogram.values()):g}; make them sum to 1")


def _validate_optimizer(t: TrainingConfig) -> None:
    _positive(t.lr, "training.lr")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError("training.min_lr", f"must be in [0, lr={t.lr}], got {t.min_lr}")
    if t.lr_warmup_iters < 0:
        raise ConfigError("training.lr_warmup_iters", f"must be >= 0, got {t.lr_warmup_iters}")
    _positive(t.decay_iters, "training.lr_decay_iters")
    if t.lr_warmup_iters >= t.decay_iters:  # megatron-core's OptimizerParamScheduler asserts it
        raise ConfigError(
            "training.lr_warmup_iters",
            f"{t.lr_warmup_iters} must be below lr_decay_iters (or "
            f"train_iters) = {t.decay_iters}; use fewer warm-up iterations",
        )
    for name in ("weight_decay", "clip_grad", "sgd_momentum"):
        if getattr(t, name) < 0:
            raise ConfigError(f"training.{name}", f"must be >= 0, got {getattr(t, name)}")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "training.use_checkpoint_opt_param_scheduler",
            "and training.override_opt_param_scheduler are both set; keep the one whose LR "
            "schedule a resumed run takes (the checkpoint's or this run's)",
        )
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise ConfigError(f"training.{name}", f"must be in [0, 1), got {getattr(t, name)}")
    _positive(t.adam_eps, "training.adam_eps")
    if t.loss_scale is not None:
        _positive(t.loss_scale, "training.loss_scale")
    _positive(t.initial_loss_scale, "training.initial_loss_scale")
    _positive(t.min_loss_scale, "training.min_loss_scale")
    _positive(t.loss_scale_window, "training.loss_scale_window")
    _positive(t.hysteresis, "training.hysteresis")


def _validate_data(config: OptimusConfig) -> None:
    d = config.data
    _positive(d.samples_per_sequence, "data.samples_per_sequence")
    if d.max_images_per_sample < 0:
        raise ConfigError(
            "data.max_images_per_sample", f"must be 0 or more, got {d.max_images_per_sample}"
        )
    if not d.image_placeholder:
        raise ConfigError("data.image_placeholder", 'must not be empty; e.g. "<image>"')


def _positive(value: float, path: str) -> None:
    if value <= 0:
        raise ConfigError(path, f"must be positive, got {value}")


def _at_most(value: int, limit: int, path: str, what: str = "") -> None:
    """Bounds that keep planning and scheduling within seconds (each far above any real job)."""
    if value > limit:
        raise ConfigError(
            path, f"{what + ' ' if what else ''}{value} is above the {limit} this tool plans for"
        )


def _validate_class_token(enc: EncoderConfig, where: str) -> None:
    if enc.drop_class_token and not enc.class_token:
        raise ConfigError(
            f"{where}.drop_class_token",
            "drops a class token the encoder does not have; set class_token: true (CLIP's) or "
            "leave drop_class_token out",
        )


def _validate_spatial_merge(enc: EncoderConfig, where: str) -> None:
    merge = enc.projector.spatial_merge
    _positive(merge, where)
    _at_most(merge, 64, where)
    if merge > 1 and enc.projected_tokens != enc.seq_length:
        raise ConfigError(
            where,
            f"{merge} would merge the class token with patch tokens; set drop_class_token: true "
            "(LLaVA's --disable-vision-class-token) or spatial_merge: 1",
        )
    if enc.seq_length % enc.merged_tokens:
        raise ConfigError(
            where,
            f"{merge} merges groups of {merge}x{merge} = {enc.merged_tokens} patch tokens, "
            f"which do not divide seq_length={enc.seq_length}; use a spatial_merge whose square "
            f"divides {enc.seq_length}, or 1",
        )


def _validate_projector_mlp(enc: EncoderConfig, where: str) -> None:
    projector = enc.projector
    if projector.ffn_hidden_size is not None:
        _positive(projector.ffn_hidden_size, f"{where}.ffn_hidden_size")
        _at_most(
            projector.ffn_hidden_size,
            MAX_MODEL_SIZES["ffn_hidden_size"],
            f"{where}.ffn_hidden_size",
        )
    if projector.type == "mlp":
        return
    for name, default in (
        ("ffn_hidden_size", None),
        ("activation", "gelu"),
        ("gated_linear_unit", False),
    ):
        if getattr(projector, name) != default:
            raise ConfigError(
                f"{where}.{name}",
                f"shapes the mlp projector's MLP, but projector.type is {projector.type}; leave "
                f"{name} out or use type: mlp",
            )


def _validate_transformer(spec: TransformerSpec, where: str) -> None:
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "seq_length",
    ):
        _positive(getattr(spec, name), f"{where}.{name}")
        _at_most(getattr(spec, name), MAX_MODEL_SIZES[name], f"{where}.{name}")
    if spec.kv_channels is None and spec.hidden_size % spec.num_attention_heads:
        raise ConfigError(
            f"{where}.num_attention_heads",
            f"{spec.num_attention_heads} does not divide hidden_size="
            f"{spec.hidden_size}; use a divisor of {spec.hidden_size} or set kv_channels",
        )
    if spec.kv_channels is not None:
        _positive(spec.kv_channels, f"{where}.kv_channels")
    if spec.num_query_groups is not None:
        _positive(spec.num_query_groups, f"{where}.num_query_groups")
        if spec.num_attention_heads % spec.num_query_groups:
            raise ConfigError(
                f"{where}.num_query_groups",
                f"{spec.num_query_groups} does not divide "
                f"num_attention_heads={spec.num_attention_heads}; use one of "
                f"{_divisors_text(spec.num_attention_heads)}",
            )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(spec, name) < 1:
            raise ConfigError(
                f"{where}.{name}",
                f"must be a probability in [0, 1), got {getattr(spec, name)}; 0 turns dropout off",
            )


def tp_divisibility_problem(spec: TransformerSpec, tp: int) -> str | None:
    """Why tensor parallel size ``tp`` cannot split ``spec``'s layers, or None if it can."""
    if spec.num_attention_heads % tp:
        return f"num_attention_heads={spec.num_attention_heads} is not divisible by tp={tp}"
    if spec.query_groups % tp:
        return f"num_query_groups={spec.query_groups} is not divisible by tp={tp}"
    if spec.ffn_hidden_size % tp:
        return f"ffn_hidden_size={spec.ffn_hidden_size} is not divisible by tp={tp}"
    return None


def tp_mode_problem(spec: TransformerSpec, mode: TPMode, tp: int) -> str | None:
    """Why ``spec``'s layers cannot run under TP mode ``mode`` of total degree ``tp``, or None.

    2D splits every matrix in q x q blocks and hosts the vectors on one grid row, 1/q each; 3D
    splits matrices p^3 ways and hosts the vectors on the cube's diagonal, 1/p^2 each; METP keeps
    megatron-core's TP shards and splits the tokens p ways. The 2D/3D memory and cost formulas are
    the papers' plain layer (one key/value head per query head, head dim hidden/heads, no gated
    linear unit), so other shapes are refused rather than misplanned."""
    if mode == "1d":
        return None
    if mode in ("2d", "3d"):
        plain = (
            spec.query_groups == spec.num_attention_heads
            and spec.head_dim * spec.num_attention_heads == spec.hidden_size
            and not spec.gated_linear_unit
        )
        if not plain:
            return (
                f"tp_mode={mode} is planned for plain layers: leave num_query_groups, kv_channels "
                "and gated_linear_unit unset, or use tp_mode 1d or metp"
            )
    if mode == "2d":
        q = _integer_root(tp, 2)
        if q is None or q < 2:
            return (
                f"tp_mode=2d needs a square TP degree q*q with q >= 2 (4, 9, 16 ...), got tp={tp}"
            )
        return _splits(spec, {"hidden_size": q, "num_attention_heads": q, "ffn_hidden_size": q})
    if mode == "3d":
        p = _integer_root(tp, 3)
        if p is None or p < 2:
            return f"tp_mode=3d needs a cube TP degree p^3 with p >= 2 (8, 27, 64 ...), got tp={tp}"
        return _splits(
            spec, {"hidden_size": p * p, "num_attention_heads": p, "ffn_hidden_size": p * p}
        )
    if tp < 2:
        return f"tp_mode=metp needs a TP degree of at least 2 (its ring), got tp={tp}"
    problem = tp_divisibility_problem(spec, tp)
    if problem is None and spec.layer_tokens % tp:
        problem = (
            f"{spec.layer_tokens} tokens per sequence are not divisible by tp={tp} "
            "(tp_mode=metp splits them over its ring)"
        )
    return problem


def _integer_root(n: int, k: int) -> int | None:
    """The integer r with r**k == n, or None."""
    r = round(n ** (1 / k))
    return next((c for c in (r - 1, r, r + 1) if c > 0 and c**k == n), None)


def _splits(spec: TransformerSpec, ways: dict[str, int]) -> str | None:
    for name, parts in ways.items():
        if getattr(spec, name) % parts:
            return f"{name}={getattr(spec, name)} is not divisible by {parts}"
    return None


def encoder_tp_problem(
    enc: EncoderConfig, llm_hidden_size: int, sequence_parallel: bool, tp: int
) -> str | None:
    """Why tensor parallel size ``tp`` cannot split encoder ``enc`` and its projector as the runtime
    shards them, or None if it can: its layers; the projector's TP-split width (the ``mlp``'s fc1
    width, the LLM's for ``affine``, the encoder's for ``linear``); its tokens (patches and class
    token) under sequence parallelism."""
    problem = tp_divisibility_problem(enc, tp)
    width = enc.projector.mlp_ffn_hidden_size(llm_hidden_size)
    if problem is None and enc.projector.type == "mlp" and width % tp:
        problem = (
            f"projector.type=mlp splits model.llm.hidden_size={llm_hidden_size}, not divisible by "
            f"tp={tp}"
            if enc.projector.ffn_hidden_size is None
            else f"projector.ffn_hidden_size={width} is not divisible by tp={tp}"
        )
    if problem is None and enc.projector.type == "affine" and llm_hidden_size % tp:
        problem = (
            f"projector.type=affine splits model.llm.hidden_size={llm_hidden_size}, not divisible "
            f"by tp={tp}"
        )
    if problem is None and enc.projector.type == "linear" and enc.hidden_size % tp:
        problem = (
            f"hidden_size={enc.hidden_size} (split by its linear projector) is not divisible by "
            f"tp={tp}"
        )
    if problem is None and sequence_parallel and tp > 1 and enc.layer_tokens % tp:
        tokens = f"seq_length={enc.seq_length}" + (
            f" and the class token ({enc.layer_tokens} tokens)" if enc.class_token else ""
        )
        problem = f"{tokens} is not divisible by tp={tp} (training.sequence_parallel splits it)"
    if (
        problem is None
        and sequence_parallel
        and tp > 1
        and (enc.seq_length // tp) % enc.merged_tokens
    ):
        problem = (
            f"seq_length={enc.seq_length} split by tp={tp} (training.sequence_parallel) leaves "
            f"{enc.seq_length // tp} tokens per rank, not whole groups of "
            "projector.spatial_merge**2="
            f"{enc.merged_tokens}"
        )
    return problem


def validate_llm_plan(config: OptimusConfig, plan: LLMPlanConfig, where: str) -> None:
    """Check a fixed LLM plan against the cluster, model and batch."""
    n, llm, t = config.cluster.num_gpus, config.llm, config.training
    vp = 1 if plan.vp is None else plan.vp
    for name in ("dp", "pp", "tp"):
        _positive(getattr(plan, name), f"{where}.{name}")
    _positive(vp, f"{where}.vp")
    if plan.dp * plan.pp * plan.tp != n:
        raise ConfigError(
            where,
            f"dp*pp*tp = {plan.dp}*{plan.pp}*{plan.tp} = {plan.dp * plan.pp * plan.tp} "
            f"must equal cluster.num_gpus={n}",
        )
    problem = tp_divisibility_problem(llm, plan.tp)
    if problem:
        ok = [d for d in divisors(n) if tp_divisibility_problem(llm, d) is None]
        raise ConfigError(f"{where}.tp", f"model.llm.{problem}; use tp in {_join_ints(ok)}")
    problem = tp_mode_problem(llm, plan.tp_mode, plan.tp)
    if problem:
        ok = [d for d in divisors(n) if tp_mode_problem(llm, plan.tp_mode, d) is None]
        raise ConfigError(f"{where}.tp_mode", _mode_fix(f"model.llm: {problem}", plan.tp_mode, ok))
    if llm.num_layers % (plan.pp * vp):
        raise ConfigError(
            f"{where}.pp",
            f"pp*vp = {plan.pp}*{vp} does not divide model.llm.num_layers="
            f"{llm.num_layers}; use pp*vp in {_divisors_text(llm.num_layers)}",
        )
    if t.sequence_parallel and plan.tp > 1 and llm.seq_length % plan.tp:
        raise ConfigError(
            f"{where}.tp",
            f"sequence parallel needs model.llm.seq_length={llm.seq_length} "
            f"divisible by tp={plan.tp}",
        )
    per_replica = t.global_batch_size // t.micro_batch_size
    if per_replica % plan.dp:
        raise ConfigError(
            "training.global_batch_size",
            f"{t.global_batch_size} is not divisible into "
            f"micro_batch_size*dp = {t.micro_batch_size}*{plan.dp}; use a multiple of "
            f"{t.micro_batch_size * plan.dp}",
        )
    num_microbatches = per_replica // plan.dp
    if num_microbatches > MAX_MICROBATCHES_PER_PIPELINE:
        raise ConfigError(
            "training.global_batch_size",
            f"{t.global_batch_size} makes {num_microbatches} "
            f"microbatches per pipeline under dp={plan.dp}; the scheduler takes at most "
            f"{MAX_MICROBATCHES_PER_PIPELINE}: use a larger micro_batch_size or dp",
        )
    if vp > 1 and num_microbatches % plan.pp:
        raise ConfigError(
            f"{where}.vp",
            f"the interleaved schedule needs the {num_microbatches} microbatches per "
            f"pipeline to be a multiple of pp={plan.pp}; use vp: 1 or change global_batch_size",
        )


def validate_encoder_plan(
    config: OptimusConfig, plan: EncoderPlanConfig, llm_plan: LLMPlanConfig, where: str
) -> None:
    """Check a fixed encoder plan: PP_enc | PP_llm and TP_enc | TP_llm (paper §4.1)."""
    _positive(plan.pp, f"{where}.pp")
    _positive(plan.tp, f"{where}.tp")
    if llm_plan.pp % plan.pp:
        raise ConfigError(
            f"{where}.pp",
            f"{plan.pp} does not divide the LLM's pp={llm_plan.pp}; use one of "
            f"{_divisors_text(llm_plan.pp)}",
        )
    if llm_plan.tp % plan.tp:
        raise ConfigError(
            f"{where}.tp",
            f"{plan.tp} does not divide the LLM's tp={llm_plan.tp}; use one of "
            f"{_divisors_text(llm_plan.tp)}",
        )
    for i, enc in enumerate(config.encoders):
        problem = encoder_tp_problem(
            enc, config.llm.hidden_size, config.training.sequence_parallel, plan.tp
        )
        if problem:
            raise ConfigError(f"{where}.tp", f"model.encoders[{i}].{problem}")
        problem = tp_mode_problem(enc, plan.tp_mode, plan.tp)
        if problem:
            ok = [d for d in divisors(llm_plan.tp) if tp_mode_problem(enc, plan.tp_mode, d) is None]
            raise ConfigError(
                f"{where}.tp_mode", _mode_fix(f"model.encoders[{i}]: {problem}", plan.tp_mode, ok)
            )
        if enc.num_layers < plan.pp:
            raise ConfigError(
                f"{where}.pp",
                f"model.encoders[{i}] has {enc.num_layers} layers, fewer than pp={plan.pp} stages",
            )


def _mode_fix(problem: str, mode: TPMode, ok: list[int]) -> str:
    if ok:
        return f"{problem}; use tp in {_join_ints(ok)} or another tp_mode"
    return f"{problem}; no tp fits tp_mode={mode} here, use another tp_mode"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join_ints(values: list[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def _divisors_text(n: int) -> str:
    divs = divisors(n)
    if len(divs) > 12:
        return f"the divisors of {n}"
    return _join_ints(divs)
