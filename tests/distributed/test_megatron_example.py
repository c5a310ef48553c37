"""``scripts/pretrain_vlm_megatron.py``: a Megatron-LM-style script (its own model_provider,
forward_step
and datasets provider) where docs/megatron-lm.md's one-line diff and one flag switch Optimus on.

With ``--optimus-schedule`` it runs the schedule (the encoder under its own plan, kernels at the
artifact's hook points) and prints the same losses as the user's script without the diff. Its model
flags are Megatron-LM's, read as ``pretrain_vlm.py`` reads them; each is honoured or refused.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import add_optimus_args
from optimus_mllm.megatron.core_training import parse_args
from optimus_mllm.megatron.flags import HONOURED_FLAGS, REFUSED_FLAGS, config_from_megatron_args

from support.paths import CONFIGS, MEGATRON_TINY_FLAGS, MEGATRON_TINY_LAYERS, REPO
from support.train_utils import assert_one_error_everywhere, ranks

SCRIPT = str(REPO / "scripts" / "pretrain_vlm_megatron.py")
MEGATRON_TINY = str(CONFIGS / "megatron_tiny.yaml")
PRETRAIN_VLM_TINY = str(CONFIGS / "pretrain_vlm_tiny.yaml")
LINE = re.compile(r"^iteration (\d)/3 \| lm loss (\d+\.\d{4}) \| (.+)$")
TINY_ARGS = list(MEGATRON_TINY_FLAGS)
LLAMA = [
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
]


def _parse_args(*argv: str, layers: bool = True) -> argparse.Namespace:
    """TINY_ARGS and ``argv``; without ``layers``, TINY_ARGS' layer counts are left out."""
    tiny = TINY_ARGS if layers else TINY_ARGS[len(MEGATRON_TINY_LAYERS) :]
    return parse_args(add_optimus_args, [*tiny, *argv])


def _config(*argv: str, layers: bool = True) -> OptimusConfig:
    return config_from_megatron_args(_parse_args(*argv, layers=layers), 4, 4)


def _run(*args: str, script: str = SCRIPT) -> subprocess.CompletedProcess:
    """Four ranks of ``script`` as torchrun starts them (its variables, one thread a rank), their
    output joined in rank order; exit 0 only if every rank's is."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = ranks(4, *TINY_ARGS, *args, program=(script,), environment=environment)
    return subprocess.CompletedProcess(
        done[0].args,
        next((d.returncode for d in done if d.returncode != 0), 0),
        "".join(d.stdout for d in done),
        "".join(d.stderr for d in done),
    )


def _lines(done: subprocess.CompletedProcess) -> list[re.Match]:
    assert done.returncode == 0, done.stderr[-3000:]
    matches = [
        LINE.match(line)
        for line in done.stdout.splitlines()
        # the start-up probe's line, before the first step of a job with the flag
        if not line.startswith(("(min, max)", "    ", "optimus: start-up probe: "))
    ]
    assert all(matches) and [m.group(1) for m in matches] == ["1", "2", "3"], done.stdout
    return matches


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> str:
    from optimus_mllm.cli.plan import main as optimus_plan

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert optimus_plan(["--config", MEGATRON_TINY, "--artifact", str(path)]) == 0
    return str(path)


def readme_diff() -> tuple[list[str], list[str]]:
    """docs/megatron-lm.md's one-flag diff as (before, after) lines."""
    page = REPO / "docs" / "megatron-lm.md"
    section = page.read_text().split("### Without Megatron-LM", 1)[1]
    block = section.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    assert block and all(line[:1] in " +-" for line in block), block
    return (
        [line[1:] for line in block if line[:1] in " -"],
        [line[1:] for line in block if line[:1] in " +"],
    )


def apply_diff(text: str, before: list[str], after: list[str]) -> str:
    lines = text.splitlines()
    starts = [i for i in range(len(lines)) if lines[i : i + len(before)] == before]
    assert len(starts) == 1, f"the diff's lines {before} occur {len(starts)} times"
    return "\n".join(lines[: starts[0]] + after + lines[starts[0] + len(before) :]) + "\n"


