"""Pretrain a ViT + GPT vision-language model: a Megatron-LM ``pretrain_vlm.py``-style script.

    torchrun --nproc-per-node 4 scripts/pretrain_vlm_megatron.py [Megatron flags]
    [--optimus-schedule plan.json]

The script is what a Megatron-LM user writes: a ``model_provider`` building megatron-core's classes
in LLaVA's layout (``CLIPViTModel`` and ``MultimodalProjector`` on the first pipeline stage,
``GPTModel`` throughout, each sample's image tokens spliced in at its ``<image>`` token), a
``forward_step`` and loss function, a datasets provider, and ``pretrain()``. ``megatron.training``
is not in the megatron-core wheel, so what the script takes from it comes from
``optimus_mllm.megatron.core_training``. The opt-in is the one marked import: Optimus's ``pretrain``
in place of Megatron's. Without ``--optimus-schedule`` the vision model runs in the first stage as
built; with it, its kernels run in the LLM's bubbles. Make the schedule for the same job from its
flags with ``optimus-plan --world-size 4 --artifact plan.json -- [Megatron flags]``. The flags are
Megatron-LM's, with its defaults (no model sizes; ``--transformer-impl local`` must be given); the
README's describe ``configs/pretrain_vlm_tiny.yaml``. As Megatron-LM's ``pretrain_vlm.py``, the
vision model is CLIP with its class token (dropped before the projector under
``--disable-vision-class-token``) and the projector is the LLM's MLP (its ffn width, SwiGLU under
``--swiglu``, no biases under ``--disable-bias-linear``).
"""

from __future__ import annotations

import sys
import zlib
from copy import deepcopy
from functools import partial
from typing import Any

import torch

# megatron.training's stand-in first, as its import sets the job up (here: quiets the CPU-only
# library warnings); the next line is the opt-in: --optimus-schedule runs the encoder in the bubbles
# isort: off
from optimus_mllm.megatron.core_training import (
    core_transformer_config_from_args,
    get_args,
    pretrain,
)
from optimus_mllm.megatron import pretrain  # Optimus's pretrain: adds --optimus-schedule
from megatron.core.enums import ModelType

# isort: on
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm

IMAGE_TOKEN_INDEX = -200  # LLaVA's <image>


class VisionLanguageModel(MegatronModule):
    """megatron-core's ``LLaVAModel`` layout: CLIP with ``class_token`` or without, the class token
    dropped before the projector under ``drop_class_token`` (LLaVA's
    ``drop_vision_class_token``)."""

    def __init__(
        self,
        language_config: TransformerConfig,
        vision_config: TransformerConfig,
        projection_config: TransformerConfig,
        *,
        pre_process: bool,
        post_process: bool,
        vp_stage: int | None,
        vocab_size: int,
        max_sequence_length: int,
        img_h: int,
        img_w: int,
        patch_dim: int,
        position_embedding_type: str = "learned_absolute",
        untie: bool = False,
        class_token: bool = False,
        drop_class_token: bool = False,
    ):
        super().__init__(config=language_config)
        self.pre_process, self.post_process = pre_process, post_process
        self.model_type = ModelType.encoder_or_decoder
        # read by megatron-core's finalize_model_grads
        self.share_embeddings_and_output_weights = not untie
        self.language_model = GPTModel(
            config=language_config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not untie,
            position_embedding_type=position_embedding_type,
            scatter_embedding_sequence_parallel=False,
            vp_stage=vp_stage,
        )
        # the vision model and projector live on the first stage only, as in LLaVAModel (whose name
        # for the drop this is)
        self._drop_vision_class_token = drop_class_token
        if pre_process:
            # no TE or apex
            self.vision_model = CLIPViTModel(
                vision_config,
                get_vit_layer_with_local_spec(),
                add_class_token=class_token,
                class_token_len=1 if class_token else 0,
                patch_dim=patch_dim,
                img_h=img_h,
                img_w=img_w,
                model_subtype="clip",
                ln_pre_impl=WrappedTorchNorm,
            )
            self.vision_projection = MultimodalProjector(
                projection_config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                "mlp",
                vision_config.hidden_size,
            )

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """LLaVAModel's: megatron-core's gradient finalisation reads the word embedding here."""
        return self.language_model.shared_embedding_or_output_weight()

    def forward(
        self,
        images: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoder_input = None
        if self.pre_process:
            image_embeddings = self.vision_model(images)  # [b, image tokens, h_vision]
            if self._drop_vision_class_token:
                image_embeddings = image_embeddings[:, self.vision_model.class_token_len :]
            image_embeddings = self.vision_projection(
                image_embeddings.permute(1, 0, 2).contiguous()
            )
            text = input_ids.clone()
            text[text == IMAGE_TOKEN_INDEX] = 0
            text_embeddings = self.language_model.embedding(
                input_ids=text, position_ids=position_ids
            )
            decoder_input = splice_images(text_embeddings, image_embeddings, input_ids)
        return self.language_model(
            None, None, attention_mask, decoder_input=decoder_input, labels=labels
        )


def splice_images(
    text: torch.Tensor, images: torch.Tensor, input_ids: torch.Tensor
) -> torch.Tensor:
    """Each sample's image tokens ``[n, b, h]`` in place of its one <image> id in ``text`` ``[s, b,
    h]``."""
    where = (input_ids == IMAGE_TOKEN_INDEX).int().argmax(dim=1).tolist()
    return torch.stack(
        [torch.cat([text[:p, i], images[:, i], text[p + 1 :, i]]) for i, p in enumerate(where)],
        dim=1,
    )


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
) -> VisionLanguageModel:
    """Builds the model as pretrain_vlm.py does: the vision model a copy of the language model's
    layers, CLIP with its class token, the projector the language model's MLP."""
    args = get_args()
    language_config = core_transformer_config_from_args(args)
    vision_config = deepcopy(language_config)
    vision_config.num_layers = args.encoder_num_layers
    vision_config.pipeline_model_parallel_size = 1  # the vision model lives on the first stage
    vision_config.virtual_pipeline_model_parallel_size = None
    vision_config.sequence_parallel = False
    projection_config = deepcopy(language_config)  # its ffn width, activation, gating and biases
    projection_config.pipeline_model_parallel_size = 1
    projection_config.virtual_pipeline_model_parallel_size = None
    projection_config.sequence_parallel = False
    image_tokens = image_tokens_per_sample(args)
    text_tokens = args.dataloader_seq_length or args.seq_length
    model = VisionLanguageModel(
        language_config,
        vision_config,
        projection_config,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        vocab_size=args.vocab_size,
        max_sequence_length=text_tokens + image_tokens,
        img_h=args.img_h,
        img_w=args.img_w,
        patch_dim=args.patch_dim,
        position_embedding_type=args.position_embedding_type,
        untie=args.untie_embeddings_and_output_weights,
        class_token=True,
        drop_class_token=args.disable_vision_class_token,
    )
    if args.freeze_ViT and pre_process:
        model.vision_model.requires_grad_(False)
    return model


