"""A Megatron-LM user's own model and ``forward_step`` under either runtime.

The user's ``model_provider`` builds megatron-core's LLaVA layout: a module whose ``language_model``
is a ``GPTModel`` and which, on the LLM's first pipeline stage, also holds ``vision_model`` (a
``CLIPViTModel``, with its class token or without) and ``vision_projection`` (a
``MultimodalProjector`` of type ``mlp`` or ``affine``), and whose forward embeds images as LLaVA
does, ``vision_projection(vision_model(images)[:, dropped:].permute(1, 0, 2))`` (``dropped``: the
class token under ``drop_vision_class_token``, else 0), then splices them in wherever its own code
puts image tokens. With the flag, both routes (Megatron-LM's seams and the project's trainer) read
the encoder config off the built modules (``optimus_encoder.with_user_model``): the layers'
``TransformerConfig``, the class token, patches and subtype from ``vision_model``
(``described_encoder``), the projector from ``vision_projection`` (``describe_projector``: its
type and, for ``mlp``, its config's ffn width, activation, gating and biases), whatever the flags
say. The flags count only where the modules cannot tell: whether the forward drops the class token
(Megatron-LM's ``--disable-vision-class-token``), which the start-up probe checks
(``vision_probe``). What the encoder cannot run as built is refused in one line naming the change.

Without the flag the model runs as built: the encoder inside the first stage's forward. With it, the
encoder runs under its own plan (``vit.EncoderStage``, split into kernels), starting from the
weights the user's provider made (``sharded_state.copy_sharded_state``), and the first stage's
``vision_model`` is replaced by ``ImageEmbeddingsInput``, which hands the user's forward the
projected image tokens A_i received from the encoder pipeline (the projector is then the identity).
The user's code, loss and splice run unchanged either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor, nn
from torch.utils.data import default_collate

from optimus_mllm.config import EncoderConfig, OptimusConfig, ProjectorConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.data import patchify
from optimus_mllm.runtime.dtypes import ACTIVATIONS

# Megatron-LM's model_provider(pre_process, post_process, vp_stage)
ModelProvider = Callable[..., nn.Module]
ForwardStep = Callable[[Iterator[Any], nn.Module], tuple[Tensor, Callable[..., Any]]]
# (iteration, global microbatch) -> forward_step's batch
BatchSource = Callable[[int, int], dict[str, Any]]


@dataclass(frozen=True)
class UserModel:
    """What a Megatron-LM pretrain script passes to ``pretrain()``, in the form the runtimes take.

    ``batch(iteration, global_microbatch)`` is the microbatch Megatron-LM's pretraining sampler
    gives that position (global microbatches counted over the data-parallel replicas, in order): the
    data iterator ``forward_step`` reads yields these, and with the flag the encoder's ranks read
    the same batch's images, ``[micro batch, channels, img_h, img_w]`` under ``image_key``
    (Megatron-LM's multimodal datasets' ``"image"``).
    """

    model_provider: ModelProvider
    forward_step: ForwardStep
    batch: BatchSource
    image_key: str = "image"


def pretraining_sampler_batches(
    dataset: Any, micro_batch_size: int, data_parallel_size: int, global_batch_size: int
) -> BatchSource:
    """The dataset's samples in Megatron-LM's ``MegatronPretrainingSampler`` order, collated as its
    data
    loader does: iteration ``i`` reads samples ``[i * global_batch_size, (i + 1) *
    global_batch_size)``, each microbatch step ``micro_batch_size`` of them per data-parallel rank,
    the ranks side by side."""
    per_replica = global_batch_size // (micro_batch_size * data_parallel_size)

    def batch(iteration: int, global_microbatch: int) -> dict[str, Any]:
        replica, step = divmod(global_microbatch, per_replica)
        start = (
            iteration * global_batch_size + (step * data_parallel_size + replica) * micro_batch_size
        )
        return default_collate([dataset[index] for index in range(start, start + micro_batch_size)])

    return batch


def build_user_chunks(
    provider: ModelProvider, pre_post: list[tuple[bool, bool]]
) -> list[nn.Module]:
    """One model per virtual stage, as Megatron-LM's ``get_model`` calls the provider."""
    interleaved = len(pre_post) > 1
    return [
        provider(pre_process=pre, post_process=post, **({"vp_stage": v} if interleaved else {}))
        for v, (pre, post) in enumerate(pre_post)
    ]


