"""Starting from pretrained weights: Hugging Face-style GPT-2 and ViT state dicts converted by
``optimus-convert`` give the model that a reference forward written from the
Hugging Face layouts computes; a plain megatron-core GPT checkpoint starts the LLM; the launcher's
flags load each part, and refuse what cannot work in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from support.distributed_utils import run_distributed
from support.train_utils import (
    TINY,
    assert_one_error_everywhere,
    encoder_under_megatron_names,
    plain_vision_model,
    ranks,
    torchrun,
)

pytestmark = pytest.mark.distributed

ONE_RANK = [
    "cluster.num_gpus=1",
    "cluster.gpus_per_node=1",
    "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
]
H, HEADS, LAYERS, VOCAB, SEQ = 64, 4, 4, 256, 64  # configs/tiny.yaml's LLM
VH, VHEADS, VLAYERS, VFFN, PATCH, GRID = 32, 4, 2, 64, 4, 4  # its encoder: 16 patches of 4x4x3


def _gpt2_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    state = {
        "transformer.wte.weight": r(VOCAB, H),
        "transformer.wpe.weight": r(128, H),
        "transformer.ln_f.weight": 1 + r(H),
        "transformer.ln_f.bias": r(H),
        "lm_head.weight": r(VOCAB, H),
    }
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        state.update(
            {
                f"{p}ln_1.weight": 1 + r(H),
                f"{p}ln_1.bias": r(H),
                f"{p}ln_2.weight": 1 + r(H),
                f"{p}ln_2.bias": r(H),
                f"{p}attn.c_attn.weight": r(H, 3 * H),
                f"{p}attn.c_attn.bias": r(3 * H),
                f"{p}attn.c_proj.weight": r(H, H),
                f"{p}attn.c_proj.bias": r(H),
                f"{p}mlp.c_fc.weight": r(H, 4 * H),
                f"{p}mlp.c_fc.bias": r(4 * H),
                f"{p}mlp.c_proj.weight": r(4 * H, H),
                f"{p}mlp.c_proj.bias": r(H),
            }
        )
    return state


def _vit_state(projector: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    state = {
        "embeddings.patch_embeddings.projection.weight": r(VH, 3, PATCH, PATCH),
        "embeddings.patch_embeddings.projection.bias": r(VH),
        "embeddings.cls_token": r(1, 1, VH),
        "embeddings.position_embeddings": r(1, GRID * GRID + 1, VH),
        "layernorm.weight": 1 + r(VH),
        "layernorm.bias": r(VH),
    }
    for i in range(VLAYERS):
        p = f"encoder.layer.{i}."
        state.update(
            {
                f"{p}layernorm_before.weight": 1 + r(VH),
                f"{p}layernorm_before.bias": r(VH),
                f"{p}layernorm_after.weight": 1 + r(VH),
                f"{p}layernorm_after.bias": r(VH),
                f"{p}attention.output.dense.weight": r(VH, VH),
                f"{p}attention.output.dense.bias": r(VH),
                f"{p}intermediate.dense.weight": r(VFFN, VH),
                f"{p}intermediate.dense.bias": r(VFFN),
                f"{p}output.dense.weight": r(VH, VFFN),
                f"{p}output.dense.bias": r(VH),
            }
        )
        for name in ("query", "key", "value"):
            state.update(
                {
                    f"{p}attention.attention.{name}.weight": r(VH, VH),
                    f"{p}attention.attention.{name}.bias": r(VH),
                }
            )
    if projector:
        state.update(
            {
                "multi_modal_projector.linear_1.weight": r(H, VH),
                "multi_modal_projector.linear_1.bias": r(H),
                "multi_modal_projector.linear_2.weight": r(H, H),
                "multi_modal_projector.linear_2.bias": r(H),
            }
        )
    return state


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, causal: bool
) -> torch.Tensor:
    b, s, width = q.shape
    q, k, v = (x.view(b, s, heads, width // heads).transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (width // heads) ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, width)


def _gpt2_logits(state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """GPT-2's forward as Hugging Face lays its weights out ([in, out] Conv1D weights, [Q; K;
    V])."""
    s = {key.removeprefix("transformer."): value for key, value in state.items()}

    def ln(x, name):
        return F.layer_norm(x, (H,), s[f"{name}.weight"], s[f"{name}.bias"], eps=1e-5)

    x = s["wte.weight"][tokens] + s["wpe.weight"][: tokens.shape[1]]
    for i in range(LAYERS):
        p = f"h.{i}."
        q, k, v = (
            ln(x, f"{p}ln_1") @ s[f"{p}attn.c_attn.weight"] + s[f"{p}attn.c_attn.bias"]
        ).split(H, dim=-1)
        x = (
            x
            + _attention(q, k, v, HEADS, causal=True) @ s[f"{p}attn.c_proj.weight"]
            + s[f"{p}attn.c_proj.bias"]
        )
        m = F.gelu(ln(x, f"{p}ln_2") @ s[f"{p}mlp.c_fc.weight"] + s[f"{p}mlp.c_fc.bias"])
        x = x + m @ s[f"{p}mlp.c_proj.weight"] + s[f"{p}mlp.c_proj.bias"]
    return ln(x, "ln_f") @ s["lm_head.weight"].t()


def _vit_features(
    state: dict[str, torch.Tensor], images: torch.Tensor, class_token: str = "none"
) -> torch.Tensor:
    """ViT's forward (Conv2d patches, separate Q / K / V), without the final norm, then LLaVA's
    projector; ``class_token``: ``none`` (ViT's [CLS] left out), ``kept`` (run and projected) or
    ``dropped`` (run, dropped before the projector, as Hugging Face LLaVA's default feature
    selection does)."""

    def ln(x, name):
        return F.layer_norm(x, (VH,), state[f"{name}.weight"], state[f"{name}.bias"], eps=1e-5)

    def linear(x, name):
        return F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])

    x = (
        F.conv2d(
            images,
            state["embeddings.patch_embeddings.projection.weight"],
            state["embeddings.patch_embeddings.projection.bias"],
            stride=PATCH,
        )
        .flatten(2)
        .transpose(1, 2)
    )
    if class_token == "none":
        x = x + state["embeddings.position_embeddings"][0, 1:]
    else:
        cls = state["embeddings.cls_token"].expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + state["embeddings.position_embeddings"][0]
    for i in range(VLAYERS):
        p = f"encoder.layer.{i}."
        a = ln(x, f"{p}layernorm_before")
        q, k, v = (
            linear(a, f"{p}attention.attention.{name}") for name in ("query", "key", "value")
        )
        x = x + linear(_attention(q, k, v, VHEADS, causal=False), f"{p}attention.output.dense")
        x = x + linear(
            F.gelu(linear(ln(x, f"{p}layernorm_after"), f"{p}intermediate.dense")),
            f"{p}output.dense",
        )
    if class_token == "dropped":
        x = x[:, 1:]
    return linear(
        F.gelu(linear(x, "multi_modal_projector.linear_1")), "multi_modal_projector.linear_2"
    )


def _patches(images: torch.Tensor) -> torch.Tensor:
    """[batch, C, H, W] images as this project's input: row-major patches flattened channel-last."""
    b, c = images.shape[:2]
    x = images.permute(0, 2, 3, 1).reshape(b, GRID, PATCH, GRID, PATCH, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, GRID * GRID, PATCH * PATCH * c)


# the config fields of each class-token case of _vit_features
CLASS_TOKEN = {
    "none": [],
    "kept": ["model.encoders.0.class_token=true"],
    "dropped": ["model.encoders.0.class_token=true", "model.encoders.0.drop_class_token=true"],
}


def _convert(tmp: Path, projector: bool = True, overrides: tuple[str, ...] = ()) -> Path:
    torch.save(_gpt2_state(), tmp / "gpt2.bin")
    torch.save(_vit_state(projector), tmp / "vit.bin")
    out = tmp / "pretrained"
    # forked from the fork server as ``python -m optimus_mllm.cli.convert`` would run (a fresh
    # interpreter spent some 6 s of CPU on its imports)
    (done,) = ranks(
        1,
        "--config",
        TINY,
        "--gpt2",
        str(tmp / "gpt2.bin"),
        "--vit",
        f"vit={tmp / 'vit.bin'}",
        "--out",
        str(out),
        *(["--override", *overrides] if overrides else []),
        program=("-m", "optimus_mllm.cli.convert"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"wrote {out}: llm, vit"
    return out


def _outputs_after_loading(folder: str, overrides: tuple[str, ...] = ()) -> dict:
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.checkpoint import load_pretrained
    from optimus_mllm.runtime.llm import causal_mask
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, [*ONE_RANK, *overrides])
    trainer = Trainer(config, plan(config).llm_plan, "baseline")
    notes = [
        load_pretrained(trainer, part, Path(folder), "--pretrained-checkpoint")
        for part in ("llm", "vit")
    ]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    images = torch.randn(
        2, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        logits = trainer.chunks[0](tokens, torch.arange(SEQ).expand(2, SEQ), causal_mask(SEQ))
        features = trainer.encoder({"vit": _patches(images)}, 0)["vit"].transpose(0, 1)
    trainer.close()
    return {
        "notes": notes,
        "tokens": tokens.numpy(),
        "images": images.numpy(),
        "logits": logits.numpy(),
        "features": features.numpy(),
    }


@pytest.mark.parametrize("class_token", CLASS_TOKEN)
def test_converted_gpt2_and_vit_compute_what_their_hugging_face_layouts_do(tmp_path, class_token):
    overrides = tuple(CLASS_TOKEN[class_token])
    out = _convert(tmp_path, overrides=overrides)
    [result] = run_distributed(_outputs_after_loading, 1, str(out), overrides, timeout=240)
    assert result["notes"] == [
        f"llm: pretrained weights from {out}",
        f"vit: pretrained weights from {out}",
    ]
    expected = _gpt2_logits(_gpt2_state(), torch.from_numpy(result["tokens"]))
    assert torch.allclose(torch.from_numpy(result["logits"]), expected, atol=1e-4), (
        (torch.from_numpy(result["logits"]) - expected).abs().max()
    )
    expected = _vit_features(_vit_state(True), torch.from_numpy(result["images"]), class_token)
    assert torch.allclose(torch.from_numpy(result["features"]), expected, atol=1e-5), (
        (torch.from_numpy(result["features"]) - expected).abs().max()
    )


def _plain_megatron_then_ours(folder: str, part: str) -> dict:
    """A plain megatron-core job saves a model part by itself: the LLM as a GPTModel (bare keys), or
    the
    encoder as a CLIPViTModel and MultimodalProjector (LLaVA's keys); then this job starts that part
    from it."""
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    import megatron_patches
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.checkpoint import load_pretrained
    from optimus_mllm.runtime.trainer import Trainer

    megatron_patches.apply()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * H,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if part == "llm":
        modules = {
            "": GPTModel(
                config,
                get_gpt_layer_local_spec(),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                share_embeddings_and_output_weights=False,
            )
        }
    else:
        clip, projector = plain_vision_model(config)
        modules = {"vision_model.": clip, "vision_projection.": projector}
    Path(folder).mkdir()
    dist_checkpointing.save(
        {
            "model": {
                key: value
                for prefix, module in modules.items()
                for key, value in module.sharded_state_dict(prefix=prefix).items()
            }
        },
        folder,
    )
    saved = {
        prefix + name: p.detach().numpy().copy()
        for prefix, module in modules.items()
        for name, p in module.named_parameters()
    }
    parallel_state.destroy_model_parallel()
    megatron_patches.remove()

    ours = load_config(TINY, ONE_RANK)
    trainer = Trainer(ours, plan(ours).llm_plan, "baseline")
    note = load_pretrained(
        trainer, part, Path(folder), "--pretrained-llm" if part == "llm" else "--pretrained-encoder"
    )
    named = (
        dict(trainer.chunks[0].named_parameters())
        if part == "llm"
        else encoder_under_megatron_names(trainer.encoder, part)
    )
    loaded = {name: p.detach().numpy().copy() for name, p in named.items()}
    trainer.close()
    return {"saved": saved, "loaded": loaded, "note": note}


@pytest.mark.parametrize("part", ["llm", "vit"])
def test_a_plain_megatron_core_checkpoint_starts_a_model_part(tmp_path, part):
    """The LLM from a GPTModel's checkpoint, the encoder from a CLIPViTModel and
    MultimodalProjector's."""
    [result] = run_distributed(
        _plain_megatron_then_ours, 1, str(tmp_path / part), part, timeout=240
    )
    assert result["note"] == f"{part}: pretrained weights from {tmp_path / part}"
    assert result["saved"].keys() == result["loaded"].keys()
    for name, weight in result["saved"].items():
        assert (weight == result["loaded"][name]).all(), name


def test_the_launcher_starts_from_converted_weights_without_a_projector(tmp_path):
    """A pretrained ViT and GPT, a new projector (LLaVA's first stage), on 4 ranks (TP2 PP2 V2 and
    the encoder under its own plan)."""
    out = _convert(tmp_path, projector=False)
    lines = torchrun(
        "--pretrained-llm",
        str(out),
        "--pretrained-encoder",
        f"vit={out}",
        "--override",
        "training.train_iters=1",
    )
    assert lines[:2] == [
        f"llm: pretrained weights from {out}",
        f"vit: pretrained weights from {out} (no projector there: it starts from scratch)",
    ]
    assert lines[2].startswith("step 1/1 | loss ")


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--pretrained-encoder", "clip=x"],
            "--pretrained-encoder 'clip=x': give NAME=DIR with NAME one of the "
            "config's encoders (vit)",
        ),
        (["--pretrained-llm", "x", "--save", "s", "--resume"], "--pretrained-llm starts a new run"),
        (
            ["--pretrained-llm", "configs"],
            "--pretrained-llm configs: not a megatron-core dist checkpoint",
        ),
        (
            ["--pretrained-checkpoint", "x", "--pretrained-llm", "x"],
            "the llm weights are given by two --pretrained-*",
        ),
    ],
)
def test_pretrained_flags_that_cannot_work_are_refused(args, expected):
    assert_one_error_everywhere(ranks(4, *args), expected)


