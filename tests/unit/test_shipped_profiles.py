"""profiles/: kernel profiles measured by optimus-profile on an H100, shipped so that the cost model
can use measured kernel times on machines without a GPU. Each must still load under this release's
kernel set and time every compute kernel of the config it was measured for."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import read_profile
from optimus_mllm.tools.profiler import matching_profile

REPO = Path(__file__).resolve().parents[2]

MEASURED_FOR = [
    ("h100_strong.json", "configs/paper/strong_1536.yaml"),
    # the three strong-scaling setups share one microbatch shape (2 images, TP8)
    ("h100_strong.json", "configs/paper/strong_2048.yaml"),
    ("h100_strong.json", "configs/paper/strong_3072.yaml"),
    ("h100_fig5_8gpu.json", "configs/paper/fig5_8gpu.yaml"),
    ("h100_gpu_single.json", "configs/gpu_single.yaml"),
]


def test_every_shipped_profile_is_listed_here():
    assert {p.name for p in (REPO / "profiles").glob("*.json")} == {p for p, _ in MEASURED_FOR}


@pytest.mark.parametrize("profile,config", MEASURED_FOR)
def test_a_shipped_profile_times_every_compute_kernel_of_its_config(profile, config):
    measured = read_profile(REPO / "profiles" / profile)
    assert {m.key for m in measured}  # read_profile checked the format and the kernel set
    table, needed = matching_profile(load_config(REPO / config), measured)
    assert needed > 0 and len(table) == needed
