"""The YAML schema: one typed dataclass per section, with the bounds of what is planned.

Field names follow megatron-core's ``TransformerConfig`` where one exists (``hidden_size``,
``num_attention_heads``, ``ffn_hidden_size``, ``kv_channels``, ``num_query_groups`` ...), so a
Megatron user can read a config without a glossary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
# the activations of megatron-core's configs (F.gelu, F.silu, F.relu, and megatron.core.activations'
# squared_relu and quick_gelu)
Activation = Literal["gelu", "silu", "relu", "squared_relu", "quick_gelu"]
PositionEmbedding = Literal["learned_absolute", "rope", "none"]
ProjectorType = Literal["mlp", "affine", "linear"]
VisionSubtype = Literal["internvit", "clip"]  # megatron-core CLIPViTModel's model_subtype
# How a part's layers are split over its TP ranks, the TP size being the mode's total degree:
# megatron-core's 1D (weights split, activations whole), 2D SUMMA on a q x q grid, 3D on a p x p x p
# cube, or METP's ring (issues 36 and 37; ``optimus_mllm/costing/tp_memory.py``)
TPMode = Literal["1d", "2d", "3d", "metp"]


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
    def layer_tokens(self) -> int:
        """Tokens each layer runs per sample (an encoder adds its class token to ``seq_length``)."""
        return self.seq_length

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

    The ``mlp`` projector is megatron-core's ``MLP`` (a ``MultimodalProjector`` of type ``mlp``):
    fc1 from the encoder's width to ``ffn_hidden_size`` (twice that with ``gated_linear_unit``),
    ``activation``, fc2 to the LLM's hidden size. Megatron-LM's ``pretrain_vlm.py`` builds it from a
    copy of the LLM's ``TransformerConfig``: the LLM's ``ffn_hidden_size``, SiLU with a gated linear
    unit under ``--swiglu``, no biases under ``--disable-bias-linear``. The defaults are LLaVA's
    ``mlp2x_gelu``: fc1 as wide as the LLM, GELU, biases.

    The ``affine`` projector is megatron-core's other ``MultimodalProjector`` type: one
    column-parallel GEMM to the LLM's width whose output is gathered over TP. ``linear`` is this
    project's own one GEMM, row-parallel over the encoder's width (its input gradient gathered).
    ``add_bias_linear`` is their bias too; the other MLP fields do not apply to them.
    """

    type: ProjectorType = "mlp"
    spatial_merge: int = 1
    ffn_hidden_size: int | None = None  # None: the LLM's hidden size
    activation: Activation = "gelu"
    gated_linear_unit: bool = False
    add_bias_linear: bool = True

    def mlp_ffn_hidden_size(self, llm_hidden_size: int) -> int:
        """The ``mlp`` projector's fc1 width (per half under ``gated_linear_unit``)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else llm_hidden_size


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
    # CLIPViTModel's class token (add_class_token, class_token_len=1): one learned token before the
    # patches, with its own position embedding, run through ln_pre and every layer
    class_token: bool = False
    # LLaVA's drop_vision_class_token (Megatron-LM's --disable-vision-class-token): the class
    # token's output is dropped before the projector, so the LLM gets the patch tokens alone;
    # kept, the LLM gets it as one more image token
    drop_class_token: bool = False
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)

    @property
    def class_tokens(self) -> int:
        """Class tokens before the patches (CLIPViTModel's ``class_token_len``, 0 without)."""
        return 1 if self.class_token else 0

    @property
    def layer_tokens(self) -> int:
        """Tokens each layer runs per image: the patches and the class token."""
        return self.seq_length + self.class_tokens

    @property
    def projected_tokens(self) -> int:
        """Tokens into the projector per image, before its spatial merge: the layers' tokens less a
        dropped class token."""
        return self.layer_tokens - (self.class_tokens if self.drop_class_token else 0)

    @property
    def merged_tokens(self) -> int:
        """Patch tokens merged into one LLM token by the projector."""
        return self.projector.spatial_merge**2

    @property
    def image_tokens(self) -> int:
        """Tokens this encoder gives the LLM per image (the projector's tokens, merged by it)."""
        return self.projected_tokens // self.merged_tokens

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
    # On a webdataset (images varying per microbatch), build each iteration's bubble schedule in
    # the background while the step before trains, the schedule for data.max_images_per_microbatch
    # the fallback (``runtime/iteration_schedules.py``); false: the artifact's schedule every step
    schedule_per_iteration: bool = False

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
    tp_mode: TPMode = "1d"


@dataclass(frozen=True)
class EncoderPlanConfig:
    """The encoders' plan: fixed (``pp`` and ``tp``; DP_enc follows from the GPU count), or only
    its TP mode, the planner choosing ``pp`` and ``tp`` among the degrees the mode can take. The
    config has one encoder plan, so the mode is every encoder's."""

    pp: int | None = None
    tp: int | None = None
    tp_mode: TPMode = "1d"

    @property
    def fixed(self) -> bool:
        """Whether the config fixes ``pp`` and ``tp`` (validation holds them given together)."""
        return self.pp is not None


@dataclass(frozen=True)
class ParallelConfig:
    llm: LLMPlanConfig | None = None
    encoder: EncoderPlanConfig | None = None

    @property
    def fixed_encoder(self) -> EncoderPlanConfig | None:
        """The encoder plan the config fixes (pp and tp given), or None: the planner chooses."""
        return self.encoder if self.encoder is not None and self.encoder.fixed else None

    @property
    def encoder_tp_mode(self) -> TPMode:
        return self.encoder.tp_mode if self.encoder is not None else "1d"


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
    # roofline (these constants), paper, or a calibration file: see
    # optimus_mllm/config/calibration.py
    calibration: str = "roofline"
    # JSON of measured kernel times (optimus-profile); overrides the roofline
    profile: str | None = None


@dataclass(frozen=True)
class DataConfig:
    """Training data. ``path`` is a Megatron-Energon webdataset (a folder with ``.nv-meta``, the
    format in ``optimus_mllm/runtime/webdataset_data.py``) or a folder holding ``captions.jsonl``
    and its images (``optimus_mllm/runtime/data.py``); left out, the job trains on synthetic data.
    A relative path is kept as written and read from the working directory, like Megatron's
    ``--data-path``. The other fields apply to a webdataset."""

    path: str | None = None
    # The encoder work memory is planned for, in images per microbatch (per encoder); None: one
    # image per sample, as today. A batch above it is refused before the step.
    max_images_per_microbatch: int | None = None
    # The workload optimus-plan ranks plans over (``optimus_mllm/costing/workload.py``): images per
    # sample -> weight, and patch tokens per image -> weight (None: the encoder's ``seq_length``)
    images_per_sample: dict[int, float] | None = None
    tokens_per_image: dict[int, float] | None = None
    # a Hugging Face tokenizer folder (tokenizer.json); None: UTF-8 bytes are the tokens
    tokenizer: str | None = None
    image_placeholder: str = "<image>"  # in a sample's text, where each of its images goes
    max_images_per_sample: int = 4  # a sample with more is an error naming it
    samples_per_sequence: int = 1  # consecutive samples packed into one LLM sequence


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
