"""Until the GPU paths have run on a GPU, each says so once per process, on rank 0 only."""

from __future__ import annotations

import pytest

from optimus_mllm import gpu_status


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(gpu_status, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.skipif(
    gpu_status.VERIFIED_ON is not None,
    reason="VERIFIED_ON is set (a scripts/gpu_truth.sh run passed): the GPU paths do not warn",
)
def test_an_unverified_gpu_path_warns_once(capsys):
    gpu_status.warn_unverified("the CUDA side stream for encoder ops")
    gpu_status.warn_unverified("the CUDA side stream for encoder ops")
    gpu_status.warn_unverified("optimus-profile")
    assert capsys.readouterr().err.splitlines() == [
        "optimus: warning: the CUDA side stream for encoder ops has not yet run on a GPU (issue "
        "16); its results "
        "are unverified",
        "optimus: warning: optimus-profile has not yet run on a GPU (issue 16); its results are "
        "unverified",
    ]


def test_other_ranks_and_verified_paths_stay_quiet(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    gpu_status.warn_unverified("training on a GPU")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(gpu_status, "VERIFIED_ON", "a gpu_truth run")
    gpu_status.warn_unverified("optimus-profile")
    assert capsys.readouterr().err == ""
