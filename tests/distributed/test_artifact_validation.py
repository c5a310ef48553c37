"""A schedule artifact is checked before any rank connects: made for this job's config, and whole.

Each refusal is one ``OptimusError`` line naming the setting or the field's path in the file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.artifact import artifact_text, load_job_artifact, schedule_job_artifact
from optimus_mllm.scheduler.artifact_format import artifact_from_json, artifact_to_json
from optimus_mllm.scheduler.fingerprint import schedule_fingerprint

from support.artifact_utils import shuffled_hooks, split_kernels
from support.paths import CONFIGS
from support.train_utils import TINY, assert_one_error_everywhere, ranks

REMEDY = "re-run optimus-plan --artifact"


def _made_with(*overrides: str) -> dict:
    """The artifact's JSON, as the file holds it: what the tests here edit."""
    config = load_config(TINY, list(overrides))
    return artifact_to_json(schedule_job_artifact(config, plan(config)))


@pytest.fixture(scope="module")
def tiny() -> dict:
    return _made_with()


def _load(artifact: dict, tmp_path: Path, *overrides: str) -> dict:
    """``load_job_artifact`` of the artifact written to a file, for the tiny job, as JSON again."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps(artifact))
    config = load_config(TINY, list(overrides))
    return artifact_to_json(load_job_artifact(path, plan(config), config, config.cluster.num_gpus))


def _refused(artifact: dict, tmp_path: Path) -> str:
    with pytest.raises(OptimusError) as caught:
        _load(artifact, tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_artifact_of_this_config_passes(tiny, tmp_path):
    assert _load(tiny, tmp_path) == tiny


def test_settings_that_do_not_shape_the_schedule_are_free(tiny, tmp_path):
    assert (
        _load(
            tiny,
            tmp_path,
            "training.train_iters=6",
            "training.lr=0.5",
            "training.seed=7",
            "name=renamed",
            "cluster.gpu_memory_gib=2",
        )
        == tiny
    )


def test_the_fingerprint_holds_the_schedule_settings_only():
    fingerprint = schedule_fingerprint(load_config(TINY))
    assert {
        "model.llm.num_layers",
        "model.encoders.0.seq_length",
        "model.encoders.0.projector.type",
        "training.micro_batch_size",
        "training.global_batch_size",
        "training.precision",
        "training.recompute",
        "training.sequence_parallel",
        "cluster.num_gpus",
        "cluster.inter_node_bandwidth_gbps",
        "cost_model.gemm_efficiency",
        "cost_model.profile",
        # the encoder's memory and the fallback schedule are planned for it
        "data.max_images_per_microbatch",
    } <= fingerprint.keys()
    assert not {
        key
        for key in fingerprint
        if key.startswith(
            (
                "training.lr",
                "training.seed",
                "training.train_iters",
                "training.min_lr",
                "training.adam",
                "training.clip_grad",
                "data.path",
                "data.tokenizer",
                "data.images_per_sample",
                "name",
                "source",
                "planner",
            )
        )
    }
    json.dumps(fingerprint)  # stored as it is


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.micro_batch_size=1", "training.micro_batch_size=1, this job has 2"),
        ("model.encoders.0.num_layers=4", "model.encoders.0.num_layers=4, this job has 2"),
        ("model.llm.num_layers=8", "model.llm.num_layers=8, this job has 4"),
        ("training.precision=bf16", 'training.precision="bf16", this job has "fp32"'),
        (
            "data.max_images_per_microbatch=8",
            "data.max_images_per_microbatch=8, this job has null",
        ),
    ],
)
def test_an_artifact_for_another_config_names_the_first_different_setting(
    override, expected, tmp_path
):
    message = _refused(_made_with(override), tmp_path)
    assert message == (
        f"schedule artifact {tmp_path / 'a.json'} was made with {expected}; re-run optimus-plan "
        "--artifact for this config"
    )


def _ops(artifact: dict, stage: int = 0) -> list[dict]:
    return artifact["encoder_stages"][stage]["ops"]


def _op_position(artifact: dict, phase: str, k: int, index: int) -> int:
    """Where the first such op of stage 0 is; -1 if there is none."""
    return next(
        (
            n
            for n, op in enumerate(_ops(artifact))
            if (op["phase"], op["local_microbatch"], op["kernel_index"]) == (phase, k, index)
        ),
        -1,
    )


def _num_gpus_as_string(a):
    a["num_gpus"] = "4"


def _unknown_plan_key(a):
    a["llm_plan"]["pp_size"] = 2


def _warmup_out_of_bounds(a):
    a["warmup"] = [17, 2]


def _deadlocking_warmup(a):
    a["warmup"] = [0, 0]


def _duplicated_op(a):
    _ops(a).append(copy.deepcopy(_ops(a)[_op_position(a, "fwd", 0, 5)]))


def _missing_last_op_of_a_chain(a):
    last = max(op["kernel_index"] for op in _ops(a) if op["phase"] == "bwd")
    del _ops(a)[_op_position(a, "bwd", 1, last)]


def _kernel_index_gap(a):
    del _ops(a)[_op_position(a, "fwd", 0, 5)]


def _missing_encoder_stage(a):
    del a["encoder_stages"][2]


def _assignment_not_a_permutation(a):
    a["assignment"][1] = a["assignment"][0]


def _llm_order_not_a_permutation(a):
    a["llm_order"][1] = a["llm_order"][0]


def _llm_order_short(a):
    a["llm_order"].pop()


def _feeds_short(a):
    a["feeds"].pop()


def _feeds_out_of_range(a):
    a["feeds"][0] = 8


def _fed_twice_without_images_per_chain(a):
    a["feeds"][1] = 0


def _images_per_chain_zero(a):
    a["images_per_chain"] = 0


def _an_llm_microbatch_fed_by_none(a):
    """Encoder microbatch 1 feeds LLM microbatch 0 as its second part: nothing feeds 1."""
    a["feeds"][1] = 0
    a["images_per_chain"] = 1
    for stage in a["encoder_stages"]:
        for op in stage["ops"]:
            if (op["microbatch"], stage["encoder_pipeline"]) == (1, 1):
                op["microbatch"] = 0


def _images_per_chain_in_a_jobs_schedule(a):
    a["images_per_chain"] = 1


def _feeds_swapped(a):
    """Encoder microbatches 0 and 1 feed each other's LLM microbatch; their ops say otherwise."""
    a["feeds"][0], a["feeds"][1] = 1, 0


