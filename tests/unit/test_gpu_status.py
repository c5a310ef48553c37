"""A GPU path no GPU run has verified says so once per process, on rank 0 only; a verified one is
quiet."""

from __future__ import annotations

import pytest

from optimus_mllm.runtime import gpu_status


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(gpu_status, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)


def test_an_unverified_gpu_path_warns_once(capsys):
    gpu_status.warn_unverified("training on several GPUs")
    gpu_status.warn_unverified("training on several GPUs")
    gpu_status.warn_unverified("METP's P2P side stream")
    assert capsys.readouterr().err.splitlines() == [
        "optimus: warning: training on several GPUs has not yet run on a GPU; its results are "
        "unverified",
        "optimus: warning: METP's P2P side stream has not yet run on a GPU; its results are "
        "unverified",
    ]


def test_other_ranks_and_verified_paths_stay_quiet(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    gpu_status.warn_unverified("training on several GPUs")
    monkeypatch.setenv("RANK", "0")
    gpu_status.warn_unverified("optimus-profile")
    gpu_status.warn_unverified("the CUDA side stream for encoder ops")
    assert capsys.readouterr().err == ""