def language_model(chunk: nn.Module) -> nn.Module:
    """The chunk's ``GPTModel``: the LLM's layers, collectives and checkpoint keys are its."""
    model = getattr(chunk, "language_model", None)
    if model is None:
        raise OptimusError(
            f"model_provider: {type(chunk).__name__} has no language_model; build megatron-core's "
            "LLaVA layout (language_model, vision_model, vision_projection)"
        )
    return model


def vision_modules(chunk: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The first stage's ``(vision_model, vision_projection)``."""
    vision, projection = (
        getattr(chunk, "vision_model", None),
        getattr(chunk, "vision_projection", None),
    )
    if vision is None or projection is None:
        raise OptimusError(
            f"model_provider: the first pipeline stage's {type(chunk).__name__} lacks "
            "vision_model or vision_projection; build them when pre_process is set, as LLaVA does"
        )
    return vision, projection


def vision_sharded_state_dict(chunk: nn.Module) -> ShardedStateDict:
    """The first stage's vision model and projector under LLaVA's checkpoint keys."""
    vision, projection = vision_modules(chunk)
    return {
        **vision.sharded_state_dict("vision_model."),
        **projection.sharded_state_dict("vision_projection."),
    }


def user_vision_layer_spec(vision: nn.Module) -> ModuleSpec:
    """The megatron-core spec the user's vision layers were built from, read off the built layer."""
    layer = vision.decoder.layers[0]
    return ModuleSpec(module=type(layer), submodules=layer.submodules_config)


# TransformerConfig fields that change an encoder layer's math: the user's vision model must have
# the values the Optimus config gives its layers (``layer_ops.vision_transformer_config``)
_LAYER_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "gated_linear_unit",
    "activation_func",
    "normalization",
    "layernorm_epsilon",
    "add_bias_linear",
    "add_qkv_bias",
    "hidden_dropout",
    "attention_dropout",
    "qk_layernorm",
    "apply_query_key_layer_scaling",
    "layernorm_zero_centered_gamma",
    "fp32_residual_connection",
    "apply_residual_connection_post_layernorm",
    "softmax_scale",
    "num_moe_experts",
)


def config_problem(
    part: str, section: str, expected: TransformerConfig, theirs: TransformerConfig
) -> str | None:
    """Why the config ``section`` (whose layers are ``expected``) does not describe the user's
    ``part`` built with ``theirs`` (one line naming the field), or None."""
    difference = _layer_difference(expected, theirs)
    return None if difference is None else _disagreement(part, section, *difference)


def _disagreement(part: str, section: str, field: str, mine: Any, got: Any) -> str:
    return (
        f"model_provider: the {part}'s TransformerConfig.{field} is {_named(got)}, but {section} "
        f"describes {_named(mine)}; make the two agree"
    )


def _layer_difference(
    expected: TransformerConfig, theirs: TransformerConfig
) -> tuple[str, Any, Any] | None:
    """The first of ``_LAYER_FIELDS`` the two configs differ in: (field, expected's, theirs)."""
    for field in _LAYER_FIELDS:
        mine, got = _effective(expected, field), _effective(theirs, field)
        if mine != got:
            return field, mine, got
    return None


def _vision_layers_problem(expected: TransformerConfig, theirs: TransformerConfig) -> str | None:
    """Why the encoder's layers (``expected``) do not compute the user's vision layers (built with
    ``theirs``): a field the encoder config holds (``described_encoder`` reads it off the built
    model) differs from the config; one it does not hold is fixed in the encoder's layers."""
    difference = _layer_difference(expected, theirs)
    if difference is None:
        return None
    field, mine, got = difference
    if field in _ENCODER_CONFIG_FIELDS:
        return _disagreement("vision model", "model.encoders[0]", field, mine, got)
    return (
        f"model_provider: the vision model's TransformerConfig.{field} is {_named(got)}; the "
        f"Optimus encoder's layers run {_named(mine)}: build the vision model with that"
    )