def _partition_of_more_microbatches(a):
    a["partition"][0] += 1


def _prediction_short(a):
    a["predicted"]["forward_dependency_us"].pop()


def _hook_kind(a):
    _ops(a)[3]["hook"] = {"at": "somewhere"}


def _hook_kernel_index(a):
    n = next(n for n, op in enumerate(_ops(a)) if op["hook"]["at"] == "llm_kernel")
    _ops(a)[n]["hook"]["llm_kernel"]["kernel_index"] = 99


def _missing_field(a):
    del a["fingerprint"]


def _llm_kernel_renamed(a):
    a["llm_kernels"]["0/0/fwd"][1] = "ln"


def _truncated_chains(a):
    """Every forward chain of a stage one kernel short: consistent in the file, not what the encoder
    runs."""
    last = max(op["kernel_index"] for op in _ops(a) if op["phase"] == "fwd")
    a["encoder_stages"][0]["ops"] = [
        op for op in _ops(a) if (op["phase"], op["kernel_index"]) != ("fwd", last)
    ]


def _nan_prediction(a):
    a["predicted"]["iteration_us"] = float("nan")  # json writes NaN, and reads it back


def _reversed_ops(a):
    """A stage's ops listed in reverse: a chain's kernels after its later ones."""
    _ops(a).reverse()