def image_tokens_per_sample(args: Any) -> int:
    """The LLM's image tokens: the patches, and the class token unless dropped
    (megatron-core's ``get_num_image_embeddings``)."""
    patches = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
    return patches + (0 if args.disable_vision_class_token else 1)


class MockVLMDataset(torch.utils.data.Dataset):
    """Random images and text, one <image> per sample at a random place: megatron-core's mock
    multimodal data, a pure function of (seed, index)."""

    def __init__(
        self,
        num_samples: int,
        seed: int,
        img_h: int,
        img_w: int,
        text_tokens: int,
        image_tokens: int,
        vocab_size: int,
    ):
        self.num_samples, self.seed, self.img_h, self.img_w = num_samples, seed, img_h, img_w
        self.text_tokens, self.image_tokens, self.vocab_size = text_tokens, image_tokens, vocab_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{index}".encode()))
        text = self.text_tokens + 1  # with the <image> id, which becomes image_tokens positions
        tokens = torch.randint(0, self.vocab_size, (text,), generator=generator)
        where = int(torch.randint(0, text // 2, (), generator=generator))
        tokens[where] = IMAGE_TOKEN_INDEX
        length = self.text_tokens + self.image_tokens
        loss_mask = torch.ones(length)
        loss_mask[where : where + self.image_tokens] = 0.0  # no loss on the image tokens
        return {
            "image": torch.randn(3, self.img_h, self.img_w, generator=generator),
            "tokens": tokens,
            "labels": torch.randint(0, self.vocab_size, (length,), generator=generator),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(text),
        }


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int],
) -> tuple[Any, Any, Any]:
    args = get_args()
    image_tokens = image_tokens_per_sample(args)
    text_tokens = args.dataloader_seq_length or args.seq_length
    datasets = [
        MockVLMDataset(
            n, args.seed, args.img_h, args.img_w, text_tokens, image_tokens, args.vocab_size
        )
        for n in train_val_test_num_samples
    ]
    return datasets[0], datasets[1], datasets[2]


def get_batch(data_iterator: Any) -> dict[str, torch.Tensor]:
    """The next microbatch; every rank reads it itself (the data is a function of the index), where
    Megatron-LM broadcasts it from TP rank 0."""
    data = next(data_iterator)
    length = data["labels"].shape[1]
    mask = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {
        **{key: value.to(device) for key, value in data.items()},
        "attention_mask": mask.to(device),
    }


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Any, model: VisionLanguageModel) -> tuple[torch.Tensor, Any]:
    batch = get_batch(data_iterator)
    output = model(
        batch["image"],
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    sys.exit(
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
    )