@pytest.mark.parametrize(
    "field, value",
    [("activation", "silu"), ("gated_linear_unit", True), ("normalization", "RMSNorm")],
)
def test_converting_into_layers_that_are_not_gpt2s_is_refused(field, value):
    from dataclasses import replace

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.tools.hf_convert import gpt2_entries

    llm = replace(load_config(TINY).llm, **{field: value})
    with pytest.raises(
        OptimusError, match=f"model.llm.{field} is {value}; Hugging Face GPT-2 and ViT layers"
    ):
        gpt2_entries(_gpt2_state(), llm)


def test_converting_a_vit_into_a_clip_embedding_is_refused():
    from dataclasses import replace

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.tools.hf_convert import vit_entries

    encoder = replace(load_config(TINY).encoders[0], model_subtype="clip")
    with pytest.raises(
        OptimusError, match=r"model.encoders\[vit\].model_subtype is clip; Hugging Face ViT's"
    ):
        vit_entries(_vit_state(True), encoder, "")


def test_loading_llavas_projector_into_a_merging_one_is_refused():
    from dataclasses import replace

    from optimus_mllm.config import ProjectorConfig, load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.tools.hf_convert import vit_entries

    encoder = replace(load_config(TINY).encoders[0], projector=ProjectorConfig(spatial_merge=2))
    with pytest.raises(
        OptimusError, match=r"model.encoders\[vit\].projector.spatial_merge is 2; set it to 1"
    ):
        vit_entries(_vit_state(True), encoder, "")
    # without LLaVA's projector the ViT still converts
    assert vit_entries(_vit_state(False), encoder, "")


def test_loading_llavas_projector_into_a_swiglu_one_is_refused():
    from dataclasses import replace

    from optimus_mllm.config import ProjectorConfig, load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.tools.hf_convert import vit_entries

    swiglu = ProjectorConfig(activation="silu", gated_linear_unit=True)
    encoder = replace(load_config(TINY).encoders[0], projector=swiglu)
    with pytest.raises(
        OptimusError,
        match=r"LLaVA's projector is a GELU MLP with biases, model.encoders\[vit\].projector is "
        r"silu, gated; drop multi_modal_projector",
    ):
        vit_entries(_vit_state(True), encoder, "")