@pytest.mark.distributed
def test_the_readmes_diff_is_the_whole_opt_in_and_gives_the_user_scripts_losses(tmp_path):
    """The docs' diff, un-applied to the script, is the user's script, and applying it gives the
    script
    back. A LLaMA-shaped model (SwiGLU, grouped-query attention, RoPE, RMSNorm, no biases) on LLM
    TP2 PP2 V2: the user's script and the script with the flag print the same losses, and Megatron's
    timers still report. Without dropout: the user's vision model draws its masks inside its own
    forward, the Optimus encoder per kernel, so with dropout the two draw different (equally valid)
    masks."""
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import artifact_text, schedule_job_artifact

    before, after = readme_diff()
    script = Path(SCRIPT).read_text()
    user_script = apply_diff(script, after, before)
    assert apply_diff(user_script, before, after) == script
    user_path = tmp_path / "pretrain_vlm.py"
    user_path.write_text(user_script)
    llama = [*LLAMA, "--hidden-dropout", "0", "--attention-dropout", "0"]
    config = _config(*llama)
    assert (config.llm.gated_linear_unit, config.llm.activation, config.llm.query_groups) == (
        True,
        "silu",
        2,
    )
    path = tmp_path / "plan.json"
    path.write_text(artifact_text(schedule_job_artifact(config, plan(config))))
    plain = _run(*llama, "--timing-log-level", "2", script=str(user_path))
    optimus = _run(*llama, "--timing-log-level", "2", "--optimus-schedule", str(path))
    plain_lines, optimus_lines = _lines(plain), _lines(optimus)
    assert {m.group(3) for m in plain_lines} == {"plain"}
    assert len({m.group(3) for m in optimus_lines}) == 1
    assert optimus_lines[0].group(3).startswith("optimus, encoder plan DP")
    assert "optimus: start-up probe: the model's vision path and the Optimus encoder's agree" in (
        optimus.stdout
    )
    assert "start-up probe" not in plain.stdout
    assert [m.group(2) for m in optimus_lines] == [m.group(2) for m in plain_lines]
    # megatron-core's schedule timed by the job's own Timers, under the hooks
    for done in (
        plain,
        optimus,
    ):
        times = re.findall(
            r"^    (forward|backward)-compute \.+: \((\d+\.\d+), (\d+\.\d+)\)$", done.stdout, re.M
        )
        assert [name for name, *_ in times] == ["forward", "backward"], done.stdout
        assert all(float(low) > 0 for _, low, _ in times), times


@pytest.mark.distributed
def test_a_schedule_for_another_job_is_refused_on_every_rank(plan_json):
    results = ranks(
        4,
        *TINY_ARGS,
        "--optimus-schedule",
        plan_json,
        "--tensor-model-parallel-size",
        "1",
        program=(SCRIPT,),
    )
    assert_one_error_everywhere(results, "re-run optimus-plan", prog="pretrain_vlm_megatron.py")


@pytest.mark.distributed
def test_bf16_is_refused_on_every_rank_where_nothing_casts_the_users_model():
    # without a refusal every rank died in the first forward: bf16 weights, fp32 images
    results = ranks(4, *TINY_ARGS, "--bf16", program=(SCRIPT,))
    assert_one_error_everywhere(results, "Float16Module", prog="pretrain_vlm_megatron.py")


def test_megatron_args_give_the_pretrain_vlm_tiny_config():
    """The script's defaults with TINY_ARGS and without dropout describe
    configs/pretrain_vlm_tiny.yaml (configs/megatron_tiny.yaml with pretrain_vlm.py's vision path:
    CLIP's class token, dropped under --disable-vision-class-token, and the LLM's MLP as
    projector); dropout is Megatron-LM's 0.1 by default, for the LLM and the vision model."""
    from optimus_mllm.config import load_config

    args = _parse_args()
    assert isinstance(args, argparse.Namespace) and args.optimus_schedule is None
    defaults = config_from_megatron_args(args, 4, 4).model
    assert {
        (spec.hidden_dropout, spec.attention_dropout) for spec in (defaults.llm, *defaults.encoders)
    } == {(0.1, 0.1)}
    ours, tiny = (
        _config("--hidden-dropout", "0", "--attention-dropout", "0"),
        load_config(PRETRAIN_VLM_TINY),
    )
    assert ours.model == tiny.model
    assert ours.parallel.llm == tiny.parallel.llm
    assert ours.training == tiny.training  # optimizer, LR schedule and clipping included