def user_vision_problem(
    encoder: EncoderConfig, expected: TransformerConfig, chunk: nn.Module, llm_hidden_size: int
) -> str | None:
    """Why the encoder config does not describe the user's first-stage vision model and projector
    (one line naming what differs), or None.

    Args:
        encoder: the config's encoder.
        expected: the ``TransformerConfig`` the Optimus encoder gives its layers.
        chunk: the user's first pipeline stage (LLaVA's layout).
        llm_hidden_size: the LLM's hidden size, the projector's output.
    """
    if encoder.projector.spatial_merge != 1:
        return (
            f"model.encoders[0].projector.spatial_merge is {encoder.projector.spatial_merge}, but "
            "a user's model "
            "(LLaVA's layout) merges no tokens before its projector; set it to 1"
        )
    vision, projection = vision_modules(chunk)
    return (
        _vision_layers_problem(expected, vision.config)
        or _class_token_problem(encoder, vision)
        or _patches_problem(encoder, vision)
        or projector_problem(encoder, projection, llm_hidden_size)
    )


def described_encoder(encoder: EncoderConfig, vision: nn.Module) -> EncoderConfig:
    """``encoder`` with the shape of the user's built ``vision_model`` (megatron-core's
    ``CLIPViTModel``): its layers' ``TransformerConfig`` (layers, widths, heads, GLU, activation,
    biases, norm, dropout), its class token, patch size and patch count, and its embedding's
    subtype (``ln_pre``: clip). A script may build its vision model from other flags than
    ``pretrain_vlm.py``'s (examples/multimodal: CLIP ViT-L from --vision-model-type); what no
    ``EncoderConfig`` field holds stays to be compared with the encoder's layers
    (``user_vision_problem``).

    Raises:
        OptimusError: one line naming a field the Optimus encoder cannot run as built.
    """
    theirs: TransformerConfig = vision.config
    activation = _ACTIVATION_NAMES.get(theirs.activation_func)
    if activation is None:
        raise OptimusError(
            "model_provider: the vision model's TransformerConfig.activation_func is "
            f"{_named(theirs.activation_func)}, which the Optimus encoder does not run (it runs "
            f"{', '.join(ACTIVATIONS)}); build the vision model with one of them"
        )
    heads = theirs.num_attention_heads
    # the config's None is megatron-core's default: one head width of hidden / heads, one group a
    # head
    kv_channels = theirs.kv_channels
    if theirs.hidden_size % heads == 0 and kv_channels == theirs.hidden_size // heads:
        kv_channels = None
    groups = theirs.num_query_groups
    if getattr(vision, "ln_post", None) is not None:
        raise OptimusError(
            "model_provider: the vision model has a norm after its layers (CLIPViTModel's "
            "model_subtype siglip, ln_post); the Optimus encoder runs the clip and internvit "
            "subtypes"
        )
    class_token = bool(getattr(vision, "add_class_token", False))
    if class_token and vision.class_token_len != 1:
        raise OptimusError(
            f"model_provider: the vision model has {vision.class_token_len} class tokens "
            "(CLIPViTModel's class_token_len); the Optimus encoder runs one (class_token_len=1)"
        )
    return replace(
        encoder,
        num_layers=theirs.num_layers,
        hidden_size=theirs.hidden_size,
        num_attention_heads=heads,
        ffn_hidden_size=theirs.ffn_hidden_size,
        kv_channels=kv_channels,
        num_query_groups=None if groups in (None, heads) else groups,
        gated_linear_unit=theirs.gated_linear_unit,
        activation=activation,
        add_bias_linear=theirs.add_bias_linear,
        normalization=theirs.normalization,
        hidden_dropout=theirs.hidden_dropout,
        attention_dropout=theirs.attention_dropout,
        seq_length=vision.num_patches,
        patch_size=vision.patch_dim,
        model_subtype="clip" if getattr(vision, "ln_pre", None) is not None else "internvit",
        class_token=class_token,
        drop_class_token=encoder.drop_class_token and class_token,
    )


def _class_token_problem(encoder: EncoderConfig, vision: nn.Module) -> str | None:
    """Whether the forward drops the class token is not read here: the start-up probe sees what it
    feeds the projector (``vision_probe``)."""
    theirs = vision.class_token_len if getattr(vision, "add_class_token", False) else 0
    if theirs != encoder.class_tokens:
        return (
            f"model_provider: the vision model has {theirs} class token(s) (CLIPViTModel's "
            f"add_class_token, class_token_len), but model.encoders[0].class_token is "
            f"{_yaml(encoder.class_token)}; "
            + (
                "the Optimus encoder runs one (class_token_len=1)"
                if theirs > 1
                else "make the two agree"
            )
        )
    return None


