"""scripts/whatif_kernel_split.py: the split it models, and that it runs end to end."""

import json
import subprocess
import sys

import pytest

from optimus_mllm.scheduler.encoder_costs import EncoderKernel, StageChain
from optimus_mllm.scheduler.fine import Resource
from optimus_mllm.scheduler.intervals import FreeIntervals
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from whatif_kernel_split import place_fitted, split_chain  # noqa: E402


def test_split_chain_cuts_long_compute_kernels_into_equal_pieces_that_each_pay_the_launch():
    chain = StageChain((EncoderKernel("vit", 0, "fc1", "fwd", False, 102.0),
                        EncoderKernel("vit", 0, "tp_ag_mlp", "fwd", True, 300.0),
                        EncoderKernel("vit", 0, "act", "fwd", False, 12.0)))
    split = split_chain(chain, 40.0, 2.0)
    assert [k.name for k in split.kernels] == ["fc1.0", "fc1.1", "fc1.2", "tp_ag_mlp", "act"]
    assert [k.duration_us for k in split.kernels[:3]] == pytest.approx([(102.0 - 2.0) / 3 + 2.0] * 3)
    assert split.duration_us == pytest.approx(chain.duration_us + 2 * 2.0)  # two more launches
    assert split_chain(chain, 40.0, 0.0).duration_us == pytest.approx(chain.duration_us)


def test_fitted_placement_fills_each_bubble_with_a_piece_that_pays_the_launch():
    compute = FreeIntervals([(0.0, 10.0), (20.0, 30.0), (40.0, 100.0)])
    comm = FreeIntervals([(0.0, 100.0)])
    fc1 = EncoderKernel("vit", 0, "fc1", "fwd", False, 25.0)
    ag = EncoderKernel("vit", 0, "tp_ag_mlp", "fwd", True, 5.0)
    place = place_fitted(2.0)
    starts, (busy, comm_busy) = place(Resource(0, compute, comm), StageChain((fc1, ag)), 0.0, 100.0)
    # 23 us of work and a 2 us launch: 8 of work in the first bubble, 8 in the second, the last 7 in the third
    assert list(busy) == [0.0, 10.0, 20.0, 30.0, 40.0, 49.0]
    assert list(comm_busy) == [49.0, 54.0] and starts == [0.0, 49.0]  # the collective whole, after the last piece
    assert place(Resource(0, compute.copy(), comm.copy()), StageChain((fc1,)), 0.0, 45.0) is None  # ends past the limit
    # free launches: the pieces add up to the kernel; a bubble too small for any work gets no piece
    starts, (busy, _) = place_fitted(0.0)(Resource(0, FreeIntervals([(0.0, 1.0), (5.0, 20.0), (30.0, 60.0)]),
                                                   comm.copy()), StageChain((fc1,)), 0.0, 100.0)
    assert list(busy) == [5.0, 20.0, 30.0, 40.0] and starts == [40.0 - 25.0]  # the last kernel ends the chain


def test_whatif_kernel_split_prints_and_writes_each_piece_size(tmp_path):
    out = tmp_path / "whatif.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "whatif_kernel_split.py"), "--only", "fig5_heavy",
                           "--pieces", "40", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    case = json.loads(out.read_text())["fig5_heavy"]
    rows = [(r["split"], r["piece_us"], r["overhead"]) for r in case["rows"]]
    assert rows == [("whole", None, True), ("equal", 40.0, True), ("equal", 40.0, False), ("fit", None, True),
                    ("fit", None, False)]
    assert case["llm_plan"] == "DP1 PP4 TP2 V10" and case["balanced_s"] < case["megatron_s"]
    assert "pieces <= 40 us free" in proc.stdout and "pieces fit to bubbles free" in proc.stdout
    whole, fit, fit_free = case["rows"][0], case["rows"][3], case["rows"][4]
    assert whole["optimus_s"] == whole["coarse_s"] > case["balanced_s"]  # whole kernels fit no TP bubble
    # cut to the bubbles, with every extra launch charged, and backwards moved first: faster than balanced
    assert fit["backward_first_s"] < case["balanced_s"] < fit["optimus_s"] < whole["optimus_s"]
    assert fit_free["backward_first_s"] < fit["backward_first_s"]
    for args in (["--pieces", "0"], ["--pieces", "-5"], ["--pieces", "nan"], ["--pieces", "inf"],
                 ["--json", str(tmp_path / "missing" / "out.json")]):
        bad = subprocess.run([sys.executable, str(REPO / "scripts" / "whatif_kernel_split.py"), *args],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and args[0] in bad.stderr, (args, bad.stderr)
    assert not (tmp_path / "missing").exists()