def _warmup_3_2(a):
    """The warm-up edited, the op order left as the scheduler ran it under [4, 2]."""
    a["warmup"] = [3, 2]


def _hook_before_the_previous_ops(a):
    """Two ops of different chains, hooked at different LLM kernels, listed in swapped order."""
    ops = _ops(a)
    n = next(
        n
        for n in range(len(ops) - 1)
        if ops[n]["hook"] != ops[n + 1]["hook"]
        and (ops[n]["phase"], ops[n]["local_microbatch"])
        != (ops[n + 1]["phase"], ops[n + 1]["local_microbatch"])
    )
    ops[n], ops[n + 1] = ops[n + 1], ops[n]


def _infinite_op_start(a):
    a["encoder_stages"][0]["ops"][2]["start_us"] = float("inf")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            _nan_prediction,
            "predicted.iteration_us: must be a finite number of at most 1e+15, got nan",
        ),
        (
            _infinite_op_start,
            "encoder_stages[0].ops[2].start_us: must be a finite number of at most 1e+15, got inf",
        ),
        (_num_gpus_as_string, "num_gpus: expected an integer, got '4' (str)"),
        (_unknown_plan_key, "llm_plan.pp_size: unknown key; valid keys: dp, pp, tp, vp"),
        (
            _warmup_out_of_bounds,
            "warmup[0]: 17 forwards, but a stage runs 16 (num_microbatches * vp)",
        ),
        (
            _deadlocking_warmup,
            "warmup: [0, 0] deadlocks the LLM pipeline (pp=2, vp=2, 8 microbatches); "
            "megatron-core's "
            "default is [4, 2]",
        ),
        (
            _duplicated_op,
            "encoder_stages[0].ops[{n}].piece: [0.0, 1.0], but the pieces of kernel_index 5 in the "
            "fwd "
            "chain of local microbatch 0 must tile [0, 1]: the next starts at 1.0",
        ),
        (
            _missing_last_op_of_a_chain,
            "encoder_stages[0].ops: no bwd op of local microbatch 1 with kernel_index {last}, "
            "but local microbatch 0 has one",
        ),
        (
            _kernel_index_gap,
            "encoder_stages[0].ops[{gap}].kernel_index: 6, but the fwd chain of local microbatch 0 "
            "has "
            "no kernel_index 5",
        ),
        (_missing_encoder_stage, "encoder_stages: no entry for encoder pipeline 2 stage 0"),
        (
            _assignment_not_a_permutation,
            "assignment[1]: encoder pipeline 0's local microbatch 0 again (also "
            "assignment[0]): must be a permutation",
        ),
        (
            _llm_order_not_a_permutation,
            "llm_order[1]: data microbatch 0 again (also llm_order[0]): must be a permutation",
        ),
        (_llm_order_short, "llm_order: 7 entries, but num_microbatches is 8"),
        (_feeds_short, "feeds: 7 entries, but assignment lists 8"),
        (_feeds_out_of_range, "feeds[0]: 8, but must be in 0..7"),
        (
            _fed_twice_without_images_per_chain,
            "images_per_chain: null, but LLM microbatch 0 is fed by feeds[0] and feeds[1]: give "
            "the images each encoder microbatch runs",
        ),
        (_images_per_chain_zero, "images_per_chain: 0, but must be >= 1"),
        (
            _an_llm_microbatch_fed_by_none,
            "feeds: no encoder microbatch feeds LLM microbatch 1, but a job's schedule runs every "
            "iteration's images, in any microbatch: feed each one",
        ),
        (
            _images_per_chain_in_a_jobs_schedule,
            "images_per_chain: 1, but a job's schedule runs every iteration's images, however "
            "many: must be null (one encoder microbatch runs all of its LLM microbatch's images)",
        ),
        (
            _feeds_swapped,
            "encoder_stages[0].ops[{feeds_op}].microbatch: 0, but feeds gives LLM microbatch 1 to "
            "encoder pipeline 0's local microbatch 0",
        ),
        (
            _partition_of_more_microbatches,
            "partition: {more_partition} adds up to 9, but assignment lists 8 encoder microbatches",
        ),
        (
            _prediction_short,
            "predicted.forward_dependency_us: 7 entries, but assignment lists 8 encoder "
            "microbatches",
        ),
        (
            _hook_kind,
            "encoder_stages[0].ops[3].hook.at: must be one of before_first_compute, "
            "llm_kernel, after_last_compute; got 'somewhere'",
        ),
        (
            _hook_kernel_index,
            "encoder_stages[0].ops[{hook}].hook.llm_kernel.kernel_index: 99, but the LLM's",
        ),
        (_missing_field, "fingerprint: is required but missing"),
        (
            _reversed_ops,
            "encoder_stages[0].ops[1]: kernel_index {rev_index} (piece [0.0, 1.0]) of the "
            "{rev_phase} chain of local microbatch {rev_k} is listed after its kernel_index "
            "{rev_prev} (piece [0.0, 1.0], ops[0]); a chain runs in kernel order: list the stage's "
            "ops in the order they run",
        ),
        (
            _warmup_3_2,
            "llm_op_order[0][4]: the fwd of microbatch 2, chunk 0, but with warmup[0]=3 "
            "megatron-core runs the bwd of microbatch 0, chunk 1 there; the runtime can run only "
            "megatron-core's order",
        ),
        (
            _hook_before_the_previous_ops,
            "encoder_stages[0].ops[{swap}].hook: ",
        ),
        (
            _llm_kernel_renamed,
            "llm_kernels['0/0/fwd'][1]: 'ln', but this job's LLM runs 'tp_ar_embed' there",
        ),
        (
            _truncated_chains,
            "encoder_stages[0].ops: the fwd chains have {last_fwd} kernels, but encoder stage 0's "
            "fwd "
            "chain has {fwd}",
        ),
    ],
)
def test_a_broken_artifact_names_the_field(tiny, tmp_path, edit, expected):
    artifact = copy.deepcopy(tiny)
    edit(artifact)
    ops = _ops(tiny)
    fwd = 1 + max(op["kernel_index"] for op in ops if op["phase"] == "fwd")
    names = {
        "n": len(_ops(artifact)) - 1,
        "dup": _op_position(artifact, "fwd", 0, 5),
        "gap": _op_position(artifact, "fwd", 0, 6),
        "last": max(op["kernel_index"] for op in ops if op["phase"] == "bwd"),
        "hook": next(n for n, op in enumerate(ops) if op["hook"]["at"] == "llm_kernel"),
        "fwd": fwd,
        "last_fwd": fwd - 1,
        "rev_index": ops[-2]["kernel_index"],
        "rev_phase": ops[-2]["phase"],
        "rev_k": ops[-2]["local_microbatch"],
        "rev_prev": ops[-1]["kernel_index"],
        "feeds_op": next(n for n, op in enumerate(ops) if op["local_microbatch"] == 0),
        "more_partition": [tiny["partition"][0] + 1, *tiny["partition"][1:]],
        "swap": 1
        + next(
            n
            for n in range(len(ops) - 1)
            if ops[n]["hook"] != ops[n + 1]["hook"]
            and (ops[n]["phase"], ops[n]["local_microbatch"])
            != (ops[n + 1]["phase"], ops[n + 1]["local_microbatch"])
        ),
    }
    message = _refused(artifact, tmp_path)
    assert message.startswith(
        f"schedule artifact {tmp_path / 'a.json'}: {expected.format(**names)}"
    ), message
    assert message.endswith(f"; {REMEDY}")