def _patches_problem(encoder: EncoderConfig, vision: nn.Module) -> str | None:
    for theirs, got, ours, want in (
        ("patch tokens", vision.num_patches, "seq_length", encoder.seq_length),
        ("patch_dim", vision.patch_dim, "patch_size", encoder.patch_size),
    ):
        if got != want:
            return (
                f"model_provider: the vision model's {theirs} is {got}, but "
                f"model.encoders[0].{ours} is {want}; make the two agree"
            )
    return None


def _effective(config: TransformerConfig, field: str) -> Any:
    """``config.field`` as the layers use it: megatron-core gives QKV a bias under either of
    ``add_bias_linear`` and ``add_qkv_bias`` (Megatron-LM sets both)."""
    if field == "add_qkv_bias":
        return bool(config.add_qkv_bias or config.add_bias_linear)
    return getattr(config, field, None)


# the layer fields an ``EncoderConfig`` holds (``described_encoder`` reads them off the built model)
_ENCODER_CONFIG_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "ffn_hidden_size",
        "gated_linear_unit",
        "activation_func",
        "normalization",
        "add_bias_linear",
        "hidden_dropout",
        "attention_dropout",
    }
)
# the config's name of each activation callable megatron-core's configs hold
_ACTIVATION_NAMES = {function: name for name, function in ACTIVATIONS.items()}
# settings of a projector's TransformerConfig that change its MLP's math beyond what
# ``ProjectorConfig`` describes (a fused kernel: tanh GELU; TE's activation; the GLU's offset and
# clamp), with the value under which the encoder's steps compute what megatron-core's MLP does
_PROJECTOR_MLP_AS_RUN = (
    ("bias_activation_fusion", False),
    ("use_te_activation_func", False),
    ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None),
)


def describe_projector(
    projection: nn.Module, input_size: int, llm_hidden_size: int
) -> ProjectorConfig:
    """The ``ProjectorConfig`` of the user's ``vision_projection`` as built: megatron-core's
    ``MultimodalProjector`` of type ``mlp`` (its config's ffn width, activation, gating and biases)
    or ``affine`` (its bias).

    Args:
        projection: the first stage's ``vision_projection``.
        input_size: the features the vision model gives it (the encoder's hidden size).
        llm_hidden_size: the LLM's hidden size, the projector's output.

    Raises:
        OptimusError: one line naming what the Optimus encoder cannot run as built.
    """
    if not isinstance(projection, MultimodalProjector):
        raise OptimusError(
            f"model_provider: vision_projection is a {type(projection).__name__}; the Optimus "
            "encoder runs megatron-core's MultimodalProjector (type mlp or affine)"
        )
    theirs = projection.config
    kind = projection.projector_type
    first = projection.encoder if kind == "affine" else projection.encoder.linear_fc1
    if theirs.hidden_size != llm_hidden_size:
        raise OptimusError(
            f"model_provider: the projector's TransformerConfig.hidden_size is "
            f"{theirs.hidden_size}, but model.llm.hidden_size describes {llm_hidden_size}; make "
            "the two agree"
        )
    if first.input_size != input_size:
        raise OptimusError(
            f"model_provider: vision_projection takes {first.input_size} features, but the vision "
            f"model gives {input_size}; make the two agree"
        )
    if kind == "affine":
        tp = first.tp_group.size() if first.tp_group is not None else 1
        if first.bias is not None and tp > 1:
            raise OptimusError(
                "model_provider: vision_projection is megatron-core's affine MultimodalProjector "
                f"with a bias at TP {tp}, whose forward adds this rank's slice of the bias to the "
                "gathered output and fails; build it with add_bias_linear=False, or at TP 1"
            )
        return ProjectorConfig(type="affine", add_bias_linear=theirs.add_bias_linear)
    activation = _ACTIVATION_NAMES.get(theirs.activation_func)
    if activation is None:
        raise OptimusError(
            "model_provider: the projector's TransformerConfig.activation_func is "
            f"{_named(theirs.activation_func)}, which the Optimus encoder does not run (it runs "
            f"{', '.join(ACTIVATIONS)}); build the projector with one of them"
        )
    for field, as_run in _PROJECTOR_MLP_AS_RUN:
        got = getattr(theirs, field, as_run)
        if got != as_run:
            raise OptimusError(
                f"model_provider: the projector's TransformerConfig.{field} is {got!r}; the "
                f"Optimus encoder runs the MLP as megatron-core computes it with {as_run!r}; "
                "build the projector with that"
            )
    return ProjectorConfig(
        type="mlp",
        ffn_hidden_size=theirs.ffn_hidden_size,
        activation=activation,
        gated_linear_unit=theirs.gated_linear_unit,
        add_bias_linear=theirs.add_bias_linear,
    )


