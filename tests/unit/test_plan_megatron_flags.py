"""``optimus-plan -- MEGATRON_FLAGS``: the job read from a Megatron-LM command line, with
Megatron-LM's defaults and ``pretrain_vlm.py``'s layer-count conventions, and the artifact it writes
accepted by ``--optimus-schedule`` for a job with the same flags.

The look-alike parser (``optimus_mllm.megatron.arguments``) is checked against Megatron-LM's own
``parse_args`` + ``validate_args`` where a checkout at tag ``core_v0.16.1`` is named by
``MEGATRON_LM_DIR`` (skipped without).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_mllm.cli.plan import main as optimus_plan
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import add_optimus_args, build_parser, parse_args
from optimus_mllm.megatron.arguments import validate_args as lookalike_validate_args
from optimus_mllm.megatron.flags import config_from_megatron_args, schedule_for_flag

from support.paths import CONFIGS, MEGATRON_TINY_FLAGS, REPO

# a model and a batch, and nothing else: every other flag takes Megatron-LM's default
SIZES = (
    *("--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "256"),
    *("--seq-length", "48", "--max-position-embeddings", "64"),
    *("--img-h", "16", "--img-w", "16", "--patch-dim", "4"),
    *("--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-4"),
    *("--transformer-impl", "local", "--disable-vision-class-token"),
)


def _plan(tmp_path: Path, *flags: str, world_size: int = 4) -> dict:
    """optimus-plan's --json of the job given by ``flags``."""
    out = tmp_path / "plan.json"
    assert optimus_plan(["--world-size", str(world_size), "--json", str(out), "--", *flags]) == 0
    return json.loads(out.read_text())