def test_an_op_hooked_before_its_chains_predecessor_is_refused(tiny, tmp_path):
    """The runtime would have to run it later than its hook, or its predecessor earlier: it refuses
    the artifact instead of running another schedule than the one written."""
    artifact = copy.deepcopy(tiny)
    stage, n = next(
        (i, n)
        for i, s in enumerate(artifact["encoder_stages"])
        for n, op in enumerate(s["ops"])
        if op["hook"]["at"] == "llm_kernel" and op["kernel_index"] > 0
    )
    artifact["encoder_stages"][stage]["ops"][n]["hook"] = {
        "at": "before_first_compute",
        "llm_kernel": None,
    }
    assert _refused(artifact, tmp_path) == (
        f"schedule artifact {tmp_path / 'a.json'}: encoder_stages[{stage}].ops[{n}].hook: "
        f"before_first_compute, earlier than the hook of ops[{n - 1}]; the runtime runs a stage's "
        f"ops in the order listed: list them in the order of their hooks; {REMEDY}"
    )


def test_the_artifact_round_trips_through_the_typed_loader(tiny):
    """JSON -> dataclasses -> JSON -> dataclasses: equal, and the same text."""
    artifact = artifact_from_json(tiny)
    text = artifact_text(artifact)
    again = artifact_from_json(json.loads(text))
    assert again == artifact
    assert artifact_text(again) == text
    assert json.loads(text) == tiny