def projector_problem(
    encoder: EncoderConfig, projection: nn.Module, llm_hidden_size: int
) -> str | None:
    """Why ``model.encoders[0].projector`` does not describe the user's ``vision_projection`` (one
    line naming what differs, or what the encoder cannot run), or None."""
    try:
        theirs = describe_projector(projection, encoder.projector_input_size, llm_hidden_size)
    except OptimusError as error:
        return str(error)
    mine = encoder.projector
    if theirs.type != mine.type:
        return (
            f"model.encoders[0].projector.type is {mine.type}, but the model's vision_projection "
            f"is a MultimodalProjector of type {theirs.type!r}; set type: {theirs.type}"
        )
    for field, config_field, got, want in (
        (
            "ffn_hidden_size",
            "ffn_hidden_size",
            theirs.mlp_ffn_hidden_size(llm_hidden_size),
            mine.mlp_ffn_hidden_size(llm_hidden_size),
        ),
        (
            "activation_func",
            "activation",
            ACTIVATIONS[theirs.activation],
            ACTIVATIONS[mine.activation],
        ),
        (
            "gated_linear_unit",
            "gated_linear_unit",
            theirs.gated_linear_unit,
            mine.gated_linear_unit,
        ),
        ("add_bias_linear", "add_bias_linear", theirs.add_bias_linear, mine.add_bias_linear),
    ):
        if got != want:
            return (
                f"model_provider: the projector's TransformerConfig.{field} is {_named(got)}, but "
                f"model.encoders[0].projector.{config_field} describes {_named(want)}; make the "
                "two agree"
            )
    return None


def _yaml(flag: bool) -> str:
    return "true" if flag else "false"


def _named(value: Any) -> str:
    return getattr(value, "__name__", repr(value))


class ImageEmbeddingsInput(nn.Module):
    """Stands in for the user's ``vision_model`` under Optimus: returns the projected image tokens
    A_i of the microbatch in flight (set by the runtime before the user's forward step) as ``[batch,
    tokens, hidden]``, the layout the user's code permutes before its projector."""

    class_token_len = 0  # what LLaVA's code slices off before the projector

    def __init__(self) -> None:
        super().__init__()
        self.embeddings: Tensor | None = None  # [tokens, batch, hidden], a leaf whose grad is G_i

    def set_input_tensor(self, input_tensor: Tensor | None) -> None:
        """LLaVAModel hands its vision model the first stage's pipeline input, which is None there:
        the image tokens come from the encoder pipeline instead."""

    def forward(self, images: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.embeddings is None:
            raise RuntimeError("ImageEmbeddingsInput ran outside a microbatch the runtime set up")
        if images.shape[0] != self.embeddings.shape[1]:
            raise RuntimeError(
                f"the user's forward passed {images.shape[0]} images, but microbatch has "
                f"{self.embeddings.shape[1]}"
            )
        embeddings, self.embeddings = self.embeddings, None
        return embeddings.transpose(0, 1)


def user_images(config: OptimusConfig, user: UserModel) -> Callable[[int, int], tuple[Tensor, ...]]:
    """The encoder's input for a microbatch: the user batch's images, as patches."""
    encoder = config.encoders[0]

    def images(iteration: int, global_microbatch: int) -> tuple[Tensor, ...]:
        return (
            patchify(
                user.batch(iteration, global_microbatch)[user.image_key].float(), encoder.patch_size
            ),
        )

    return images
