"""A Megatron-LM user's own job for the runtime tests: ``scripts/pretrain_vlm_megatron.py``'s model
(megatron-core's CLIPViTModel, MultimodalProjector and GPTModel in LLaVA's layout), forward step and
mock data, built from explicit ``TransformerConfig``s of ``configs/megatron_tiny.yaml``'s sizes
rather than from flags, and read in Megatron-LM's pretraining-sampler order. By default CLIP has no
class token and the projector is LLaVA's GELU MLP to the language width (megatron_tiny.yaml); with
``class_token`` and ``projection_from_language`` it is the model Megatron-LM's ``pretrain_vlm.py``
builds (its projector a copy of the language model's config).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

from optimus_mllm.runtime.user_model import BatchSource, pretraining_sampler_batches

from .paths import load_script

script = load_script("pretrain_vlm_megatron")

IMG, PATCH, VOCAB, TEXT, MICRO_BATCH, GLOBAL_BATCH = 16, 4, 256, 48, 2, 16
IMAGE_TOKENS = (IMG // PATCH) ** 2
forward_step = script.forward_step


def language_config(tp: int, pp: int, vp: int | None, **changes: Any) -> TransformerConfig:
    # on the CPU: megatron-core's CUDA-only fusions off
    return TransformerConfig(
        **{
            "num_layers": 4,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "ffn_hidden_size": 256,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vp,
            "pipeline_dtype": torch.float32,
            "use_cpu_initialization": True,
            "bias_activation_fusion": False,
            "masked_softmax_fusion": False,
            "bias_dropout_fusion": False,
            "persist_layer_norm": False,
            "apply_rope_fusion": False,
            "batch_p2p_comm": False,
            "gradient_accumulation_fusion": False,
            **changes,
        }
    )


def _fields(config: TransformerConfig) -> dict[str, Any]:
    return {
        name: getattr(config, name)
        for name, field in TransformerConfig.__dataclass_fields__.items()
        if field.init
    }


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    *,
    tp: int,
    pp: int,
    vp: int | None,
    vision_changes: dict[str, Any] | None = None,
    language_changes: dict[str, Any] | None = None,
    class_token: bool = False,
    drop_class_token: bool = False,
    projection_from_language: bool = False,
) -> script.VisionLanguageModel:
    language = language_config(tp, pp, vp, **(language_changes or {}))
    vision = TransformerConfig(
        **{
            **_fields(language_config(tp, pp, vp)),
            "num_layers": 2,
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            **(vision_changes or {}),
        }
    )
    if projection_from_language:  # pretrain_vlm.py: the language model's MLP, on the first stage
        projection = TransformerConfig(
            **{
                **_fields(language),
                "pipeline_model_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": None,
            }
        )
    else:  # LLaVA's GELU MLP from the vision width to the language width
        projection = TransformerConfig(
            **{**_fields(vision), "ffn_hidden_size": language.hidden_size}
        )
    return script.VisionLanguageModel(
        language,
        vision,
        projection,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        vocab_size=VOCAB,
        max_sequence_length=TEXT + image_tokens(class_token, drop_class_token),
        img_h=IMG,
        img_w=IMG,
        patch_dim=PATCH,
        untie=True,
        class_token=class_token,
        drop_class_token=drop_class_token,
    )


def image_tokens(class_token: bool = False, drop_class_token: bool = False) -> int:
    """The LLM's image tokens per sample: the patches, and a class token that is kept."""
    return IMAGE_TOKENS + (1 if class_token and not drop_class_token else 0)


def batches(data_parallel_size: int, steps: int, image_tokens: int = IMAGE_TOKENS) -> BatchSource:
    dataset = script.MockVLMDataset(steps * GLOBAL_BATCH, 1234, IMG, IMG, TEXT, image_tokens, VOCAB)
    return pretraining_sampler_batches(dataset, MICRO_BATCH, data_parallel_size, GLOBAL_BATCH)
