"""A schedule artifact is checked before any rank connects: made for this job's config.

Each refusal is one ``OptimusError`` line naming the setting.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.artifact import load_job_artifact, schedule_job_artifact
from optimus_mllm.scheduler.fingerprint import schedule_fingerprint
from tests.train_utils import TINY, assert_one_error_everywhere, ranks

def _made_with(*overrides: str) -> dict:
    config = load_config(TINY, list(overrides))
    return schedule_job_artifact(config, plan(config))


@pytest.fixture(scope="module")
def tiny() -> dict:
    return _made_with()


def _load(artifact: dict, tmp_path: Path, *overrides: str) -> dict:
    """``load_job_artifact`` of the artifact written to a file, for the tiny job."""
    path = tmp_path / "a.json"
    path.write_text(json.dumps(artifact))
    config = load_config(TINY, list(overrides))
    return load_job_artifact(path, plan(config), config, config.cluster.num_gpus)


def _refused(artifact: dict, tmp_path: Path) -> str:
    with pytest.raises(OptimusError) as caught:
        _load(artifact, tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_artifact_of_this_config_passes(tiny, tmp_path):
    assert _load(tiny, tmp_path) == tiny


def test_settings_that_do_not_shape_the_schedule_are_free(tiny, tmp_path):
    assert _load(tiny, tmp_path, "training.train_iters=6", "training.lr=0.5", "training.seed=7",
                 "name=renamed", "cluster.gpu_memory_gib=2") == tiny


def test_the_fingerprint_holds_the_schedule_settings_only():
    fingerprint = schedule_fingerprint(load_config(TINY))
    assert {"model.llm.num_layers", "model.encoders.0.seq_length", "model.encoders.0.projector.type",
            "training.micro_batch_size", "training.global_batch_size", "training.precision", "training.recompute",
            "training.sequence_parallel", "cluster.num_gpus", "cluster.inter_node_bandwidth_gbps",
            "cost_model.gemm_efficiency", "cost_model.profile"} <= fingerprint.keys()
    assert not {key for key in fingerprint if key.startswith(("training.lr", "training.seed", "training.train_iters",
                                                              "data", "name", "source", "planner"))}
    json.dumps(fingerprint)  # stored as it is


@pytest.mark.parametrize("override, expected", [
    ("training.micro_batch_size=1", "training.micro_batch_size=1, this job has 2"),
    ("model.encoders.0.num_layers=4", "model.encoders.0.num_layers=4, this job has 2"),
    ("model.llm.num_layers=8", "model.llm.num_layers=8, this job has 4"),
    ("training.precision=bf16", 'training.precision="bf16", this job has "fp32"'),
])
def test_an_artifact_for_another_config_names_the_first_different_setting(override, expected, tmp_path):
    message = _refused(_made_with(override), tmp_path)
    assert message == (f"schedule artifact {tmp_path / 'a.json'} was made with {expected}; re-run optimus-plan "
                       "--artifact for this config")


def test_a_version_1_artifact_is_refused(tiny, tmp_path):
    old = {**copy.deepcopy(tiny), "version": 1}
    del old["fingerprint"]
    assert _refused(old, tmp_path) == (f"schedule artifact {tmp_path / 'a.json'} has version 1, this release reads "
                                       "version 2; write one with optimus-plan --artifact")


def test_an_artifact_for_another_config_exits_2_on_every_rank(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_made_with("model.llm.num_layers=8")))
    assert_one_error_everywhere(ranks(4, "--schedule", str(path)),
                                f"schedule artifact {path} was made with model.llm.num_layers=8, this job has 4; "
                                "re-run optimus-plan --artifact for this config")
