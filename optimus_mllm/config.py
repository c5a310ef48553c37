"""The YAML schema: typed dataclasses, strict loading, and cross-field validation.

Field names follow megatron-core's ``TransformerConfig`` where one exists (``hidden_size``,
``num_attention_heads``, ``ffn_hidden_size``, ``kv_channels``, ``num_query_groups`` ...), so a
Megatron user can read a config without a glossary.

A model section (``model.llm`` or one entry of ``model.encoders``) may name a ``base`` YAML file,
relative to the file that names it; the section's own keys override the base's. The model zoo in
``configs/models/`` is used this way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from optimus_mllm.calibration import load_calibration
from optimus_mllm.errors import ConfigError
from optimus_mllm.typed_load import load_typed
from optimus_mllm.yaml_input import YAMLInputError, parse_yaml, read_yaml_file

# The bounds of what is planned, each far above any job of today: the planner's and scheduler's work
# grows with layers, GPUs and microbatches, and a typo (4000000000000 layers) must not run for
# hours.
MAX_GPUS = 1 << 17
# the paper's largest is 128; the scheduler's time grows ~mb^2.5
MAX_MICROBATCHES_PER_PIPELINE = 256
MAX_MODEL_SIZES = {
    "num_layers": 1024,
    "hidden_size": 1 << 20,
    "num_attention_heads": 1 << 14,
    "ffn_hidden_size": 1 << 22,
    "seq_length": 1 << 22,
}
Precision = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
Optimizer = Literal["adam", "sgd"]
LRDecayStyle = Literal["constant", "linear", "cosine"]
Normalization = Literal["LayerNorm", "RMSNorm"]
Activation = Literal["gelu", "silu"]
PositionEmbedding = Literal["learned_absolute", "rope", "none"]
ProjectorType = Literal["mlp", "linear"]
VisionSubtype = Literal["internvit", "clip"]  # megatron-core CLIPViTModel's model_subtype


@dataclass(frozen=True)
class ClusterConfig:
    """The GPUs the job runs on. Bandwidths are per GPU, one direction, in GB/s."""

    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 tensor-core peak (H100 SXM)
    hbm_bandwidth_gbps: float = 3350.0
    intra_node_bandwidth_gbps: float = 450.0  # NVLink
    inter_node_bandwidth_gbps: float = 50.0  # one 400 Gb/s NIC per GPU


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a stack of identical transformer layers."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    kv_channels: int | None = None  # attention head dim; None means hidden_size // heads
    num_query_groups: int | None = None  # grouped-query attention; None means one per head
    gated_linear_unit: bool = False  # GLU MLP: fc1 produces two ffn-wide halves, act(gate) * up
    # the MLP's; Megatron-LM's --swiglu is silu with a gated linear unit
    activation: Activation = "gelu"
    add_bias_linear: bool = True
    normalization: Normalization = "LayerNorm"
    # Megatron-LM's --hidden-dropout / --attention-dropout (whose defaults are 0.1); off unless set
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return (
            self.kv_channels
            if self.kv_channels is not None
            else self.hidden_size // self.num_attention_heads
        )

    @property
    def query_groups(self) -> int:
        return (
            self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
        )


@dataclass(frozen=True)
class ProjectorConfig:
    """Maps encoder features into the LLM's hidden space (LLaVA's ``mlp2x_gelu`` is ``mlp``).

    ``spatial_merge`` > 1 first merges each group of ``spatial_merge**2`` neighbouring patch tokens
    into one token of ``spatial_merge**2`` times the width (Qwen2-VL's patch merger, InternVL's
    pixel shuffle), so the encoder sees all its patches while the LLM gets ``spatial_merge**2``
    times fewer image tokens. The data orders patches so that each group is contiguous (as
    Qwen2-VL's processor does), which makes the merge a reshape of consecutive tokens.
    """

    type: ProjectorType = "mlp"
    spatial_merge: int = 1


@dataclass(frozen=True)
class EncoderConfig(TransformerSpec):
    """A ViT-style modality encoder. ``seq_length`` is the number of patch tokens per image."""

    name: str = "vit"
    patch_size: int = 14
    in_channels: int = 3
    # megatron-core CLIPViTModel's embedding: internvit a patch conv with a bias; clip one without,
    # and a norm (ln_pre) before the first layer, as Megatron-LM's pretrain_vlm.py builds it
    model_subtype: VisionSubtype = "internvit"
    frozen: bool = False  # frozen encoders run forward only; their backward is never scheduled
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)

    @property
    def merged_tokens(self) -> int:
        """Patch tokens merged into one LLM token by the projector."""
        return self.projector.spatial_merge**2

    @property
    def image_tokens(self) -> int:
        """Tokens this encoder gives the LLM per image (``seq_length`` patches, merged by the
        projector)."""
        return self.seq_length // self.merged_tokens

    @property
    def projector_input_size(self) -> int:
        return self.hidden_size * self.merged_tokens


@dataclass(frozen=True)
class LLMConfig(TransformerSpec):
    """The language backbone. ``seq_length`` counts every token, image tokens included."""

    vocab_size: int = 50257
    position_embedding_type: PositionEmbedding = "learned_absolute"
    untie_embeddings_and_output_weights: bool = False


@dataclass(frozen=True)
class ModelConfig:
    encoders: tuple[EncoderConfig, ...]
    llm: LLMConfig


@dataclass(frozen=True)
class TrainingConfig:
    global_batch_size: int
    micro_batch_size: int = 1
    precision: Precision = "bf16"
    distributed_optimizer: bool = True
    sequence_parallel: bool = True
    recompute: Recompute = "none"
    train_iters: int = 10
    seed: int = 1234
    # Optimizer, clipping and LR schedule: Megatron-LM's argument names and defaults
    # (``--optimizer``, ``--lr-decay-style`` ...). ``adam`` is AdamW (decoupled weight decay), as in
    # megatron-core.
    optimizer: Optimizer = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: LRDecayStyle = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    # Resuming with other LR-schedule settings than the checkpoint's (lr, min_lr, warm-up, decay
    # iterations or style, weight decay): refused unless one says which side wins, as Megatron-LM's
    # --override-opt_param-scheduler (this run's) / --use-checkpoint-opt_param-scheduler (the
    # checkpoint's)
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0  # 0 turns clipping off
    # fp16 loss scaling: a fixed ``loss_scale``, or dynamic from ``initial_loss_scale``
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters


@dataclass(frozen=True)
class LLMPlanConfig:
    """A fixed LLM plan. ``vp`` is the number of model chunks per pipeline rank (virtual stages);
    left out, the planner chooses it."""

    dp: int
    pp: int
    tp: int
    vp: int | None = None


@dataclass(frozen=True)
class EncoderPlanConfig:
    """A fixed encoder plan; DP_enc follows from the GPU count."""

    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelConfig:
    llm: LLMPlanConfig | None = None
    encoder: EncoderPlanConfig | None = None


@dataclass(frozen=True)
class PlannerConfig:
    # Upper bound on microbatch partitions kept per encoder plan (after symmetry reduction).
    max_partitions: int = 64
    # Upper bound on virtual stages when the planner chooses V itself (12 is the paper's largest).
    max_virtual_stages: int = 12


@dataclass(frozen=True)
class CostModelConfig:
    """Roofline efficiency factors: achieved / peak, per kernel class."""

    gemm_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    network_efficiency: float = 0.7
    nvlink_efficiency: float | None = None  # collectives inside a node; None: network_efficiency
    kernel_overhead_us: float = 2.0  # launch and tail latency added to every kernel
    # roofline (these constants), paper, or a calibration file: see optimus_mllm/calibration.py
    calibration: str = "roofline"
    # JSON of measured kernel times (optimus-profile); overrides the roofline
    profile: str | None = None


@dataclass(frozen=True)
class DataConfig:
    """Training data. ``path`` is a folder holding ``captions.jsonl`` and its images (the format is
    in ``optimus_mllm/runtime/data.py``); left out, the job trains on synthetic data. A relative
    path is kept as written and read from the working directory, like Megatron's ``--data-path``."""

    path: str | None = None


@dataclass(frozen=True)
class OptimusConfig:
    cluster: ClusterConfig
    model: ModelConfig
    training: TrainingConfig
    name: str = "unnamed"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # the file this config was read from; set by load_config
    source: str | None = field(default=None, metadata={"set_by_loader": True})

    @property
    def encoders(self) -> tuple[EncoderConfig, ...]:
        return self.model.encoders

    @property
    def llm(self) -> LLMConfig:
        return self.model.llm

    @property
    def image_tokens(self) -> int:
        """The LLM's image positions per sample: every encoder's, after its projector's spatial
        merge."""
        return sum(e.image_tokens for e in self.encoders)

    @property
    def num_microbatches_total(self) -> int:
        """Microbatches per iteration over all LLM data-parallel replicas."""
        return self.training.global_batch_size // self.training.micro_batch_size


# --------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> OptimusConfig:
    """Read, merge ``base`` files, apply ``key.path=value`` overrides, type-check and validate."""
    path = Path(path)
    raw = _read_yaml(path, "--config")
    if not isinstance(raw, dict):
        raise ConfigError(
            "config", f"{path} must hold a mapping at top level, got {type(raw).__name__}"
        )
    raw = _resolve_model_bases(raw, path.parent)
    for item in overrides:
        _apply_override(raw, item)
    raw["source"] = str(path)
    config = calibrate(load_typed(OptimusConfig, raw, ""))
    validate(config)
    return config


def config_from_dict(raw: dict[str, Any], base_dir: str | Path = ".") -> OptimusConfig:
    """Build and validate a config from an in-memory mapping (tests, programmatic use)."""
    raw = _resolve_model_bases(dict(raw), Path(base_dir))
    config = calibrate(load_typed(OptimusConfig, raw, ""))
    validate(config)
    return config


def _read_yaml(path: Path, field_name: str) -> Any:
    try:
        return read_yaml_file(path)
    except FileNotFoundError:
        raise ConfigError(
            field_name, f"file {path} does not exist; pass an existing YAML file"
        ) from None
    except OSError as exc:
        raise ConfigError(field_name, f"cannot read {path}: {exc.strerror}") from None
    except YAMLInputError as exc:
        raise ConfigError(field_name, f"{path} {exc}") from None


def _resolve_model_bases(raw: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    model = dict(model)
    if isinstance(model.get("llm"), dict):
        model["llm"] = _merge_base(model["llm"], base_dir, "model.llm")
    if isinstance(model.get("encoders"), list):
        model["encoders"] = [
            _merge_base(enc, base_dir, f"model.encoders[{i}]") if isinstance(enc, dict) else enc
            for i, enc in enumerate(model["encoders"])
        ]
    raw = dict(raw)
    raw["model"] = model
    return raw


def _merge_base(section: dict[str, Any], base_dir: Path, where: str) -> dict[str, Any]:
    if "base" not in section:
        return section
    base_name = section["base"]
    if not isinstance(base_name, str):
        raise ConfigError(f"{where}.base", "must be a path to a YAML file, relative to this config")
    base = _read_yaml(base_dir / base_name, f"{where}.base")
    if not isinstance(base, dict):
        raise ConfigError(f"{where}.base", f"{base_name} must hold a mapping of model fields")
    merged = {**base, **{k: v for k, v in section.items() if k != "base"}}
    return merged


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(
            "--override", f"'{item}' is not key=value; write e.g. training.micro_batch_size=2"
        )
    key, value = item.split("=", 1)
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(
                ".".join(parts[: i + 1]), f"cannot override inside a {type(node).__name__}"
            )
    if not isinstance(node, dict):
        raise ConfigError(key, "override must name a mapping key")
    try:
        node[parts[-1]] = parse_yaml(value)
    except YAMLInputError as exc:
        raise ConfigError(
            key, f"the --override value {value[:40]!r} {exc}; write it as YAML, e.g. {key}=2"
        ) from None


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A ``model`` section as written out (e.g. in a checkpoint's meta.json): fields it lacks, added
    to the schema since, take their defaults. ConfigError on keys or values this schema does not
    know."""
    return load_typed(ModelConfig, data, "model")


# --------------------------------------------------------------------------------------------
# Validation: everything that a single field's type cannot say.


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
        _validate_spatial_merge(enc, f"model.encoders[{i}].projector.spatial_merge")
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

    if config.parallel.llm is not None:
        validate_llm_plan(config, config.parallel.llm, "parallel.llm")
    if config.parallel.encoder is not None:
        if config.parallel.llm is None:
            raise ConfigError(
                "parallel.encoder", "a fixed encoder plan needs a fixed parallel.llm plan too"
            )
        validate_encoder_plan(
            config, config.parallel.encoder, config.parallel.llm, "parallel.encoder"
        )


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


def _positive(value: float, path: str) -> None:
    if value <= 0:
        raise ConfigError(path, f"must be positive, got {value}")


def _at_most(value: int, limit: int, path: str, what: str = "") -> None:
    """Bounds that keep planning and scheduling within seconds (each far above any real job)."""
    if value > limit:
        raise ConfigError(
            path, f"{what + ' ' if what else ''}{value} is above the {limit} this tool plans for"
        )


def _validate_spatial_merge(enc: EncoderConfig, where: str) -> None:
    merge = enc.projector.spatial_merge
    _positive(merge, where)
    _at_most(merge, 64, where)
    if enc.seq_length % enc.merged_tokens:
        raise ConfigError(
            where,
            f"{merge} merges groups of {merge}x{merge} = {enc.merged_tokens} patch tokens, "
            f"which do not divide seq_length={enc.seq_length}; use a spatial_merge whose square "
            f"divides {enc.seq_length}, or 1",
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


def encoder_tp_problem(
    enc: EncoderConfig, llm_hidden_size: int, sequence_parallel: bool, tp: int
) -> str | None:
    """Why tensor parallel size ``tp`` cannot split encoder ``enc`` and its projector as the runtime
    shards them, or None if it can: its layers; the projector's TP-split width (the LLM's hidden
    size for ``mlp``, the encoder's for ``linear``); its tokens under sequence parallelism."""
    problem = tp_divisibility_problem(enc, tp)
    if problem is None and enc.projector.type == "mlp" and llm_hidden_size % tp:
        problem = (
            f"projector.type=mlp splits model.llm.hidden_size={llm_hidden_size}, not divisible by "
            f"tp={tp}"
        )
    if problem is None and enc.projector.type == "linear" and enc.hidden_size % tp:
        problem = (
            f"hidden_size={enc.hidden_size} (split by its linear projector) is not divisible by "
            f"tp={tp}"
        )
    if problem is None and sequence_parallel and tp > 1 and enc.seq_length % tp:
        problem = (
            f"seq_length={enc.seq_length} is not divisible by tp={tp} (training.sequence_parallel "
            "splits it)"
        )
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
        if enc.num_layers < plan.pp:
            raise ConfigError(
                f"{where}.pp",
                f"model.encoders[{i}] has {enc.num_layers} layers, fewer than pp={plan.pp} stages",
            )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join_ints(values: list[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def _divisors_text(n: int) -> str:
    divs = divisors(n)
    if len(divs) > 12:
        return f"the divisors of {n}"
    return _join_ints(divs)


def calibrate(config: OptimusConfig) -> OptimusConfig:
    """``config`` under its ``cost_model.calibration``."""
    calibration = load_calibration(config.cost_model.calibration)
    if calibration is None:
        return config
    training = config.training
    if calibration.recompute is not None:
        training = dataclasses.replace(training, recompute=calibration.recompute)
    return dataclasses.replace(
        config,
        cost_model=dataclasses.replace(config.cost_model, **calibration.constants),
        training=training,
    )