def test_pieces_of_the_kernels_the_job_splits_pass(tiny, tmp_path):
    split = artifact_to_json(split_kernels(artifact_from_json(tiny), TINY, [0.25, 0.5]))
    assert len(_ops(split)) > len(_ops(tiny))
    assert _load(split, tmp_path) == split


def _first(ops: list[dict], **fields) -> dict:
    return next(op for op in ops if all(op[k] == v for k, v in fields.items()))


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda ops: _first(ops, kernel="patch_embed", phase="fwd").update(piece=[0.0, 0.5]),
            "encoder_stages[0].ops[{patch}].piece: the pieces of kernel_index 0 in the fwd chain "
            "of local microbatch 0 end "
            "at 0.5, not 1",
        ),
        (
            lambda ops: _first(ops, kernel="fc1", phase="fwd", piece=[0.25, 0.5]).update(
                piece=[0.3, 0.5]
            ),
            "encoder_stages[0].ops[{fc1}].piece: [0.3, 0.5], but the pieces of kernel_index "
            "{fc1_index} in the fwd chain "
            "of local microbatch 0 must tile [0, 1]: the next starts at 0.25",
        ),
        (
            lambda ops: _first(ops, kernel="fc1", phase="fwd", piece=[0.25, 0.5]).update(
                piece=[0.5, 0.25]
            ),
            "encoder_stages[0].ops[{fc1}].piece: [0.5, 0.25], but must have 0 <= lo < hi <= 1",
        ),
        (
            lambda ops: _first(ops, kernel="fc1", phase="fwd", piece=[0.25, 0.5]).update(piece=0.5),
            "encoder_stages[0].ops[{fc1}].piece: expected a list of 2 entries, got 0.5 (float)",
        ),
    ],
)
def test_a_broken_piece_names_the_field(tiny, tmp_path, edit, expected):
    split = artifact_to_json(split_kernels(artifact_from_json(tiny), TINY, [0.25, 0.5]))
    ops = _ops(split)
    fc1 = ops.index(_first(ops, kernel="fc1", phase="fwd", piece=[0.25, 0.5], local_microbatch=0))
    names = {
        "patch": ops.index(_first(ops, kernel="patch_embed", phase="fwd", local_microbatch=0)),
        "fc1": fc1,
        "fc1_index": ops[fc1]["kernel_index"],
    }
    edit([op for op in ops if op["local_microbatch"] == 0])
    assert (
        _refused(split, tmp_path)
        == f"schedule artifact {tmp_path / 'a.json'}: {expected.format(**names)}; {REMEDY}"
    )