# Every flag of HONOURED_FLAGS: the flags given, and what the LLM and the ViT become (None:
# unchanged)
HONOURED = {
    # in place of TINY_ARGS' --encoder-num-layers / --decoder-num-layers: both models' depth
    "--num-layers": (["--num-layers", "8"], {"num_layers": 8}, {"num_layers": 8}),
    "--decoder-num-layers": (["--decoder-num-layers", "8"], {"num_layers": 8}, None),
    "--hidden-size": (["--hidden-size", "128"], {"hidden_size": 128}, {"hidden_size": 128}),
    "--ffn-hidden-size": (
        ["--ffn-hidden-size", "96"],
        {"ffn_hidden_size": 96},
        {"ffn_hidden_size": 96},
    ),
    "--num-attention-heads": (
        ["--num-attention-heads", "8"],
        {"num_attention_heads": 8},
        {"num_attention_heads": 8},
    ),
    "--kv-channels": (["--kv-channels", "8"], {"kv_channels": 8}, {"kv_channels": 8}),
    "--group-query-attention": (
        ["--group-query-attention", "--num-query-groups", "2"],
        {"num_query_groups": 2},
        {"num_query_groups": 2},
    ),
    # needs the flag above
    "--num-query-groups": (
        ["--num-query-groups", "2"],
        {"num_query_groups": None},
        None,
    ),
    "--swiglu": (
        ["--swiglu", "--ffn-hidden-size", "128"],
        {"gated_linear_unit": True, "activation": "silu"},
        {"gated_linear_unit": True, "activation": "silu"},
    ),
    "--normalization": (
        ["--normalization", "RMSNorm"],
        {"normalization": "RMSNorm"},
        {"normalization": "RMSNorm"},
    ),
    "--disable-bias-linear": (
        ["--disable-bias-linear"],
        {"add_bias_linear": False},
        {"add_bias_linear": False},
    ),
    "--add-qkv-bias": (["--add-qkv-bias"], {"add_bias_linear": True}, None),
    "--position-embedding-type": (
        ["--position-embedding-type", "rope"],
        {"position_embedding_type": "rope"},
        None,
    ),
    "--untie-embeddings-and-output-weights": (
        [],
        {"untie_embeddings_and_output_weights": True},
        None,
    ),
    "--hidden-dropout": (
        ["--hidden-dropout", "0.2"],
        {"hidden_dropout": 0.2},
        {"hidden_dropout": 0.2},
    ),
    "--attention-dropout": (
        ["--attention-dropout", "0.3"],
        {"attention_dropout": 0.3},
        {"attention_dropout": 0.3},
    ),
    "--vocab-size": (["--vocab-size", "512"], {"vocab_size": 512}, None),
    "--seq-length": (
        ["--seq-length", "112", "--max-position-embeddings", "112"],
        {"seq_length": 128},
        None,
    ),
    "--dataloader-seq-length": (
        [
            "--dataloader-seq-length",
            "112",
            "--seq-length",
            "999",
            "--max-position-embeddings",
            "999",
        ],
        {"seq_length": 128},
        None,
    ),
    "--encoder-num-layers": (["--encoder-num-layers", "4"], None, {"num_layers": 4}),
    "--img-h": (["--img-h", "32"], {"seq_length": 80}, {"seq_length": 32}),
    "--img-w": (["--img-w", "32"], {"seq_length": 80}, {"seq_length": 32}),
    "--patch-dim": (["--patch-dim", "8"], {"seq_length": 52}, {"seq_length": 4, "patch_size": 8}),
    "--freeze-ViT": (["--freeze-ViT"], None, {"frozen": True}),
    # in TINY_ARGS; left out, the class token is one more image token
    "--disable-vision-class-token": ([], None, {"class_token": True, "drop_class_token": True}),
    "--recompute-granularity": (["--recompute-granularity", "full"], None, None),
}


def test_the_walk_covers_every_model_flag_and_the_script_takes_each():
    from optimus_mllm.megatron.core_training import build_parser

    assert set(HONOURED) == set(HONOURED_FLAGS)
    flags = {*HONOURED_FLAGS, *(refused.flag for refused in REFUSED_FLAGS)}
    parser_flags = {
        option for action in build_parser()._actions for option in action.option_strings
    }
    assert flags <= parser_flags, flags - parser_flags


