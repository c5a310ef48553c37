"""Every path the program reads is read only when it is a regular file (or a folder where a folder
is meant): a FIFO with no writer, named as a profile, an artifact, a dataset file, a checkpoint's
file or a pretrained folder's file, is refused in one line instead of blocking ``open`` forever."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.config.files import read_regular_file, special_entries
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.runtime.checkpoint_meta import (
    LATEST,
    _missing_bytes,
    dist_checkpoint_folder,
    latest_checkpoint,
)
from optimus_mllm.runtime.data import read_captions
from optimus_mllm.scheduler.artifact import load_job_artifact

from support.paths import CONFIGS


@pytest.fixture(autouse=True)
def _within_seconds() -> Iterator[None]:
    """Fail (instead of hanging) when a read blocks: the alarm's exception interrupts open()."""

    def expire(signum, frame):
        raise TimeoutError("blocked reading a path")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_read_regular_file_refuses_what_is_not_one(tmp_path):
    with pytest.raises(OSError, match="is a FIFO, not a regular file"):
        read_regular_file(_fifo(tmp_path / "f"))
    with pytest.raises(OSError, match="is a device, not a regular file"):
        read_regular_file("/dev/zero")
    with pytest.raises(IsADirectoryError):
        read_regular_file(tmp_path)
    (tmp_path / "r").write_bytes(b"abc")
    assert read_regular_file(tmp_path / "r") == b"abc"
    assert read_regular_file(tmp_path / "r", 2) == b"ab"
    assert special_entries(tmp_path) == ["f (a FIFO)"]


def test_a_profile_that_is_a_fifo(tmp_path):
    fifo = _fifo(tmp_path / "profile.json")
    config = load_config(CONFIGS / "tiny.yaml", [f"cost_model.profile={fifo}"])
    with pytest.raises(OptimusError, match="is a FIFO, not a regular file"):
        CostModel.from_config(config)


def test_an_artifact_that_is_a_fifo(tmp_path):
    config = load_config(CONFIGS / "tiny.yaml")
    fifo = _fifo(tmp_path / "schedule.json")
    with pytest.raises(OptimusError, match="is a FIFO, not a regular file"):
        load_job_artifact(fifo, plan(config), config, config.cluster.num_gpus)


def test_a_caption_file_or_image_that_is_a_fifo(tmp_path):
    _fifo(tmp_path / "captions.jsonl")
    with pytest.raises(OptimusError, match="is a FIFO, not a regular file"):
        read_captions(tmp_path)


def test_a_checkpoint_whose_files_are_fifos(tmp_path):
    _fifo(tmp_path / LATEST)
    with pytest.raises(OptimusError, match="is a FIFO, not a regular file"):
        latest_checkpoint(tmp_path)
    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    _fifo(folder / "meta.json")
    with pytest.raises(OptimusError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)
    # past a whole meta.json, the files megatron-core reads
    _fifo(folder / "metadata.json")
    assert _missing_bytes(folder) == (
        "holds meta.json (a FIFO), which cannot be read without blocking"
    )


def test_a_pretrained_folder_holding_a_fifo(tmp_path):
    (tmp_path / "metadata.json").write_text("{}")
    _fifo(tmp_path / "common.pt")
    with pytest.raises(OptimusError, match=r"holds common.pt \(a FIFO\), not a regular file"):
        dist_checkpoint_folder(tmp_path, "--pretrained-llm")