def test_a_piece_of_a_kernel_the_job_runs_whole_is_refused(tiny, tmp_path):
    """Pieces that tile [0, 1] of the patch embedding, which the runtime cannot split."""
    artifact = copy.deepcopy(tiny)
    ops = _ops(artifact)
    n = ops.index(_first(ops, kernel="patch_embed", phase="fwd", local_microbatch=0))
    ops[n : n + 1] = [{**ops[n], "piece": [0.0, 0.5]}, {**ops[n], "piece": [0.5, 1.0]}]
    assert _refused(artifact, tmp_path) == (
        f"schedule artifact {tmp_path / 'a.json'}: encoder_stages[0].ops[{n}].piece: [0.0, 0.5], "
        "but this job's "
        "encoder runs kernel 0 ('patch_embed') whole: only a layer's compute kernels without "
        f"dropout split; {REMEDY}"
    )


@pytest.mark.parametrize("version", [1, 4])
def test_an_older_artifact_is_refused(tiny, tmp_path, version):
    old = {**copy.deepcopy(tiny), "version": version}
    assert _refused(old, tmp_path) == (
        f"schedule artifact {tmp_path / 'a.json'} has version {version}, this release reads "
        "version 5; re-run optimus-plan --artifact"
    )


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "is a directory, not a JSON file"),
        (b"\xff\xfe\x00\x01", "is not a text file (not UTF-8)"),
        (b'{"format": "optimus-schedule",', "is not valid JSON (line 1)"),
        (b"[" * 100_000, "is not valid JSON (nested too deeply)"),
    ],
)
def test_a_file_that_is_not_json_is_one_line(tmp_path, content, expected):
    path = tmp_path / "a.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    config = load_config(TINY)
    with pytest.raises(OptimusError) as caught:
        load_job_artifact(path, plan(config), config, 4)
    assert (
        str(caught.value) == f"schedule artifact {path} {expected}; re-run optimus-plan --artifact"
    )


@pytest.mark.parametrize(
    "config, overrides",
    [
        # a stage without backward
        (
            TINY,
            ["model.encoders.0.frozen=true", "parallel.encoder={pp: 2, tp: 1}"],
        ),
        (str(CONFIGS / "paper" / "fig5_8gpu.yaml"), []),
    ],
)
def test_what_the_scheduler_writes_passes(config, overrides, tmp_path):
    job = load_config(config, overrides)
    artifact = schedule_job_artifact(job, plan(job))
    path = tmp_path / "a.json"
    path.write_text(artifact_text(artifact))
    assert load_job_artifact(path, plan(job), job, job.cluster.num_gpus) == artifact


def test_hooks_anywhere_in_the_stage_are_well_formed(tiny, tmp_path):
    """Any LLM kernel of the stage is a valid hook, listed in hook order: the runtime copes with
    wrong predictions."""
    artifact = artifact_to_json(shuffled_hooks(artifact_from_json(tiny), seed=0))
    assert _load(artifact, tmp_path) == artifact


@pytest.mark.distributed
def test_an_artifact_for_another_config_exits_2_on_every_rank(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_made_with("model.llm.num_layers=8")))
    assert_one_error_everywhere(
        ranks(4, "--schedule", str(path)),
        f"schedule artifact {path} was made with model.llm.num_layers=8, this job has 4; "
        "re-run optimus-plan --artifact for this config",
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "edit, expected",
    [
        (_reversed_ops, "encoder_stages[0].ops[1]: kernel_index "),
        (_warmup_3_2, "llm_op_order[0][4]: the fwd of microbatch 2, chunk 0, but with warmup[0]=3"),
    ],
    ids=["reversed-stage", "warmup-3-2"],
)
def test_an_artifact_the_runtime_would_not_run_as_written_exits_2_on_every_rank(
    tiny, tmp_path, edit, expected
):
    """Issue 39: a stage's ops listed in reverse, or the warm-up edited to [3, 2], once trained with
    the order ignored or ops moved; ``optimus-train --schedule`` now refuses them before training.
    """
    artifact = copy.deepcopy(tiny)
    edit(artifact)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(artifact))
    assert_one_error_everywhere(
        ranks(4, "--schedule", str(path)), f"schedule artifact {path}: {expected}"
    )