@pytest.mark.parametrize("flag", HONOURED)
def test_an_honoured_flag_shapes_the_llm_and_the_vit_as_pretrain_vlm_does(flag):
    argv, llm, vit = HONOURED[flag]
    base, config = _config(), _config(*argv, layers=flag != "--num-layers")
    for spec, expected in ((config.llm, llm), (config.encoders[0], vit)):
        for field, value in (expected or {}).items():
            assert getattr(spec, field) == value, (flag, field)
    if flag == "--recompute-granularity":
        assert (base.training.recompute, config.training.recompute) == ("none", "full")
    # in TINY_ARGS: compare with the flag left out
    elif flag == "--disable-vision-class-token":
        kept = _parse_args()
        kept.disable_vision_class_token = False
        kept_config = config_from_megatron_args(kept, 4, 4)
        assert not kept_config.encoders[0].drop_class_token
        assert kept_config.llm.seq_length == config.llm.seq_length + 1
    elif flag == "--untie-embeddings-and-output-weights":
        tied = _parse_args()
        tied.untie_embeddings_and_output_weights = False
        assert not config_from_megatron_args(tied, 4, 4).llm.untie_embeddings_and_output_weights
    else:
        assert (config.llm, config.encoders[0]) != (base.llm, base.encoders[0]) or flag in (
            "--num-query-groups",
            "--add-qkv-bias",
        )


def _refused_value(refused) -> list[str]:
    if refused.default is False:
        return [refused.flag]
    values = {
        "--position-embedding-type": "relative",
        "--transformer-impl": "transformer_engine",
        "--recompute-method": "block",
        "--fp8-format": "hybrid",
    }
    return [refused.flag, values.get(refused.flag, "2")]


@pytest.mark.parametrize("refused", REFUSED_FLAGS, ids=lambda r: r.flag)
def test_a_model_flag_the_runtime_does_not_build_is_refused_naming_it(refused):
    argv = _refused_value(refused)
    args = _parse_args(*argv)
    with pytest.raises(OptimusError) as caught:
        config_from_megatron_args(args, 4, 4)
    message = str(caught.value)
    assert message.startswith(f"{refused.flag} ") and "\n" not in message, message


def test_qkv_bias_without_the_other_biases_is_refused():
    with pytest.raises(OptimusError, match="--add-qkv-bias with --disable-bias-linear"):
        _config("--add-qkv-bias", "--disable-bias-linear")


@pytest.mark.parametrize(
    "argv, projector",
    [
        ([], {"ffn_hidden_size": 256}),
        (
            ["--swiglu", "--ffn-hidden-size", "128"],
            {"ffn_hidden_size": 128, "activation": "silu", "gated_linear_unit": True},
        ),
        (["--disable-bias-linear"], {"ffn_hidden_size": 256, "add_bias_linear": False}),
    ],
    ids=["default", "swiglu", "no-bias"],
)
def test_the_projector_is_the_llms_mlp_as_pretrain_vlm_builds_it(argv, projector):
    from optimus_mllm.config import ProjectorConfig

    assert _config(*argv).encoders[0].projector == ProjectorConfig(**projector)


def test_swiglu_gives_megatron_cores_llm_a_silu_gated_mlp():
    import torch.nn.functional as F

    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.llm import transformer_config

    for argv, activation in (([], F.gelu), (["--swiglu"], F.silu)):
        config = _config(*argv)
        tconfig = transformer_config(config, plan(config).llm_plan)
        assert (tconfig.activation_func, tconfig.gated_linear_unit) == (activation, bool(argv))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--patch-dim", "0"], "--patch-dim 0: must be a positive integer"),
        (
            ["--tensor-model-parallel-size", "0"],
            "--tensor-model-parallel-size 0: must be a positive integer",
        ),
        (
            ["--num-layers-per-virtual-pipeline-stage", "3"],
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the "
            "2 layers of a pipeline stage",
        ),
        (
            ["--num-attention-heads", "3"],
            "--num-attention-heads 3 does not divide --hidden-size 64",
        ),
        (["--adam-beta1", "2"], "--adam-beta1: training.adam_beta1: must be in [0, 1)"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_megatron_flag(argv, expected):
    with pytest.raises(OptimusError) as caught:
        _config(*argv)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value), str(
        caught.value
    )