def _refusal(*argv: str) -> str:
    """optimus-plan's stderr for ``argv``, which it must refuse in one line with exit code 2."""
    done = subprocess.run(
        [sys.executable, "-m", "optimus_mllm.cli.plan", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("optimus-plan: error: ")
    return done.stderr


# Megatron-LM core_v0.16.1's defaults (megatron/training/arguments.py, pretrain_vlm.py's
# add_vlm_extra_args) of the flags the config reads
MEGATRON_DEFAULTS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "num_layers": None,
    "encoder_num_layers": None,
    "decoder_num_layers": None,
    "hidden_size": None,
    "ffn_hidden_size": None,
    "num_attention_heads": None,
    "seq_length": None,
    "max_position_embeddings": None,
    "vocab_size": None,
    "img_h": 224,
    "img_w": 224,
    "patch_dim": 16,
    "micro_batch_size": None,
    "global_batch_size": None,
    "train_iters": None,
    "lr": None,
    "transformer_impl": "transformer_engine",
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}


def test_the_lookalike_parser_has_megatron_lms_defaults():
    parsed = vars(parse_args(argv=[]))
    assert {name: parsed[name] for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def test_left_out_parallelism_is_megatrons_one_rank_model_without_interleaving(tmp_path):
    """No TP, PP or virtual-stage flag: TP1 PP1, one model chunk, the rest data parallel; the global
    batch is Megatron's micro batch x DP."""
    planned = _plan(tmp_path, "--num-layers", "4", *SIZES)
    assert planned["llm_plan"] == {"dp": 4, "pp": 1, "tp": 1, "vp": 1}
    assert planned["num_microbatches"] == 1  # global batch 2 x 4 over DP 4
    pp2 = _plan(tmp_path, "--num-layers", "4", "--pipeline-model-parallel-size", "2", *SIZES)
    assert pp2["llm_plan"] == {"dp": 2, "pp": 2, "tp": 1, "vp": 1}


@pytest.mark.parametrize(
    "layers, llm, vit",
    [
        (("--num-layers", "4"), 4, 4),  # Megatron-LM: encoder_num_layers = num_layers
        (("--encoder-num-layers", "2"), 2, 2),  # and num_layers = encoder_num_layers
        (("--encoder-num-layers", "2", "--decoder-num-layers", "6"), 6, 2),
        (("--num-layers", "2", "--decoder-num-layers", "6"), 6, 2),
    ],
)
def test_layer_counts_are_read_as_pretrain_vlm_reads_them(layers, llm, vit):
    config = config_from_megatron_args(parse_args(argv=[*layers, *SIZES]), 4, 4)
    assert (config.llm.num_layers, config.encoders[0].num_layers) == (llm, vit)


def test_without_vocab_size_the_vocabulary_is_the_one_megatron_took_from_the_tokenizer():
    """examples/multimodal's MultimodalTokenizer (a HuggingFaceTokenizer alike) gives no
    --vocab-size: Megatron-LM sets args.padded_vocab_size from the tokenizer it built, and
    --optimus-schedule plans with that; a bare command line still needs --vocab-size."""
    flags = [*SIZES]
    del flags[flags.index("--vocab-size") : flags.index("--vocab-size") + 2]
    args = parse_args(argv=["--num-layers", "2", *flags])
    with pytest.raises(OptimusError, match="--vocab-size is missing"):
        config_from_megatron_args(args, 4, 4)
    args.padded_vocab_size = 384  # as initialize_megatron's build_tokenizer leaves it
    assert config_from_megatron_args(args, 4, 4).llm.vocab_size == 384
    given = parse_args(argv=["--num-layers", "2", *SIZES])
    given.padded_vocab_size = 384
    assert config_from_megatron_args(given, 4, 4).llm.vocab_size == 256  # --vocab-size, as before


@pytest.mark.parametrize(
    "class_token", [(), ("--disable-vision-class-token",)], ids=["cls", "no-cls"]
)
@pytest.mark.parametrize(
    "text, expected_text",
    [(("--seq-length", "48"), 48), (("--seq-length", "48", "--dataloader-seq-length", "40"), 40)],
    ids=["seq-length", "dataloader-seq-length"],
)
def test_the_llm_sequence_is_pretrain_vlms(class_token, text, expected_text):
    """pretrain_vlm.py's LLM sequence: the text tokens (--dataloader-seq-length, else
    --seq-length) plus megatron-core's image embeddings of CLIP (the class token unless
    --disable-vision-class-token); the ViT's, the patches alone."""
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings

    image = ("--img-h", "32", "--img-w", "48", "--patch-dim", "8")
    sizes = [flag for flag in SIZES if flag != "--disable-vision-class-token"]
    argv = ["--num-layers", "2", *sizes, *text, *image, *class_token]
    config = config_from_megatron_args(parse_args(argv=argv), 4, 4)
    # as pretrain_vlm.py's model_provider calls it
    image_tokens = get_num_image_embeddings(
        32, 48, 8, "clip", bool(class_token), class_token_len=1, pixel_shuffle=False
    )
    assert config.llm.seq_length == expected_text + image_tokens
    assert config.encoders[0].seq_length == 4 * 6


@pytest.mark.parametrize(
    "flags, vp",
    [
        (("--num-layers-per-virtual-pipeline-stage", "1"), 4),
        (("--num-layers-per-virtual-pipeline-stage", "2"), 2),
        (("--num-layers-per-virtual-pipeline-stage", "4"), 1),
        (("--num-virtual-stages-per-pipeline-rank", "2"), 2),
        ((), 1),
    ],
)
def test_either_virtual_pipeline_flag_sets_the_model_chunks(tmp_path, flags, vp):
    job = ("--encoder-num-layers", "2", "--decoder-num-layers", "8", *SIZES)
    pp2 = ("--pipeline-model-parallel-size", "2", "--global-batch-size", "8")
    planned = _plan(tmp_path, *job, *pp2, *flags)
    assert planned["llm_plan"]["vp"] == vp


@pytest.mark.parametrize(
    "argv, expected",
    [
        (  # a flag neither list knows: it may change the model (here, the padded vocabulary)
            ["--world-size", "4", "--", *SIZES, "--make-vocab-size-divisible-by", "64"],
            "unrecognized arguments: --make-vocab-size-divisible-by 64; optimus-plan refuses a "
            "flag it does not know, since it may change the model",
        ),
        (["--world-size", "4", "--", "--num-layers", "x"], "argument --num-layers: invalid int"),
        (["--", "--num-layers", "4", *SIZES], "--world-size is missing"),
        (["--world-size", "4", "--", *SIZES], "--num-layers or --encoder-num-layers is missing"),
        (
            ["--world-size", "4", "--", "--num-layers", "4", "--encoder-num-layers", "2", *SIZES],
            "--num-layers 4 with --encoder-num-layers 2: Megatron-LM refuses both",
        ),
        (
            [
                *("--world-size", "4", "--", "--num-layers", "4", *SIZES),
                *("--num-layers-per-virtual-pipeline-stage", "1"),
                *("--num-virtual-stages-per-pipeline-rank", "2"),
            ],
            "--num-layers-per-virtual-pipeline-stage with --num-virtual-stages-per-pipeline-rank",
        ),
        (
            [
                *("--world-size", "4", "--", "--num-layers", "4", *SIZES),
                *("--pipeline-model-parallel-size", "2"),
                *("--num-layers-per-virtual-pipeline-stage", "3"),
            ],
            "--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers",
        ),
        (
            ["--world-size", "4", "--", "--num-layers", "4", *SIZES[:-3]],
            "--transformer-impl transformer_engine: ",  # Megatron-LM's default, not built here
        ),
        (["--world-size", "0", "--", "--num-layers", "4", *SIZES], "--world-size 0: must be"),
        (
            ["--config", str(CONFIGS / "megatron_tiny.yaml"), "--", *SIZES],
            "--config with Megatron-LM flags",
        ),
        (
            ["--world-size", "4"],
            "give the job: --config YAML, or --world-size and Megatron-LM flags",
        ),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(argv, expected):
    assert expected in _refusal(*argv)


# what a real pretrain_vlm.py job adds to its model flags: data, tokenizer, checkpoints, evaluation,
# logging, fusions, the backend (one of them as --flag=value, one with several values)
JOB_FLAGS = (
    *("--data-path", "0.3", "/data/a_text_document", "0.7", "/data/b_text_document"),
    *("--split", "949,50,1", "--tokenizer-type", "HuggingFaceTokenizer"),
    *("--tokenizer-model", "/models/tokenizer", "--save", "/ckpt", "--load", "/ckpt"),
    *("--save-interval=1000", "--eval-interval", "100", "--eval-iters", "10"),
    *("--log-interval", "1", "--wandb-project", "vlm", "--wandb-exp-name", "run-1"),
    *("--tensorboard-dir", "/tb", "--no-gradient-accumulation-fusion", "--use-cpu-initialization"),
    *("--distributed-backend", "gloo", "--ckpt-format", "torch", "--log-interval", "10"),
    *("--optimus-schedule", "auto"),
)


def test_a_jobs_whole_command_line_plans_as_its_model_flags_and_names_what_it_did_not_read(
    tmp_path, capsys
):
    alone, whole = tmp_path / "alone.json", tmp_path / "whole.json"
    argv = ["--world-size", "4", "--gpus-per-node", "4", "--artifact"]
    assert optimus_plan([*argv, str(alone), "--", *MEGATRON_TINY_FLAGS]) == 0
    capsys.readouterr()
    assert optimus_plan([*argv, str(whole), "--", *MEGATRON_TINY_FLAGS, *JOB_FLAGS]) == 0
    assert whole.read_text() == alone.read_text()
    first = capsys.readouterr().out.splitlines()[0]
    given = [flag.split("=")[0] for flag in JOB_FLAGS if flag.startswith("--")]
    named = list(dict.fromkeys(given))  # each once, in the order given
    assert first == "Megatron-LM flags not read (they do not shape the plan): " + " ".join(named)


def test_flags_that_shape_the_plan_are_read_not_passed_over(tmp_path):
    """Precision and sequence parallelism change the plan's config: they are read (and are not
    named among the flags not read)."""
    from optimus_mllm.megatron.unread_flags import UNREAD_FLAGS

    unread = {flag.flag for flag in UNREAD_FLAGS}
    lookalike = {name for a in build_parser()._actions for name in a.option_strings}
    assert unread.isdisjoint(lookalike)
    for flag in ("--bf16", "--fp16", "--sequence-parallel", "--recompute-granularity"):
        assert flag in lookalike and flag not in unread
    config = config_from_megatron_args(parse_args(argv=[*MEGATRON_TINY_FLAGS, "--bf16"]), 4, 4)
    assert config.training.precision == "bf16"


def test_an_artifact_from_the_flags_is_the_schedule_of_the_job_with_those_flags(tmp_path):
    path = tmp_path / "plan.json"
    argv = ["--world-size", "4", "--gpus-per-node", "4", "--artifact", str(path)]
    assert optimus_plan([*argv, "--", *MEGATRON_TINY_FLAGS]) == 0
    job = parse_args(add_optimus_args, [*MEGATRON_TINY_FLAGS, "--optimus-schedule", str(path)])
    lookalike_validate_args(job, 4)  # as the job's pretrain() does at start-up
    artifact = schedule_for_flag(job.optimus_schedule)(config_from_megatron_args(job, 4, 4))
    assert artifact is not None
    assert (artifact.llm_plan.tp, artifact.llm_plan.pp, artifact.llm_plan.vp) == (2, 2, 2)
    # another job: the same flags with another micro batch
    other = parse_args(
        add_optimus_args,
        [*MEGATRON_TINY_FLAGS, "--micro-batch-size", "1", "--optimus-schedule", str(path)],
    )
    with pytest.raises(OptimusError, match="re-run optimus-plan"):
        schedule_for_flag(other.optimus_schedule)(config_from_megatron_args(other, 4, 4))


def test_the_flags_of_pretrain_vlm_tiny_plan_what_its_yaml_plans(tmp_path):
    """configs/pretrain_vlm_tiny.yaml as flags and as YAML: the same artifact, but for the config's
    name."""
    from_flags, from_yaml = tmp_path / "flags.json", tmp_path / "yaml.json"
    argv = ["--world-size", "4", "--gpus-per-node", "4", "--artifact", str(from_flags)]
    assert optimus_plan([*argv, "--", *MEGATRON_TINY_FLAGS]) == 0
    yaml = str(CONFIGS / "pretrain_vlm_tiny.yaml")
    assert optimus_plan(["--config", yaml, "--artifact", str(from_yaml)]) == 0
    flags, planned = json.loads(from_flags.read_text()), json.loads(from_yaml.read_text())
    assert {**flags, "config": None} == {**planned, "config": None}


# -- against Megatron-LM's own parse_args + validate_args ------------------------------------------

CHECKOUT = os.environ.get("MEGATRON_LM_DIR")
needs_megatron_lm = pytest.mark.skipif(
    not CHECKOUT, reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is unset"
)

# Megatron-LM's parse_args (with pretrain_vlm.py's extra flags) + validate_args on each command line
# of argv in $COMMAND_LINES, on world size 4: one line per command line, its namespace or REFUSED
_MEGATRON_SIDE = """
import json, os, sys
import megatron.core  # the installed megatron-core, before the checkout's
sys.path.append(os.environ["MEGATRON_LM_DIR"])
import megatron_patches.cpu.training as training_cpu
training_cpu.apply()  # validate_args asks for the GPU's architecture at TP > 1
import pretrain_vlm
from megatron.training.arguments import parse_args, validate_args
for argv in json.loads(os.environ["COMMAND_LINES"]):
    sys.argv = ["pretrain_vlm.py", *argv]
    try:
        args = validate_args(parse_args(pretrain_vlm.add_vlm_extra_args), {})
    except AssertionError:
        print("MEGATRON-ARGS REFUSED", flush=True)
        continue
    values = {k: v for k, v in vars(args).items() if isinstance(v, (bool, int, float, str))}
    values.update({k: None for k, v in vars(args).items() if v is None})
    print("MEGATRON-ARGS " + json.dumps(values), flush=True)
"""

COMMAND_LINES = [
    list(MEGATRON_TINY_FLAGS),
    ["--num-layers", "4", *SIZES],
    [
        *("--encoder-num-layers", "2", "--decoder-num-layers", "8", "--swiglu", *SIZES),
        *("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
        *("--hidden-size", "96", "--num-attention-heads", "6", "--global-batch-size", "8"),
    ],
    [  # Megatron counts --num-layers, not --decoder-num-layers, for the model chunks when given
        *("--num-layers", "4", "--decoder-num-layers", "8", *SIZES),
        *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        *("--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel"),
        *("--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2"),
        *("--bf16", "--untie-embeddings-and-output-weights", "--kv-channels", "32"),
        *("--global-batch-size", "8"),
    ],
    ["--num-layers", "4", *SIZES, "--sequence-parallel"],  # without TP: off
    # refused by both
    ["--num-layers", "4", "--encoder-num-layers", "2", *SIZES],
    [
        *("--num-layers", "4", *SIZES, "--num-layers-per-virtual-pipeline-stage", "1"),
        *("--num-virtual-stages-per-pipeline-rank", "2"),
    ],
    ["--num-layers", "3", *SIZES, "--pipeline-model-parallel-size", "2"],
]
# what validate_args derives, besides the flags themselves
DERIVED = ("virtual_pipeline_model_parallel_size", "data_parallel_size", "world_size")


@needs_megatron_lm
def test_the_lookalike_reads_a_command_line_as_megatron_lm_does():
    environment = {
        **os.environ,
        "MEGATRON_LM_DIR": CHECKOUT,
        "COMMAND_LINES": json.dumps(COMMAND_LINES),
        "WORLD_SIZE": "4",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # as Megatron-LM's examples set it
    }
    done = subprocess.run(
        [sys.executable, "-c", _MEGATRON_SIDE],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [
        None if line == "MEGATRON-ARGS REFUSED" else json.loads(line.split(" ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith("MEGATRON-ARGS ")
    ]
    assert len(theirs) == len(COMMAND_LINES), done.stdout[-3000:]
    read = [a.dest for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    for argv, megatron in zip(COMMAND_LINES, theirs):
        try:
            ours = vars(lookalike_validate_args(parse_args(argv=argv), 4))
        except OptimusError as refused:
            assert megatron is None, (argv, str(refused))
            continue
        assert megatron is not None, argv
        names = [name for name in (*read, *DERIVED) if name in megatron]
        assert {n: ours[n] for n in names} == {n: megatron[n] for n in names}, argv
        # every flag the config reads is one of Megatron-LM's (pretrain_vlm.py's included)
        assert set(read) - set(megatron) == set(), argv
        # and Megatron-LM's own namespace makes the same config
        assert _config_or_refusal(argparse.Namespace(**megatron)) == _config_or_refusal(
            argparse.Namespace(**ours)
        ), argv


def _config_or_refusal(args: argparse.Namespace) -> object:
    try:
        return config_from_megatron_args(args, 4, 4)
    except OptimusError as refused:
        return str(refused)


# Megatron-LM's own parser (megatron.training.arguments' flags, pretrain_vlm.py's extra ones): each
# option string, with its nargs and destination
_MEGATRON_FLAGS = """
import argparse, json, os, sys
import megatron.core  # the installed megatron-core, before the checkout's
sys.path.append(os.environ["MEGATRON_LM_DIR"])
import megatron_patches.cpu.training as training_cpu
training_cpu.apply()
import pretrain_vlm
from megatron.training.arguments import add_megatron_arguments
parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
parser = pretrain_vlm.add_vlm_extra_args(add_megatron_arguments(parser))
flags = {flag: [a.nargs, a.dest] for flag, a in parser._option_string_actions.items()}
print("MEGATRON-FLAGS " + json.dumps(flags), flush=True)
"""


@needs_megatron_lm
def test_every_flag_taken_unread_is_megatron_lms_with_its_arity_and_a_name_the_plan_does_not_read():
    from optimus_mllm.megatron.unread_flags import UNREAD_FLAGS

    done = subprocess.run(
        [sys.executable, "-c", _MEGATRON_FLAGS],
        cwd=REPO,
        env={**os.environ, "MEGATRON_LM_DIR": CHECKOUT},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("MEGATRON-FLAGS ")]
    theirs = json.loads(lines[0].split(" ", 1)[1])
    read = {a.dest for a in build_parser()._actions if a.option_strings}
    for unread in UNREAD_FLAGS:
        assert unread.flag in theirs, f"{unread.flag} is not a Megatron-LM flag"
        nargs, dest = theirs[unread.flag]
        assert nargs == unread.takes.nargs, (unread.flag, nargs, unread.takes)
        # a flag read under another name would shape the plan through it
        assert dest not in read, (unread.flag, dest)


def test_a_job_with_dropout_says_its_masks_are_not_the_plain_runs():
    from optimus_mllm.megatron.seams import dropout_line

    def line(*flags: str) -> str:
        args = lookalike_validate_args(
            parse_args(add_optimus_args, [*MEGATRON_TINY_FLAGS, *flags]), 4
        )
        return dropout_line(config_from_megatron_args(args, 4, 4))

    assert line("--hidden-dropout", "0", "--attention-dropout", "0") == ""
    said = line("--hidden-dropout", "0.1", "--attention-dropout", "0")
    assert said.startswith("optimus: with dropout (hidden 0.1, attention 0) this job draws other ")
    assert "--hidden-dropout 0 --attention-dropout 0" in said


# examples/multimodal's flags (its multimodal_args.py adds them to Megatron-LM's), as its
# extra_args_provider leaves them in the namespace -> the most images a microbatch of 2 holds
TILE_FLAGS = {
    "one tile an image": ({"max_num_tiles": 1}, 2),
    "tiles without tiling": ({"max_num_tiles": 6}, 2),
    "6 tiles": ({"max_num_tiles": 6, "use_tiling": True}, 12),
    "6 tiles and a thumbnail": (
        {"max_num_tiles": 6, "use_tiling": True, "use_thumbnail": True},
        14,
    ),
    "1 tile, no thumbnail added": (
        {"max_num_tiles": 1, "use_tiling": True, "use_thumbnail": True},
        2,
    ),
    "8 frames": ({"max_num_tiles": 4, "use_tiling": True, "num_frames": 8}, 16),
    "packed samples": ({"max_num_tiles": 4, "use_tiling": True, "packing_seq_length": 4096}, None),
}


@pytest.mark.parametrize("case", TILE_FLAGS)
def test_the_most_images_a_microbatch_holds_comes_from_examples_multimodal_s_flags(case):
    from optimus_mllm.megatron.flags import bound_line, images_bound

    given, most = TILE_FLAGS[case]
    args = lookalike_validate_args(parse_args(argv=list(MEGATRON_TINY_FLAGS)), 4)
    vars(args).update({"use_tiling": False, "use_thumbnail": False, "num_frames": 1, **given})
    config = config_from_megatron_args(args, 4, 4)
    assert images_bound(args).images == most
    assert config.data.max_images_per_microbatch == most
    assert bound_line(config, images_bound(args)).startswith(
        f"optimus: planned for at most {most or 2} images a microbatch ("
    )


def test_pretrain_vlm_s_flags_state_no_bound_and_plan_one_image_a_sample():
    from optimus_mllm.megatron.flags import bound_line, images_bound

    args = parse_args(argv=list(MEGATRON_TINY_FLAGS))
    config = config_from_megatron_args(args, 4, 4)
    assert config.data.max_images_per_microbatch is None  # optimus-plan's outputs as before
    assert bound_line(config, images_bound(args)) == (
        "optimus: planned for at most 2 images a microbatch (one image a sample, "
        "--micro-batch-size 2: the job states no bound: examples/multimodal's --max-num-tiles / "
        "--use-thumbnail / --num-frames, or a plan file made by optimus-plan for a config with "
        "data.max_images_per_microbatch); a microbatch of 0 to 2 images trains, one of more is "
        "refused before its step"
    )


def test_a_saved_schedule_planned_for_more_images_is_the_job_s_maximum(tmp_path):
    """A job whose flags state no bound takes the saved schedule's
    ``data.max_images_per_microbatch`` (and the artifact then fits it); one whose flags state
    another keeps its own, and the artifact is refused naming the field."""
    from dataclasses import replace

    from optimus_mllm.megatron.flags import with_schedule_bound
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import (
        artifact_text,
        load_job_artifact,
        schedule_job_artifact,
    )

    args = parse_args(argv=list(MEGATRON_TINY_FLAGS))
    job = config_from_megatron_args(args, 4, 4)
    planned_for = replace(job, data=replace(job.data, max_images_per_microbatch=6))
    path = tmp_path / "plan.json"
    path.write_text(artifact_text(schedule_job_artifact(planned_for, plan(planned_for))))
    assert with_schedule_bound(job, "auto") is job
    taken = with_schedule_bound(job, str(path))
    assert taken.data.max_images_per_microbatch == 6
    load_job_artifact(path, plan(taken), taken, 4)
    vars(args).update(max_num_tiles=4, use_tiling=True, use_thumbnail=False, num_frames=1)
    tiles = config_from_megatron_args(args, 4, 4)
    assert with_schedule_bound(tiles, str(path)) is tiles
    with pytest.raises(OptimusError, match="data.max_images_per_microbatch=6, this job has 8"):
        load_job_artifact(path, plan(tiles), tiles, 4)


def _cpu_profile(folder: Path, device_kind: str = "cpu") -> Path:
    """A kernel profile of no kernels, as optimus-profile writes one on ``device_kind``."""
    from optimus_mllm.costing.cost_model import KERNEL_SET, PROFILE_FORMAT, PROFILE_VERSION

    path = folder / f"{device_kind}.profile.json"
    header = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kernel_set": KERNEL_SET}
    path.write_text(json.dumps({**header, "kernels": [], "device_kind": device_kind}))
    return path


def test_optimus_profile_prices_the_flag_s_job_with_the_machine_s_profile(tmp_path):
    from optimus_mllm.costing.cost_model import CostModel

    profile = str(_cpu_profile(tmp_path))
    flags = [*MEGATRON_TINY_FLAGS, "--optimus-schedule", "auto", "--optimus-profile", profile]
    args = build_parser(add_optimus_args).parse_args(flags)
    config = config_from_megatron_args(args, 4, 4)
    assert config.cost_model.profile == profile
    assert CostModel.from_config(config).device_kind == "cpu"
    # without it the flag prices with the cost model's constants, as before
    without = config_from_megatron_args(build_parser(add_optimus_args).parse_args(flags[:-2]), 4, 4)
    assert without.cost_model.profile is None


def test_a_bad_optimus_profile_is_one_line_naming_the_flag(tmp_path):
    from optimus_mllm.megatron.flags import optimus_profile_problem

    cpu, gpu = str(_cpu_profile(tmp_path)), str(_cpu_profile(tmp_path, "cuda"))
    assert optimus_profile_problem("auto", cpu, "cpu") is None
    assert optimus_profile_problem(None, None, "cpu") is None
    assert optimus_profile_problem(None, cpu, "cpu") == (
        f"--optimus-profile {cpu}: prices what --optimus-schedule runs; add --optimus-schedule "
        "auto, or drop --optimus-profile"
    )
    assert optimus_profile_problem("auto", gpu, "cpu") == (
        f"--optimus-profile: {gpu} was measured on a cuda device, this job runs on cpu; profile "
        "this machine with optimus-profile, or drop --optimus-profile"
    )
    missing = str(tmp_path / "missing.json")
    assert optimus_profile_problem("plan.json", missing, "cpu") == (
        f"--optimus-profile: {missing} does not exist; run optimus-profile to create it"
    )
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    said = optimus_profile_problem("auto", str(not_json), "cuda")
    assert said is not None and said.startswith(f"--optimus-profile: {not_json} is not valid JSON")
